package rpactl

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

// redisFlags say how the plugin reaches an activity's Redis from the user's machine.
type redisFlags struct {
	secret, addr, mode string
}

func (f *redisFlags) register(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.StringVar(&f.secret, "redis-secret", "", "a Secret in the namespace in the connection format (addresses, mode, username, password, tls); default: the one spec.redis.secretRef names")
	fl.StringVar(&f.addr, "redis-addr", "", "comma-separated host:port to dial instead of the Secret's addresses, such as 127.0.0.1:6379 through kubectl port-forward; required for an activity on the operator's default Redis, whose user name and password come from $REDIS_USERNAME and $REDIS_PASSWORD")
	fl.StringVar(&f.mode, "redis-mode", redisconn.ModeStandalone, "standalone or cluster, when no Secret says")
}

// errDefaultRedis says why the plugin cannot find the operator's default Redis.
var errDefaultRedis = errors.New("the activity has no spec.redis and uses the operator's default Redis, which is configured " +
	"in the operator's flags and usually reachable only inside the cluster: pass --redis-addr (for example 127.0.0.1:6379 " +
	"after kubectl -n redpacket-system port-forward service/redis 6379) or --redis-secret")

// connection returns the Redis connection of an activity as this machine can dial
// it: the Secret named by --redis-secret, else by spec.redis.secretRef (parsed by
// redisconn.ConnFromSecret, as the controller does), with its addresses replaced by
// --redis-addr when given; without a Secret, --redis-addr and --redis-mode with the
// user name from $REDIS_USERNAME and the password from $REDIS_PASSWORD.
func (f *redisFlags) connection(ctx context.Context, s *session, a *redpacketv1alpha1.RedPacketActivity) (redisconn.Conn, string, error) {
	specSecret := ""
	if a.Spec.Redis != nil {
		specSecret = a.Spec.Redis.SecretRef.Name
	}
	return f.connectionOf(ctx, s, "redpacketactivity "+a.Namespace+"/"+a.Name, specSecret)
}

// connectionOf is connection for the resource named what (an activity or a budget)
// whose spec.redis.secretRef names specSecret ("" on the operator's default Redis).
func (f *redisFlags) connectionOf(ctx context.Context, s *session, resource, specSecret string) (redisconn.Conn, string, error) {
	secretName, what := f.secret, "--redis-secret"
	if secretName == "" && specSecret != "" {
		secretName, what = specSecret, "spec.redis.secretRef"
	}
	var conn redisconn.Conn
	var source string
	switch {
	case secretName != "":
		sec, err := s.secret(ctx, secretName, what)
		if err != nil {
			return redisconn.Conn{}, "", err
		}
		if conn, err = redisconn.ConnFromSecret(sec.Data); err != nil {
			return redisconn.Conn{}, "", fmt.Errorf("secret %s/%s: %w", s.namespace, secretName, err)
		}
		source = "secret " + secretName
	case f.addr != "":
		conn = redisconn.Conn{Mode: strings.TrimSpace(f.mode), Username: os.Getenv("REDIS_USERNAME"), Password: os.Getenv("REDIS_PASSWORD")}
		source = "--redis-addr"
	default:
		return redisconn.Conn{}, "", fmt.Errorf("%s: %w", resource, errDefaultRedis)
	}
	if f.addr != "" {
		conn.Addresses = redisconn.ParseAddresses(f.addr)
		if secretName != "" {
			source += " at --redis-addr"
		}
	}
	if err := conn.Validate(); err != nil {
		return redisconn.Conn{}, "", err
	}
	return conn, source + " (" + strings.Join(conn.Addresses, ",") + ")", nil
}

