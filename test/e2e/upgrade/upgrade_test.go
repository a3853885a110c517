package upgrade

import (
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	appsv1 "k8s.io/api/apps/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/internal/rain"
	"redpacket.io/operator/test/cluster"
	"redpacket.io/operator/test/e2e/kit"
)

// TestUpgradeMidRain installs an activity with signed user tokens and a signed webhook
// on the previous release, makes it rain, and mid-rain runs helm upgrade to this
// tree. The operator's Deployment rolls out to the new image, a new replica takes the
// lease, and it rolls the activity's grab Deployment to its own image, so grab pods of
// both versions serve the activity at once, beside an operator of the new one. The
// rain goes on through all of it and then sells the activity out. There must be no
// wrong answer (every user answered with an outcome of the API, no packet granted
// twice, every retry consistent), no fence (the activity never Stalled, never fenced
// in Redis), and every grant credited once, signed, by the settlement of whichever
// operator led at the time.
func TestUpgradeMidRain(t *testing.T) {
	if env.skip != "" {
		t.Skip(env.skip)
	}
	const (
		name  = "upgrade"
		count = int64(10000)
		total = int64(1000000)
	)
	ns := "e2e-upgrade"
	kubectl(t, "", "create", "namespace", ns)
	kubectl(t, "", "-n", ns, "create", "secret", "generic", "grab-hmac", "--from-literal=key="+string(tokenKey))
	kubectl(t, activityManifest(ns, name, total, count), "apply", "-f", "-")
	kubectl(t, "", "-n", ns, "wait", "--for=condition=Ready", "rpa/"+name, "--timeout=180s")
	grabDeploy := name + "-grab"
	kubectl(t, "", "-n", ns, "rollout", "status", "deployment/"+grabDeploy, "--timeout=180s")
	previousTag, nextTag := env.previousImage.Tag, env.images["operator"].Tag
	for _, p := range env.kit.GrabPods(t, ns, name) {
		if img := p.Spec.Containers[0].Image; img != previousTag {
			t.Fatalf("grab pod %s runs %s on release %s, want %s", p.Name, img, env.previous.Version, previousTag)
		}
	}
	uid := string(activity(t, ns, name).UID)
	url := env.kit.GrabURL(t, ns, name)
	libsBefore := functionLibraries(t)
	t.Logf("release %s serves %s/%s with grab image %s; function libraries %v", env.previous.Version, ns, name, previousTag, libsBefore)

	// Whatever happens, the activity is never fenced: watched from before the first
	// grab to the end of settlement.
	fences := watchFences(t, ns, name, uid)

	spec := rain.Spec{URL: url + "/v1/grab", Connections: 16, Timeout: 10 * time.Second,
		RetryUnavailable: true, Token: tokens(t, ns, name, uid), UserPrefix: "up", RetryEvery: 10}
	var (
		mu      sync.Mutex
		results []rain.Result
		used    int
	)
	testStart := time.Now()
	done := make(chan struct{})
	raining := make(chan struct{})
	go func() {
		defer close(raining)
		for {
			select {
			case <-done:
				return
			default:
			}
			s := spec
			mu.Lock()
			s.Users, s.Rate, s.FirstUser = 500, 100, used+1
			used += s.Users
			mu.Unlock()
			began := time.Since(testStart)
			r := rain.Run(t.Context(), s)
			t.Logf("wave at +%s: %d users in %s, %d 503, %d dropped (first: %s)", began.Round(100*time.Millisecond),
				s.Users, r.Elapsed.Round(100*time.Millisecond), r.Unavailable, r.TransportErrors, r.FirstDropped)
			mu.Lock()
			results = append(results, r)
			mu.Unlock()
		}
	}()
	time.Sleep(5 * time.Second)

	// helm upgrade mid-rain, with the values the release was installed with.
	upgradeStart := time.Now()
	t.Logf("helm upgrade begins at +%s", upgradeStart.Sub(testStart).Round(100*time.Millisecond))
	timeline := watchRollout(t, ns, name, nextTag)
	took, err := env.node.UpgradeChart(t.Context(), chartDir(), version, env.installed, values)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("helm upgrade %s -> %s: operator rolled out in %s", env.previous.Version, version, took.Round(100*time.Millisecond))
	eventually(t, 2*time.Minute, "a replica of the new operator to hold the lease", func() error {
		_, err := newLeader(t, nextTag)
		return err
	})
	// The new operator rolls the grab Deployment to its image; the old grab pods serve
	// beside the new ones until the rollout ends.
	eventually(t, 2*time.Minute, "the grab Deployment to name "+nextTag, func() error {
		if img := deployment(t, ns, grabDeploy).Spec.Template.Spec.Containers[0].Image; img != nextTag {
			return fmt.Errorf("image %s", img)
		}
		return nil
	})
	kubectl(t, "", "-n", ns, "rollout", "status", "deployment/"+grabDeploy, "--timeout=180s")
	eventually(t, 2*time.Minute, "the last grab pod of "+previousTag+" to be gone", func() error {
		if tl := timeline(); tl.oldGone == 0 {
			return fmt.Errorf("%+v", tl)
		}
		return nil
	})
	for _, p := range env.kit.GrabPods(t, ns, name) {
		if img := p.Spec.Containers[0].Image; img != nextTag {
			t.Errorf("grab pod %s runs %s after the rollout, want %s", p.Name, img, nextTag)
		}
	}
	tl := timeline()
	t.Logf("after helm upgrade began: the new operator held the lease at +%s, the grab Deployment named %s at +%s, "+
		"grab pods of both versions ran together for %s, the last one of %s was gone at +%s",
		tl.leaseMoved.Round(100*time.Millisecond), nextTag, tl.grabPatched.Round(100*time.Millisecond),
		tl.mixed.Round(100*time.Millisecond), previousTag, tl.oldGone.Round(100*time.Millisecond))
	if tl.mixed == 0 {
		t.Errorf("no grab pods of both versions were seen together: the rollout did not put a skew under the rain")
	}
	time.Sleep(5 * time.Second) // the new grab pods serve the rain a while
	close(done)
	<-raining
	// While the operator and the grab pods rolled, the rain's users were answered:
	// a version skew that broke the old grab pods (a library they cannot find, a
	// format they cannot read) would answer 503 to every grab they take, and a
	// rollout that cut connections would drop them.
	var waveRequests, waveUnavailable, waveDropped int64
	for _, r := range results {
		waveRequests += r.Requests
		waveUnavailable += r.Unavailable
		waveDropped += r.TransportErrors
	}
	t.Logf("the rain during the upgrade: %d users, %d requests, %d answered 503, %d dropped and asked again",
		used, waveRequests, waveUnavailable, waveDropped)
	if (waveUnavailable+waveDropped)*50 > waveRequests {
		t.Errorf("%d 503 answers and %d dropped requests of %d during the upgrade: more than 2%%", waveUnavailable, waveDropped, waveRequests)
	}

	// The rest of the users, 1,000 a second, until every packet is gone.
	mu.Lock()
	rest := spec
	rest.Users, rest.FirstUser, rest.Rate = max(int(count)+2000-used, 2000), used+1, 1000
	used += rest.Users
	mu.Unlock()
	results = append(results, rain.Run(t.Context(), rest))

	tally := kit.Sum(t, results)
	t.Logf("the whole rain: %s", tally)
	tally.CheckSoldOut(t, count, total)

	// Settlement does not stall across the upgrade: every grant is credited once.
	env.kit.WaitSoldOutAndSettled(t, ns, name, count, total, 3*time.Minute)
	tally.CheckCredited(t, env.receiver, uid, count, total)
	if seen := fences(); seen != "" {
		t.Errorf("the activity was fenced during the upgrade: %s", seen)
	}
	t.Logf("function libraries after the upgrade: %v", functionLibraries(t))
	t.Log("\n" + kubectl(t, "", "-n", ns, "get", "rpa", "-o", "wide"))
}

