package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/go-logr/logr"
	"github.com/redis/go-redis/v9"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/store"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/proc"
	"redpacket.io/operator/test/redistest"
)

// benchActivity is the name of the activity the HTTP measurement grabs from.
const benchActivity = "bench"

// httpPair is (c) and (d) under one load: grab and noop are the median round's.
type httpPair struct {
	clients    int
	grab, noop latencies
	rounds     []httpRound
	// granted is how many grants the grab service answered in all rounds.
	granted int64
}

// httpRound is one round of c/d: the no-op handler, then the grab service.
type httpRound struct{ grab, noop latencies }

func (h httpRound) ratio() float64 { return ratio(h.grab.Rate(), h.noop.Rate()) }

// measureHTTP runs (d) the no-op handler and (c) the grab service binary, each in its
// own process, under the same Go load generator: low with o.httpClients clients and
// high with o.httpClientsHigh (none when that is 0). The grab service looks its
// activity up in a local control plane; the benchmark seeds the activity's packets
// itself.
func measureHTTP(ctx context.Context, o options, root, work string, redisSrv *redistest.Server, rc redis.Cmdable) (low, high httpPair, err error) {
	ctrllog.SetLogger(logr.Discard())
	grabBin := filepath.Join(root, "bin", "grabsvc")
	if !o.skipBuild {
		fmt.Println("    building bin/grabsvc ...")
		cmd := exec.CommandContext(ctx, "go", "build", "-o", grabBin, "./cmd/grabsvc")
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		if err := cmd.Run(); err != nil {
			return low, high, fmt.Errorf("building the grab service: %w", err)
		}
	}
	if err := ensureControlPlane(ctx, root); err != nil {
		return low, high, err
	}
	fmt.Println("    starting a local control plane ...")
	cp, err := controlplane.New()
	if err != nil {
		return low, high, err
	}
	defer func() { _ = cp.Stop() }()
	kubeconfig := filepath.Join(work, "kubeconfig")
	if err := cp.Kubeconfig(kubeconfig); err != nil {
		return low, high, err
	}

	rpa := &redpacketv1alpha1.RedPacketActivity{
		ObjectMeta: metav1.ObjectMeta{Name: benchActivity, Namespace: "default"},
		Spec: redpacketv1alpha1.RedPacketActivitySpec{
			TotalAmount:  o.httpPackets * packetAmount,
			Count:        o.httpPackets,
			Distribution: redpacketv1alpha1.Distribution{Type: redpacketv1alpha1.DistributionFixed, MinAmount: 1},
			Sponsor:      "bench",
		},
	}
	if err := cp.Client.Create(ctx, rpa); err != nil {
		return low, high, fmt.Errorf("creating the benchmark activity: %w", err)
	}
	uid := string(rpa.UID)
	fmt.Printf("    seeding %d packets for the HTTP claim path ... ", o.httpPackets)
	took, err := seedActivity(ctx, rc, uid, o.httpPackets)
	if err != nil {
		return low, high, err
	}
	fmt.Println(took.Round(time.Millisecond))

	grabAddr, err := proc.FreeAddr()
	if err != nil {
		return low, high, err
	}
	grabArgs := []string{"--namespace", "default", "--activity", benchActivity, "--listen", grabAddr,
		"--kubeconfig", kubeconfig, "--redis-addresses", redisSrv.Addr}
	var pprofAddr string
	if o.grabProfile != "" {
		if pprofAddr, err = proc.FreeAddr(); err != nil {
			return low, high, err
		}
		grabArgs = append(grabArgs, "--pprof-listen", pprofAddr)
	}
	gp, err := proc.Start("grabsvc", filepath.Join(work, "grabsvc.log"), redisSrv.AuthEnv(), grabBin, grabArgs...)
	if err != nil {
		return low, high, err
	}
	defer gp.Stop(10 * time.Second)
	if err := proc.WaitHTTP(ctx, gp, "http://"+grabAddr+"/readyz", 60*time.Second); err != nil {
		return low, high, fmt.Errorf("grab service: %w (log: %s)", err, proc.Tail(filepath.Join(work, "grabsvc.log"), 2000))
	}

	self, err := os.Executable()
	if err != nil {
		return low, high, fmt.Errorf("finding the benchmark binary: %w", err)
	}
	noopAddr, err := proc.FreeAddr()
	if err != nil {
		return low, high, err
	}
	np, err := proc.Start("no-op server", filepath.Join(work, "noop.log"), nil, self, "--serve-noop", noopAddr)
	if err != nil {
		return low, high, err
	}
	defer np.Stop(5 * time.Second)
	if err := proc.WaitHTTP(ctx, np, "http://"+noopAddr+"/", 30*time.Second); err != nil {
		return low, high, err
	}

	body := func(prefix string) func(int64) []byte {
		return func(i int64) []byte {
			return []byte(`{"userId":"` + prefix + strconv.FormatInt(i, 10) + `"}`)
		}
	}
	redisMeter := redisCPUMeter(ctx, rc)
	// round runs the no-op handler, then the grab service, with as many clients; the
	// grab service is profiled in the first round at the first load.
	round := func(clients, n int) (h httpRound, err error) {
		spec := loadSpec{Clients: clients, Duration: o.httpDuration, Warmup: o.httpWarmup, Max: o.httpPackets / 8}
		fmt.Printf("(d) round %d: no-op Go handler, %d keep-alive clients, %s ... ", n, clients, o.httpDuration)
		spec.URL, spec.Body = "http://"+noopAddr+"/v1/grab", body(fmt.Sprintf("n%d-%d-", clients, n))
		spec.Meters = []cpuMeter{procCPU(serverMeter, np.Pid()), redisMeter, selfCPU()}
		if h.noop, err = runHTTPLoad(ctx, spec); err != nil {
			return h, fmt.Errorf("no-op load: %w", err)
		}
		fmt.Printf("%s  CPU per request %s\n", rateLine(h.noop), fmtCPU(h.noop.CPU))
		fmt.Printf("(c) round %d: grab service POST /v1/grab, %d keep-alive clients, %s ... ", n, clients, o.httpDuration)
		spec.URL, spec.Body = "http://"+grabAddr+"/v1/grab", body(fmt.Sprintf("h%d-%d-", clients, n))
		spec.Meters = []cpuMeter{procCPU(serverMeter, gp.Pid()), redisMeter, selfCPU()}
		profiled := make(chan error, 1)
		if pprofAddr != "" && clients == o.httpClients && n == 1 {
			go func() {
				profiled <- fetchProfile(ctx, "http://"+pprofAddr, o.httpWarmup, o.httpDuration, o.grabProfile)
			}()
		} else {
			profiled <- nil
		}
		if h.grab, err = runHTTPLoad(ctx, spec); err != nil {
			return h, fmt.Errorf("grab load: %w", err)
		}
		if err := <-profiled; err != nil {
			return h, fmt.Errorf("profiling the grab service: %w", err)
		}
		fmt.Printf("%s  CPU per request %s  c/d %.2f\n", rateLine(h.grab), fmtCPU(h.grab.CPU), h.ratio())
		if h.grab.Errors > 0 || h.grab.ByStatus["200"] == 0 {
			return h, fmt.Errorf("grab service answers: %v (log: %s)", h.grab.ByStatus, proc.Tail(filepath.Join(work, "grabsvc.log"), 2000))
		}
		return h, nil
	}
	// run is o.httpRounds rounds under one load; the pair's figures are the median
	// round's, as for b/a.
	run := func(clients int) (pair httpPair, err error) {
		pair.clients = clients
		for n := 1; n <= max(1, o.httpRounds); n++ {
			h, err := round(clients, n)
			if err != nil {
				return pair, err
			}
			pair.rounds = append(pair.rounds, h)
			pair.granted += h.grab.ByStatus["200"]
		}
		median := medianRound(pair.rounds, httpRound.ratio)
		pair.grab, pair.noop = median.grab, median.noop
		return pair, nil
	}
	if low, err = run(o.httpClients); err != nil {
		return low, high, err
	}
	granted := low.granted
	if o.httpClientsHigh > 0 {
		if high, err = run(o.httpClientsHigh); err != nil {
			return low, high, err
		}
		granted += high.granted
	}
	snap, err := store.NewActivity(rc, uid, 1).Snapshot(ctx)
	if err != nil {
		return low, high, err
	}
	if snap.ClaimedCount < granted {
		return low, high, fmt.Errorf("grab service answered %d grants but Redis counts %d", granted, snap.ClaimedCount)
	}
	return low, high, nil
}

