package controllers

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers/specs"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

// RedisAccess is how both reconcilers reach Redis, one value that the activity's
// and the budget's reconcilers embed: the operator's policy on which servers a
// spec.redis may name (redis_policy.go), the cache of clients, the function keeper,
// the API reader that reads the Secrets spec.redis names, and the deadline of one
// Redis call. cmd/manager makes one and hands it to both; a reconciler set up
// without one makes its own from its Options (SetupWithManager).
//
// It resolves a resource's connection in one way for both kinds (connection): the
// Secret spec.redis names, checked against the policy, else the operator's default.
type RedisAccess struct {
	// DefaultRedis is the connection of resources without spec.redis.
	DefaultRedis redisconn.Conn
	// AllowedHosts are the hosts and networks spec.redis may name besides the
	// default Redis's own addresses.
	AllowedHosts RedisHosts
	// Timeout bounds one Redis call (redisContext); 0 means DefaultRedisTimeout.
	Timeout time.Duration
	// Clients caches the Redis clients; nil is made and added to the manager by
	// SetupWithManager.
	Clients *RedisClients
	// Functions keeps the grab-side function library loaded on every Redis the
	// resources use (a leader-election runnable); nil is made and added to the
	// manager by SetupWithManager. Left nil outside a manager, nobody watches the
	// library between reconciles.
	Functions *FunctionKeeper
	// APIReader reads the Secrets that spec.redis names, from the API server.
	APIReader client.Reader
	// LibraryRetireAfter is the function keeper's RetireAfter (Options); it passes
	// every quarter of it, at most every DefaultLibraryRetireInterval.
	LibraryRetireAfter time.Duration
}

// NewRedisAccess is the Redis access of the operator-wide settings o: its default
// Redis, its allowed hosts and its Redis timeout. Clients, Functions and APIReader
// are left to the caller or to SetupWithManager.
func NewRedisAccess(o Options) *RedisAccess {
	o = o.withDefaults()
	return &RedisAccess{DefaultRedis: o.DefaultRedis, AllowedHosts: o.AllowedRedisHosts, Timeout: o.RedisTimeout,
		LibraryRetireAfter: o.LibraryRetireAfter}
}

// SetupWithManager fills what is nil from mgr: the API reader, the client cache and
// the function keeper, adding the last two to mgr as runnables. Both reconcilers
// call it on the value they share; the second call finds nothing to do.
func (a *RedisAccess) SetupWithManager(mgr ctrl.Manager) error {
	if a.APIReader == nil {
		a.APIReader = mgr.GetAPIReader()
	}
	if a.Clients == nil {
		a.Clients = NewRedisClients()
		if err := mgr.Add(a.Clients); err != nil {
			return fmt.Errorf("adding the Redis client cache to the manager: %w", err)
		}
	}
	if a.Functions == nil {
		a.Functions = NewFunctionKeeper(a.redisClient)
		reader := mgr.GetClient()
		a.Functions.InUse = func(ctx context.Context) (map[string]bool, error) { return grabLibrariesInUse(ctx, reader) }
		if a.LibraryRetireAfter > 0 {
			a.Functions.RetireAfter = a.LibraryRetireAfter
			a.Functions.RetireInterval = min(DefaultLibraryRetireInterval, a.LibraryRetireAfter/4)
		}
		if err := mgr.Add(a.Functions); err != nil {
			return fmt.Errorf("adding the function keeper to the manager: %w", err)
		}
	}
	return nil
}

// redisContext bounds one Redis call.
func (a *RedisAccess) redisContext(ctx context.Context) (context.Context, context.CancelFunc) {
	timeout := a.Timeout
	if timeout <= 0 {
		timeout = DefaultRedisTimeout
	}
	return context.WithTimeout(ctx, timeout)
}

// redisClient is the cached client for conn (see redisClientOptions): its errors
// are safe for status, and a connection from spec.redis dials only allowed
// addresses.
func (a *RedisAccess) redisClient(conn redisconn.Conn) redis.UniversalClient {
	return a.Clients.Get(conn, a.redisClientOptions(conn, true))
}

