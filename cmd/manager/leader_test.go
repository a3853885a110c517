package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/redistest"
	"redpacket.io/operator/test/wait"
)

// leaseDuration is client-go's and controller-runtime's default lease duration,
// which the operator keeps: without a release, a new leader waits out about this long.
const leaseDuration = 15 * time.Second

// A leader that stops cleanly releases its Lease, with its settlement worker stopped
// first: a replica that starts then leads at once, well within the lease duration,
// instead of waiting for the old lease to expire. Both managers are the operator's
// own (newManager) against a real API server and Redis, and the first one has an
// activity with a webhook whose receiver holds every delivery, so a delivery is in
// flight when it stops.
func TestLeaderReleasesLeaseOnCleanShutdown(t *testing.T) {
	if testing.Short() {
		t.Skip("needs kube-apiserver, etcd and Redis; run without -short")
	}
	cp := controlplane.Start(t)
	ns := cp.Namespace(t)
	rdb := redistest.Start(t)
	ctx := t.Context()

	// The receiver answers nothing until the test ends: deliveries stay in flight.
	held := make(chan struct{})
	receiver := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-held:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(receiver.Close)
	t.Cleanup(func() { close(held) })

	// The allowlist is keyed by host and port: the receiver's.
	keys := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "settlement-keys", Namespace: ns},
		Data: map[string][]byte{strings.Replace(strings.TrimPrefix(receiver.URL, "http://"), ":", "_", 1): []byte("signing-key")}}
	if err := cp.Client.Create(ctx, keys); err != nil {
		t.Fatal(err)
	}

	config := func(name string) managerConfig {
		return managerConfig{
			MetricsAddr: "0", ProbeAddr: "0",
			LeaderElect: true, LeaderElectionNamespace: ns,
			ShutdownTimeout: DefaultShutdownTimeout,
			Reconciler: controllers.Options{
				DefaultRedis:         rdb.Conn(),
				GrabImage:            "registry.example/redpacket-operator:test",
				GrabReplicas:         1,
				SettlementKeysSecret: types.NamespacedName{Namespace: ns, Name: keys.Name},
				Name:                 name,
				SkipNameValidation:   true,
			},
		}
	}
	type running struct {
		elected <-chan struct{}
		cancel  context.CancelFunc
		stopped chan struct{} // closed when Start returned, with err
		err     error
	}
	start := func(name string) *running {
		mgr, err := newManager(cp.Config, config(name))
		if err != nil {
			t.Fatalf("manager %s: %v", name, err)
		}
		mctx, cancel := context.WithCancel(context.Background())
		m := &running{elected: mgr.Elected(), cancel: cancel, stopped: make(chan struct{})}
		go func() {
			m.err = mgr.Start(mctx)
			close(m.stopped)
		}()
		t.Cleanup(func() {
			cancel()
			<-m.stopped
		})
		return m
	}
	holder := func() string {
		lease := &coordinationv1.Lease{}
		if err := cp.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: leaderElectionID}, lease); err != nil {
			t.Fatalf("reading the Lease: %v", err)
		}
		if lease.Spec.HolderIdentity == nil {
			return ""
		}
		return *lease.Spec.HolderIdentity
	}

	a := start("a")
	select {
	case <-a.elected:
	case <-time.After(2 * leaseDuration):
		t.Fatal("the first manager did not lead")
	}
	leaderA := holder()

	activity := &redpacketv1alpha1.RedPacketActivity{
		ObjectMeta: metav1.ObjectMeta{Name: "failover", Namespace: ns},
		Spec: redpacketv1alpha1.RedPacketActivitySpec{
			TotalAmount: 1000, Count: 10,
			Distribution: redpacketv1alpha1.Distribution{Type: redpacketv1alpha1.DistributionRandom, MinAmount: 1},
			Sponsor:      "merchant-001",
			Settlement: &redpacketv1alpha1.Settlement{
				Webhook: &redpacketv1alpha1.Webhook{URL: receiver.URL + "/credit"}, MaxAttempts: 10,
			},
		},
	}
	if err := cp.Client.Create(ctx, activity); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 30*time.Second, "seeding by the first manager", func() (bool, string) {
		got := &redpacketv1alpha1.RedPacketActivity{}
		if err := cp.Client.Get(ctx, client.ObjectKeyFromObject(activity), got); err != nil {
			return false, err.Error()
		}
		return meta.IsStatusConditionTrue(got.Status.Conditions, redpacketv1alpha1.ConditionSeeded), string(got.Status.Phase)
	})

	stopping := time.Now()
	a.cancel()
	select {
	case <-a.stopped:
		if a.err != nil {
			t.Fatalf("the first manager stopped with an error: %v", a.err)
		}
	case <-time.After(DefaultShutdownTimeout + 5*time.Second):
		t.Fatal("the first manager did not stop")
	}
	stopped := time.Since(stopping)
	if got := holder(); got != "" {
		t.Fatalf("after a clean shutdown the Lease is still held by %q (was %q)", got, leaderA)
	}

	starting := time.Now()
	b := start("b")
	select {
	case <-b.elected:
	case <-time.After(2 * leaseDuration):
		t.Fatal("the second manager did not lead")
	}
	failover := time.Since(starting)
	t.Logf("the first manager stopped in %v; the second led %v after it started (lease duration %v)",
		stopped.Round(time.Millisecond), failover.Round(time.Millisecond), leaseDuration)
	if failover > leaseDuration/5 {
		t.Errorf("the second manager led after %v, not well within the lease duration %v", failover, leaseDuration)
	}
	if got := holder(); got == "" || got == leaderA {
		t.Errorf("the Lease is held by %q after the failover (first leader %q)", got, leaderA)
	}
}
