package main

import (
	"bytes"
	"context"
	"io"
	"path/filepath"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/redistest"
)

// TestReplayDeadLetters runs the replay-dead-letters command against a real API
// server and a real Redis: it finds the activity's keys by its UID, moves at most
// --max entries back into the stream with their original fields, and moves the rest
// when run again without --max.
func TestReplayDeadLetters(t *testing.T) {
	cp := controlplane.Start(t)
	ns := cp.Namespace(t)
	rs := redistest.Start(t)
	ctx := context.Background()
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := cp.Kubeconfig(kubeconfig); err != nil {
		t.Fatal(err)
	}
	rpa := &redpacketv1alpha1.RedPacketActivity{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "quiz"},
		Spec: redpacketv1alpha1.RedPacketActivitySpec{
			TotalAmount: 30, Count: 3, Currency: "CNY", Sponsor: "sponsor-1",
			Distribution: redpacketv1alpha1.Distribution{Type: redpacketv1alpha1.DistributionFixed, MinAmount: 1},
		},
	}
	if err := cp.Client.Create(ctx, rpa); err != nil {
		t.Fatal(err)
	}
	admin := rs.Client(t)
	act := store.NewActivity(admin, string(rpa.UID), 1)
	keys := act.Shard(0).Keys()
	if _, err := act.Seed(ctx, []int64{10, 10, 10}, store.SeedParams{Count: 3, Total: 30, Sponsor: "sponsor-1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := act.Configure(ctx, 0, 0, false, true); err != nil {
		t.Fatal(err)
	}
	// Three grants, each parked by the dead-letter script as a worker would.
	const group = "replay-test"
	if err := admin.XGroupCreateMkStream(ctx, keys.Stream, group, "0").Err(); err != nil {
		t.Fatal(err)
	}
	for _, u := range []string{"u1", "u2", "u3"} {
		if r, err := act.Shard(0).Grab(ctx, u); err != nil || r.Outcome != store.Granted {
			t.Fatalf("grab for %s: %+v %v", u, r, err)
		}
	}
	read, err := admin.XReadGroup(ctx, &redis.XReadGroupArgs{Group: group, Consumer: "c", Streams: []string{keys.Stream, ">"}}).Result()
	if err != nil || len(read) != 1 || len(read[0].Messages) != 3 {
		t.Fatalf("reading the grants: %+v %v", read, err)
	}
	for _, m := range read[0].Messages {
		if ok, err := act.Shard(0).DeadLetter(ctx, group, m.ID, "HTTP 400", m.Values); err != nil || !ok {
			t.Fatalf("dead-lettering %s: %v %v", m.ID, ok, err)
		}
	}

	replay := func(extra ...string) string {
		t.Helper()
		var out bytes.Buffer
		args := append([]string{"--namespace", ns, "--activity", "quiz", "--kubeconfig", kubeconfig,
			"--redis-addresses", rs.Addr, "--redis-username", rs.Username, "--redis-password", rs.Password}, extra...)
		if err := replayDeadLetters(ctx, args, &out, io.Discard); err != nil {
			t.Fatalf("replay-dead-letters %v: %v", extra, err)
		}
		return out.String()
	}
	check := func(dead, streamLen int64) {
		t.Helper()
		snap, err := act.Snapshot(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if n := admin.XLen(ctx, keys.DeadLetters).Val(); n != dead || snap.DeadCount != dead {
			t.Fatalf("dead-letter stream holds %d, dead_count %d, want %d", n, snap.DeadCount, dead)
		}
		if n := admin.XLen(ctx, keys.Stream).Val(); n != streamLen {
			t.Fatalf("stream holds %d entries, want %d", n, streamLen)
		}
	}
	check(3, 3)

	if out := replay("--max", "2"); !strings.Contains(out, "moved 2 ") {
		t.Fatalf("--max 2 printed %q", out)
	}
	check(1, 5)
	if out := replay(); !strings.Contains(out, "moved 1 ") {
		t.Fatalf("second run printed %q", out)
	}
	check(0, 6)
	if out := replay(); !strings.Contains(out, "moved 0 ") {
		t.Fatalf("run with nothing parked printed %q", out)
	}

	// The replayed entries carry the original grants' fields, without the dead
	// letter's own ones, so the workers deliver them again as they were.
	news, err := act.Shard(0).Entries(ctx)
	if err != nil {
		t.Fatal(err)
	}
	users := map[string]bool{}
	for _, e := range news[3:] {
		if _, ok := e.Fields["error"]; ok || e.Malformed != nil || e.Kind != store.KindGrant || e.Amount != 10 {
			t.Fatalf("replayed entry %s: %v", e.ID, e.Fields)
		}
		users[e.UserID] = true
	}
	if len(users) != 3 {
		t.Fatalf("replayed users: %v", users)
	}

	// An activity the API server does not know is an error, and nothing moves.
	err = replayDeadLetters(ctx, []string{"--namespace", ns, "--activity", "nope", "--kubeconfig", kubeconfig,
		"--redis-addresses", rs.Addr, "--redis-username", rs.Username, "--redis-password", rs.Password}, io.Discard, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "nope") {
		t.Fatalf("unknown activity: %v", err)
	}
	for _, args := range [][]string{
		{},
		{"--activity", "x", "--max", "-1"},
		{"--activity", "x", "--redis-mode", "sentinel"},
		{"--activity", "x", "extra"},
	} {
		if _, err := parseReplayFlags(args, io.Discard); err == nil {
			t.Errorf("%v accepted", args)
		}
	}
}
