package grabsvc

import (
	"testing"

	"redpacket.io/operator/grabsvc/grabapi"
	"redpacket.io/operator/store"
)

// The deadlines the operator sizes its HTTPRoute timeouts by (grabapi) are the ones
// the grab service runs with.
func TestDeadlinesAreTheGrabAPIs(t *testing.T) {
	if DefaultRedisTimeout != grabapi.RedisTimeout || DefaultResolveTimeout != grabapi.ResolveTimeout {
		t.Errorf("grab service deadlines %v/%v, grabapi's %v/%v", DefaultRedisTimeout, DefaultResolveTimeout, grabapi.RedisTimeout, grabapi.ResolveTimeout)
	}
	if DefaultReplicaTimeout != grabapi.DefaultReplicaWait || store.DefaultReplicaTimeout != grabapi.DefaultReplicaWait {
		t.Errorf("replica wait %v (store %v), grabapi's %v", DefaultReplicaTimeout, store.DefaultReplicaTimeout, grabapi.DefaultReplicaWait)
	}
	if s := NewHTTPServer(":0", nil); s.WriteTimeout <= grabapi.GrabDeadline(grabapi.MaxReplicaWait) {
		t.Errorf("write timeout %v does not cover the longest grab %v", s.WriteTimeout, grabapi.GrabDeadline(grabapi.MaxReplicaWait))
	}
}
