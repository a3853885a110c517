package grabsvc

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
)

// ClaimSecretHeader carries a packet's claim secret on a grab or a read
// (spec.packets.claimSecret). A header, never the URL: a URL is logged by proxies
// and sent on in a Referer; the packet page keeps the secret in its link's fragment,
// which browsers send nowhere, and puts it in this header itself.
const ClaimSecretHeader = "Claim-Secret"

// claimSecretLabel separates the claim secrets' HMAC inputs from any other use
// of the key.
const claimSecretLabel = "redpacket claim secret v1\x00"

// ClaimSecret is the claim secret of packet packetID of the budget budgetUID: 22
// characters of base64url (132 bits) of HMAC-SHA256 keyed by the sender
// credential's SHA-256 digest. It is a pseudo-random function of the packet: as
// good as random to anyone without the sender credential, and the same in every
// grab pod and for every retry of the creation, so nothing is stored. Whoever holds
// the sender credential can compute it, and it creates the packets anyway. A new
// sender credential changes every live packet's secret: its links stop working.
func (c *SenderCredential) ClaimSecret(budgetUID, packetID string) string {
	d := c.digest.Load()
	mac := hmac.New(sha256.New, d[:])
	mac.Write([]byte(claimSecretLabel))
	mac.Write([]byte(budgetUID))
	mac.Write([]byte{0})
	mac.Write([]byte(packetID))
	return base64.RawURLEncoding.EncodeToString(mac.Sum(nil))[:22]
}

// checkClaimSecret reports whether presented is packetID's claim secret, in time
// that does not depend on how much of it is right.
func (c *SenderCredential) checkClaimSecret(budgetUID, packetID, presented string) bool {
	want := c.ClaimSecret(budgetUID, packetID)
	return hmac.Equal([]byte(want), []byte(presented))
}
