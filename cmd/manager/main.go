// Command manager runs the redpacket-operator: the RedPacketActivity controller, with
// leader election, Prometheus metrics and health probes.
package main

import (
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/textlogger"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	gatewayv1 "sigs.k8s.io/gateway-api/apis/v1"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/controllers"
	"redpacket.io/operator/internal/version"
	"redpacket.io/operator/settlement"
	"redpacket.io/operator/store/redisconn"
)

// leaderElectionID names the Lease the operator's replicas compete for.
const leaderElectionID = "redpacket-operator.redpacket.io"

// DefaultMetricsAddr is where the metrics endpoint binds when --metrics-bind-address
// is not given: loopback only, and not the grab service's :8080, so that the operator
// and a grab service run by hand on one host do not collide. The install manifests
// give :8080 explicitly: in the operator's pod, nothing else listens.
const DefaultMetricsAddr = "127.0.0.1:8082"

// DefaultShutdownTimeout is --graceful-shutdown-timeout's default: below the
// install's terminationGracePeriodSeconds (30), so that a leader stopping cleanly
// releases its lease before the kubelet kills it.
const DefaultShutdownTimeout = 20 * time.Second

// maxSettlementConcurrency is the highest --settlement-max-concurrency accepted: each
// worker keeps up to twice as many connections to the balance system.
const maxSettlementConcurrency = 1024