// tokenKey is the HMAC key of user tokens in the test's namespace.
var tokenKey = []byte("upgrade-user-token-key")

// activityManifest is a RedPacketActivity with user tokens, two grab replicas and a
// webhook to the test's receiver, in fields every supported release reads.
func activityManifest(ns, name string, total, count int64) string {
	return fmt.Sprintf(`apiVersion: redpacket.io/v1alpha1
kind: RedPacketActivity
metadata:
  name: %s
  namespace: %s
spec:
  totalAmount: %d
  count: %d
  currency: CNY
  distribution: {type: Random, minAmount: 1}
  sponsor: merchant-upgrade
  grabService:
    replicas: 2
    auth:
      tokenSecretRef: {name: grab-hmac}
  settlement:
    webhook:
      url: %s/credit
    maxAttempts: 20
`, name, ns, total, count, env.receiverURL)
}

// tokens signs user tokens for the activity of uid. Safe for concurrent use.
func tokens(t *testing.T, ns, name, uid string) func(string) string {
	return func(user string) string {
		tok, err := grabsvc.SignToken(tokenKey, grabsvc.TokenClaims{UserID: user, Activity: ns + "/" + name,
			ActivityUID: types.UID(uid), Exp: time.Now().Add(time.Hour).Unix()})
		if err != nil {
			t.Error(err)
		}
		return tok
	}
}

// chartDir is this tree's chart.
func chartDir() string { return env.root + "/charts/redpacket-operator" }

