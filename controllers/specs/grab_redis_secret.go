package specs

import (
	"crypto/sha256"
	"encoding/hex"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store/redisconn"
)

// AnnotationRedisCredentials, on the grab pods' template, is a digest of the Redis
// user and password in <activity>-grab-redis. The pods read the Secret into their
// environment when they start, so a new password (a rotation) changes the digest and
// the Deployment rolls them.
const AnnotationRedisCredentials = "redpacket.io/redis-credentials"

// RedisLogin is how the grab pods of an activity without spec.redis reach the
// operator's default Redis: its addresses, mode and TLS setting, with the
// activity's own ACL user and password. It has no field for the operator's own
// credentials, so they cannot reach the activity's namespace through it.
type RedisLogin struct {
	// Addresses, Mode and TLS are the default Redis's, as the operator reaches it.
	Addresses []string
	Mode      string
	TLS       bool
	// Username and Password are the activity's own Redis user's.
	Username string
	Password string
}

// SecretData is the data of <activity>-grab-redis: the login under the keys of a
// connection Secret (redisconn.ConnFromSecret reads it), which the grab
// container's REDIS_* variables name.
func (l RedisLogin) SecretData() map[string][]byte {
	return map[string][]byte{
		redisconn.SecretAddresses: []byte(strings.Join(l.Addresses, ",")),
		redisconn.SecretMode:      []byte(l.Mode),
		redisconn.SecretUsername:  []byte(l.Username),
		redisconn.SecretPassword:  []byte(l.Password),
		redisconn.SecretTLS:       []byte(strconv.FormatBool(l.TLS)),
	}
}

// Digest is the value of AnnotationRedisCredentials for the login: the digest of
// its Secret's data (RedisCredentialsDigest).
func (l RedisLogin) Digest() string { return RedisCredentialsDigest(l.SecretData()) }

// RedisCredentialsDigest is the value of AnnotationRedisCredentials for a Secret's
// data: a hash of its user and password, from which neither can be learnt.
func RedisCredentialsDigest(data map[string][]byte) string {
	h := sha256.New()
	h.Write([]byte("redpacket.io/redis-credentials\x00"))
	h.Write(data[redisconn.SecretUsername])
	h.Write([]byte{0})
	h.Write(data[redisconn.SecretPassword])
	return hex.EncodeToString(h.Sum(nil))[:16]
}

// GrabRedisSecretName is the name of the Secret that holds an activity's login on
// the operator's default Redis, for an activity without spec.redis.
func GrabRedisSecretName(a *redpacketv1alpha1.RedPacketActivity) string {
	return a.Name + "-grab-redis"
}

// GrabRedisSecret is the Secret <activity>-grab-redis holding login, which the grab
// Deployment's pods read, so no password is part of the Deployment. Like every
// object of the workload it carries the activity's controller reference: deleting
// the activity deletes it.
func GrabRedisSecret(a *redpacketv1alpha1.RedPacketActivity, login RedisLogin) *corev1ac.SecretApplyConfiguration {
	return corev1ac.Secret(GrabRedisSecretName(a), a.Namespace).WithLabels(GrabLabels(a)).WithOwnerReferences(grabOwner(a)).
		WithType(corev1.SecretTypeOpaque).WithData(login.SecretData())
}
