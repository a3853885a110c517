package settlement

import (
	"encoding/json"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
)

// A delivery's body carries its source twice: in today's fields (activity,
// activityUID, and source "budget" for a budget's) and in the sourceRef object,
// which names the kind, for an activity's and a budget's deliveries alike.
func TestDeliveryBodyCarriesSource(t *testing.T) {
	a := &redpacketv1alpha1.RedPacketActivity{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "quiz", UID: "uid-a"}}
	entry := store.StreamEntry{ID: "1-0", Kind: store.KindGrant, PacketID: "7", UserID: "u1", Amount: 100,
		At: time.UnixMilli(1_700_000_000_000)}
	cases := []struct {
		name       string
		cfg        Config
		wantSource any
		wantRef    map[string]any
	}{
		{"activity", ActivityConfig(a, nil), nil,
			map[string]any{"kind": "RedPacketActivity", "namespace": "ns", "name": "quiz", "uid": "uid-a"}},
		{"budget", BudgetConfigFor("shop", "group", "uid-b", "", "", 0, nil, Packets{}), "budget",
			map[string]any{"kind": "RedPacketBudget", "namespace": "shop", "name": "group", "uid": "uid-b"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			w := &Worker{cfg: tc.cfg}
			body, err := json.Marshal(w.delivery(entry))
			if err != nil {
				t.Fatal(err)
			}
			var got map[string]any
			if err := json.Unmarshal(body, &got); err != nil {
				t.Fatal(err)
			}
			ref, _ := got["sourceRef"].(map[string]any)
			if len(ref) != len(tc.wantRef) {
				t.Fatalf("sourceRef %v, want %v (body %s)", got["sourceRef"], tc.wantRef, body)
			}
			for k, v := range tc.wantRef {
				if ref[k] != v {
					t.Errorf("sourceRef.%s = %v, want %v (body %s)", k, ref[k], v, body)
				}
			}
			wantActivity := tc.wantRef["namespace"].(string) + "/" + tc.wantRef["name"].(string)
			if got["activity"] != wantActivity || got["activityUID"] != tc.wantRef["uid"] || got["source"] != tc.wantSource ||
				got["currency"] != DefaultCurrency {
				t.Errorf("body %s: activity %v, activityUID %v, source %v, currency %v; want %s, %v, %v, %s",
					body, got["activity"], got["activityUID"], got["source"], got["currency"],
					wantActivity, tc.wantRef["uid"], tc.wantSource, DefaultCurrency)
			}
		})
	}
}
