package rpactl

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/internal/rain"
)

// Bounds of a rehearsal rain.
const (
	MaxRainUsers       = 100000
	MaxRainConnections = 256
	// rainTokenTTL is how long the tokens minted for the rain's users are valid.
	rainTokenTTL = 15 * time.Minute
)

// rainOptions are the flags of `rain`.
type rainOptions struct {
	users, connections, rate, retryEvery int
	url, userPrefix                      string
	timeout, deadline, reportWait        time.Duration
}

func (o rainOptions) validate() error {
	switch {
	case o.users < 1 || o.users > MaxRainUsers:
		return fmt.Errorf("--users %d is outside 1..%d", o.users, MaxRainUsers)
	case o.connections < 1 || o.connections > MaxRainConnections:
		return fmt.Errorf("--connections %d is outside 1..%d", o.connections, MaxRainConnections)
	case o.rate < 0:
		return errors.New("--rate must not be negative")
	case o.retryEvery < 0:
		return errors.New("--retry-every must not be negative")
	case o.timeout <= 0 || o.deadline <= 0 || o.reportWait < 0:
		return errors.New("--timeout and --deadline must be positive, --report-wait not negative")
	}
	if o.url != "" {
		u, err := url.Parse(o.url)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("--url %q is not an http(s) URL", o.url)
		}
	}
	if o.userPrefix != "" && grabsvc.CheckUserID(rain.Spec{UserPrefix: o.userPrefix}.UserName(o.users-1)) != "" {
		return fmt.Errorf("--user-prefix %q makes user ids the grab service refuses", o.userPrefix)
	}
	return nil
}

func newRainCommand(flags *kubeFlags, streams Streams) *cobra.Command {
	o := rainOptions{}
	cmd := &cobra.Command{
		Use:   "rain NAME --users N",
		Short: "Rehearse: rain N users on an Active activity's grab service and check the invariants",
		Long: `Rehearse an activity: N users (at most 100000) each grab once, every --retry-every'th
user asks again, over at most --connections connections, and then the rain checks that
every user got an answer, no packet was granted twice, every retry got the same answer,
the status counts every grant, and claimed + remaining + refunded == total.

Every grant is real: it takes a packet and is settled to the balance system like any
other. Use it on a rehearsal activity.

The grab service is reached through a port-forward to one of its Ready pods (as
kubectl port-forward does; needs create on pods/portforward), or at --url. With
spec.grabService.auth, each user gets a token signed with the activity's key, which
needs get on the Secret. The exit status is 1 when a check fails.`,
		Example: `  kubectl rpa rain rehearsal --users 2000
  kubectl rpa rain rehearsal --users 20000 --rate 500 --connections 64
  kubectl rpa rain rehearsal --users 500 --url http://rehearsal-grab.default.svc:8080`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := o.validate(); err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), o.deadline)
			defer cancel()
			s, err := flags.connect()
			if err != nil {
				return err
			}
			return s.rain(ctx, args[0], o, streams)
		},
	}
	fl := cmd.Flags()
	fl.IntVar(&o.users, "users", 0, "how many users grab, each once (required; at most 100000)")
	fl.IntVar(&o.connections, "connections", 16, "at most this many connections at once (at most 256)")
	fl.IntVar(&o.rate, "rate", 0, "users starting per second; 0: all at once")
	fl.IntVar(&o.retryEvery, "retry-every", 10, "every n-th user grabs again and must get the same answer; 0: none")
	fl.StringVar(&o.url, "url", "", "base URL of the grab service, such as http://NAME-grab.NAMESPACE.svc:8080 from inside the cluster; default: a port-forward to a grab pod")
	fl.StringVar(&o.userPrefix, "user-prefix", "", "user ids are PREFIX-00001 and on; default: rain-<unix time>, fresh users every run")
	fl.DurationVar(&o.timeout, "timeout", 10*time.Second, "deadline of one grab request")
	fl.DurationVar(&o.deadline, "deadline", 10*time.Minute, "deadline of the whole rain, checks included")
	fl.DurationVar(&o.reportWait, "report-wait", 30*time.Second, "how long to wait for the grab service to report the rain into the status")
	if err := cmd.MarkFlagRequired("users"); err != nil {
		panic(err)
	}
	return cmd
}