func newReplayCommand(flags *kubeFlags, streams Streams) *cobra.Command {
	var (
		rf      redisFlags
		max     int
		timeout time.Duration
	)
	cmd := &cobra.Command{
		Use:   "replay-dead-letters NAME | rpb/BUDGET",
		Short: "Move an activity's (or a budget's) dead-lettered settlement entries back into its settlement streams",
		Long: `Move the settlement entries that were parked after too many failed deliveries back
into the activity's settlement stream, oldest first, in atomic steps (lua/replay_dead.lua);
the settlement workers then deliver them again with the same Idempotency-Key. Fix the
cause first: each parked entry holds the balance system's last answer.

The plugin talks to the activity's Redis directly. It reads the connection from the
Secret that spec.redis.secretRef names (or --redis-secret), but the addresses there
are usually cluster-internal: reach Redis with kubectl port-forward and pass
--redis-addr. An activity on the operator's default Redis needs --redis-addr.

A RedPacketBudget is named rpb/BUDGET (or redpacketbudget/BUDGET): the dead letters
of every budget shard go back into that shard's stream, and the operator's workers
deliver them again with the same Idempotency-Key ("<uid>/<packetId>/<share>",
"<uid>/<packetId>/refund"), checked again against the packet and the budget's
ledger.`,
		Example: `  kubectl -n redpacket-system port-forward service/redis 6379 &
  kubectl rpa replay-dead-letters quiz-night --redis-addr 127.0.0.1:6379
  kubectl rpa replay-dead-letters rpb/group-packets --redis-addr 127.0.0.1:6379`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if max < 0 {
				return errors.New("--max must not be negative")
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			s, err := flags.connect()
			if err != nil {
				return err
			}
			if name, ok := budgetArg(args[0]); ok {
				return s.replayBudget(ctx, name, rf, max, streams.Out)
			}
			a, err := s.activity(ctx, args[0])
			if err != nil {
				return err
			}
			conn, where, err := rf.connection(ctx, s, a)
			if err != nil {
				return err
			}
			rdb := conn.NewClient(redisconn.ClientOptions{Timeout: 10 * time.Second})
			defer func() { _ = rdb.Close() }()
			h := store.NewActivity(rdb, string(a.UID), a.Spec.ShardCount())
			snap, err := h.Snapshot(ctx)
			if err != nil {
				return fmt.Errorf("reading activity %s/%s from Redis via %s: %w", a.Namespace, a.Name, where, err)
			}
			if !snap.Exists() {
				return fmt.Errorf("no data of activity %s/%s (uid %s) in the Redis reached via %s: is it the activity's Redis?",
					a.Namespace, a.Name, a.UID, where)
			}
			moved, err := h.ReplayDeadLetters(ctx, max)
			if err != nil {
				return fmt.Errorf("activity %s/%s: %w", a.Namespace, a.Name, err)
			}
			_, err = fmt.Fprintf(streams.Out, "moved %d of %d dead letters of %s/%s back into the settlement stream\n",
				moved, snap.DeadCount, a.Namespace, a.Name)
			return err
		},
	}
	rf.register(cmd)
	cmd.Flags().IntVar(&max, "max", 0, "move at most this many, oldest first; 0: all")
	cmd.Flags().DurationVar(&timeout, "timeout", time.Minute, "deadline of the whole command")
	return cmd
}

// budgetArg reports whether arg names a RedPacketBudget, "rpb/NAME",
// "redpacketbudget/NAME" or "redpacketbudgets/NAME", and returns NAME.
func budgetArg(arg string) (string, bool) {
	kind, name, ok := strings.Cut(arg, "/")
	if !ok || name == "" {
		return "", false
	}
	switch strings.ToLower(kind) {
	case "rpb", "redpacketbudget", "redpacketbudgets", "redpacketbudget.redpacket.io", "redpacketbudgets.redpacket.io":
		return name, true
	}
	return "", false
}

// replayBudget moves up to max dead letters (all when 0) of every shard of the
// budget back into the shard's settlement stream.
func (s *session) replayBudget(ctx context.Context, name string, rf redisFlags, max int, out io.Writer) error {
	b, err := s.budget(ctx, name)
	if err != nil {
		return err
	}
	resource := "redpacketbudget " + b.Namespace + "/" + b.Name
	conn, where, err := rf.connectionOf(ctx, s, resource, b.RedisSecret)
	if err != nil {
		return err
	}
	rdb := conn.NewClient(redisconn.ClientOptions{Timeout: 10 * time.Second})
	defer func() { _ = rdb.Close() }()
	h := store.NewBudget(rdb, b.UID, b.Shards)
	snap, err := h.Snapshot(ctx)
	if err != nil {
		return fmt.Errorf("reading %s from Redis via %s: %w", resource, where, err)
	}
	if snap.Total == 0 && snap.CreatedPackets == 0 {
		return fmt.Errorf("no data of %s (uid %s) in the Redis reached via %s: is it the budget's Redis?", resource, b.UID, where)
	}
	moved, err := ReplayBudgetDeadLetters(ctx, h, max)
	if err != nil {
		return fmt.Errorf("%s: %w", resource, err)
	}
	_, err = fmt.Fprintf(out, "moved %d of %d dead letters of %s back into the settlement streams\n", moved, snap.DeadLetters, resource)
	return err
}

// ReplayBudgetDeadLetters moves up to max dead letters (all when max <= 0) of every
// shard of the budget back into that shard's settlement stream, shard by shard
// (store.Shard.ReplayDeadLetters), and returns how many moved.
func ReplayBudgetDeadLetters(ctx context.Context, h *store.Budget, max int) (int, error) {
	moved := 0
	for i := range h.N() {
		left := 0
		if max > 0 {
			if left = max - moved; left <= 0 {
				break
			}
		}
		n, err := h.Stream(i).ReplayDeadLetters(ctx, left)
		moved += n
		if err != nil {
			return moved, fmt.Errorf("budget shard %d (after %d moved): %w", i, moved, err)
		}
	}
	return moved, nil
}
