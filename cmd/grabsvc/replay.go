package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

// replayCommand is the subcommand that moves dead letters back into the stream.
const replayCommand = "replay-dead-letters"

// redisFlags registers the Redis connection flags (--redis-addresses, --redis-mode,
// --redis-username, --redis-password, --redis-tls, each defaulting from its REDIS_*
// environment variable) on fs. The variables mirror the keys of the connection
// Secret (the grab Deployment maps each key to one), so the returned function,
// called after fs.Parse, parses the flags' values as that Secret's data with
// redisconn.ConnFromSecret into conn.
func redisFlags(fs *flag.FlagSet, conn *redisconn.Conn) func() error {
	addresses := fs.String("redis-addresses", envOr("REDIS_ADDRESSES", "127.0.0.1:6379"), "comma-separated Redis host:port (env REDIS_ADDRESSES)")
	mode := fs.String("redis-mode", envOr("REDIS_MODE", redisconn.ModeStandalone), "standalone or cluster (env REDIS_MODE)")
	username := fs.String("redis-username", os.Getenv("REDIS_USERNAME"), "Redis ACL user name (env REDIS_USERNAME)")
	password := fs.String("redis-password", "", "Redis password (env REDIS_PASSWORD)")
	useTLS := fs.Bool("redis-tls", redisconn.TLSEnabled(os.Getenv("REDIS_TLS")), "connect to Redis with TLS (env REDIS_TLS: \"true\")")
	return func() error {
		if *password == "" {
			// Read here rather than as the flag's default, so --help never shows it.
			*password = os.Getenv("REDIS_PASSWORD")
		}
		c, err := redisconn.ConnFromSecret(map[string][]byte{
			redisconn.SecretAddresses: []byte(*addresses),
			redisconn.SecretMode:      []byte(*mode),
			redisconn.SecretUsername:  []byte(*username),
			redisconn.SecretPassword:  []byte(*password),
			redisconn.SecretTLS:       []byte(strconv.FormatBool(*useTLS)),
		})
		*conn = c
		return err
	}
}

// replayOptions are the command line of replay-dead-letters.
type replayOptions struct {
	namespace, activity, kubeconfig string
	max                             int
	timeout                         time.Duration
	redis                           redisconn.Conn
}

func parseReplayFlags(args []string, out io.Writer) (replayOptions, error) {
	var o replayOptions
	fs := flag.NewFlagSet("grabsvc "+replayCommand, flag.ContinueOnError)
	fs.SetOutput(out)
	fs.StringVar(&o.namespace, "namespace", envOr("POD_NAMESPACE", "default"), "namespace of the RedPacketActivity")
	fs.StringVar(&o.activity, "activity", "", "name of the RedPacketActivity (required)")
	fs.IntVar(&o.max, "max", 0, "move at most this many dead letters, oldest first; 0: all of them")
	fs.DurationVar(&o.timeout, "timeout", time.Minute, "deadline of the whole command")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig file; empty: $KUBECONFIG, in-cluster, or ~/.kube/config")
	finish := redisFlags(fs, &o.redis)
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	if o.activity == "" {
		return o, errors.New("--activity is required")
	}
	if o.max < 0 {
		return o, errors.New("--max must not be negative")
	}
	if o.timeout <= 0 {
		return o, errors.New("--timeout must be positive")
	}
	if err := finish(); err != nil {
		return o, err
	}
	return o, nil
}

// replayDeadLetters is the replay-dead-letters command: it looks the activity's UID
// up in the API server, moves its dead letters back into the settlement stream with
// the activity's handle (store.Shard.ReplayDeadLetters), and prints how many it
// moved on stdout.
func replayDeadLetters(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o, err := parseReplayFlags(args, stderr)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()

	cfg, err := restConfig(o.kubeconfig)
	if err != nil {
		return err
	}
	scheme := runtime.NewScheme()
	if err := redpacketv1alpha1.AddToScheme(scheme); err != nil {
		return fmt.Errorf("building the API scheme: %w", err)
	}
	kube, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		return fmt.Errorf("creating the API client: %w", err)
	}
	key := types.NamespacedName{Namespace: o.namespace, Name: o.activity}
	obj := &redpacketv1alpha1.RedPacketActivity{}
	if err := kube.Get(ctx, key, obj); err != nil {
		return fmt.Errorf("reading activity %s: %w", key, err)
	}

	rdb := o.redis.NewClient()
	defer func() { _ = rdb.Close() }()
	moved, err := store.NewActivity(rdb, string(obj.UID), obj.Spec.ShardCount()).ReplayDeadLetters(ctx, o.max)
	if err != nil {
		return fmt.Errorf("activity %s: %w", key, err)
	}
	_, err = fmt.Fprintf(stdout, "moved %d dead letters of %s back into the settlement stream\n", moved, key)
	return err
}