// rain runs the rehearsal; it returns an error when it could not run or a check failed.
func (s *session) rain(ctx context.Context, name string, o rainOptions, streams Streams) error {
	a, err := s.activity(ctx, name)
	if err != nil {
		return err
	}
	if a.Status.Phase != redpacketv1alpha1.PhaseActive {
		return fmt.Errorf("redpacketactivity %s/%s is %s: a rain needs an Active activity", a.Namespace, a.Name, orNone(string(a.Status.Phase)))
	}
	before := MoneyOf(a)

	base, via := strings.TrimRight(o.url, "/"), "--url"
	if base == "" {
		fw, err := s.forwardToGrabPod(ctx, a, streams.ErrOut)
		if err != nil {
			return err
		}
		defer fw.Close()
		base, via = fw.URL, "a port-forward to pod "+fw.Pod
	}
	spec := rain.Spec{
		URL: base + "/v1/grab", Users: o.users, Connections: o.connections, Rate: o.rate,
		UserPrefix: o.userPrefix, RetryEvery: o.retryEvery, Timeout: o.timeout, RetryUnavailable: true, WaitForOpening: true,
		Progress: streams.ErrOut,
	}
	if spec.UserPrefix == "" {
		spec.UserPrefix = fmt.Sprintf("rain-%d", time.Now().Unix())
	}
	if a.Spec.GrabService.Auth != nil {
		key, err := s.activityTokenKey(ctx, a)
		if err != nil {
			return err
		}
		exp := time.Now().Add(rainTokenTTL)
		spec.Token = func(user string) string {
			// Signing cannot fail: the claims are plain strings and numbers.
			tok, _ := mintToken(key, a, user, exp)
			return tok
		}
	}
	fmt.Fprintf(streams.Out, "Rain on %s/%s: %d users (%s-%05d on), %d connections, through %s (%s)\n",
		a.Namespace, a.Name, o.users, spec.UserPrefix, 1, o.connections, via, base)

	res := rain.Run(ctx, spec)
	ended := time.Now()
	if err := printRainResult(streams.Out, res); err != nil {
		return err
	}

	after, reportErr := s.awaitReport(ctx, name, ended, before, res, o.reportWait)
	checks := RainChecks(res, before, MoneyOf(after), reportErr)
	fmt.Fprintln(streams.Out)
	if after.Status.LastReportTime != nil {
		fmt.Fprintf(streams.Out, "Status as reported at %s: phase %s\n",
			after.Status.LastReportTime.UTC().Format(time.RFC3339), orNone(string(after.Status.Phase)))
	}
	failed, err := printChecks(streams.Out, checks)
	if err != nil {
		return err
	}
	if failed > 0 {
		return fmt.Errorf("rain on %s/%s: %d of %d checks failed", a.Namespace, a.Name, failed, len(checks))
	}
	return nil
}

