package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/test/controlplane"
	"redpacket.io/operator/test/proc"
	"redpacket.io/operator/test/redistest"
)

// activityRun is the resource path measured beside the runtime packets of (l): N
// activities of 5 packets applied at once to a local API server with the operator
// running on the benchmark's Redis, timed until every one reports phase Active.
type activityRun struct {
	Activities int
	// Elapsed is from the first create until the last activity was seen Active.
	Elapsed time.Duration
}

// Rate is activities made Active per second.
func (a activityRun) Rate() float64 {
	if a.Elapsed <= 0 {
		return 0
	}
	return float64(a.Activities) / a.Elapsed.Seconds()
}

// benchOperatorNamespace is where the benchmark's operator believes it runs.
const benchOperatorNamespace = "redpacket-system"

// measureActivitiesActive starts a local control plane and the operator (bin/manager,
// or one built into the work directory) on the benchmark's Redis, logged in as its
// admin user, applies n activities of 5
// packets from 32 concurrent clients, and polls until every one is Active. The
// control plane has no node: an activity is Active once its packets are seeded and
// its gates open, which is all a packet of the runtime path needs to be grabbed.
func measureActivitiesActive(ctx context.Context, o options, root, work string, redisSrv *redistest.Server, n int) (activityRun, error) {
	r := activityRun{Activities: n}
	if err := ensureControlPlane(ctx, root); err != nil {
		return r, err
	}
	manager, err := benchBinary(ctx, o, root, work, "manager")
	if err != nil {
		return r, err
	}
	fmt.Println("    starting a local control plane and the operator ...")
	cp, err := controlplane.New()
	if err != nil {
		return r, err
	}
	defer func() { _ = cp.Stop() }()
	kubeconfig := filepath.Join(work, "kubeconfig-activities")
	if err := cp.Kubeconfig(kubeconfig); err != nil {
		return r, err
	}
	if err := cp.Client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: benchOperatorNamespace}}); err != nil {
		return r, fmt.Errorf("creating the operator's namespace: %w", err)
	}
	probe, err := proc.FreeAddr()
	if err != nil {
		return r, err
	}
	logPath := filepath.Join(work, "manager.log")
	mp, err := proc.Start("operator", logPath, append([]string{"POD_NAMESPACE=" + benchOperatorNamespace}, redisSrv.AuthEnv()...), manager,
		"--kubeconfig", kubeconfig, "--redis-addresses", redisSrv.Addr,
		"--metrics-bind-address", "0", "--health-probe-bind-address", probe)
	if err != nil {
		return r, err
	}
	defer mp.Stop(10 * time.Second)
	if err := proc.WaitHTTP(ctx, mp, "http://"+probe+"/readyz", 60*time.Second); err != nil {
		return r, fmt.Errorf("operator: %w (log: %s)", err, proc.Tail(logPath, 2000))
	}

	const ns = "default"
	fmt.Printf("(l) %d activities of 5 packets applied at once, until all are Active ... ", n)
	start := time.Now()
	if err := createActivities(ctx, cp.Client, ns, n); err != nil {
		return r, err
	}
	deadline := start.Add(10 * time.Minute)
	for {
		var list redpacketv1alpha1.RedPacketActivityList
		if err := cp.Client.List(ctx, &list, client.InNamespace(ns)); err != nil {
			return r, fmt.Errorf("listing activities: %w", err)
		}
		active := 0
		for _, a := range list.Items {
			if a.Status.Phase == redpacketv1alpha1.PhaseActive {
				active++
			}
		}
		if active == n {
			r.Elapsed = time.Since(start)
			break
		}
		if time.Now().After(deadline) {
			return r, fmt.Errorf("%d of %d activities Active after %s (log: %s)", active, n, time.Since(start).Round(time.Second), proc.Tail(logPath, 2000))
		}
		time.Sleep(100 * time.Millisecond)
	}
	fmt.Printf("%s, %.1f Active/s\n", fmtDur(r.Elapsed), r.Rate())
	return r, nil
}

// benchBinary is the path of the project's binary cmd/<name>: bin/<name> as it is
// with -skip-build, otherwise built from this tree into the work directory (bin/ may
// be shared with a running demo or test).
func benchBinary(ctx context.Context, o options, root, work, name string) (string, error) {
	if o.skipBuild {
		return filepath.Join(root, "bin", name), nil
	}
	out := filepath.Join(work, name)
	fmt.Printf("    building %s ...\n", name)
	cmd := exec.CommandContext(ctx, "go", "build", "-o", out, "./cmd/"+name)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("building %s: %w", name, err)
	}
	return out, nil
}

// createActivities creates activities act-0 .. act-<n-1> in ns, 5 packets of 100
// each, from 32 concurrent clients.
func createActivities(ctx context.Context, c client.Client, ns string, n int) error {
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
		next  = make(chan int)
	)
	for range 32 {
		wg.Go(func() {
			for i := range next {
				a := &redpacketv1alpha1.RedPacketActivity{
					ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("act-%d", i), Namespace: ns},
					Spec: redpacketv1alpha1.RedPacketActivitySpec{
						TotalAmount:  5 * 100,
						Count:        5,
						Currency:     redpacketv1alpha1.DefaultCurrency,
						Distribution: redpacketv1alpha1.Distribution{Type: redpacketv1alpha1.DistributionFixed, MinAmount: 1},
						Sponsor:      "bench",
					},
				}
				if err := c.Create(ctx, a); err != nil {
					mu.Lock()
					if first == nil {
						first = fmt.Errorf("creating %s: %w", a.Name, err)
					}
					mu.Unlock()
				}
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	return first
}
