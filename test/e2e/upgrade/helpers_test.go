package upgrade

import (
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/test/e2e/kit"
)

func kubectl(t *testing.T, stdin string, args ...string) string {
	t.Helper()
	return env.kit.Kubectl(t, stdin, args...)
}

func eventually(t *testing.T, within time.Duration, what string, f func() error) {
	t.Helper()
	kit.Eventually(t, within, what, f)
}

func activity(t *testing.T, ns, name string) *redpacketv1alpha1.RedPacketActivity {
	t.Helper()
	return env.kit.Activity(t, ns, name)
}

func deployment(t *testing.T, ns, name string) *appsv1.Deployment {
	t.Helper()
	return env.kit.Deployment(t, ns, name)
}
