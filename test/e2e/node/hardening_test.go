package node

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// TestGrabPodsRunHardened installs an activity with two grab replicas and checks, on
// the real node, what the kubelet and runc made of the grab pod spec: both pods Ready
// and serving a grab through the Service, each grab process (seen from the host's
// /proc) running as 65532 with no capability in any set, no_new_privs, a seccomp
// filter and a read-only root mount, with the service-account token mounted for the
// status reporter; a PodDisruptionBudget that the disruption controller reports as
// allowing one eviction of two healthy pods, and gone once the activity asks for
// one replica; and the NetworkPolicy (shipped, not enforced by this node's CNI).
// With a grab pod's own token, the installed admission policy lets a report through
// and refuses a patch of seededTime, and kube-controller-manager type-checks it
// without warnings.
func TestGrabPodsRunHardened(t *testing.T) {
	requireNode(t)
	const name = "hardened"
	ns := namespace(t, "e2e-hardened")
	kubectl(t, activityManifest(ns, name, 10000, 100, 2), "apply", "-f", "-")
	kubectl(t, "", "-n", ns, "wait", "--for=condition=Ready", "rpa/"+name, "--timeout=180s")
	available(t, ns, name+"-grab", 2, 90*time.Second)

	pods := &corev1.PodList{}
	if err := env.client.List(t.Context(), pods, client.InNamespace(ns), client.MatchingLabels{"redpacket.io/activity": name}); err != nil {
		t.Fatal(err)
	}
	if len(pods.Items) != 2 {
		t.Fatalf("%d grab pods, want 2", len(pods.Items))
	}
	for _, p := range pods.Items {
		if p.Status.Phase != corev1.PodRunning || !podReady(&p) {
			t.Fatalf("grab pod %s: phase %s, ready %t", p.Name, p.Status.Phase, podReady(&p))
		}
		if len(p.Status.ContainerStatuses) != 1 || p.Status.ContainerStatuses[0].RestartCount != 0 {
			t.Fatalf("grab pod %s restarted: %+v", p.Name, p.Status.ContainerStatuses)
		}
	}

	// The pods serve under the hardening.
	url := grabURL(t, ns, name)
	req, err := http.NewRequest(http.MethodPost, url+"/v1/grab", bytes.NewBufferString(`{"userId":"hardened-1"}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+tokens(t, ns, name)("hardened-1"))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var answer struct{ Outcome string }
	_ = json.NewDecoder(resp.Body).Decode(&answer)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || answer.Outcome != "granted" {
		t.Fatalf("a grab through the Service: HTTP %d %q", resp.StatusCode, answer.Outcome)
	}

	// What the runtime made of the security context, from the host.
	procs := grabProcesses(t, ns, name)
	if len(procs) != 2 {
		t.Fatalf("%d grab service processes on the host, want 2 (one per pod)", len(procs))
	}
	for _, pid := range procs {
		st := procStatus(t, pid)
		want := map[string]string{
			"Uid": "65532\t65532\t65532\t65532", "Gid": "65532\t65532\t65532\t65532",
			"CapInh": "0000000000000000", "CapPrm": "0000000000000000", "CapEff": "0000000000000000",
			"CapBnd": "0000000000000000", "CapAmb": "0000000000000000", "NoNewPrivs": "1", "Seccomp": "2",
		}
		for k, v := range want {
			if st[k] != v {
				t.Errorf("grab process %d: %s %q, want %q", pid, k, st[k], v)
			}
		}
		if opts := rootMountOptions(t, pid); !strings.HasPrefix(opts, "ro,") && opts != "ro" {
			t.Errorf("grab process %d: root mounted %q, want read-only", pid, opts)
		}
		token := filepath.Join("/proc", strconv.Itoa(pid), "root", "var/run/secrets/kubernetes.io/serviceaccount/token")
		if fi, err := os.Stat(token); err != nil || fi.Size() == 0 {
			t.Errorf("grab process %d: no service-account token for the reporter: %v", pid, err)
		}
		t.Logf("grab process %d: uid %s, CapEff %s, CapBnd %s, NoNewPrivs %s, Seccomp %s, root %s", pid,
			strings.Fields(st["Uid"])[0], st["CapEff"], st["CapBnd"], st["NoNewPrivs"], st["Seccomp"], rootMountOptions(t, pid))
	}

	// With a grab pod's own ServiceAccount token, the admission policy lets a
	// reported field through and refuses seededTime.
	token, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(procs[0]), "root", "var/run/secrets/kubernetes.io/serviceaccount/token"))
	if err != nil {
		t.Fatal(err)
	}
	asPod := rest.AnonymousClientConfig(env.node.Config)
	asPod.BearerToken = strings.TrimSpace(string(token))
	podClient, err := client.New(asPod, client.Options{Scheme: env.client.Scheme()})
	if err != nil {
		t.Fatal(err)
	}
	a := activity(t, ns, name)
	report := fmt.Sprintf(`{"status":{"lastReportTime":%q}}`, time.Now().UTC().Format(time.RFC3339))
	if err := podClient.Status().Patch(t.Context(), a.DeepCopy(), client.RawPatch(types.MergePatchType, []byte(report))); err != nil {
		t.Fatalf("a report with the grab pod's token: %v", err)
	}
	err = podClient.Status().Patch(t.Context(), a.DeepCopy(),
		client.RawPatch(types.MergePatchType, []byte(`{"status":{"seededTime":"2001-01-01T00:00:00Z"}}`)))
	if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "seededTime") {
		t.Fatalf("a patch of seededTime with the grab pod's token: %v, want the admission policy's refusal", err)
	}
	if after := activity(t, ns, name); !after.Status.SeededTime.Equal(a.Status.SeededTime) {
		t.Fatalf("seededTime changed: %v -> %v", a.Status.SeededTime, after.Status.SeededTime)
	}
	// kube-controller-manager type-checked the policy against the CRD's schema.
	vap := &admissionregistrationv1.ValidatingAdmissionPolicy{}
	eventually(t, 60*time.Second, "the admission policy's type check", func() error {
		if err := env.client.Get(t.Context(), client.ObjectKey{Name: "redpacket-grab-status-fields"}, vap); err != nil {
			return err
		}
		if vap.Status.ObservedGeneration != vap.Generation || vap.Status.TypeChecking == nil {
			return fmt.Errorf("status %+v", vap.Status)
		}
		return nil
	})
	if w := vap.Status.TypeChecking.ExpressionWarnings; len(w) > 0 {
		t.Errorf("the admission policy type-checks with warnings: %+v", w)
	}

	// The disruption budget, as kube-controller-manager's disruption controller sees it.
	key := client.ObjectKey{Namespace: ns, Name: name + "-grab"}
	pdb := &policyv1.PodDisruptionBudget{}
	eventually(t, 60*time.Second, "the PodDisruptionBudget to count two healthy grab pods", func() error {
		if err := env.client.Get(t.Context(), key, pdb); err != nil {
			return err
		}
		st := pdb.Status
		if st.ExpectedPods != 2 || st.CurrentHealthy != 2 || st.DesiredHealthy != 1 || st.DisruptionsAllowed != 1 {
			return fmt.Errorf("status %+v", st)
		}
		return nil
	})
	t.Logf("PodDisruptionBudget %s: expected %d, healthy %d, desired %d, disruptions allowed %d", pdb.Name,
		pdb.Status.ExpectedPods, pdb.Status.CurrentHealthy, pdb.Status.DesiredHealthy, pdb.Status.DisruptionsAllowed)
	np := &networkingv1.NetworkPolicy{}
	if err := env.client.Get(t.Context(), key, np); err != nil {
		t.Fatalf("the grab NetworkPolicy: %v", err)
	}

	kubectl(t, "", "-n", ns, "patch", "rpa", name, "--type=merge", "-p", `{"spec":{"grabService":{"replicas":1}}}`)
	eventually(t, 60*time.Second, "the PodDisruptionBudget to go at one replica", func() error {
		err := env.client.Get(t.Context(), key, &policyv1.PodDisruptionBudget{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		return fmt.Errorf("still there: %v", err)
	})
	available(t, ns, name+"-grab", 1, 90*time.Second)
}

// grabProcesses finds the host PIDs of the grab service processes of one activity
// by their command line.
func grabProcesses(t *testing.T, ns, name string) []int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue // gone meanwhile
		}
		args := strings.Split(string(cmdline), "\x00")
		if len(args) > 0 && args[0] == "/grabsvc" && slices.Contains(args, "--activity="+name) && slices.Contains(args, "--namespace="+ns) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// procStatus reads /proc/PID/status into a map of field to value.
func procStatus(t *testing.T, pid int) map[string]string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "status"))
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]string{}
	for _, line := range strings.Split(string(data), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok {
			m[k] = strings.TrimSpace(v)
		}
	}
	return m
}

// rootMountOptions are the per-mount options of the root mount of the process's
// mount namespace (the fifth field after the IDs in /proc/PID/mountinfo).
func rootMountOptions(t *testing.T, pid int) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "mountinfo"))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) > 5 && f[4] == "/" {
			return f[5]
		}
	}
	t.Fatalf("no root mount in /proc/%d/mountinfo", pid)
	return ""
}