// ensureControlPlane builds the control-plane binaries when bin/ lacks them.
func ensureControlPlane(ctx context.Context, root string) error {
	for _, b := range []string{"kube-apiserver", "etcd", "kubectl"} {
		if _, err := os.Stat(filepath.Join(root, "bin", b)); err != nil {
			fmt.Println("    building the local control plane (hack/build-controlplane.sh) ...")
			cmd := exec.CommandContext(ctx, filepath.Join(root, "hack", "build-controlplane.sh"))
			cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
			if err := cmd.Run(); err != nil {
				return fmt.Errorf("building the control plane: %w", err)
			}
			return nil
		}
	}
	return nil
}

// serverMeter names the HTTP server's process in a run's CPU figures.
const serverMeter = "server"

// cpuMeterOrder is the order the CPU figures are printed in.
var cpuMeterOrder = []string{serverMeter, redisServer, loadGenerator}

// fmtCPU prints a run's CPU time per request, by process, and their sum.
func fmtCPU(cpu map[string]time.Duration) string {
	var b strings.Builder
	var total time.Duration
	for _, name := range cpuMeterOrder {
		if d, ok := cpu[name]; ok {
			fmt.Fprintf(&b, "%s %s, ", name, fmtMicros(d))
			total += d
		}
	}
	fmt.Fprintf(&b, "in all %s", fmtMicros(total))
	return b.String()
}

// fetchProfile waits out the warm-up, then records the grab service's CPU profile
// for the measured duration into path.
func fetchProfile(ctx context.Context, base string, warmup, dur time.Duration, path string) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(warmup):
	}
	url := fmt.Sprintf("%s/debug/pprof/profile?seconds=%d", base, max(1, int(dur.Seconds())))
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}