// awaitReport waits up to wait for a status report made after the rain ended that
// counts the rain's grants, and returns the latest activity read.
func (s *session) awaitReport(ctx context.Context, name string, ended time.Time, before Money, res rain.Result, wait time.Duration) (*redpacketv1alpha1.RedPacketActivity, error) {
	deadline := time.Now().Add(wait)
	for {
		a, err := s.activity(ctx, name)
		if err != nil {
			return &redpacketv1alpha1.RedPacketActivity{}, err
		}
		m := MoneyOf(a)
		// lastReportTime has whole seconds: a report stamped after the second the rain
		// ended in was made after the rain.
		fresh := a.Status.LastReportTime != nil && a.Status.LastReportTime.After(ended.Truncate(time.Second))
		if fresh && m.Reported && m.ClaimedCount-before.ClaimedCount >= res.Granted && m.Check().Verdict == VerdictOK {
			return a, nil
		}
		if time.Now().After(deadline) {
			if !fresh {
				return a, fmt.Errorf("no status report within %s after the rain", wait)
			}
			return a, nil
		}
		select {
		case <-ctx.Done():
			return a, ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// Check is one verdict of a rain.
type Check struct {
	Name   string
	OK     bool
	Detail string
}

// RainChecks are the rain's verdicts from its client-side result and the activity's
// figures before the rain and after (as reported once it ended). reportErr is why no
// fresh report was seen, if so.
func RainChecks(res rain.Result, before, after Money, reportErr error) []Check {
	answered := res.ByOutcome["error"] == 0 && res.Failed == 0
	checks := []Check{
		{Name: "every user got an answer", OK: answered,
			Detail: fmt.Sprintf("%d without an answer, %d failed answers; first error: %s", res.ByOutcome["error"], res.Failed, orNone(res.FirstError))},
		{Name: "no packet granted twice", OK: res.DupPackets == 0,
			Detail: fmt.Sprintf("%d packets granted to more than one user", res.DupPackets)},
		{Name: "every retry got the same answer", OK: res.RetriesInconsistent == 0,
			Detail: fmt.Sprintf("%d of %d retries inconsistent", res.RetriesInconsistent, res.Retries)},
	}
	claimed, claimedAmount := after.ClaimedCount-before.ClaimedCount, after.ClaimedAmount-before.ClaimedAmount
	counted := Check{Name: "the status counts every grant",
		OK:     reportErr == nil && after.Reported && claimed >= res.Granted && claimedAmount >= res.GrantedSum,
		Detail: fmt.Sprintf("claimed +%d packets, +%d amount; the rain was granted %d, %d", claimed, claimedAmount, res.Granted, res.GrantedSum)}
	if reportErr != nil {
		counted.Detail = reportErr.Error()
	}
	inv := after.Check()
	checks = append(checks, counted, Check{Name: "claimed + remaining + refunded = total", OK: inv.Verdict == VerdictOK,
		Detail: inv.Verdict + ": " + inv.Equation + strings.Join(append([]string{""}, inv.Problems...), "; ")})
	return checks
}

// printRainResult prints the client side of a rain as kubectl-style tables.
func printRainResult(out io.Writer, r rain.Result) error {
	w := newTable(out)
	fmt.Fprintln(w, "OUTCOME\tUSERS")
	outcomes := make([]string, 0, len(r.ByOutcome))
	for k := range r.ByOutcome {
		outcomes = append(outcomes, k)
	}
	slices.Sort(outcomes)
	for _, k := range outcomes {
		fmt.Fprintf(w, "%s\t%d\n", k, r.ByOutcome[k])
	}
	fmt.Fprintln(w)
	rate := float64(r.Requests) / max(r.Elapsed.Seconds(), 0.001)
	fmt.Fprintln(w, "REQUESTS\tELAPSED\tREQ/S\tP50\tP99\tMAX\tASKED AGAIN (503, NO ANSWER)")
	fmt.Fprintf(w, "%d\t%s\t%.0f\t%s\t%s\t%s\t%d, %d\n", r.Requests, r.Elapsed.Round(time.Millisecond), rate,
		r.P50.Round(10*time.Microsecond), r.P99.Round(10*time.Microsecond), r.Max.Round(10*time.Microsecond),
		r.Unavailable, r.TransportErrors)
	fmt.Fprintln(w)
	fmt.Fprintln(w, "GRANTED\tAMOUNT\tDUPLICATE PACKETS\tRETRIES\tCONSISTENT")
	fmt.Fprintf(w, "%d\t%d\t%d\t%d\t%d\n", r.Granted, r.GrantedSum, r.DupPackets, r.Retries, r.RetriesSame)
	return w.Flush()
}

// printChecks prints the checks and returns how many failed.
func printChecks(out io.Writer, checks []Check) (int, error) {
	w := newTable(out)
	fmt.Fprintln(w, "CHECK\tRESULT\tDETAIL")
	failed := 0
	for _, c := range checks {
		verdict := "OK"
		if !c.OK {
			verdict = "FAILED"
			failed++
		}
		fmt.Fprintf(w, "%s\t%s\t%s\n", c.Name, verdict, oneLine(c.Detail))
	}
	return failed, w.Flush()
}
