package lua

import (
	"crypto/tls"
	"fmt"
	"strings"

	"github.com/redis/go-redis/v9"
)

// Redis modes a connection can use.
const (
	ModeStandalone = "standalone"
	ModeCluster    = "cluster"
)

// Conn says how to reach one Redis deployment.
type Conn struct {
	// Addresses are host:port pairs: one for standalone, any seed nodes for cluster.
	Addresses []string
	// Mode is ModeStandalone or ModeCluster.
	Mode     string
	Username string
	Password string
	TLS      bool
}

// ConnFromSecret reads a connection from a Secret's data with the keys addresses
// (comma-separated host:port), mode, username, password and tls ("true").
func ConnFromSecret(data map[string][]byte) (Conn, error) {
	c := Conn{
		Mode:     strings.TrimSpace(string(data["mode"])),
		Username: string(data["username"]),
		Password: string(data["password"]),
		TLS:      strings.TrimSpace(string(data["tls"])) == "true",
	}
	for _, a := range strings.Split(string(data["addresses"]), ",") {
		if a = strings.TrimSpace(a); a != "" {
			c.Addresses = append(c.Addresses, a)
		}
	}
	if c.Mode == "" {
		c.Mode = ModeStandalone
	}
	return c, c.Validate()
}

// Validate reports what makes the connection unusable, if anything.
func (c Conn) Validate() error {
	if len(c.Addresses) == 0 {
		return fmt.Errorf("redis connection: no addresses")
	}
	switch c.Mode {
	case ModeStandalone:
		if len(c.Addresses) != 1 {
			return fmt.Errorf("redis connection: standalone mode takes one address, got %d", len(c.Addresses))
		}
	case ModeCluster:
	default:
		return fmt.Errorf("redis connection: mode %q is neither %s nor %s", c.Mode, ModeStandalone, ModeCluster)
	}
	return nil
}

// Key identifies the connection's target and credentials, for caching clients.
func (c Conn) Key() string {
	return fmt.Sprintf("%s|%s|%s|%s|%t", c.Mode, strings.Join(c.Addresses, ","), c.Username, c.Password, c.TLS)
}

// NewClient opens a client for the connection: a cluster client in cluster mode,
// else a plain client.
func (c Conn) NewClient() redis.UniversalClient {
	var tc *tls.Config
	if c.TLS {
		tc = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	if c.Mode == ModeCluster {
		return redis.NewClusterClient(&redis.ClusterOptions{
			Addrs: c.Addresses, Username: c.Username, Password: c.Password, TLSConfig: tc,
		})
	}
	return redis.NewClient(&redis.Options{
		Addr: c.Addresses[0], Username: c.Username, Password: c.Password, TLSConfig: tc,
	})
}