// watchFences polls the activity's conditions and its Redis meta hashes every 250 ms
// until the test ends, and returns a function that reports the first fence seen: a
// Stalled condition that is True, or a meta hash with its fenced field set.
func watchFences(t *testing.T, ns, name, uid string) func() string {
	var (
		mu   sync.Mutex
		seen string
	)
	note := func(s string) {
		mu.Lock()
		defer mu.Unlock()
		if seen == "" {
			seen = s
		}
	}
	metas := metaKeys(t, uid)
	go func() {
		tick := time.NewTicker(250 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-t.Context().Done():
				return
			case <-tick.C:
			}
			a := &redpacketv1alpha1.RedPacketActivity{}
			if err := env.client.Get(t.Context(), client.ObjectKey{Namespace: ns, Name: name}, a); err == nil {
				if c := apimeta.FindStatusCondition(a.Status.Conditions, "Stalled"); c != nil && c.Status == "True" {
					note(fmt.Sprintf("Stalled %s: %s", c.Reason, c.Message))
				}
			}
			for _, k := range metas {
				if f, err := env.redis.HGet(t.Context(), k, "fenced").Result(); err == nil && f != "" {
					note(fmt.Sprintf("%s fenced=%s", k, f))
				}
			}
		}
	}()
	return func() string {
		mu.Lock()
		defer mu.Unlock()
		return seen
	}
}

// metaKeys are the activity's meta hashes, one per shard.
func metaKeys(t *testing.T, uid string) []string {
	t.Helper()
	keys, err := env.redis.Keys(t.Context(), "rpa:{"+uid+"*}:meta").Result()
	if err != nil || len(keys) == 0 {
		t.Fatalf("the meta hashes of activity %s: %v %v", uid, keys, err)
	}
	return keys
}

// functionLibraries lists the function libraries the Redis holds.
func functionLibraries(t *testing.T) []string {
	t.Helper()
	libs, err := env.redis.FunctionList(t.Context(), redis.FunctionListQuery{}).Result()
	if err != nil {
		t.Fatalf("FUNCTION LIST: %v", err)
	}
	var names []string
	for _, l := range libs {
		names = append(names, l.Name)
	}
	sort.Strings(names)
	return names
}

// newLeader returns the lease holder once it is an operator pod that runs image.
func newLeader(t *testing.T, image string) (string, error) {
	l := &coordinationv1.Lease{}
	if err := env.client.Get(t.Context(), client.ObjectKey{Namespace: cluster.OperatorNamespace, Name: cluster.OperatorLease}, l); err != nil {
		return "", err
	}
	if l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity == "" {
		return "", fmt.Errorf("no holder")
	}
	pod, _, _ := strings.Cut(*l.Spec.HolderIdentity, "_")
	p := &corev1.Pod{}
	if err := env.client.Get(t.Context(), client.ObjectKey{Namespace: cluster.OperatorNamespace, Name: pod}, p); err != nil {
		return "", fmt.Errorf("holder %s: %w", pod, err)
	}
	if img := p.Spec.Containers[0].Image; img != image {
		return "", fmt.Errorf("holder %s runs %s", pod, img)
	}
	return pod, nil
}

// rollout is when each step of an upgrade was first seen, since watchRollout began.
type rollout struct {
	leaseMoved  time.Duration // a pod of the new image held the operator's lease
	grabPatched time.Duration // the grab Deployment named the new image
	oldGone     time.Duration // no grab pod of another image was left, not even terminating
	mixed       time.Duration // how long grab pods of both images were seen, one of the new Ready
}

// watchRollout polls the lease, the activity's grab Deployment and its pods every
// 250 ms until the test ends, and returns a function that reports what it saw.
func watchRollout(t *testing.T, ns, name, image string) func() rollout {
	var (
		mu sync.Mutex
		tl rollout
	)
	start := time.Now()
	go func() {
		tick := time.NewTicker(250 * time.Millisecond)
		defer tick.Stop()
		last := time.Now()
		for {
			select {
			case <-t.Context().Done():
				return
			case <-tick.C:
			}
			now := time.Now()
			since := now.Sub(start)
			_, leaseErr := newLeader(t, image)
			d := &appsv1.Deployment{}
			depErr := env.client.Get(t.Context(), client.ObjectKey{Namespace: ns, Name: name + "-grab"}, d)
			pods := &corev1.PodList{}
			podErr := env.client.List(t.Context(), pods, client.InNamespace(ns), client.MatchingLabels{"redpacket.io/activity": name})
			mu.Lock()
			if tl.leaseMoved == 0 && leaseErr == nil {
				tl.leaseMoved = since
			}
			if tl.grabPatched == 0 && depErr == nil && d.Spec.Template.Spec.Containers[0].Image == image {
				tl.grabPatched = since
			}
			if podErr == nil && tl.grabPatched > 0 {
				old, newReady := 0, 0
				for _, p := range pods.Items {
					switch {
					case p.Spec.Containers[0].Image != image:
						old++
					case kit.PodReady(&p) && p.DeletionTimestamp == nil:
						newReady++
					}
				}
				if old > 0 && newReady > 0 {
					tl.mixed += now.Sub(last)
				}
				if old == 0 && tl.oldGone == 0 {
					tl.oldGone = since
				}
			}
			mu.Unlock()
			last = now
		}
	}()
	return func() rollout {
		mu.Lock()
		defer mu.Unlock()
		return tl
	}
}
