package cluster

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
)

// requireNode skips outside CI when the machine cannot run a node, saying why; in CI
// (CI=true) it fails instead, since nothing may skip there.
func requireNode(t *testing.T) {
	t.Helper()
	if why := Supported(); why != "" {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI must run the real node: %s", why)
		}
		t.Skip(why)
	}
}

// TestNodeServesPodsAndLeavesHostAsFound starts a node with two replicas of the dev
// Redis image behind a Service, talks Redis to each pod directly and to the Service
// through its ClusterIP from the host, stops the node, and checks that the host is
// exactly as it was before: settings, links, addresses, firewall rules, nftables,
// mounts, network namespaces, cgroups, paths and processes.
func TestNodeServesPodsAndLeavesHostAsFound(t *testing.T) {
	requireNode(t)
	ctx, cancel := context.WithTimeout(t.Context(), 8*time.Minute)
	defer cancel()
	images, err := BuildImages(ctx, t.TempDir(), "node-test", "pause", "redis")
	if err != nil {
		t.Fatal(err)
	}
	c, err := Start(ctx, Options{
		Images:     []string{images["pause"].File, images["redis"].File},
		PauseImage: images["pause"].Tag,
		Logf:       t.Logf,
	})
	if err != nil {
		t.Fatal(err)
	}
	stopped := false
	defer func() {
		if !stopped {
			_ = c.Stop()
		}
	}()
	if c.Started > 2*time.Minute {
		t.Errorf("the node took %s to become Ready", c.Started)
	}

	// Nothing for the node's ranges may follow the default route off the machine,
	// not even a ClusterIP that kube-proxy has not translated yet.
	for _, addr := range []string{"10.252.0.77", "10.251.0.200"} {
		out, err := exec.Command("ip", "route", "get", addr).CombinedOutput()
		if err != nil || !strings.Contains(string(out), "dev "+BridgeName) {
			t.Errorf("ip route get %s: %q (%v), want it on %s", addr, out, err, BridgeName)
		}
	}

	labels := map[string]string{"app": "redis-probe"}
	dep := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "redis-probe", Namespace: "default"},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To[int32](2),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{
					Containers: []corev1.Container{{
						Name:            "redis",
						Image:           images["redis"].Tag,
						ImagePullPolicy: corev1.PullNever,
						Args:            []string{"--save", "", "--appendonly", "no", "--protected-mode", "no", "--bind", "0.0.0.0"},
						Ports:           []corev1.ContainerPort{{ContainerPort: 6379}},
						ReadinessProbe: &corev1.Probe{
							ProbeHandler:  corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(6379)}},
							PeriodSeconds: 1,
						},
					}},
				},
			},
		},
	}
	applied := time.Now()
	if _, err := c.Client.AppsV1().Deployments("default").Create(ctx, dep, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "redis-probe", Namespace: "default"},
		Spec:       corev1.ServiceSpec{Selector: labels, Ports: []corev1.ServicePort{{Port: 6379, TargetPort: intstr.FromInt32(6379)}}},
	}
	svc, err = c.Client.CoreV1().Services("default").Create(ctx, svc, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	err = c.poll(ctx, 2*time.Minute, "the Deployment to be Available", func() error {
		d, err := c.Client.AppsV1().Deployments("default").Get(ctx, "redis-probe", metav1.GetOptions{})
		if err != nil {
			return err
		}
		if d.Status.AvailableReplicas != 2 {
			return fmt.Errorf("%d of 2 replicas available", d.Status.AvailableReplicas)
		}
		return nil
	})
	if err != nil {
		out, _ := c.Kubectl(ctx, "", "describe", "pods", "-n", "default")
		t.Fatalf("%v\n%s\n--- kubelet\n%s", err, out, tail(c.LogPath("kubelet")))
	}
	t.Logf("2 replicas Available %s after the Deployment was created", time.Since(applied).Round(100*time.Millisecond))

	pods, err := c.Client.CoreV1().Pods("default").List(ctx, metav1.ListOptions{LabelSelector: "app=redis-probe"})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pods.Items {
		if !strings.HasPrefix(p.Status.PodIP, "10.251.0.") {
			t.Errorf("pod %s has IP %q, outside %s", p.Name, p.Status.PodIP, PodCIDR)
		}
		if err := redisPing(ctx, net.JoinHostPort(p.Status.PodIP, "6379")); err != nil {
			t.Errorf("pod %s: %v", p.Name, err)
		}
	}
	if !strings.HasPrefix(svc.Spec.ClusterIP, "10.252.0.") {
		t.Errorf("Service ClusterIP %q is outside %s", svc.Spec.ClusterIP, ServiceCIDR)
	}
	err = c.poll(ctx, 30*time.Second, "the ClusterIP to answer", func() error {
		return redisPing(ctx, net.JoinHostPort(svc.Spec.ClusterIP, "6379"))
	})
	if err != nil {
		t.Fatal(err)
	}
	mem := c.ResidentMemory()
	var total int64
	for _, v := range mem {
		total += v
	}
	t.Logf("resident memory: %d MiB in all %v", total>>20, mem)

	stopStart := time.Now()
	stopped = true
	if err := c.Stop(); err != nil {
		t.Errorf("stopping the node: %v", err)
	}
	t.Logf("teardown took %s", time.Since(stopStart).Round(100*time.Millisecond))
	if diff := c.HostBefore.Diff(ReadHostState()); len(diff) > 0 {
		t.Errorf("the host is not as it was found:\n%s", strings.Join(diff, "\n"))
	}
}

// redisPing sends PING over a new connection and expects +PONG.
func redisPing(ctx context.Context, addr string) error {
	d := net.Dialer{Timeout: 2 * time.Second}
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := conn.Write([]byte("PING\r\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		return fmt.Errorf("PING %s: %w", addr, err)
	}
	if strings.TrimSpace(line) != "+PONG" {
		return fmt.Errorf("PING %s: %q", addr, line)
	}
	return nil
}

func tail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

// TestSplitRule checks that rules read back from iptables-save split into the
// arguments that delete them, quotes included.
func TestSplitRule(t *testing.T) {
	got, err := splitRule(`KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule" -j KUBE-NODEPORTS`)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"KUBE-SERVICES", "-m", "comment", "--comment", "kubernetes service nodeports; NOTE: this must be the last rule", "-j", "KUBE-NODEPORTS"}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("splitRule = %q, want %q", got, want)
	}
	if _, err := splitRule(`X -m comment --comment "open`); err == nil {
		t.Fatal("an unbalanced quote was accepted")
	}
}

// TestHostStateDiff checks that a difference of any kind is reported.
func TestHostStateDiff(t *testing.T) {
	a := HostState{Sysctls: map[string]string{"net.ipv4.ip_forward": "0"}, Links: []string{"lo"}, Paths: map[string]bool{}}
	b := HostState{Sysctls: map[string]string{"net.ipv4.ip_forward": "1"}, Links: []string{"lo", BridgeName}, Paths: map[string]bool{"/var/lib/cni": true}}
	diff := strings.Join(a.Diff(b), "\n")
	for _, want := range []string{"net.ipv4.ip_forward", "link added: " + BridgeName, "/var/lib/cni"} {
		if !strings.Contains(diff, want) {
			t.Errorf("diff lacks %q:\n%s", want, diff)
		}
	}
	if d := a.Diff(a); len(d) != 0 {
		t.Errorf("a state differs from itself: %v", d)
	}
}
