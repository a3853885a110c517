package node

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/internal/rain"
	"redpacket.io/operator/test/cluster"
	"redpacket.io/operator/test/e2e/kit"
)

// TestRainThroughTheClusterIP installs an activity with signed user tokens and a
// signed webhook, waits until it is Ready and its grab Deployment Available, and
// makes it rain through the grab Service's ClusterIP while, one after the other: a
// grab pod is deleted, the grab image is changed to a rebuilt tag, the grab
// Deployment is scaled by hand, the leading operator pod is stopped cleanly (the lease
// must move at once), and the next leading operator pod is killed. No grab may
// fail (a 503 or a dropped connection is asked again, as a client does), no packet
// may be granted twice, and every grant must be booked once, signed, in the balance
// system's PostgreSQL, whose totals must be the status's to the unit.
func TestRainThroughTheClusterIP(t *testing.T) {
	requireNode(t)
	const (
		name     = "rain"
		count    = int64(20000)
		total    = int64(2000000)
		minUsers = 20000
	)
	ns := namespace(t, "e2e-rain")
	applied := time.Now()
	kubectl(t, activityManifest(ns, name, total, count, 2), "apply", "-f", "-")
	kubectl(t, "", "-n", ns, "wait", "--for=condition=Ready", "rpa/"+name, "--timeout=180s")
	readyAfter := time.Since(applied)
	// Ready means grabs can be served: the grab Deployment is Available by then.
	if d := deployment(t, ns, name+"-grab"); d.Status.AvailableReplicas < 1 {
		t.Fatalf("Ready=True while the grab Deployment has %d available replicas", d.Status.AvailableReplicas)
	}
	available(t, ns, name+"-grab", 2, 60*time.Second)
	t.Logf("activity Ready %s after apply; grab pods Running", readyAfter.Round(100*time.Millisecond))
	t.Log("\n" + kubectl(t, "", "-n", ns, "get", "pods", "-o", "wide"))

	url := grabURL(t, ns, name)
	uid := string(activity(t, ns, name).UID)

	// The grab pods serve the rain page, under its Content-Security-Policy.
	page, err := http.Get(url + "/")
	if err != nil {
		t.Fatal(err)
	}
	page.Body.Close()
	if page.StatusCode != http.StatusOK || page.Header.Get("Content-Security-Policy") != grabsvc.PageContentSecurityPolicy {
		t.Fatalf("GET / from the grab pods: HTTP %d, CSP %q", page.StatusCode, page.Header.Get("Content-Security-Policy"))
	}

	// Without a token: 401, and nothing claimed.
	resp, err := http.Post(url+"/v1/grab", "application/json", strings.NewReader(`{"userId":"nobody"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("a grab without a token answered HTTP %d, want 401", resp.StatusCode)
	}

	spec := rain.Spec{URL: url + "/v1/grab", Connections: 32, Timeout: 10 * time.Second,
		RetryUnavailable: true, Token: tokens(t, ns, name), UserPrefix: "rain", RetryEvery: 10}
	var mu sync.Mutex
	var results []rain.Result
	used := 0
	// wave rains on the activity with fresh users until done is closed (at least once).
	wave := func(done <-chan struct{}) {
		for first := true; ; first = false {
			select {
			case <-done:
				if !first {
					return
				}
			default:
			}
			s := spec
			s.Users, s.Rate, s.FirstUser = 1000, 400, used+1
			used += s.Users
			r := rain.Run(t.Context(), s)
			mu.Lock()
			results = append(results, r)
			mu.Unlock()
		}
	}
	during := func(what string, disrupt func()) {
		t.Helper()
		done := make(chan struct{})
		finished := make(chan struct{})
		before := used
		go func() { defer close(finished); wave(done) }()
		start := time.Now()
		disrupt()
		close(done)
		<-finished
		t.Logf("%s: done in %s while %d users grabbed", what, time.Since(start).Round(100*time.Millisecond), used-before)
	}

	grabDeploy := name + "-grab"
	during("delete one grab pod", func() {
		pods := grabPods(t, ns, name)
		victim := pods[0].Name
		kubectl(t, "", "-n", ns, "delete", "pod", victim, "--wait=false")
		// The victim goes away for good (after its graceful shutdown) and two other pods
		// are Ready in its place.
		eventually(t, 2*time.Minute, "the deleted grab pod to be gone and replaced", func() error {
			list := &corev1.PodList{}
			if err := env.client.List(t.Context(), list, client.InNamespace(ns), client.MatchingLabels{"redpacket.io/activity": name}); err != nil {
				return err
			}
			ready := 0
			for _, p := range list.Items {
				if p.Name == victim {
					return fmt.Errorf("%s still exists", victim)
				}
				if p.DeletionTimestamp == nil && podReady(&p) {
					ready++
				}
			}
			if ready != 2 {
				return fmt.Errorf("%d grab pods Ready", ready)
			}
			return nil
		})
		available(t, ns, grabDeploy, 2, 2*time.Minute)
	})

	during("change spec.grabService.image to a rebuilt tag", func() {
		kubectl(t, fmt.Sprintf(`{"spec":{"grabService":{"image":%q}}}`, env.rebuilt.Tag),
			"-n", ns, "patch", "rpa", name, "--type=merge", "--patch-file=/dev/stdin")
		eventually(t, time.Minute, "the grab Deployment to name the rebuilt image", func() error {
			if img := deployment(t, ns, grabDeploy).Spec.Template.Spec.Containers[0].Image; img != env.rebuilt.Tag {
				return fmt.Errorf("image %s", img)
			}
			return nil
		})
		kubectl(t, "", "-n", ns, "rollout", "status", "deployment/"+grabDeploy, "--timeout=180s")
		available(t, ns, grabDeploy, 2, time.Minute)
		for _, p := range grabPods(t, ns, name) {
			if img := p.Spec.Containers[0].Image; img != env.rebuilt.Tag {
				t.Errorf("pod %s runs %s after the rollout, want %s", p.Name, img, env.rebuilt.Tag)
			}
		}
	})

	during("kubectl scale the grab Deployment to 3", func() {
		kubectl(t, "", "-n", ns, "scale", "deployment/"+grabDeploy, "--replicas=3")
		available(t, ns, grabDeploy, 3, 2*time.Minute)
		// A reconcile after the scale leaves the count alone.
		kubectl(t, "", "-n", ns, "annotate", "rpa", name, "e2e/poke="+strconv.FormatInt(time.Now().UnixNano(), 10), "--overwrite")
		time.Sleep(3 * time.Second)
		if r := deployment(t, ns, grabDeploy).Spec.Replicas; r == nil || *r != 3 {
			t.Errorf("the controller changed the scaled grab Deployment's replicas to %v", r)
		}
	})

	during("stop the leading operator pod cleanly", func() {
		leader, took := moveLeader(t, false)
		t.Logf("operator pod %s stopped; another replica took the lease %s later", leader, took.Round(100*time.Millisecond))
		// A clean stop releases the lease: the other replica takes it at its next
		// try (every 2 s), not after the 15 s a lapsed lease takes.
		if took > 10*time.Second {
			t.Errorf("the lease moved %s after the leader stopped cleanly: it was not released", took)
		}
	})

	during("kill the leading operator pod", func() {
		leader, took := moveLeader(t, true)
		t.Logf("operator pod %s killed; another replica took the lease %s later", leader, took.Round(100*time.Millisecond))
		// controller-runtime's lease lasts 15 s; the other replica retries every 2 s.
		if took > 20*time.Second {
			t.Errorf("the lease moved %s after the leader died, more than the lease time", took)
		}
	})

	// The rest of the users, all at once, until every packet is gone.
	s := spec
	s.Users, s.FirstUser = max(minUsers+2000-used, 2000), used+1
	used += s.Users
	results = append(results, rain.Run(t.Context(), s))

	// The client side: every user answered, nothing failed, nothing granted twice.
	tally := kit.Sum(t, results)
	t.Logf("rain: %s", tally)
	if used < minUsers {
		t.Errorf("only %d users rained, want at least %d", used, minUsers)
	}
	tally.CheckSoldOut(t, count, total)

	// The resource: Exhausted, exact counters, every claim settled.
	env.kit.WaitSoldOutAndSettled(t, ns, name, count, total, 3*time.Minute)
	cols := columns(t, "rpa", name, "-n", ns)
	want := map[string]string{"TOTAL": strconv.FormatInt(total, 10), "COUNT": strconv.FormatInt(count, 10),
		"REMAINING": "0", "CLAIMED": strconv.FormatInt(count, 10), "PHASE": "Exhausted"}
	for k, v := range want {
		if cols[k] != v {
			t.Errorf("kubectl get rpa: %s = %q, want %q (row %v)", k, cols[k], v, cols)
		}
	}
	t.Log("\n" + kubectl(t, "", "-n", ns, "get", "rpa", "-o", "wide"))

	// The balance system: each grant booked once in PostgreSQL, to its user, signed;
	// its totals the status's to the unit.
	tally.CheckBooked(t, env.balance, uid, activity(t, ns, name).Status, count, total)

	kubectl(t, "", "-n", ns, "delete", "rpa", name, "--timeout=120s")
	if keys := keysOf(t, uid); len(keys) != 0 {
		t.Errorf("Redis still holds %d keys of the deleted activity: %v", len(keys), keys)
	}
}

// grabPods lists the activity's grab pods that are not being deleted.
func grabPods(t *testing.T, ns, name string) []corev1.Pod {
	t.Helper()
	return env.kit.GrabPods(t, ns, name)
}

// moveLeader deletes the operator pod that holds the leader lease and returns its name
// and how long another replica took to hold the lease. Killed, it is force-deleted at
// once without a grace period: the API object goes at once and the kubelet stops the
// container as it can (a signal it may still catch and release the lease on, or not),
// so the lease moves within its 15 s at worst. Otherwise it is deleted with its grace
// period: it stops cleanly and must release the lease on the way out
// (LeaderElectionReleaseOnCancel).
func moveLeader(t *testing.T, killed bool) (string, time.Duration) {
	t.Helper()
	holder := func() string {
		l := &coordinationv1.Lease{}
		if err := env.client.Get(t.Context(), client.ObjectKey{Namespace: cluster.OperatorNamespace, Name: cluster.OperatorLease}, l); err != nil || l.Spec.HolderIdentity == nil {
			return ""
		}
		return *l.Spec.HolderIdentity
	}
	var leader string
	eventually(t, time.Minute, "an operator replica to hold the lease", func() error {
		if leader = holder(); leader == "" {
			return fmt.Errorf("no holder")
		}
		return nil
	})
	pod, _, _ := strings.Cut(leader, "_")
	if killed {
		kubectl(t, "", "-n", cluster.OperatorNamespace, "delete", "pod", pod, "--grace-period=0", "--force", "--wait=false")
	} else {
		kubectl(t, "", "-n", cluster.OperatorNamespace, "delete", "pod", pod, "--wait=false")
	}
	took := eventually(t, time.Minute, "another operator replica to take the lease", func() error {
		h := holder()
		if h == "" || strings.HasPrefix(h, pod+"_") {
			return fmt.Errorf("holder %q", h)
		}
		return nil
	})
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	if _, err := env.node.Kubectl(ctx, "", "-n", cluster.OperatorNamespace, "rollout", "status", "deployment/"+cluster.OperatorDeployment, "--timeout=180s"); err != nil {
		t.Error(err)
	}
	return pod, took
}

// podReady reports whether a pod's Ready condition is True.
func podReady(p *corev1.Pod) bool { return kit.PodReady(p) }