func main() {
	var (
		metricsAddr        string
		probeAddr          string
		leaderElect        bool
		redisAddresses     string
		redisMode          string
		redisUsername      string
		redisPassword      string
		redisTLS           bool
		grabImage          string
		grabReplicas       int
		cleanupGrace       time.Duration
		unsettledRetention time.Duration
		grabReportTimeout  time.Duration
		grabTokenLifetime  time.Duration
		redisTimeout       time.Duration
		activeResync       time.Duration
		concurrentRecons   int
		redisClientIdleTTL time.Duration
		allowImageOverride bool
		allowedRedisHosts  string
		settlementKeys     string
		settlementMinConc  int
		settlementMaxConc  int
		reconcileInterval  time.Duration
		shutdownTimeout    time.Duration
		showVersion        bool
	)
	flag.BoolVar(&showVersion, "version", false, "print the version and exit")
	flag.StringVar(&metricsAddr, "metrics-bind-address", DefaultMetricsAddr, "address the Prometheus metrics endpoint binds to (0 turns it off); the install manifests bind :8080 in the pod")
	flag.StringVar(&probeAddr, "health-probe-bind-address", ":8081", "address /healthz and /readyz bind to")
	flag.BoolVar(&leaderElect, "leader-elect", false, "elect one active controller among the operator's replicas")
	flag.StringVar(&redisAddresses, "redis-addresses", "127.0.0.1:6379", "default Redis: comma-separated host:port (one for standalone, seed nodes for cluster)")
	flag.StringVar(&redisMode, "redis-mode", redisconn.ModeStandalone, "default Redis mode: standalone or cluster")
	flag.StringVar(&redisUsername, "redis-username", "", "default Redis ACL user name (env REDIS_USERNAME when the flag is empty)")
	flag.StringVar(&redisPassword, "redis-password", "", "default Redis password (env REDIS_PASSWORD when the flag is empty)")
	flag.BoolVar(&redisTLS, "redis-tls", false, "connect to the default Redis over TLS")
	flag.StringVar(&grabImage, "grab-image", controllers.DefaultGrabImage, "grab service image of activities that do not name one")
	flag.IntVar(&grabReplicas, "grab-replicas", controllers.DefaultGrabReplicas, "grab Deployment replicas of activities that do not set them")
	flag.DurationVar(&cleanupGrace, "cleanup-grace-period", controllers.DefaultCleanupGracePeriod, "how long deletion waits for settlement to drain before deleting the Redis keys anyway")
	flag.DurationVar(&unsettledRetention, "unsettled-retention", controllers.DefaultUnsettledRetention, "how long the settlement and dead-letter streams of an activity deleted before settlement drained are kept")
	flag.DurationVar(&grabReportTimeout, "grab-report-timeout", controllers.DefaultGrabReportTimeout, "how recent a grab replica's report must be for GrabServiceAvailable")
	flag.DurationVar(&grabTokenLifetime, "grab-token-max-lifetime", controllers.DefaultGrabTokenMaxLifetime, "longest time ahead a user token's exp may lie; grab services refuse tokens beyond it (at least 1s)")
	flag.DurationVar(&redisTimeout, "redis-timeout", controllers.DefaultRedisTimeout, "deadline of each Redis call (seeding gets more, growing with the packet count)")
	flag.DurationVar(&activeResync, "active-resync-period", controllers.DefaultActiveResyncPeriod, "how often an active activity is looked at again")
	flag.IntVar(&concurrentRecons, "max-concurrent-reconciles", 2, "how many activities are reconciled at once")
	flag.DurationVar(&redisClientIdleTTL, "redis-client-idle-timeout", controllers.DefaultRedisIdleTimeout, "close a cached Redis client unused for this long")
	flag.BoolVar(&allowImageOverride, "allow-grab-image-override", false, "let activities replace the grab image with spec.grabService.image (when false, such an activity gets Ready=False with reason GrabImageNotAllowed)")
	flag.StringVar(&allowedRedisHosts, "allowed-redis-hosts", "", "comma-separated host names, IP addresses and CIDR networks that spec.redis may name besides the default Redis (empty: the default Redis only)")
	flag.DurationVar(&shutdownTimeout, "graceful-shutdown-timeout", DefaultShutdownTimeout, "how long the operator's work gets to stop on SIGTERM before the leader lease is released anyway; keep it below the pod's terminationGracePeriodSeconds")
	flag.StringVar(&settlementKeys, "settlement-keys-secret", controllers.DefaultSettlementKeysSecret, "Secret in the operator's namespace (POD_NAMESPACE) holding the keys that sign settlement deliveries: one data key per balance system's host and port (<host>_<port>; a bare <host> is the scheme's default port only; names are fully qualified), its HMAC key as the value; a webhook that no key allows, or with userinfo, gets nothing")
	flag.IntVar(&settlementMinConc, "settlement-min-concurrency", settlement.DefaultMinConcurrency, "floor of each settlement worker's adaptive limit on first deliveries in flight (one worker per shard of an activity or budget); the limit falls towards it while the balance system fails most deliveries or slows down")
	flag.IntVar(&settlementMaxConc, "settlement-max-concurrency", settlement.DefaultMaxConcurrency, "ceiling of each settlement worker's adaptive limit on first deliveries in flight (one worker per shard of an activity or budget): the most one worker asks of a balance system at once, retries running besides in the ratio 1:1")
	flag.DurationVar(&reconcileInterval, "reconcile-interval", controllers.DefaultReconcileInterval, "how often each activity's and budget's settlement ledger is compared with the balance system's book through its read endpoints (a deletion asks for a comparison at once)")
	logConfig := textlogger.NewConfig()
	// Registered here rather than with logConfig.AddFlags, whose help text speaks of a
	// testing logger.
	flag.Var(logConfig.Verbosity(), "v", "log verbosity: 0 logs what the operator does and its errors; 1 adds retries with backoff and deletions waiting for settlement; higher levels add controller-runtime's and client-go's detail")
	flag.Var(logConfig.VModule(), "vmodule", "comma-separated pattern=N settings: log verbosity per source file")
	flag.Parse()
	if showVersion {
		fmt.Println(version.String("manager"))
		return
	}

	logger := textlogger.NewLogger(logConfig)
	ctrl.SetLogger(logger)
	klog.SetLogger(logger)
	log := ctrl.Log.WithName("setup")

	if grabReplicas < 0 || grabReplicas > 1000 {
		fail(log.Error, fmt.Errorf("--grab-replicas=%d is outside 0..1000", grabReplicas), "invalid flags")
	}
	if grabTokenLifetime < time.Second {
		fail(log.Error, fmt.Errorf("--grab-token-max-lifetime=%s is below 1s", grabTokenLifetime), "invalid flags")
	}
	if settlementMinConc < 1 || settlementMaxConc < settlementMinConc || settlementMaxConc > maxSettlementConcurrency {
		fail(log.Error, fmt.Errorf("--settlement-min-concurrency=%d and --settlement-max-concurrency=%d: want 1 <= min <= max <= %d",
			settlementMinConc, settlementMaxConc, maxSettlementConcurrency), "invalid flags")
	}
	allowedHosts, err := controllers.ParseRedisHosts(allowedRedisHosts)
	if err != nil {
		fail(log.Error, err, "invalid --allowed-redis-hosts")
	}
	defaultRedis, err := defaultRedisConn(redisAddresses, redisMode, redisUsername, redisPassword, redisTLS, os.Getenv)
	if err != nil {
		fail(log.Error, err, "invalid default Redis connection flags")
	}

	mgr, err := newManager(ctrl.GetConfigOrDie(), managerConfig{
		MetricsAddr:        metricsAddr,
		ProbeAddr:          probeAddr,
		LeaderElect:        leaderElect,
		ShutdownTimeout:    shutdownTimeout,
		RedisClientIdleTTL: redisClientIdleTTL,
		Reconciler: controllers.Options{
			DefaultRedis:             defaultRedis,
			GrabImage:                grabImage,
			GrabReplicas:             int32(grabReplicas),
			CleanupGracePeriod:       cleanupGrace,
			UnsettledRetention:       unsettledRetention,
			GrabReportTimeout:        grabReportTimeout,
			GrabTokenMaxLifetime:     grabTokenLifetime,
			RedisTimeout:             redisTimeout,
			ActiveResyncPeriod:       activeResync,
			MaxConcurrentReconciles:  concurrentRecons,
			AllowGrabImageOverride:   allowImageOverride,
			AllowedRedisHosts:        allowedHosts,
			SettlementKeysSecret:     types.NamespacedName{Name: settlementKeys},
			SettlementMinConcurrency: settlementMinConc,
			SettlementMaxConcurrency: settlementMaxConc,
			ReconcileInterval:        reconcileInterval,
		},
	})
	if err != nil {
		fail(log.Error, err, "setting up the manager")
	}

	log.Info("starting the manager", "redis", strings.Join(defaultRedis.Addresses, ","), "redisMode", defaultRedis.Mode,
		"grabImage", grabImage, "leaderElection", leaderElect,
		"allowGrabImageOverride", allowImageOverride, "allowedRedisHosts", allowedHosts.String())
	if err := mgr.Start(ctrl.SetupSignalHandler()); err != nil {
		fail(log.Error, err, "running the manager")
	}
}

