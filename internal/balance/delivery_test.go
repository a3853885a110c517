package balance

import (
	"bytes"
	"testing"
)

// The key of every kind of delivery the operator sends is accepted with its body,
// and with no other body: a credit's key is never an announcement's.
func TestParseKeysOfEveryDelivery(t *testing.T) {
	for _, c := range []struct {
		d        Delivery
		key      string
		announce bool
		source   string
	}{
		{announceActivity("u1", 100, 3), "u1/budget", true, SourceKindActivity},
		{grant("u1", 7, "alice", 10), "u1/7", false, SourceKindActivity},
		{refund("u1", "sponsor", 10), "u1/refund", false, SourceKindActivity},
		{announceBudget("b1", 5000), "b1/budget:5000", true, SourceKindBudget},
		{budgetGrant("b1", "order-9", 0, "alice", 10), "b1/order-9/0", false, SourceKindBudget},
		{budgetRefund("b1", "order-9", "sender", 10), "b1/order-9/refund", false, SourceKindBudget},
	} {
		body := mustJSON(t, c.d)
		r, err := parse(c.key, body)
		if err != nil {
			t.Errorf("%s: %v", c.key, err)
			continue
		}
		if r.announce != c.announce || r.source != c.source || len(r.digest) != 32 {
			t.Errorf("%s: announce %v, source %s, digest %x", c.key, r.announce, r.source, r.digest)
		}
		for _, other := range []string{"u1/budget", "u1/7", "u1/refund", "b1/budget:5000", "b1/order-9/0", "b1/order-9/refund", "b1/budget:5001"} {
			if other == c.key {
				continue
			}
			if _, err := parse(other, body); err == nil {
				t.Errorf("the body of %s was accepted under %s", c.key, other)
			}
		}
	}
}

// The digest covers what a booking depends on, not the JSON's form or the labels.
func TestDigestIsOfTheCanonicalForm(t *testing.T) {
	a, err := parse("u1/7", []byte(`{"kind":"grant","activityUID":"u1","packetId":"7","userId":"alice","amount":10,"currency":"CNY","at":"2026-12-04T10:00:00Z"}`))
	if err != nil {
		t.Fatal(err)
	}
	b, err := parse("u1/7", []byte(`{"at":"2026-12-04T18:00:00.000+08:00","currency":"CNY","amount":10,"userId":"alice",
		"packetId":"7","activityUID":"u1","kind":"grant","activity":"ns/label","extra":true}`))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.digest, b.digest) {
		t.Fatal("the same booking in two JSON forms has two digests")
	}
	c, err := parse("u1/7", []byte(`{"kind":"grant","activityUID":"u1","packetId":"7","userId":"alice","amount":11,"currency":"CNY","at":"2026-12-04T10:00:00Z"}`))
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(a.digest, c.digest) {
		t.Fatal("two amounts, one digest")
	}
}
