// Command grabsvc is the grab service of one red-packet activity: it serves
// POST /v1/grab and GET /v1/activity, reports the activity's counters into its
// status. It delivers nothing to the balance system: the operator settles every
// activity's claims, with a signing key the grab pods never hold.
//
// With --budget it is instead one pod of a RedPacketBudget's shared grab fleet: it
// serves the runtime packet API (POST /v1/packets, POST /v1/packets/{id}/grab,
// GET /v1/packets/{id}) and the packet page /p/{id}, and reads nothing from the API
// server (the operator reports the budget's status).
//
// Usage:
//
//	grabsvc --activity NAME [flags]                      serve the activity
//	grabsvc --budget NAME --budget-uid UID --budget-shards N --sender-token-file PATH [flags]
//	                                                     serve the budget's packets
//	grabsvc replay-dead-letters --activity NAME [flags]  move its dead letters back into the settlement stream
//	grabsvc --version                                    print the version
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrlconfig "sigs.k8s.io/controller-runtime/pkg/client/config"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/internal/version"
	"redpacket.io/operator/store"
	"redpacket.io/operator/store/redisconn"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var err error
	if versionRequested(os.Args[1:]) {
		fmt.Println(version.String("grabsvc"))
		return
	}
	if len(os.Args) > 1 && os.Args[1] == replayCommand {
		err = replayDeadLetters(ctx, os.Args[2:], os.Stdout, os.Stderr)
	} else {
		err = run(ctx, os.Args[1:], os.Stderr)
	}
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "grabsvc:", err)
		os.Exit(1)
	}
}

// versionRequested reports whether the command line asks for the version: --version
// (or -version) before any "--", in either command.
func versionRequested(args []string) bool {
	for _, a := range args {
		switch a {
		case "--":
			return false
		case "--version", "-version", "--version=true", "-version=true":
			return true
		}
	}
	return false
}

// options are the command line of the grab service.
type options struct {
	namespace, activity, listen                string
	pprofListen                                string
	activityUID                                string
	redis                                      redisconn.Conn
	redisTimeout                               time.Duration
	resolveTimeout                             time.Duration
	tokenKeyFile                               string
	tokenMaxLifetime                           time.Duration
	reportInterval, refreshInterval            time.Duration
	ratePerUser, ratePerClient                 float64
	burstPerUser, burstPerClient, limitEntries int
	page                                       bool
	sendWindows                                string
	claimSecret                                bool
	sendTimeZone                               string
	quotas                                     store.Quotas
	kubeconfig                                 string
	shutdownDelay, shutdownTimeout             time.Duration
	logLevel                                   string
	// Budget mode (--budget).
	budget, budgetUID, senderTokenFile string
	budgetShards                       int
}

func envOr(name, def string) string {
	if v, ok := os.LookupEnv(name); ok && v != "" {
		return v
	}
	return def
}