// defaultRedisConn is the operator's default Redis connection, standalone unless
// it says otherwise.
func (a *RedisAccess) defaultRedisConn() (redisconn.Conn, error) {
	conn := a.DefaultRedis
	if conn.Mode == "" {
		conn.Mode = redisconn.ModeStandalone
	}
	if err := conn.Validate(); err != nil {
		return redisconn.Conn{}, fmt.Errorf("the operator's default Redis connection: %w", err)
	}
	return conn, nil
}

// connection resolves the Redis connection of a resource in namespace whose
// spec.redis is ref: the operator's default when ref is nil, else the Secret ref
// names, read from the API server and refused when it names an address the policy
// does not allow (checkRedisAllowed) before anything dials it. Its errors name the
// Secret; connectionFailureReason turns them into Ready's reason.
func (a *RedisAccess) connection(ctx context.Context, namespace string, ref *redpacketv1alpha1.RedisConnection) (redisconn.Conn, error) {
	if ref == nil {
		return a.defaultRedisConn()
	}
	secret := &corev1.Secret{}
	key := client.ObjectKey{Namespace: namespace, Name: ref.SecretRef.Name}
	if err := a.APIReader.Get(ctx, key, secret); err != nil {
		if apierrors.IsNotFound(err) {
			return redisconn.Conn{}, fmt.Errorf("secret %s named by spec.redis.secretRef does not exist", key.Name)
		}
		return redisconn.Conn{}, fmt.Errorf("reading secret %s: %w", key.Name, err)
	}
	conn, err := redisconn.ConnFromSecret(secret.Data)
	if err != nil {
		return redisconn.Conn{}, fmt.Errorf("secret %s: %w", key.Name, err)
	}
	if err := a.checkRedisAllowed(conn); err != nil {
		return redisconn.Conn{}, fmt.Errorf("secret %s: %w", key.Name, err)
	}
	return conn, nil
}

// redisPasswordBytes is how many random bytes the password of a resource's own
// Redis user has; it is written as hex.
const redisPasswordBytes = 32

// redisUsers is what the controllers do to a resource's own Redis ACL user on the
// default Redis, an activity's or a budget's (store.Activity, store.Budget).
type redisUsers interface {
	// UserName is the user's name.
	UserName() string
	// EnsureUser makes Redis hold the user with exactly this password and rules.
	EnsureUser(ctx context.Context, password string) (store.UserChange, error)
	// DeleteUser removes the user, and with it its connections.
	DeleteUser(ctx context.Context) (int, error)
}

var (
	_ redisUsers = (*store.Activity)(nil)
	_ redisUsers = (*store.Budget)(nil)
)

// newRedisPassword is a random password for a resource's own Redis user.
func newRedisPassword() (string, error) {
	b := make([]byte, redisPasswordBytes)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("generating a Redis password: %w", err)
	}
	return hex.EncodeToString(b), nil
}

// loginPassword is the password of a resource's own Redis user named user: the one
// existing (its <name>-grab-redis Secret as it is, nil when there is none) holds for
// that user, else a new random one (no Secret is how a rotation is asked for; one
// that holds something else is replaced).
func loginPassword(existing *corev1.Secret, user string) (string, error) {
	if existing != nil && string(existing.Data[redisconn.SecretUsername]) == user &&
		len(existing.Data[redisconn.SecretPassword]) >= 2*redisPasswordBytes {
		return string(existing.Data[redisconn.SecretPassword]), nil
	}
	return newRedisPassword()
}

// defaultRedisLogin is the login on the default Redis conn of the resource's own
// user: conn's addresses, mode and TLS setting, never the operator's credentials.
func defaultRedisLogin(conn redisconn.Conn, user, password string) *specs.RedisLogin {
	return &specs.RedisLogin{Addresses: conn.Addresses, Mode: conn.Mode, TLS: conn.TLS, Username: user, Password: password}
}
