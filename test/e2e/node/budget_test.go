package node

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/internal/balance"
	"redpacket.io/operator/internal/rain"
	"redpacket.io/operator/settlement"
	"redpacket.io/operator/test/cluster"
	"redpacket.io/operator/test/e2e/kit"
)

// TestBudgetOnTheNode runs seed 004's group packets on the real node: a
// RedPacketBudget's shared fleet of 2 grab pods from the operator's image, 2,000
// packets created through the grab Service by the sender credential the operator
// minted, each raced by a group, expired with their remainders refunded, every
// share and refund booked once in the balance system's PostgreSQL with the
// operator's signature, kubectl get rpb exact and PostgreSQL's totals the status's to
// the unit, and the budget deleted with no key left.
func TestBudgetOnTheNode(t *testing.T) {
	requireNode(t)
	const (
		name    = "group-packets"
		packets = 2000
		each    = int64(1000)
		total   = int64(10_000_000)
		ttl     = 45 // seconds: past the creation and the race on a busy 2-core node
	)
	ns := namespace(t, "e2e-budget")
	events := serveEvents(t)
	applied := time.Now()
	kubectl(t, fmt.Sprintf(`apiVersion: redpacket.io/v1alpha1
kind: RedPacketBudget
metadata:
  name: %s
  namespace: %s
spec:
  total: %d
  currency: CNY
  packets: {maxTotal: 100000, maxCount: 10, minShare: 1, distributions: [Random, Fixed], defaultTTL: 1h, maxTTL: 1h}
  budgetShards: 4
  grabService: {replicas: 2}
  settlement:
    webhook: {url: %s}
    maxAttempts: 20
  events:
    webhook: {url: %s}
`, name, ns, total, env.balance.WebhookURL(), events.url), "apply", "-f", "-")
	kubectl(t, "", "-n", ns, "wait", "--for=condition=Ready", "rpb/"+name, "--timeout=180s")
	available(t, ns, name+"-grab", 2, 60*time.Second)
	t.Logf("budget Ready and its 2 grab pods Available %s after apply", time.Since(applied).Round(100*time.Millisecond))
	t.Log("\n" + kubectl(t, "", "-n", ns, "get", "rpb", name))

	b := &redpacketv1alpha1.RedPacketBudget{}
	if err := env.client.Get(t.Context(), client.ObjectKey{Namespace: ns, Name: name}, b); err != nil {
		t.Fatal(err)
	}
	uid := string(b.UID)
	enc := kubectl(t, "", "-n", ns, "get", "secret", name+"-sender", "-o", "jsonpath={.data.token}")
	token, err := base64.StdEncoding.DecodeString(enc)
	if err != nil || len(token) == 0 {
		t.Fatalf("the sender credential: %q, %v", enc, err)
	}
	ip := kubectl(t, "", "-n", ns, "get", "service", name+"-grab", "-o", "jsonpath={.spec.clusterIP}")
	url := "http://" + ip + ":8080"
	eventually(t, time.Minute, "the budget's grab Service to answer", func() error {
		resp, err := http.Get(url + "/readyz")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("HTTP %d", resp.StatusCode)
		}
		return nil
	})

	// Without the credential nothing is created.
	resp, err := http.Post(url+"/v1/packets", "application/json",
		strings.NewReader(`{"id":"nobody","sender":"x","totalAmount":10,"count":1}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("a create without the sender credential answered %d, want 401", resp.StatusCode)
	}
	// Each packet is raced by a group: 8 members for the even packets (every share
	// goes), 3 for the odd ones (two shares are left to refund).
	spec := rain.GroupSpec{URL: url, SenderToken: string(token), Packets: packets, IDPrefix: "order-", Total: each, Shares: 5,
		TTLSeconds: ttl, Members: func(p int) int { return 8 - 5*(p%2) }}
	res := rain.RunGroups(t.Context(), spec)
	if len(res.Errors) > 0 || res.Created != packets {
		t.Fatalf("%d of %d packets created; unexpected answers: %v", res.Created, packets, res.Errors)
	}
	t.Logf("%d packets created through the Service in %s; %d grabs (%d sold out) in %s", packets,
		res.CreateElapsed.Round(time.Millisecond), res.Grabs, res.SoldOut, res.GrabElapsed.Round(time.Millisecond))
	claimed, err := res.Check(spec)
	if err != nil {
		t.Fatal(err)
	}
	refunded := packets*each - claimed

	// Expiry: every packet's time runs out, the remainders are refunded, and
	// settlement books every share and refund once.
	const shares = packets/2*5 + packets/2*3
	eventually(t, 3*time.Minute, "every share and refund booked", func() error {
		grants, refunds := booked(t, uid)
		if len(grants) != shares || refunds != refunded {
			return fmt.Errorf("%d shares and %d refunded booked, want %d and %d", len(grants), refunds, shares, refunded)
		}
		return nil
	})
	// Every credit once, signed, within the budget: nothing refused that the
	// operator never causes.
	kit.CheckNoAlarms(t, env.balance)
	src := book(t, uid)
	// One refund per odd packet, raced by 3 members for 5 shares.
	wantGrants, wantRefunds := balance.Tally{Count: shares, Sum: claimed}, balance.Tally{Count: packets / 2, Sum: refunded}
	if src.Kind != "budget" || src.Total != total || src.Grants != wantGrants || src.Refunds != wantRefunds {
		t.Fatalf("the balance system's book: %+v; want a budget of %d, grants %+v, refunds %+v", src, total, wantGrants, wantRefunds)
	}
	eventually(t, time.Minute, "kubectl get rpb exact", func() error {
		row := columns(t, "-n", ns, "rpb", name)
		want := map[string]string{"TOTAL": strconv.FormatInt(total, 10), "AVAILABLE": strconv.FormatInt(total-packets*each, 10),
			"IN-PACKETS": "0", "CLAIMED": strconv.FormatInt(claimed, 10), "REFUNDED": strconv.FormatInt(refunded, 10), "LIVE": "0", "READY": "True"}
		for k, v := range want {
			if row[k] != v {
				return fmt.Errorf("%s is %q, want %q (row %v)", k, row[k], v, row)
			}
		}
		return nil
	})
	t.Log("\n" + kubectl(t, "", "-n", ns, "get", "rpb", name, "-o", "wide"))
	// PostgreSQL's totals are the status's, to the unit.
	if err := env.client.Get(t.Context(), client.ObjectKey{Namespace: ns, Name: name}, b); err != nil {
		t.Fatal(err)
	}
	st := b.Status
	if src.Total != val(st.Total) || src.Grants.Count != val(st.GrabbedShares) || src.Grants.Sum != val(st.Claimed) || src.Refunds.Sum != val(st.Refunded) {
		t.Errorf("PostgreSQL's totals: total %d, grants %+v, refunds %+v; the status: total %d, %d shares grabbed, claimed %d, refunded %d",
			src.Total, src.Grants, src.Refunds, val(st.Total), val(st.GrabbedShares), val(st.Claimed), val(st.Refunded))
	}
	t.Logf("PostgreSQL's book of the budget: total %d, %d grants summing to %d, %d refunds summing to %d: the status's totals",
		src.Total, src.Grants.Count, src.Grants.Sum, src.Refunds.Count, src.Refunds.Sum)

	// The merchant's events: each even packet created and exhausted, each odd one
	// created, expired and refunded, in that order, each key once, signed with the
	// operator's key for the events host, the refunds summing to what was refunded.
	eventually(t, 2*time.Minute, "every packet's events", func() error {
		if n := events.count(); n != packets/2*2+packets/2*3 {
			return fmt.Errorf("%d events, want %d", n, packets/2*2+packets/2*3)
		}
		return nil
	})
	events.check(t, uid, packets, refunded)

	reconcileOnTheNode(t, ns, name, uid)

	kubectl(t, "", "-n", ns, "delete", "rpb", name, "--timeout=120s")
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	keys, err := env.redis.Keys(ctx, "rpb:{"+uid+".*").Result()
	if err != nil || len(keys) != 0 {
		t.Fatalf("keys left after the budget was deleted: %v (%v)", keys, err)
	}
}

// reconcileOnTheNode plays the faults reconciliation is for on the budget name (UID
// uid), settled into cmd/balance's PostgreSQL by the operator on the node, which
// reconciles every 2 s (TestMain): Reconciled is True; a grant row deleted by hand is
// delivered again under its key and booked with its original digest, Reconciled True
// again and PostgreSQL's totals the status's to the unit; a row inserted by hand makes
// Reconciled False naming its key, with a Warning BooksDiffer; once it is deleted the
// books agree again, so the deletion that follows is not held.
func reconcileOnTheNode(t *testing.T, ns, name, uid string) {
	t.Helper()
	ctx := t.Context()
	db, err := pgx.Connect(ctx, env.balance.DatabaseURL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close(ctx)
	reconciled := func(what string, status metav1.ConditionStatus, reason, contains string) {
		t.Helper()
		var last string
		eventually(t, 2*time.Minute, what, func() error {
			b := &redpacketv1alpha1.RedPacketBudget{}
			if err := env.client.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, b); err != nil {
				return err
			}
			c := meta.FindStatusCondition(b.Status.Conditions, redpacketv1alpha1.ConditionReconciled)
			if c == nil {
				return fmt.Errorf("no Reconciled condition")
			}
			last = fmt.Sprintf("Reconciled=%s %s: %s", c.Status, c.Reason, c.Message)
			if c.Status != status || c.Reason != reason || !strings.Contains(c.Message, contains) {
				return fmt.Errorf("%s", last)
			}
			return nil
		})
		t.Logf("%s: %s", what, last)
	}
	before := book(t, uid)
	all := fmt.Sprintf("the balance system booked %d grants (%d) and %d refunds (%d)", before.Grants.Count, before.Grants.Sum,
		before.Refunds.Count, before.Refunds.Sum)
	reconciled("the books agree", metav1.ConditionTrue, redpacketv1alpha1.ReasonBooksAgree, all)

	var lost, digest string
	if err := db.QueryRow(ctx, `DELETE FROM credits WHERE idempotency_key = (SELECT idempotency_key FROM credits
		WHERE source_uid = $1 AND kind = 'grant' ORDER BY idempotency_key LIMIT 1) RETURNING idempotency_key, encode(digest, 'hex')`, uid).
		Scan(&lost, &digest); err != nil {
		t.Fatalf("deleting a credit row by hand: %v", err)
	}
	t.Logf("deleted the credit row %s by hand", lost)
	eventually(t, 2*time.Minute, "the deleted credit booked again", func() error {
		var again string
		if err := db.QueryRow(ctx, `SELECT encode(digest, 'hex') FROM credits WHERE idempotency_key = $1`, lost).Scan(&again); err != nil {
			return err
		}
		if again != digest {
			return fmt.Errorf("booked again with digest %s, want %s", again, digest)
		}
		return nil
	})
	reconciled("the books agree again", metav1.ConditionTrue, redpacketv1alpha1.ReasonBooksAgree, all)
	if after := book(t, uid); after.Grants != before.Grants || after.Refunds != before.Refunds {
		t.Errorf("PostgreSQL's totals after the re-delivery: grants %+v, refunds %+v; before the deletion %+v, %+v",
			after.Grants, after.Refunds, before.Grants, before.Refunds)
	}

	forged := uid + "/order-forged/0"
	if _, err := db.Exec(ctx, `INSERT INTO credits (idempotency_key, digest, kind, user_id, amount, currency, source_uid, packet_id, at)
		VALUES ($1, sha256('forged'), 'grant', 'mallory', 1, 'CNY', $2, 'order-forged/0', now())`, forged, uid); err != nil {
		t.Fatalf("inserting a credit row by hand: %v", err)
	}
	reconciled("a credit booked that the operator never paid", metav1.ConditionFalse, redpacketv1alpha1.ReasonBooksDiffer, forged)
	eventually(t, time.Minute, "the Warning BooksDiffer", func() error {
		out := kubectl(t, "", "-n", ns, "get", "events", "--field-selector", "reason=BooksDiffer", "-o", "jsonpath={.items[*].message}")
		if !strings.Contains(out, forged) {
			return fmt.Errorf("events: %q", out)
		}
		return nil
	})
	if _, err := db.Exec(ctx, `DELETE FROM credits WHERE idempotency_key = $1`, forged); err != nil {
		t.Fatal(err)
	}
	reconciled("the books agree once the forged row is gone", metav1.ConditionTrue, redpacketv1alpha1.ReasonBooksAgree, all)
}

// eventsReceiver is the merchant's endpoint for a budget's packet events, at the
// node's address where the operator reaches it: it checks the operator's signature
// and records each Idempotency-Key's first body, in arrival order per packet.
type eventsReceiver struct {
	url      string
	mu       sync.Mutex
	first    map[string]settlement.Event
	order    map[string][]string
	problems []string
}

// serveEvents serves an events receiver until the test ends and adds its
// "<node IP>_<port>" to the operator's settlement keys Secret, with the key the
// balance system verifies: the operator signs events with the key for their host.
func serveEvents(t *testing.T) *eventsReceiver {
	t.Helper()
	r := &eventsReceiver{first: map[string]settlement.Event{}, order: map[string][]string{}}
	l, err := net.Listen("tcp", net.JoinHostPort(cluster.NodeIP, "0"))
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: r, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close() })
	r.url = "http://" + l.Addr().String() + "/packet-events"
	allowed := strings.Replace(l.Addr().String(), ":", "_", 1)
	patch := fmt.Sprintf(`{"stringData":{%q:%q}}`, allowed, string(env.webhookKey))
	kubectl(t, "", "-n", cluster.OperatorNamespace, "patch", "secret", "redpacket-settlement-keys", "--type", "merge", "-p", patch)
	return r
}

func (r *eventsReceiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	body, _ := io.ReadAll(req.Body)
	key := req.Header.Get("Idempotency-Key")
	r.mu.Lock()
	defer r.mu.Unlock()
	var e settlement.Event
	if req.Header.Get("X-Signature") != settlement.Sign(env.webhookKey, body) || json.Unmarshal(body, &e) != nil {
		r.problems = append(r.problems, fmt.Sprintf("%s: bad signature or body %s", key, body))
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	if _, ok := r.first[key]; !ok {
		r.first[key] = e
		r.order[e.Data.PacketID] = append(r.order[e.Data.PacketID], e.Type)
	}
	w.WriteHeader(http.StatusNoContent)
}

func (r *eventsReceiver) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.first)
}

// check fails the test unless each of the packets "order-<p>" had its events in
// lifecycle order (the even ones exhausted, the odd ones expired and refunded), each
// under its key, and the refunded events sum to refunded.
func (r *eventsReceiver) check(t *testing.T, uid string, packets int, refunded int64) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.problems) > 0 {
		t.Fatalf("the events receiver saw: %v", r.problems[:min(len(r.problems), 5)])
	}
	var sum int64
	for p := range packets {
		id := fmt.Sprintf("order-%d", p)
		want := []string{settlement.EventPacketCreated, settlement.EventPacketExhausted}
		if p%2 == 1 {
			want = []string{settlement.EventPacketCreated, settlement.EventPacketExpired, settlement.EventPacketRefunded}
		}
		if !slices.Equal(r.order[id], want) {
			t.Errorf("packet %s: events %v, want %v", id, r.order[id], want)
		}
		if e, ok := r.first[settlement.EventKey(uid, id, settlement.EventPacketRefunded)]; ok && e.Data.RefundAmount != nil {
			sum += *e.Data.RefundAmount
		}
	}
	if sum != refunded {
		t.Errorf("the refunded events carry %d, the budget refunded %d", sum, refunded)
	}
	t.Logf("%d packet events, each packet's in lifecycle order; the refunded ones carry %d", len(r.first), sum)
}
