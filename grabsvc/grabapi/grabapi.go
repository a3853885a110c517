// Package grabapi holds the JSON bodies of the grab API (docs/grab-api.md) that
// both the grab service and its clients (the kubectl plugin, the load generator)
// speak. It imports nothing but the standard library, so a client does not pull
// in the grab server to read its answers. Field names and shapes are the wire
// contract fixed in API.md: change them only additively.
package grabapi

// GrabResponse is the body of every /v1/grab answer. Amount is present exactly
// when a share was handed out (granted, or already_claimed with its packet).
type GrabResponse struct {
	Outcome  string `json:"outcome"`
	PacketID string `json:"packetId,omitempty"`
	Amount   *int64 `json:"amount,omitempty"`
	Error    string `json:"error,omitempty"`
	// OpensAt is, on a not_started answer of an activity with a start spread, the
	// user's own opening instant (RFC 3339 with milliseconds).
	OpensAt string `json:"opensAt,omitempty"`
}

// PacketView is a packet as POST /v1/packets answers it.
type PacketView struct {
	// Outcome is created or existing in a creation's answer, absent elsewhere.
	Outcome string `json:"outcome,omitempty"`
	// ClaimSecret is, in a creation's answer of a budget with
	// spec.packets.claimSecret, what a grab or a read of the packet must carry (the
	// Claim-Secret header): put it in the share link's fragment, /p/{id}#<secret>.
	// No other answer carries it.
	ClaimSecret     string `json:"claimSecret,omitempty"`
	ID              string `json:"id"`
	Sender          string `json:"sender"`
	Currency        string `json:"currency"`
	Distribution    string `json:"distribution"`
	TotalAmount     int64  `json:"totalAmount"`
	Count           int64  `json:"count"`
	RemainingAmount int64  `json:"remainingAmount"`
	RemainingCount  int64  `json:"remainingCount"`
	// CreatedAt and ExpiresAt are RFC 3339 with milliseconds, by the Redis clock.
	CreatedAt string `json:"createdAt"`
	ExpiresAt string `json:"expiresAt"`
	// Expired is set once the remainder was refunded (or nothing was left).
	Expired bool `json:"expired"`
	// Forgotten is set once the refund settled (or the packet expired with nothing
	// left) and only the packet's tombstone is kept: the totals as it ended, no grabs.
	// Its id stays taken while settlement can still credit its keys.
	Forgotten bool `json:"forgotten,omitempty"`
	// State is the packet's place in its lifecycle: live, exhausted (every share
	// grabbed), expired (its time is up and the remainder is not yet on its way
	// back), refunding (the remainder was moved to the sender's refund and its
	// credit is being delivered) or refunded (the balance system acknowledged the
	// refund). Absent in a creation's answer of an older service.
	State string `json:"state,omitempty"`
	// ExhaustedAt is when the last share was grabbed (exhausted, while the grabs
	// are kept). RefundAmount is the remainder that goes back to the sender, once
	// the packet expired with money left; RefundedAt is when the balance system's
	// acknowledgement was recorded.
	ExhaustedAt  string `json:"exhaustedAt,omitempty"`
	RefundAmount *int64 `json:"refundAmount,omitempty"`
	RefundedAt   string `json:"refundedAt,omitempty"`
}

// The states of a packet's lifecycle (PacketView.State).
const (
	PacketLive      = "live"
	PacketExhausted = "exhausted"
	PacketExpired   = "expired"
	PacketRefunding = "refunding"
	PacketRefunded  = "refunded"
)

// PacketShareView is one granted share, in grab order.
type PacketShareView struct {
	Share  int    `json:"share"`
	UserID string `json:"userId"`
	Amount int64  `json:"amount"`
	At     string `json:"at"`
	// BestLuck marks the largest share (手气最佳) once the packet is done: every
	// share grabbed, or expired. Ties go to the earliest grab. Never set on a live
	// packet, on a Fixed packet (every share is equal), or with fewer than two grabs.
	BestLuck bool `json:"bestLuck,omitempty"`
}

// PacketDetailView is GET /v1/packets/{id}: the packet and its detail list.
type PacketDetailView struct {
	PacketView
	// Grabs are the granted shares in grab order; empty, never null.
	Grabs []PacketShareView `json:"grabs"`
}
