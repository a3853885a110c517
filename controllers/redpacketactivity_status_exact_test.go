package controllers_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
)

// Status is exact at every moment: sampled again and again while users grab, a grab
// replica reports and the activity closes at endTime, every status anyone reads has
// claimedAmount + remainingAmount + refundedAmount == totalAmount, and no cumulative
// counter ever goes down.
func TestStatusAddsUpAcrossTheClose(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.startController(nil)
	ctx := context.Background()
	const total, count = int64(2_000_000), int64(20_000)

	end := metav1.NewTime(time.Now().Add(5 * time.Second).Truncate(time.Second))
	a := e.create(e.activity("sampled", total, count, func(a *redpacketv1alpha1.RedPacketActivity) {
		a.Spec.EndTime = &end
	}))
	e.waitPhase("sampled", redpacketv1alpha1.PhaseActive, 20*time.Second)
	e.runReporter("sampled")

	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				res, err := e.handle(a).Shard(0).Grab(ctx, fmt.Sprintf("w%d-%d", w, i))
				if err != nil || res.Outcome == store.Ended || res.Outcome == store.SoldOut {
					return
				}
				time.Sleep(5 * time.Millisecond)
			}
		})
	}

	var samples, withAll int
	var lastClaimed, lastRefunded int64
	deadline := time.Now().Add(40 * time.Second)
	for {
		got := e.get("sampled")
		st := got.Status
		samples++
		if st.ClaimedAmount != nil || st.RemainingAmount != nil || st.RefundedAmount != nil {
			if st.ClaimedAmount == nil || st.RemainingAmount == nil || st.RefundedAmount == nil {
				t.Fatalf("sample %d: some money counters are set and some are not: %s", samples, describe(got))
			}
			withAll++
			if sum := *st.ClaimedAmount + *st.RemainingAmount + *st.RefundedAmount; sum != total {
				t.Fatalf("sample %d: claimed %d + remaining %d + refunded %d = %d, want %d",
					samples, *st.ClaimedAmount, *st.RemainingAmount, *st.RefundedAmount, sum, total)
			}
			if *st.ClaimedAmount < lastClaimed || *st.RefundedAmount < lastRefunded {
				t.Fatalf("sample %d: a counter went down: claimed %d after %d, refunded %d after %d",
					samples, *st.ClaimedAmount, lastClaimed, *st.RefundedAmount, lastRefunded)
			}
			lastClaimed, lastRefunded = *st.ClaimedAmount, *st.RefundedAmount
		}
		if st.Phase == redpacketv1alpha1.PhaseExpired && st.RefundedAmount != nil && *st.RefundedAmount > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the activity did not close with a refund: %s", describe(got))
		}
		time.Sleep(10 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	// A few more samples after the close, as the last reports arrive.
	for range 50 {
		st := e.get("sampled").Status
		samples++
		if *st.ClaimedAmount+*st.RemainingAmount+*st.RefundedAmount != total {
			t.Fatalf("after the close: %d + %d + %d != %d", *st.ClaimedAmount, *st.RemainingAmount, *st.RefundedAmount, total)
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("%d status samples (%d with counters), the last: %d claimed, %d refunded", samples, withAll, lastClaimed, lastRefunded)
	if lastClaimed == 0 {
		t.Errorf("nothing was claimed before the close: the test did not sample a moving status")
	}
}