// managerConfig is what newManager needs besides the API server's address.
type managerConfig struct {
	MetricsAddr, ProbeAddr string
	// LeaderElect elects one active controller among the replicas; the Lease lives
	// in LeaderElectionNamespace, empty meaning the pod's own namespace.
	LeaderElect             bool
	LeaderElectionNamespace string
	// ShutdownTimeout bounds how long the runnables get to stop on a clean shutdown
	// before the lease is released anyway; it must stay below the pod's
	// terminationGracePeriodSeconds so the release happens before the kubelet kills.
	ShutdownTimeout    time.Duration
	RedisClientIdleTTL time.Duration
	Reconciler         controllers.Options
}

// newManager builds the operator's manager on cfg: the RedPacketActivity controller
// with its runnables (the Redis client cache, the function keeper, the settlement
// workers), the RedPacketBudget controller with its expiry driver and settlement, and
// the health checks.
//
// On a clean shutdown (SIGTERM, context cancelled) the leader releases its Lease
// (LeaderElectionReleaseOnCancel), so that a replica waiting takes over within its
// retry period instead of the whole lease duration. That is safe because every
// runnable returns once its context ends, the settlement workers after their
// deliveries in flight have stopped, and main exits as soon as Start returns: no
// leader-only work goes on after the release.
func newManager(cfg *rest.Config, o managerConfig) (manager.Manager, error) {
	scheme := runtime.NewScheme()
	utilruntime.Must(clientgoscheme.AddToScheme(scheme))
	utilruntime.Must(redpacketv1alpha1.AddToScheme(scheme))
	// The Gateway API's kinds, for spec.expose.httpRoute; the CRDs need not be installed.
	utilruntime.Must(gatewayv1.Install(scheme))

	shutdownTimeout := o.ShutdownTimeout
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Scheme:                        scheme,
		Metrics:                       metricsserver.Options{BindAddress: o.MetricsAddr},
		HealthProbeBindAddress:        o.ProbeAddr,
		LeaderElection:                o.LeaderElect,
		LeaderElectionID:              leaderElectionID,
		LeaderElectionNamespace:       o.LeaderElectionNamespace,
		LeaderElectionReleaseOnCancel: true,
		GracefulShutdownTimeout:       &shutdownTimeout,
		Cache:                         controllers.CacheOptions(),
	})
	if err != nil {
		return nil, fmt.Errorf("creating the manager: %w", err)
	}

	// Both controllers reach Redis through one access: the Redis policy, the client
	// cache and the function keeper (made and added to the manager by the first
	// SetupWithManager).
	redisAccess := controllers.NewRedisAccess(o.Reconciler)
	redisAccess.Clients = controllers.NewRedisClients()
	redisAccess.Clients.IdleTimeout = o.RedisClientIdleTTL
	if err := mgr.Add(redisAccess.Clients); err != nil {
		return nil, fmt.Errorf("adding the Redis client cache: %w", err)
	}
	reconciler := &controllers.RedPacketActivityReconciler{RedisAccess: redisAccess, Options: o.Reconciler}
	if err := reconciler.SetupWithManager(mgr); err != nil {
		return nil, fmt.Errorf("setting up the controller: %w", err)
	}
	// Budgets share the activities' options and Redis access; their expiry driver
	// and their settlement are leader-election runnables of their own.
	budgetOptions := reconciler.Options
	budgetOptions.Name = controllers.BudgetControllerName
	budgetSettlement := controllers.NewBudgetSettlementRunner(mgr.GetAPIReader(),
		mgr.GetEventRecorder(controllers.EventReporter), reconciler.Options)
	if err := mgr.Add(budgetSettlement); err != nil {
		return nil, fmt.Errorf("adding the budget settlement runner: %w", err)
	}
	budgets := &controllers.RedPacketBudgetReconciler{RedisAccess: redisAccess,
		Options: budgetOptions, Settlement: budgetSettlement}
	if err := budgets.SetupWithManager(mgr); err != nil {
		return nil, fmt.Errorf("setting up the budget controller: %w", err)
	}
	if err := mgr.AddHealthzCheck("healthz", healthz.Ping); err != nil {
		return nil, fmt.Errorf("adding the health check: %w", err)
	}
	if err := mgr.AddReadyzCheck("readyz", healthz.Ping); err != nil {
		return nil, fmt.Errorf("adding the readiness check: %w", err)
	}
	return mgr, nil
}

// defaultRedisConn is the default Redis connection from the flags. An empty user name
// is read from the environment variable REDIS_USERNAME and an empty password from
// REDIS_PASSWORD, so that both can come from a Secret (the install's redpacket-redis)
// without showing in the process's arguments (or in --help). A flag that is given
// wins over its variable; each is read on its own.
func defaultRedisConn(addresses, mode, username, password string, tls bool, getenv func(string) string) (redisconn.Conn, error) {
	if username == "" {
		username = getenv("REDIS_USERNAME")
	}
	if password == "" {
		password = getenv("REDIS_PASSWORD")
	}
	conn := redisconn.Conn{
		Addresses: redisconn.ParseAddresses(addresses),
		Mode:      strings.TrimSpace(mode),
		Username:  username,
		Password:  password,
		TLS:       tls,
	}
	if err := conn.Validate(); err != nil {
		return redisconn.Conn{}, fmt.Errorf("default Redis connection: %w", err)
	}
	return conn, nil
}

func fail(logError func(error, string, ...any), err error, msg string) {
	logError(err, msg)
	os.Exit(1)
}
