package controllers_test

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/wait"
)

// The rendered install manifests (config/default) and the samples are accepted by the
// API server, and the permissions they grant the operator's ServiceAccount are enough
// to run an activity: a controller that acts as that ServiceAccount seeds it, creates
// its grab workload (including the Role it grants, which needs no escalate/bind, and
// an autoscaled activity's HPA and PodDisruptionBudget), and reports status.
func TestInstallManifestsGrantEnoughToRunAnActivity(t *testing.T) {
	needsServers(t)
	root, err := controlplane.Root()
	if err != nil {
		t.Fatal(err)
	}
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := cp.Kubeconfig(kubeconfig); err != nil {
		t.Fatal(err)
	}
	kubectl := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(filepath.Join(cp.BinDir, "kubectl"), append([]string{"--kubeconfig", kubeconfig}, args...)...)
		cmd.Dir = root
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("kubectl %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	rendered := filepath.Join(t.TempDir(), "install.yaml")
	kubectl("kustomize", "config/default", "-o", rendered)
	kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=install-test", "-f", rendered)
	kubectl("apply", "--dry-run=server", "-f", "config/samples")

	ctx := context.Background()
	sa := "system:serviceaccount:redpacket-system:redpacket-controller-manager"
	role := &rbacv1.ClusterRoleBinding{}
	if err := cp.Client.Get(ctx, client.ObjectKey{Name: "redpacket-manager-rolebinding"}, role); err != nil {
		t.Fatalf("the manager's ClusterRoleBinding: %v", err)
	}
	d := &appsv1.Deployment{}
	if err := cp.Client.Get(ctx, client.ObjectKey{Namespace: "redpacket-system", Name: "redpacket-controller-manager"}, d); err != nil {
		t.Fatalf("the manager's Deployment: %v", err)
	}
	if d.Spec.Template.Spec.ServiceAccountName != "redpacket-controller-manager" {
		t.Errorf("manager runs as %q", d.Spec.Template.Spec.ServiceAccountName)
	}

	e := newEnv(t)
	asOperator := rest.CopyConfig(cp.Config)
	asOperator.Impersonate = rest.ImpersonationConfig{UserName: sa}
	e.startControllerWith(asOperator, nil)
	a := e.create(e.activity("rbac", 1000, 10, withSettlement))
	e.waitPhase("rbac", redpacketv1alpha1.PhaseActive, 20*time.Second)
	grabRole := &rbacv1.Role{}
	if err := cp.Client.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "rbac-grab"}, grabRole); err != nil {
		t.Fatalf("the grab Role created as the operator: %v", err)
	}
	e.waitEvent("rbac", "Normal", "Committed")

	// The operator's role lets it keep an autoscaled activity's HPA and its
	// PodDisruptionBudget.
	e.create(e.activity("rbac-scaled", 1000, 10, func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.GrabService.Autoscaling = &redpacketv1alpha1.ActivityGrabAutoscaling{MinReplicas: 2, MaxReplicas: 4}
	}))
	wait.Until(t, 20*time.Second, "the HPA and the PDB created as the operator", func() (bool, string) {
		key := client.ObjectKey{Namespace: e.ns, Name: "rbac-scaled-grab"}
		herr := e.c.Get(ctx, key, &autoscalingv2.HorizontalPodAutoscaler{})
		perr := e.c.Get(ctx, key, &policyv1.PodDisruptionBudget{})
		return herr == nil && perr == nil, fmt.Sprintf("HPA: %v, PDB: %v", herr, perr)
	})
	if err := e.c.Delete(ctx, a); err != nil {
		t.Fatal(err)
	}
}
