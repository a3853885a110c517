package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"

	"sigs.k8s.io/yaml"
)

// kubectl runs bin/kubectl against the demo's control plane.
type kubectl struct {
	bin        string
	kubeconfig string
}

// cmd builds a kubectl command.
func (k kubectl) cmd(ctx context.Context, args ...string) *exec.Cmd {
	c := exec.CommandContext(ctx, k.bin, args...)
	c.Env = append(os.Environ(), "KUBECONFIG="+k.kubeconfig)
	return c
}

// show runs kubectl, echoing the command and its output.
func (k kubectl) show(ctx context.Context, args ...string) error {
	fmt.Printf("$ kubectl %s\n", strings.Join(args, " "))
	c := k.cmd(ctx, args...)
	c.Stdout, c.Stderr = os.Stdout, os.Stderr
	if err := c.Run(); err != nil {
		return fmt.Errorf("kubectl %s: %w", strings.Join(args, " "), err)
	}
	return nil
}

// output runs kubectl and returns its standard output.
func (k kubectl) output(ctx context.Context, args ...string) (string, error) {
	c := k.cmd(ctx, args...)
	var stderr bytes.Buffer
	c.Stderr = &stderr
	out, err := c.Output()
	if err != nil {
		return "", fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, stderr.String())
	}
	return string(out), nil
}

// demoActivity is the built-in activity used when config/samples has none.
const demoActivity = `apiVersion: redpacket.io/v1alpha1
kind: RedPacketActivity
metadata:
  name: quiz-night
  namespace: default
spec:
  totalAmount: 200000
  count: 5000
  currency: CNY
  distribution:
    type: Random
    minAmount: 1
  sponsor: merchant-001
`

var docSeparator = regexp.MustCompile(`(?m)^---\s*$`)

// sampleActivity finds the RedPacketActivity in config/samples and returns it as a
// map together with the file it came from.
func sampleActivity(root string) (map[string]any, string, error) {
	files, err := filepath.Glob(filepath.Join(root, "config", "samples", "*.yaml"))
	if err != nil {
		return nil, "", fmt.Errorf("listing config/samples: %w", err)
	}
	var fallback map[string]any
	var fallbackFile string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, "", fmt.Errorf("reading %s: %w", f, err)
		}
		for _, doc := range docSeparator.Split(string(b), -1) {
			var obj map[string]any
			if err := yaml.Unmarshal([]byte(doc), &obj); err != nil || obj == nil {
				continue
			}
			if obj["kind"] != "RedPacketActivity" {
				continue
			}
			rel, _ := filepath.Rel(root, f)
			md, _ := obj["metadata"].(map[string]any)
			if md != nil && md["name"] == "quiz-night" {
				return obj, rel, nil
			}
			if fallback == nil {
				fallback, fallbackFile = obj, rel
			}
		}
	}
	if fallback != nil {
		return fallback, fallbackFile, nil
	}
	var obj map[string]any
	if err := yaml.Unmarshal([]byte(demoActivity), &obj); err != nil {
		return nil, "", fmt.Errorf("parsing the built-in activity: %w", err)
	}
	return obj, "", nil
}

// demoManifest turns the sample into the demo's activity: packets packets (the total
// scaled to keep the sample's average packet), open at once, a window of an hour,
// settlement to the receiver signed with the demo's key Secret, and grabReplicas
// grab replicas (0: as the sample says).
func demoManifest(sample map[string]any, name string, packets int64, webhookURL, webhookSecret string, grabReplicas int) ([]byte, int64, error) {
	spec, _ := sample["spec"].(map[string]any)
	if spec == nil {
		spec = map[string]any{}
	}
	total := int64(200000)
	count := int64(5000)
	if v, ok := spec["totalAmount"].(float64); ok && v > 0 {
		total = int64(v)
	}
	if v, ok := spec["count"].(float64); ok && v > 0 {
		count = int64(v)
	}
	if packets != count {
		total = total * packets / count
		count = packets
	}
	spec["totalAmount"] = total
	spec["count"] = count
	delete(spec, "startTime")
	delete(spec, "endTime")
	delete(spec, "redis") // the operator's default Redis: the demo's redis-server
	spec["paused"] = false
	if _, ok := spec["sponsor"]; !ok {
		spec["sponsor"] = "merchant-001"
	}
	webhook := map[string]any{"url": webhookURL}
	if webhookSecret != "" {
		// Deprecated and ignored: the operator signs with its own key.
		webhook["secretRef"] = map[string]any{"name": webhookSecret}
	}
	spec["settlement"] = map[string]any{"webhook": webhook, "maxAttempts": 10}
	if gs, ok := spec["grabService"].(map[string]any); ok {
		delete(gs, "auth") // the demo's users send plain user ids
	}
	if grabReplicas > 0 {
		gs, _ := spec["grabService"].(map[string]any)
		if gs == nil {
			gs = map[string]any{}
		}
		gs["replicas"] = grabReplicas
		spec["grabService"] = gs
	}
	obj := map[string]any{
		"apiVersion": "redpacket.io/v1alpha1",
		"kind":       "RedPacketActivity",
		"metadata":   map[string]any{"name": name, "namespace": "default"},
		"spec":       spec,
	}
	out, err := yaml.Marshal(obj)
	if err != nil {
		return nil, 0, fmt.Errorf("rendering the demo activity: %w", err)
	}
	return out, total, nil
}
