package rpactl

import (
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/apimachinery/pkg/util/duration"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
)

func newStatusCommand(flags *kubeFlags, streams Streams) *cobra.Command {
	return &cobra.Command{
		Use:   "status NAME",
		Short: "Show an activity's money table, conservation check, conditions and settlement progress",
		Long: `Show an activity's money table (total, claimed, remaining and refunded, in packets
and in minor units), check that claimed + remaining + refunded == total, and show its
conditions and settlement progress (settled of claimed).`,
		Example: `  kubectl rpa status quiz-night
  kubectl rpa status quiz-night -n promotions`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := flags.connect()
			if err != nil {
				return err
			}
			a, err := s.activity(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			return PrintStatus(streams.Out, a, time.Now())
		},
	}
}

// PrintStatus writes the status report of an activity as of now: its identity and
// phase, the money table, the conservation check, settlement progress and conditions.
func PrintStatus(out io.Writer, a *redpacketv1alpha1.RedPacketActivity, now time.Time) error {
	st := a.Status
	currency := a.Spec.Currency
	if currency == "" {
		currency = redpacketv1alpha1.DefaultCurrency
	}
	w := newTable(out)
	p := func(format string, args ...any) { fmt.Fprintf(w, format+"\n", args...) }

	p("Name:\t%s", a.Name)
	p("Namespace:\t%s", a.Namespace)
	p("Phase:\t%s", orNone(string(st.Phase)))
	p("Paused:\t%t", a.Spec.Paused)
	p("Window:\t%s", window(a))
	p("Endpoint:\t%s", orNone(st.Endpoint))
	if st.LastReportTime != nil {
		p("Last report:\t%s (%s ago)", st.LastReportTime.UTC().Format(time.RFC3339), age(st.LastReportTime.Time, now))
	} else {
		p("Last report:\t<none>")
	}
	p("")

	m := MoneyOf(a)
	p("MONEY\tPACKETS\tAMOUNT\t%s", currency)
	p("total\t%d\t%d\t%s", m.TotalCount, m.TotalAmount, FormatMajor(m.TotalAmount, currency))
	if m.Reported {
		p("claimed\t%d\t%d\t%s", m.ClaimedCount, m.ClaimedAmount, FormatMajor(m.ClaimedAmount, currency))
		p("remaining\t%d\t%d\t%s", m.RemainingCount, m.RemainingAmount, FormatMajor(m.RemainingAmount, currency))
		p("refunded\t%d\t%d\t%s", m.RefundedCount, m.RefundedAmount, FormatMajor(m.RefundedAmount, currency))
	} else {
		for _, row := range []string{"claimed", "remaining"} {
			p("%s\t<none>\t<none>\t", row)
		}
		p("refunded\t<none>\t%d\t%s", m.RefundedAmount, FormatMajor(m.RefundedAmount, currency))
	}
	p("")
	inv := m.Check()
	switch inv.Verdict {
	case VerdictUnknown:
		p("Invariant:\t%s: %s", inv.Verdict, inv.Equation)
	default:
		p("Invariant:\t%s: claimed + remaining + refunded = %s, total %d", inv.Verdict, inv.Equation, m.TotalAmount)
	}
	for _, problem := range inv.Problems {
		p("\t- %s", problem)
	}
	if err := w.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(out)

	w = newTable(out)
	p("SETTLEMENT\tSETTLED\tOF CLAIMED\tPROGRESS")
	settledCount, settledAmount := deref(st.SettledCount), deref(st.SettledAmount)
	if m.Reported {
		p("packets\t%d\t%d\t%s", settledCount, m.ClaimedCount, percent(settledCount, m.ClaimedCount))
		p("amount\t%d\t%d\t%s", settledAmount, m.ClaimedAmount, percent(settledAmount, m.ClaimedAmount))
	} else {
		p("packets\t%d\t<none>\t-", settledCount)
		p("amount\t%d\t<none>\t-", settledAmount)
	}
	p("")
	if m.Reported {
		p("Pending:\t%d", max(0, m.ClaimedCount-settledCount))
	} else {
		p("Pending:\t<none>")
	}
	if d := st.SettlementDelivery; d != nil {
		lastError := "last error: <none>"
		if d.LastErrorClass != "" && d.LastErrorTime != nil {
			lastError = fmt.Sprintf("last error: %s, %s ago", d.LastErrorClass, age(d.LastErrorTime.Time, now))
		}
		p("Retrying:\t%d (%s)", d.Retrying, lastError)
		if d.OldestUndeliveredTime != nil {
			p("Oldest undelivered:\t%s (%s ago)", d.OldestUndeliveredTime.UTC().Format(time.RFC3339), age(d.OldestUndeliveredTime.Time, now))
		}
	} else {
		p("Retrying:\t<unknown> (no settlement worker reports)")
	}
	p("Dead letters:\t%d", deref(st.DeadLetterCount))
	p("Webhook:\t%s", webhook(a))
	p("")

	p("CONDITIONS")
	if len(st.Conditions) == 0 {
		p("<none>")
	} else {
		p("TYPE\tSTATUS\tREASON\tAGE\tMESSAGE")
		for _, c := range st.Conditions {
			p("%s\t%s\t%s\t%s\t%s", c.Type, c.Status, c.Reason, age(c.LastTransitionTime.Time, now), oneLine(c.Message))
		}
	}
	return w.Flush()
}

func window(a *redpacketv1alpha1.RedPacketActivity) string {
	start, end := "as soon as seeded", "until every packet is claimed"
	if a.Spec.StartTime != nil {
		start = a.Spec.StartTime.UTC().Format(time.RFC3339)
	}
	if a.Spec.EndTime != nil {
		end = a.Spec.EndTime.UTC().Format(time.RFC3339)
	}
	return start + " → " + end
}

func webhook(a *redpacketv1alpha1.RedPacketActivity) string {
	if a.Spec.Settlement == nil || a.Spec.Settlement.Webhook == nil {
		return "<none> (claims wait in the stream)"
	}
	return a.Spec.Settlement.Webhook.URL
}

// age is kubectl's short age of t, such as "5m" or "2d3h".
func age(t time.Time, now time.Time) string {
	if t.IsZero() {
		return "<unknown>"
	}
	return duration.HumanDuration(now.Sub(t))
}

func orNone(s string) string {
	if s == "" {
		return "<none>"
	}
	return s
}

// oneLine keeps a table row on one line.
func oneLine(s string) string {
	return strings.Join(strings.Fields(s), " ")
}

func deref(p *int64) int64 {
	if p == nil {
		return 0
	}
	return *p
}
