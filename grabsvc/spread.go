package grabsvc

import (
	"crypto/sha256"

	"encoding/binary"
	"math/bits"
	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"time"
)

// SpreadOffset is a user's place in an activity's start spread: an offset in
// [0, spread), a whole number of milliseconds, taken from SHA-256 of the activity's
// UID, a zero byte and the user id. The same activity and user get the same offset
// in every process and every run; over many users the offsets are uniform over the
// window (the hash's first 64 bits scaled by the window with a 128-bit product, so
// no value of the window is favoured by a modulo). The UID is part of the hash so
// that a user late in one rain is not late in every rain. A spread under 1 ms
// spreads nothing: the offset is 0.
func SpreadOffset(activityUID, userID string, spread time.Duration) time.Duration {
	ms := uint64(spread / time.Millisecond)
	if ms == 0 {
		return 0
	}
	h := sha256.New()
	h.Write([]byte(activityUID))
	h.Write([]byte{0})
	h.Write([]byte(userID))
	var sum [sha256.Size]byte
	hi, _ := bits.Mul64(binary.BigEndian.Uint64(h.Sum(sum[:0])[:8]), ms)
	return time.Duration(hi) * time.Millisecond
}

// OpensAt is when userID's grabs open in an activity that starts at start with the
// given spread: start plus SpreadOffset. A zero start (no startTime) opens at once
// and spreads nothing.
func OpensAt(activityUID, userID string, start time.Time, spread time.Duration) time.Time {
	if start.IsZero() {
		return start
	}
	return start.Add(SpreadOffset(activityUID, userID, spread))
}

// startSpreadOf is the activity's start and spread as its spec declares them: a
// zero spread when it has none or no startTime.
func startSpreadOf(o *redpacketv1alpha1.RedPacketActivity) (time.Time, time.Duration) {
	if o.Spec.StartTime == nil || o.Spec.GrabService.StartSpread == nil {
		return time.Time{}, 0
	}
	return o.Spec.StartTime.Time, o.Spec.GrabService.StartSpread.Duration
}
