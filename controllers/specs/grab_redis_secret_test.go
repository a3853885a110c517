package specs

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"redpacket.io/operator/store/redisconn"
)

// The Secret <activity>-grab-redis holds the activity's login under the keys of a
// connection Secret, which the grab service reads back as the same connection.
func TestGrabRedisSecret(t *testing.T) {
	cases := []struct {
		name  string
		login RedisLogin
	}{
		{name: "standalone", login: testLogin},
		{name: "a cluster over TLS", login: RedisLogin{Addresses: []string{"r-0:6379", "r-1:6379"}, Mode: "cluster", TLS: true,
			Username: "rpa-uid-1", Password: strings.Repeat("cd", 32)}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := testActivity()
			ac := GrabRedisSecret(a, tc.login)
			checkObjectMeta(t, a, "Secret", "quiz-grab-redis", ac)
			secret := sent[corev1.Secret](t, ac)
			if secret.Type != corev1.SecretTypeOpaque {
				t.Errorf("type %s", secret.Type)
			}
			var keys []string
			for k := range secret.Data {
				keys = append(keys, k)
			}
			if len(keys) != 5 {
				t.Errorf("keys %q, want addresses, mode, username, password and tls", keys)
			}
			conn, err := redisconn.ConnFromSecret(secret.Data)
			if err != nil {
				t.Fatal(err)
			}
			l := tc.login
			if strings.Join(conn.Addresses, ",") != strings.Join(l.Addresses, ",") || conn.Mode != l.Mode || conn.TLS != l.TLS ||
				conn.Username != l.Username || conn.Password != l.Password {
				t.Errorf("the Secret reads back as %+v, want the login %+v", conn, l)
			}
		})
	}
}

// The digest on the pod template changes with the user or the password, so a
// rotation rolls the pods, and with nothing else; it does not show the password.
func TestRedisLoginDigest(t *testing.T) {
	base := testLogin
	digest := base.Digest()
	if len(digest) != 16 || strings.Contains(base.Password, digest) {
		t.Errorf("digest %q", digest)
	}
	if got := RedisCredentialsDigest(base.SecretData()); got != digest {
		t.Errorf("the digest of the Secret's data %q, want the login's %q", got, digest)
	}
	rotated := base
	rotated.Password = strings.Repeat("ef", 32)
	otherUser := base
	otherUser.Username = "rpa-uid-2"
	moved := base
	moved.Addresses, moved.TLS = []string{"redis-2.test:6379"}, true
	if rotated.Digest() == digest || otherUser.Digest() == digest {
		t.Error("a new password or user keeps the digest: the pods would keep the old credentials")
	}
	if moved.Digest() != digest {
		t.Error("the digest depends on the address: the pods would roll although their login did not change")
	}
}