func parseFlags(args []string, out io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("grabsvc", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.StringVar(&o.namespace, "namespace", envOr("POD_NAMESPACE", "default"), "namespace of the RedPacketActivity")
	fs.StringVar(&o.activity, "activity", "", "name of the RedPacketActivity (this or --budget is required)")
	fs.StringVar(&o.budget, "budget", "", "name of the RedPacketBudget whose runtime packets to serve (instead of --activity)")
	fs.StringVar(&o.budgetUID, "budget-uid", "", "with --budget: the budget's metadata.uid, the tag of its Redis keys (required)")
	fs.IntVar(&o.budgetShards, "budget-shards", 0, "with --budget: spec.budgetShards, the budget's shard count (required, immutable)")
	fs.StringVar(&o.senderTokenFile, "sender-token-file", "", "with --budget: file holding the sender credential that "+
		"POST /v1/packets requires as a bearer token (required; re-read every --activity-refresh)")
	fs.StringVar(&o.activityUID, "activity-uid", "", "serve only the activity with this UID; empty: whichever has the name")
	fs.StringVar(&o.listen, "listen", ":8080", "address of the HTTP API, probes and metrics")
	fs.StringVar(&o.pprofListen, "pprof-listen", "", "address serving Go's profiles under /debug/pprof/; empty: none. Bind it to loopback or a port no Service exposes")
	finishRedis := redisFlags(fs, &o.redis)
	fs.DurationVar(&o.redisTimeout, "redis-timeout", grabsvc.DefaultRedisTimeout, "deadline of every Redis call on the grab path")
	fs.DurationVar(&o.resolveTimeout, "resolve-timeout", grabsvc.DefaultResolveTimeout, "how long a grab whose Redis call timed out after it was sent may spend asking Redis again what it decided, before answering 503")
	fs.StringVar(&o.tokenKeyFile, "token-key-file", "", "file holding the HMAC key of user tokens; empty: tokens are not required, "+
		"and an activity with spec.grabService.auth gets 503 on every grab")
	fs.DurationVar(&o.tokenMaxLifetime, "token-max-lifetime", grabsvc.DefaultTokenMaxLifetime,
		"longest time ahead a user token's exp may lie; a token beyond it is refused (at least 1s)")
	fs.DurationVar(&o.reportInterval, "report-interval", grabsvc.DefaultReportInterval, "shortest time between two status reports")
	fs.DurationVar(&o.refreshInterval, "activity-refresh", 5*time.Second, "how often the activity is re-read from the API server")
	fs.Float64Var(&o.ratePerUser, "rate-per-user", 0, "grabs per second allowed per user id; 0: no limit")
	fs.IntVar(&o.burstPerUser, "rate-burst-per-user", 0, "burst of the per-user limit; 0: the rate rounded up")
	fs.Float64Var(&o.ratePerClient, "rate-per-client", 0, "requests per second allowed per client address; 0: no limit")
	fs.IntVar(&o.burstPerClient, "rate-burst-per-client", 0, "burst of the per-client limit; 0: the rate rounded up")
	fs.IntVar(&o.limitEntries, "rate-limit-entries", grabsvc.DefaultMaxLimiterEntries, "most users (and clients) the rate limits track at once")
	fs.BoolVar(&o.page, "page", true, "serve the red-packet rain page at / (false: / answers 404)")
	fs.BoolVar(&o.claimSecret, "claim-secret", false, "with --budget: every grab and read of a packet needs its claim secret (spec.packets.claimSecret), which its creation answers")
	fs.StringVar(&o.sendWindows, "send-windows", "", "with --budget: comma-separated HH:MM-HH:MM windows when packets may be created (spec.packets.sendWindows; empty: always)")
	fs.StringVar(&o.sendTimeZone, "send-time-zone", "UTC", "with --budget: the IANA time zone of --send-windows and of the daily quotas' day")
	fs.Int64Var(&o.quotas.PacketsPerMinute, "quota-packets-per-minute", 0, "with --budget: packets one sender may create per minute (spec.packets.quotas.perSender; 0: no limit)")
	fs.Int64Var(&o.quotas.PacketsPerDay, "quota-packets-per-day", 0, "with --budget: packets one sender may create per day in --send-time-zone (0: no limit)")
	fs.Int64Var(&o.quotas.AmountPerDay, "quota-amount-per-day", 0, "with --budget: money, in minor units, one sender's packets may hold per day (0: no limit)")
	fs.Int64Var(&o.quotas.SharesPerDay, "quota-shares-per-day", 0, "with --budget: shares one user may be granted per day across the budget (spec.packets.quotas.perRecipient; 0: no limit)")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig file; empty: $KUBECONFIG, in-cluster, or ~/.kube/config")
	fs.DurationVar(&o.shutdownDelay, "shutdown-delay", 5*time.Second, "on SIGTERM, how long readiness fails before the listener closes")
	fs.DurationVar(&o.shutdownTimeout, "shutdown-timeout", 30*time.Second, "on SIGTERM, how long in-flight requests get to finish")
	fs.StringVar(&o.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.Bool("version", false, "print the version and exit")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	if err := checkMode(o); err != nil {
		return o, err
	}
	if err := finishRedis(); err != nil {
		return o, err
	}
	if o.ratePerUser < 0 || o.ratePerClient < 0 {
		return o, errors.New("rate limits must not be negative")
	}
	if o.tokenMaxLifetime < time.Second {
		return o, errors.New("--token-max-lifetime must be at least 1s")
	}
	if o.reportInterval <= 0 || o.refreshInterval <= 0 || o.redisTimeout <= 0 {
		return o, errors.New("--report-interval, --activity-refresh and --redis-timeout must be positive")
	}
	return o, nil
}

func restConfig(kubeconfig string) (*rest.Config, error) {
	if kubeconfig != "" {
		cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
		if err != nil {
			return nil, fmt.Errorf("loading kubeconfig %s: %w", kubeconfig, err)
		}
		return cfg, nil
	}
	cfg, err := ctrlconfig.GetConfig()
	if err != nil {
		return nil, fmt.Errorf("finding the API server: %w", err)
	}
	return cfg, nil
}

// checkMode checks that the command line names one activity or one budget, with
// what budget mode needs.
func checkMode(o options) error {
	switch {
	case o.activity == "" && o.budget == "":
		return errors.New("--activity or --budget is required")
	case o.activity != "" && o.budget != "":
		return errors.New("--activity and --budget are mutually exclusive: one grab service serves one activity or one budget")
	case o.activity != "":
		if o.budgetUID != "" || o.budgetShards != 0 || o.senderTokenFile != "" {
			return errors.New("--budget-uid, --budget-shards and --sender-token-file go with --budget, not --activity")
		}
		return nil
	}
	switch {
	case o.activityUID != "":
		return errors.New("--activity-uid goes with --activity; a budget's UID is --budget-uid")
	case o.budgetUID == "":
		return errors.New("--budget-uid is required with --budget")
	case o.budgetShards < 1 || o.budgetShards > store.MaxBudgetShards:
		return fmt.Errorf("--budget-shards must be between 1 and %d", store.MaxBudgetShards)
	case o.senderTokenFile == "":
		return errors.New("--sender-token-file is required with --budget")
	}
	return nil
}

// run is the whole service: it returns when ctx is done and everything stopped.
func run(ctx context.Context, args []string, stderr io.Writer) error {
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	if o.budget != "" {
		return runBudget(ctx, o, stderr)
	}
	log, err := o.newLogger(stderr, "activity", o.namespace+"/"+o.activity)
	if err != nil {
		return err
	}
	ctrllog.SetLogger(logr.FromSlogHandler(log.Handler()))

	cfg, err := restConfig(o.kubeconfig)
	if err != nil {
		return err
	}
	cfg = rest.CopyConfig(cfg)
	cfg.UserAgent = "redpacket-grab-service"
	scheme := runtime.NewScheme()
	if err := redpacketv1alpha1.AddToScheme(scheme); err != nil {
		return fmt.Errorf("building the API scheme: %w", err)
	}
	kube, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		return fmt.Errorf("creating the API client: %w", err)
	}

	tokens, err := o.tokenVerifier()
	if err != nil {
		return err
	}
	if tokens == nil {
		log.Warn("no --token-key-file: grabs carry no user token; if the activity asks for tokens " +
			"(spec.grabService.auth), every grab is refused with 503")
	}

	rc, err := o.redis.NewPipelinedClient(redisconn.GrabClientOptions(o.redisTimeout))
	if err != nil {
		return err
	}
	defer func() { _ = rc.Close() }()

	reg := prometheus.NewRegistry()
	metrics := grabsvc.NewMetrics(reg)
	source := &grabsvc.ActivitySource{
		Client:  kube,
		Key:     types.NamespacedName{Namespace: o.namespace, Name: o.activity},
		UID:     types.UID(o.activityUID),
		Refresh: o.refreshInterval,
		Metrics: metrics,
		Log:     log,
	}
	// One guard for the grab path and the reporter: the watermark every grab carries,
	// and whether the activity is fenced or missing (then /readyz fails).
	guard := &grabsvc.RollbackGuard{}
	srv, err := grabsvc.NewServer(grabsvc.Config{
		Guard:          guard,
		Redis:          rc.Pipeliner,
		Resource:       source.Current,
		Ping:           rc.Client,
		Tokens:         tokens,
		UserLimiter:    grabsvc.NewKeyedLimiter(o.ratePerUser, o.burstPerUser, o.limitEntries),
		ClientLimiter:  grabsvc.NewKeyedLimiter(o.ratePerClient, o.burstPerClient, o.limitEntries),
		RedisTimeout:   o.redisTimeout,
		ResolveTimeout: o.resolveTimeout,
		Metrics:        metrics,
		Gatherer:       reg,
		Log:            log,
		Page:           o.page,
	})
	if err != nil {
		return err
	}
	reporter := &grabsvc.Reporter{
		Guard:    guard,
		Client:   kube,
		Redis:    rc.Pipeliner,
		Resource: source.Current,
		Interval: o.reportInterval,
		Metrics:  metrics,
		Log:      log,
	}

	fr, err := o.openFront(srv.Handler(), log, "grab service listening", "auth", tokens != nil,
		"page", o.page)
	if err != nil {
		return err
	}
	defer fr.stopPprof()

	// Background work lives until the HTTP server has drained.
	bg, stopBG := context.WithCancel(context.WithoutCancel(ctx))
	defer stopBG()
	var wg sync.WaitGroup

	changed := make(chan struct{}, 1)
	missingKey := false
	source.OnChange = func(a *grabsvc.Resource) {
		// Fail closed, loudly: Check refuses every grab; say why once per episode.
		if missing := tokens == nil && grabsvc.RequiresTokens(a.Object); missing != missingKey {
			missingKey = missing
			if missing {
				log.Error("refusing every grab with 503", "err", grabsvc.ErrNoTokenKey)
			}
		}
		select {
		case changed <- struct{}{}:
		default:
		}
	}
	wg.Go(func() { source.Run(bg) })
	wg.Go(func() { reporter.Run(bg) })
	wg.Go(func() {
		t := time.NewTicker(o.refreshInterval)
		defer t.Stop()
		for {
			select {
			case <-bg.Done():
				return
			case <-changed:
			case <-t.C:
			}
			reloadTokenKey(tokens, o.tokenKeyFile, log)
		}
	})

	serveErr := fr.serve(ctx, srv, o)
	log.Info("http server stopped; stopping background work")
	stopBG()
	wg.Wait()
	// One last report, so the status holds the final counters.
	fctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if _, err := reporter.ReportOnce(fctx); err != nil {
		log.Warn("final status report failed", "err", err)
	}
	return serveErr
}

// reloadTokenKey picks up a rotated token key (a mounted Secret is updated in place).
func reloadTokenKey(v *grabsvc.TokenVerifier, path string, log *slog.Logger) {
	if v == nil || path == "" {
		return
	}
	key, err := grabsvc.ReadKeyFile(path)
	if err != nil {
		log.Warn("re-reading the token key failed; keeping the current key", "err", err)
		return
	}
	_ = v.SetKey(key)
}

// newPprofServer serves Go's profiles (net/http/pprof) and nothing else, on a
// listener of its own: the API's listener never serves them.
func newPprofServer() *http.Server {
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	return &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
}

// servePprof serves Go's profiles on addr (none when addr is empty) and returns the
// function that stops it.
func servePprof(addr string, log *slog.Logger) (func(), error) {
	if addr == "" {
		return func() {}, nil
	}
	pl, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listening on %s: %w", addr, err)
	}
	ps := newPprofServer()
	go func() { _ = ps.Serve(pl) }()
	log.Info("serving profiles", "addr", pl.Addr().String())
	return func() { _ = ps.Close() }, nil
}

// tokenVerifier verifies user tokens with the key in --token-key-file; nil when no
// file is given (grabs carry no token).
func (o *options) tokenVerifier() (*grabsvc.TokenVerifier, error) {
	if o.tokenKeyFile == "" {
		return nil, nil
	}
	key, err := grabsvc.ReadKeyFile(o.tokenKeyFile)
	if err != nil {
		return nil, fmt.Errorf("--token-key-file: %w", err)
	}
	tokens, err := grabsvc.NewTokenVerifier(key)
	if err != nil {
		return nil, fmt.Errorf("--token-key-file: %w", err)
	}
	tokens.MaxLifetime = o.tokenMaxLifetime
	return tokens, nil
}
