// Package kit holds what the suites on a real node (test/e2e/node, test/e2e/upgrade)
// share: the kubectl and API reads a test makes, polling, the rain's tally and the
// balance system's check of it, and the balance systems the operator delivers to:
// cmd/balance on a real PostgreSQL (test/e2e/node), or the in-memory receiver
// (test/e2e/upgrade, whose previous release sends X-Signature alone).
package kit

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/internal/balance"
	"redpacket.io/operator/internal/rain"
	"redpacket.io/operator/test/balancetest"
	"redpacket.io/operator/test/cluster"
	"redpacket.io/operator/test/proc"
)

// Kit is a node and an API client of it.
type Kit struct {
	Node   *cluster.Cluster
	Client client.Client
}

// Kubectl runs the real kubectl against the node and fails the test when it fails.
func (k Kit) Kubectl(t testing.TB, stdin string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	out, err := k.Node.Kubectl(ctx, stdin, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// Eventually polls f every 250 ms until it returns nil, failing the test after
// within, and returns how long it took.
func Eventually(t testing.TB, within time.Duration, what string, f func() error) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		err := f()
		if err == nil {
			return time.Since(start)
		}
		if time.Since(start) > within {
			t.Fatalf("%s: not within %s: %v", what, within, err)
		}
		select {
		case <-t.Context().Done():
			t.Fatalf("%s: %v", what, t.Context().Err())
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// Activity reads an activity.
func (k Kit) Activity(t testing.TB, ns, name string) *redpacketv1alpha1.RedPacketActivity {
	t.Helper()
	a := &redpacketv1alpha1.RedPacketActivity{}
	if err := k.Client.Get(t.Context(), client.ObjectKey{Namespace: ns, Name: name}, a); err != nil {
		t.Fatalf("reading activity %s/%s: %v", ns, name, err)
	}
	return a
}

// Deployment reads a Deployment.
func (k Kit) Deployment(t testing.TB, ns, name string) *appsv1.Deployment {
	t.Helper()
	d := &appsv1.Deployment{}
	if err := k.Client.Get(t.Context(), client.ObjectKey{Namespace: ns, Name: name}, d); err != nil {
		t.Fatalf("reading deployment %s/%s: %v", ns, name, err)
	}
	return d
}

// GrabPods lists the activity's grab pods that are not being deleted; it fails the
// test when there is none.
func (k Kit) GrabPods(t testing.TB, ns, name string) []corev1.Pod {
	t.Helper()
	list := &corev1.PodList{}
	if err := k.Client.List(t.Context(), list, client.InNamespace(ns), client.MatchingLabels{"redpacket.io/activity": name}); err != nil {
		t.Fatal(err)
	}
	var pods []corev1.Pod
	for _, p := range list.Items {
		if p.DeletionTimestamp == nil {
			pods = append(pods, p)
		}
	}
	if len(pods) == 0 {
		t.Fatalf("activity %s has no grab pods", name)
	}
	return pods
}

// GrabURL is the grab Service's ClusterIP URL of an activity, once the Service
// answers there. Ready and an Available Deployment do not mean that kube-proxy has
// already routed the Service to the new pods: that follows a moment later, and a
// client that came too early is refused.
func (k Kit) GrabURL(t testing.TB, ns, name string) string {
	t.Helper()
	ip := k.Kubectl(t, "", "-n", ns, "get", "service", name+"-grab", "-o", "jsonpath={.spec.clusterIP}")
	url := "http://" + ip + ":8080"
	start := time.Now()
	if err := proc.WaitHTTP(t.Context(), nil, url+"/readyz", time.Minute); err != nil {
		t.Fatalf("the grab Service at its ClusterIP: %v", err)
	}
	t.Logf("%s answered at %s %s after the first look", name+"-grab", url, time.Since(start).Round(10*time.Millisecond))
	return url
}

// PodReady reports whether a pod's Ready condition is True.
func PodReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// Val is a status counter, -1 while unset.
func Val(p *int64) int64 {
	if p == nil {
		return -1
	}
	return *p
}

// Tally is the sum of a rain's waves, seen from the client side.
type Tally struct {
	Users                                    int
	Requests, Granted, GrantedSum, Recovered int64
	Unavailable, Dropped, Failed             int64
	Retries, RetriesSame                     int64
	Outcomes                                 map[string]int64
	// Grants maps each granted user to its packet.
	Grants map[string]rain.Answer
}

// Sum adds up the waves of one rain on one activity, failing the test for every
// packet granted to two users.
func Sum(t testing.TB, results []rain.Result) Tally {
	t.Helper()
	s := Tally{Outcomes: map[string]int64{}, Grants: map[string]rain.Answer{}}
	byPacket := map[string]string{}
	for _, r := range results {
		s.Users += r.Users
		s.Requests += r.Requests
		s.Granted += r.Granted
		s.GrantedSum += r.GrantedSum
		s.Recovered += r.Recovered
		s.Unavailable += r.Unavailable
		s.Dropped += r.TransportErrors
		s.Failed += r.Failed
		s.Retries += r.Retries
		s.RetriesSame += r.RetriesSame
		for k, v := range r.ByOutcome {
			s.Outcomes[k] += v
		}
		if r.FirstError != "" {
			t.Logf("first error of a wave: %s", r.FirstError)
		}
		for user, a := range r.Grants {
			if other, ok := byPacket[a.PacketID]; ok {
				t.Errorf("packet %s granted to %s and %s", a.PacketID, other, user)
			}
			byPacket[a.PacketID] = user
			s.Grants[user] = a
		}
	}
	return s
}

// String is the tally in one line.
func (s Tally) String() string {
	return fmt.Sprintf("%d users, %d requests, outcomes %v (%d answers lost and recovered as already_claimed), "+
		"%d 503 answers and %d dropped connections asked again, %d of %d retries consistent",
		s.Users, s.Requests, s.Outcomes, s.Recovered, s.Unavailable, s.Dropped, s.RetriesSame, s.Retries)
}

// CheckSoldOut fails the test unless the rain was answered right and sold out an
// activity of count packets summing to total: every user answered by the API,
// every packet granted once, every user granted or told sold_out, every retry
// consistent with the first answer.
func (s Tally) CheckSoldOut(t testing.TB, count, total int64) {
	t.Helper()
	if s.Outcomes["error"] != 0 || s.Failed != 0 {
		t.Errorf("%d users got no answer and %d answers were failures", s.Outcomes["error"], s.Failed)
	}
	if s.Granted != count || s.GrantedSum != total {
		t.Errorf("granted %d packets summing to %d, want %d summing to %d", s.Granted, s.GrantedSum, count, total)
	}
	if s.Granted+s.Outcomes["sold_out"] != int64(s.Users) {
		t.Errorf("%d granted + %d sold out != %d users", s.Granted, s.Outcomes["sold_out"], s.Users)
	}
	if s.RetriesSame != s.Retries {
		t.Errorf("%d of %d retries were inconsistent with the first answer", s.Retries-s.RetriesSame, s.Retries)
	}
}

// CheckCredited fails the test unless the receiver credited the activity of uid
// exactly the tally's grants, count of them summing to total, each to its user,
// refunded nothing, and saw no bad, unsigned or conflicting delivery.
func (s Tally) CheckCredited(t testing.TB, rc *rain.Receiver, uid string, count, total int64) {
	t.Helper()
	credited, refund := rc.Credited(uid)
	var sum int64
	for _, d := range credited {
		sum += d.Amount
		if a, ok := s.Grants[d.UserID]; !ok || a.PacketID != d.PacketID || a.Amount != d.Amount {
			t.Errorf("credited packet %s (%d) to %s, who was granted %+v", d.PacketID, d.Amount, d.UserID, a)
		}
	}
	if int64(len(credited)) != count || sum != total || refund != 0 {
		t.Errorf("credited %d grants summing to %d and a refund of %d, want %d summing to %d and none",
			len(credited), sum, refund, count, total)
	}
	if tot := rc.Totals(); tot.BadRequests != 0 || tot.Conflicts != 0 || tot.UsersCreditedTwice != 0 {
		t.Errorf("the balance system saw %d bad or unsigned deliveries, %d conflicting repeats, %d users credited twice",
			tot.BadRequests, tot.Conflicts, tot.UsersCreditedTwice)
	}
}

// CheckBooked fails the test unless the balance system booked in PostgreSQL exactly
// the tally's grants for the activity of uid, each to its user, count of them
// summing to total, and no refund; unless its book's totals are the activity's status
// totals to the unit (grants and their sum the settled count and amount, refunds the
// refunded amount); and unless it refused nothing the operator never causes.
func (s Tally) CheckBooked(t testing.TB, bs *balancetest.System, uid string, status redpacketv1alpha1.RedPacketActivityStatus, count, total int64) {
	t.Helper()
	credits, err := bs.Credits(t.Context(), uid)
	if err != nil {
		t.Fatal(err)
	}
	var grants, sum, refund int64
	byUser := map[string]int{}
	for _, c := range credits {
		if c.Kind == "refund" {
			refund += c.Amount
			continue
		}
		grants++
		sum += c.Amount
		byUser[c.UserID]++
		if a, ok := s.Grants[c.UserID]; !ok || a.PacketID != c.PacketID || a.Amount != c.Amount {
			t.Errorf("booked packet %s (%d) to %s, who was granted %+v", c.PacketID, c.Amount, c.UserID, a)
		}
	}
	if grants != count || sum != total || refund != 0 {
		t.Errorf("booked %d grants summing to %d and a refund of %d, want %d summing to %d and none", grants, sum, refund, count, total)
	}
	for user, n := range byUser {
		if n > 1 {
			t.Errorf("%s was booked %d grants of one activity", user, n)
		}
	}
	src, ok, err := bs.Source(t.Context(), uid)
	if err != nil || !ok {
		t.Fatalf("the balance system's source %s: %v, %v", uid, ok, err)
	}
	if src.Total != total || src.Count == nil || *src.Count != count {
		t.Errorf("the balance system holds an announcement of %d in %v packets, want %d in %d", src.Total, src.Count, total, count)
	}
	settled := balance.Tally{Count: Val(status.SettledCount), Sum: Val(status.SettledAmount)}
	refunded := max(0, Val(status.RefundedAmount))
	if src.Grants != settled || src.Refunds.Sum != refunded || src.Grants.Count != grants || src.Grants.Sum != sum {
		t.Errorf("PostgreSQL's totals: grants %+v, refunds %+v; the status: settled %+v, refunded %d; the credits: %d summing to %d",
			src.Grants, src.Refunds, settled, refunded, grants, sum)
	}
	t.Logf("PostgreSQL's book of the activity: %d grants summing to %d, %d refunds summing to %d; the status: settled %d summing to %d, refunded %d",
		src.Grants.Count, src.Grants.Sum, src.Refunds.Count, src.Refunds.Sum, settled.Count, settled.Sum, refunded)
	CheckNoAlarms(t, bs)
}

// CheckNoAlarms fails the test when the balance system refused a POST the operator
// never causes: a bad signature or body, a key reused with another body, a credit
// beyond its budget (balancetest.Alarms).
func CheckNoAlarms(t testing.TB, bs *balancetest.System) {
	t.Helper()
	refusals, err := bs.Refusals()
	if err != nil {
		t.Fatal(err)
	}
	if alarms := balancetest.Alarms(refusals); len(alarms) > 0 {
		t.Errorf("the balance system refused %v (all refusals: %v); log %s", alarms, refusals, bs.LogPath)
	}
}

// StartBalanceSystem starts cmd/balance, the binary bin, on a PostgreSQL cluster of
// its own, at the node's address where the operator's pods reach it, verifying v1
// signatures with key; its log and key file go in dir. It creates the operator's
// settlement keys Secret with key for its "<node IP>_<port>". Stop the system to
// remove its database.
func StartBalanceSystem(ctx context.Context, node *cluster.Cluster, bin, dir string, key []byte) (*balancetest.System, error) {
	bs, err := balancetest.Start(ctx, balancetest.Options{Binary: bin, Host: cluster.NodeIP, Dir: dir, SigningKeys: [][]byte{key}})
	if err != nil {
		return nil, err
	}
	allowed := strings.Replace(strings.TrimPrefix(bs.URL, "http://"), ":", "_", 1)
	if _, err := node.Kubectl(ctx, "", "-n", cluster.OperatorNamespace, "create", "secret", "generic", "redpacket-settlement-keys",
		"--from-literal="+allowed+"="+string(key)); err != nil {
		_ = bs.Stop()
		return nil, err
	}
	return bs, nil
}

// ServeReceiver serves a receiver that verifies with key and requires each
// activity's budget first, at the node's address, until ctx ends or stop is
// called, and creates the operator's settlement keys Secret with key for the
// receiver's address and port ("<node IP>_<port>", and the bare address for the
// previous release). It returns the receiver and its
// base URL.
func ServeReceiver(ctx context.Context, node *cluster.Cluster, key []byte) (*rain.Receiver, string, func(), error) {
	rc := rain.NewReceiver(key)
	rc.RequireBudget = true
	url, stop, err := rc.Serve(ctx, cluster.NodeIP)
	if err != nil {
		return nil, "", nil, err
	}
	hostPort := strings.TrimPrefix(url, "http://")
	allowed := strings.Replace(hostPort, ":", "_", 1)
	// The bare host is for the previous release (the upgrade test starts with it),
	// which reads a key as a host of any port; this tree reads it as the host's port 80
	// only, where nothing listens.
	host, _, _ := strings.Cut(hostPort, ":")
	if _, err := node.Kubectl(ctx, "", "-n", cluster.OperatorNamespace, "create", "secret", "generic", "redpacket-settlement-keys",
		"--from-literal="+allowed+"="+string(key), "--from-literal="+host+"="+string(key)); err != nil {
		stop()
		return nil, "", nil, err
	}
	return rc, url, stop, nil
}

// WaitSoldOutAndSettled waits until the activity is Exhausted with all count packets
// claimed and settled, then fails the test unless its status is exact: total claimed
// and settled, nothing remaining, claimed + remaining + refunded = total.
func (k Kit) WaitSoldOutAndSettled(t testing.TB, ns, name string, count, total int64, within time.Duration) {
	t.Helper()
	Eventually(t, within, "the activity to be Exhausted and settled", func() error {
		st := k.Activity(t, ns, name).Status
		if st.Phase != redpacketv1alpha1.PhaseExhausted || Val(st.ClaimedCount) != count || Val(st.SettledCount) != count {
			return fmt.Errorf("phase %s claimed %d settled %d", st.Phase, Val(st.ClaimedCount), Val(st.SettledCount))
		}
		return nil
	})
	st := k.Activity(t, ns, name).Status
	if Val(st.ClaimedAmount) != total || Val(st.RemainingCount) != 0 || Val(st.RemainingAmount) != 0 || Val(st.SettledAmount) != total {
		t.Errorf("status claimed %d remaining %d/%d settled %d, want %d, 0/0, %d",
			Val(st.ClaimedAmount), Val(st.RemainingCount), Val(st.RemainingAmount), Val(st.SettledAmount), total, total)
	}
	if Val(st.ClaimedAmount)+Val(st.RemainingAmount)+Val(st.RefundedAmount) != total {
		t.Errorf("claimed %d + remaining %d + refunded %d != total %d",
			Val(st.ClaimedAmount), Val(st.RemainingAmount), Val(st.RefundedAmount), total)
	}
}
