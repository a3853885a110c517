package rpactl

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/grabsvc/grabapi"
	"redpacket.io/operator/settlement"
)

// The commands of a RedPacketBudget's runtime packets: `packets` lists the live ones
// and their money, `packet` shows one with who got what, `send` creates one with the
// sender credential. They talk to the budget's grab Service ("<budget>-grab")
// through a port-forward to one of its Ready pods (or --url), never to Redis: the
// plugin holds no Redis credentials of a budget.

// budgetGVK is the kind the plugin reads without depending on its Go type.
var budgetGVK = schema.GroupVersionKind{Group: redpacketv1alpha1.GroupVersion.Group, Version: redpacketv1alpha1.GroupVersion.Version,
	Kind: "RedPacketBudget"}

// budgetView is what the plugin reads of a RedPacketBudget.
type budgetView struct {
	Namespace, Name, UID string
	Currency             string
	Shards               int
	// RedisSecret is spec.redis.secretRef.name ("" on the operator's default Redis).
	RedisSecret string
	// SenderSecret holds the sender credential: status.senderSecretName, else
	// "<budget>-sender".
	SenderSecret string
	// TokenSecret is spec.grabService.auth.tokenSecretRef.name: the Secret of the
	// HMAC key of user tokens ("" when grabs take no token).
	TokenSecret string
	// Status figures as the operator reported them (0 when absent).
	Total, Available, InPackets, Claimed, Refunded int64
	LivePackets, CreatedPackets, ExpiredPackets    int64
}

// budget reads the named RedPacketBudget in the session's namespace.
func (s *session) budget(ctx context.Context, name string) (*budgetView, error) {
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(budgetGVK)
	if err := s.client.Get(ctx, client.ObjectKey{Namespace: s.namespace, Name: name}, u); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("redpacketbudget %q not found in namespace %q", name, s.namespace)
		}
		return nil, fmt.Errorf("reading redpacketbudget %s/%s: %w", s.namespace, name, err)
	}
	return budgetViewOf(u), nil
}

// budgetViewOf reads the fields the plugin uses from a RedPacketBudget.
func budgetViewOf(u *unstructured.Unstructured) *budgetView {
	str := func(path ...string) string { v, _, _ := unstructured.NestedString(u.Object, path...); return v }
	num := func(path ...string) int64 {
		v, _, _ := unstructured.NestedFieldNoCopy(u.Object, path...)
		switch n := v.(type) {
		case int64:
			return n
		case float64:
			return int64(n)
		}
		return 0
	}
	b := &budgetView{Namespace: u.GetNamespace(), Name: u.GetName(), UID: string(u.GetUID()),
		Currency: str("spec", "currency"), Shards: int(num("spec", "budgetShards")), RedisSecret: str("spec", "redis", "secretRef", "name"),
		SenderSecret: str("status", "senderSecretName"), TokenSecret: str("spec", "grabService", "auth", "tokenSecretRef", "name"),
		Total: num("status", "total"), Available: num("status", "available"), InPackets: num("status", "inPackets"),
		Claimed: num("status", "claimed"), Refunded: num("status", "refunded"), LivePackets: num("status", "livePackets"),
		CreatedPackets: num("status", "createdPackets"), ExpiredPackets: num("status", "expiredPackets")}
	if b.Currency == "" {
		b.Currency = settlement.DefaultCurrency
	}
	if b.Shards < 1 {
		b.Shards = 1
	}
	if b.SenderSecret == "" {
		b.SenderSecret = b.Name + "-sender"
	}
	return b
}

// SenderTokenKey is the data key of the sender credential in the budget's sender
// Secret.
const SenderTokenKey = "token"

// PacketView is a packet as the grab service answers it (docs/grab-api.md). Grabs,
// who got what in grab order, come only with GET /v1/packets/{id}; a creation's
// answer and the live list leave them empty.
type PacketView = grabapi.PacketDetailView

// PacketShareView is one granted share.
type PacketShareView = grabapi.PacketShareView

// packetList is GET /v1/packets?limit=N.
type packetList struct {
	Packets []PacketView `json:"packets"`
}

// apiError is a refusal's body: a code and a sentence.
type apiError struct {
	Error   string `json:"error"`
	Message string `json:"message"`
}

// PacketsClient calls a budget's grab service.
type PacketsClient struct {
	// BaseURL is the grab service's base URL, such as http://127.0.0.1:<port>.
	BaseURL string
	// HTTP sends the requests.
	HTTP *http.Client
}

// call sends one request and decodes a 2xx JSON answer into out; any other answer
// is an error with the service's code and sentence.
func (c PacketsClient) call(ctx context.Context, method, path, token string, body, out any) (int, error) {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return 0, err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, strings.TrimRight(c.BaseURL, "/")+path, rd)
	if err != nil {
		return 0, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return 0, fmt.Errorf("%s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 8<<20))
	if err != nil {
		return resp.StatusCode, fmt.Errorf("%s %s: reading the answer: %w", method, path, err)
	}
	if resp.StatusCode/100 != 2 {
		var e apiError
		if json.Unmarshal(data, &e) == nil && e.Error != "" {
			return resp.StatusCode, fmt.Errorf("%s %s: %s (%s): %s", method, path, resp.Status, e.Error, e.Message)
		}
		return resp.StatusCode, fmt.Errorf("%s %s: %s: %s", method, path, resp.Status, oneLine(string(data)))
	}
	if err := json.Unmarshal(data, out); err != nil {
		return resp.StatusCode, fmt.Errorf("%s %s: decoding the answer: %w", method, path, err)
	}
	return resp.StatusCode, nil
}

// Packet is GET /v1/packets/{id}, with token (the sender credential) when the
// budget has user tokens, and "" when it has none.
func (c PacketsClient) Packet(ctx context.Context, id, token string) (PacketView, error) {
	var p PacketView
	_, err := c.call(ctx, http.MethodGet, "/v1/packets/"+url.PathEscape(id), token, nil, &p)
	return p, err
}

// ErrNoListing is returned by Live when the grab service does not list packets.
var ErrNoListing = errors.New("this grab service does not list live packets (GET /v1/packets?limit=N); read one with `kubectl rpa packet`")

// Live is GET /v1/packets?limit=N with the sender credential: at most limit live
// packets, soonest expiry first.
func (c PacketsClient) Live(ctx context.Context, token string, limit int) ([]PacketView, error) {
	var l packetList
	status, err := c.call(ctx, http.MethodGet, "/v1/packets?limit="+strconv.Itoa(limit), token, nil, &l)
	if status == http.StatusMethodNotAllowed || status == http.StatusNotFound {
		return nil, fmt.Errorf("%w: %v", ErrNoListing, err)
	}
	return l.Packets, err
}

// SendRequest is the body of POST /v1/packets.
type SendRequest struct {
	ID           string `json:"id"`
	Sender       string `json:"sender"`
	TotalAmount  int64  `json:"totalAmount"`
	Count        int64  `json:"count"`
	Distribution string `json:"distribution,omitempty"`
	TTLSeconds   int64  `json:"ttlSeconds,omitempty"`
}

// senderToken reads the budget's sender credential from its Secret (key "token";
// status.senderSecretName names it), which needs get on that Secret.
func (s *session) senderToken(ctx context.Context, b *budgetView) (string, error) {
	sec, err := s.secret(ctx, b.SenderSecret, "the budget's sender credential")
	if err != nil {
		return "", err
	}
	token := strings.TrimRight(string(sec.Data[SenderTokenKey]), "\r\n")
	if token == "" {
		return "", fmt.Errorf("secret %s/%s holds no %q", b.Namespace, b.SenderSecret, SenderTokenKey)
	}
	return token, nil
}

// Send is POST /v1/packets with the sender credential.
func (c PacketsClient) Send(ctx context.Context, token string, r SendRequest) (PacketView, error) {
	var p PacketView
	_, err := c.call(ctx, http.MethodPost, "/v1/packets", token, r, &p)
	return p, err
}

// grabFlags are how the packet commands reach the budget's grab service.
type grabFlags struct {
	url     string
	timeout time.Duration
}

func (f *grabFlags) register(cmd *cobra.Command) {
	cmd.Flags().StringVar(&f.url, "url", "", "base URL of the budget's grab service, such as http://NAME-grab.NAMESPACE.svc:8080 from inside the cluster; default: a port-forward to a pod of the Service NAME-grab")
	cmd.Flags().DurationVar(&f.timeout, "timeout", 30*time.Second, "deadline of the whole command")
}

// packetsClient returns a client of the budget's grab service: --url, else a
// port-forward to a Ready pod of "<budget>-grab". Close the returned func when done.
func (f *grabFlags) packetsClient(ctx context.Context, s *session, b *budgetView, errOut io.Writer) (PacketsClient, func(), error) {
	c := PacketsClient{BaseURL: f.url, HTTP: &http.Client{Timeout: f.timeout}}
	if f.url != "" {
		u, err := url.Parse(f.url)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return c, nil, fmt.Errorf("--url %q is not an http(s) URL", f.url)
		}
		return c, func() {}, nil
	}
	fw, err := s.forwardToService(ctx, b.Namespace, b.Name+"-grab", errOut)
	if err != nil {
		return c, nil, err
	}
	c.BaseURL = fw.URL
	return c, fw.Close, nil
}

func newPacketsCommand(flags *kubeFlags, streams Streams) *cobra.Command {
	var (
		gf     grabFlags
		limit  int
		states []string
	)
	cmd := &cobra.Command{
		Use:   "packets BUDGET",
		Short: "List a budget's live packets and their money",
		Long: `Show a RedPacketBudget's money as the operator reports it (total, available, in live
packets, claimed, refunded) and list its live packets, soonest expiry first, with
what is left of each and its state (live, exhausted, expired), as the budget's grab
service answers GET /v1/packets?limit=N. --state keeps the packets in those states.`,
		Example: `  kubectl rpa packets group-packets
  kubectl rpa packets group-packets --limit 500
  kubectl rpa packets group-packets --state exhausted,expired`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if limit < 1 || limit > 1000 {
				return fmt.Errorf("--limit %d is outside 1..1000", limit)
			}
			wanted, err := checkStates(states)
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), gf.timeout)
			defer cancel()
			s, err := flags.connect()
			if err != nil {
				return err
			}
			b, err := s.budget(ctx, args[0])
			if err != nil {
				return err
			}
			if err := PrintBudgetMoney(streams.Out, b); err != nil {
				return err
			}
			token, err := s.senderToken(ctx, b)
			if err != nil {
				return err
			}
			c, done, err := gf.packetsClient(ctx, s, b, streams.ErrOut)
			if err != nil {
				return err
			}
			defer done()
			live, err := c.Live(ctx, token, limit)
			if err != nil {
				return fmt.Errorf("redpacketbudget %s/%s: %w", b.Namespace, b.Name, err)
			}
			fmt.Fprintln(streams.Out)
			return PrintPackets(streams.Out, FilterPackets(live, wanted), b.Currency, time.Now())
		},
	}
	gf.register(cmd)
	cmd.Flags().IntVar(&limit, "limit", 100, "list at most this many live packets (1..1000)")
	cmd.Flags().StringSliceVar(&states, "state", nil, "list only packets in these states: live, exhausted, expired (the packets not yet expired by the operator; refunding and refunded ones are read one at a time with kubectl rpa packet)")
	return cmd
}

// listedStates are the states a packet of the live list can be in: the operator's
// expiry takes a packet off the list as it starts its refund.
var listedStates = []string{grabapi.PacketLive, grabapi.PacketExhausted, grabapi.PacketExpired}

// checkStates refuses a --state that the live list cannot hold.
func checkStates(states []string) (map[string]bool, error) {
	if len(states) == 0 {
		return nil, nil
	}
	wanted := map[string]bool{}
	for _, st := range states {
		if !slices.Contains(listedStates, st) {
			return nil, fmt.Errorf("--state %q: the list holds packets that are %s; a refunding or refunded packet is read with kubectl rpa packet BUDGET ID",
				st, strings.Join(listedStates, ", "))
		}
		wanted[st] = true
	}
	return wanted, nil
}

// FilterPackets keeps the packets whose state is wanted (all when wanted is nil).
func FilterPackets(packets []PacketView, wanted map[string]bool) []PacketView {
	if wanted == nil {
		return packets
	}
	var out []PacketView
	for _, p := range packets {
		if wanted[p.State] {
			out = append(out, p)
		}
	}
	return out
}

func newPacketCommand(flags *kubeFlags, streams Streams) *cobra.Command {
	var gf grabFlags
	cmd := &cobra.Command{
		Use:   "packet BUDGET ID",
		Short: "Show one packet of a budget: what is left and who got what",
		Long: `Show one runtime packet of a RedPacketBudget as its grab service answers
GET /v1/packets/{id}: its total, what is left, when it expires, and who got which
share in grab order (the group's detail list). A packet is forgotten once it expired
and its refund was settled.`,
		Example: `  kubectl rpa packet group-packets order-20260101-0001`,
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), gf.timeout)
			defer cancel()
			s, err := flags.connect()
			if err != nil {
				return err
			}
			b, err := s.budget(ctx, args[0])
			if err != nil {
				return err
			}
			c, done, err := gf.packetsClient(ctx, s, b, streams.ErrOut)
			if err != nil {
				return err
			}
			defer done()
			// A budget with user tokens shows a packet only to a token or its sender
			// credential; without them the read needs none (and no Secret is read).
			token := ""
			if b.TokenSecret != "" {
				if token, err = s.senderToken(ctx, b); err != nil {
					return err
				}
			}
			p, err := c.Packet(ctx, args[1], token)
			if err != nil {
				return fmt.Errorf("redpacketbudget %s/%s: %w", b.Namespace, b.Name, err)
			}
			return PrintPacket(streams.Out, p, time.Now())
		},
	}
	gf.register(cmd)
	return cmd
}

func newSendCommand(flags *kubeFlags, streams Streams) *cobra.Command {
	var (
		gf  grabFlags
		req SendRequest
		ttl time.Duration
	)
	cmd := &cobra.Command{
		Use:   "send BUDGET --id ID --sender ACCOUNT --total MINOR --count N",
		Short: "Create one packet from a budget, as the merchant's backend does",
		Long: `Create one runtime packet drawn from a RedPacketBudget: POST /v1/packets on its grab
service with the sender credential, read from the Secret "<budget>-sender" (key
"token"; status.senderSecretName names it), which needs get on that Secret. The id
makes the call idempotent: the same id and body answer the same packet, another body
is refused (409). Amounts are integers in minor units. Money is real: what is not
grabbed before expiry is refunded to the sender.`,
		Example: `  kubectl rpa send group-packets --id order-1001 --sender merchant-7 --total 1000 --count 5
  kubectl rpa send group-packets --id order-1002 --sender merchant-7 --total 600 --count 3 --distribution Fixed --ttl 10m`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if ttl < 0 || ttl%time.Second != 0 {
				return fmt.Errorf("--ttl %s is not a whole number of seconds", ttl)
			}
			req.TTLSeconds = int64(ttl / time.Second)
			if req.ID == "" || req.Sender == "" || req.TotalAmount < 1 || req.Count < 1 {
				return errors.New("--id, --sender, a positive --total and a positive --count are required")
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), gf.timeout)
			defer cancel()
			s, err := flags.connect()
			if err != nil {
				return err
			}
			b, err := s.budget(ctx, args[0])
			if err != nil {
				return err
			}
			token, err := s.senderToken(ctx, b)
			if err != nil {
				return err
			}
			c, done, err := gf.packetsClient(ctx, s, b, streams.ErrOut)
			if err != nil {
				return err
			}
			defer done()
			p, err := c.Send(ctx, token, req)
			if err != nil {
				return fmt.Errorf("redpacketbudget %s/%s: %w", b.Namespace, b.Name, err)
			}
			return PrintPacket(streams.Out, p, time.Now())
		},
	}
	gf.register(cmd)
	fl := cmd.Flags()
	fl.StringVar(&req.ID, "id", "", "the packet's id, the caller's order id (required)")
	fl.StringVar(&req.Sender, "sender", "", "the account the packet is sent from and refunded to (required)")
	fl.Int64Var(&req.TotalAmount, "total", 0, "the packet's money in minor units (required)")
	fl.Int64Var(&req.Count, "count", 0, "how many shares (required)")
	fl.StringVar(&req.Distribution, "distribution", "", "Random, LineCut or Fixed, as the budget allows; default: the grab service's (Random)")
	fl.DurationVar(&ttl, "ttl", 0, "how long it may be grabbed, in whole seconds; default: the budget's defaultTTL")
	return cmd
}

// PrintBudgetMoney writes the budget's money as the operator reports it, and
// whether it adds up.
func PrintBudgetMoney(out io.Writer, b *budgetView) error {
	w := newTable(out)
	p := func(format string, args ...any) { fmt.Fprintf(w, format+"\n", args...) }
	p("Budget:\t%s/%s", b.Namespace, b.Name)
	p("Packets:\t%d live, %d created, %d expired", b.LivePackets, b.CreatedPackets, b.ExpiredPackets)
	p("")
	p("MONEY\tAMOUNT\t%s", b.Currency)
	for _, row := range []struct {
		name string
		v    int64
	}{{"total", b.Total}, {"available", b.Available}, {"in packets", b.InPackets}, {"claimed", b.Claimed}, {"refunded", b.Refunded}} {
		p("%s\t%d\t%s", row.name, row.v, FormatMajor(row.v, b.Currency))
	}
	sum := b.Available + b.InPackets + b.Claimed + b.Refunded
	verdict := VerdictOK
	if sum != b.Total {
		verdict = VerdictViolated
	}
	p("")
	p("Invariant:\t%s: available + in packets + claimed + refunded = %d + %d + %d + %d = %d, total %d",
		verdict, b.Available, b.InPackets, b.Claimed, b.Refunded, sum, b.Total)
	return w.Flush()
}

// PrintPackets writes live packets as a table.
func PrintPackets(out io.Writer, packets []PacketView, currency string, now time.Time) error {
	w := newTable(out)
	fmt.Fprintf(w, "ID\tSENDER\tSTATE\tTOTAL\tLEFT\tSHARES LEFT\tEXPIRES\n")
	var left int64
	for _, p := range packets {
		fmt.Fprintf(w, "%s\t%s\t%s\t%d\t%d\t%d/%d\t%s\n", p.ID, p.Sender, orNone(p.State), p.TotalAmount, p.RemainingAmount, p.RemainingCount, p.Count,
			expiresIn(p.ExpiresAt, now))
		left += p.RemainingAmount
	}
	if err := w.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(out, "%d live packets listed, %d (%s) left in them\n", len(packets), left, FormatMajor(left, currency))
	return err
}

// PrintPacket writes one packet and its detail list.
func PrintPacket(out io.Writer, p PacketView, now time.Time) error {
	w := newTable(out)
	f := func(format string, args ...any) { fmt.Fprintf(w, format+"\n", args...) }
	f("Packet:\t%s", p.ID)
	if p.Outcome != "" {
		f("Outcome:\t%s", p.Outcome)
	}
	f("Sender:\t%s", p.Sender)
	f("Distribution:\t%s", orNone(p.Distribution))
	f("Total:\t%d in %d shares (%s)", p.TotalAmount, p.Count, FormatMajor(p.TotalAmount, p.Currency))
	f("Left:\t%d in %d shares", p.RemainingAmount, p.RemainingCount)
	f("State:\t%s", packetStateLine(p, now))
	f("")
	f("SHARE\tUSER\tAMOUNT\tAT\t")
	var granted int64
	for _, g := range p.Grabs {
		mark := ""
		if g.BestLuck {
			mark = "best luck"
		}
		f("%d\t%s\t%d\t%s\t%s", g.Share, g.UserID, g.Amount, g.At, mark)
		granted += g.Amount
	}
	f("")
	f("Granted:\t%d in %d shares; granted + left = %d, total %d", granted, len(p.Grabs), granted+p.RemainingAmount, p.TotalAmount)
	return w.Flush()
}

// packetStateLine says where the packet is in its lifecycle, with its times and
// refund.
func packetStateLine(p PacketView, now time.Time) string {
	refund := func() string {
		if p.RefundAmount == nil {
			return ""
		}
		return fmt.Sprintf(", %d (%s) to refund", *p.RefundAmount, FormatMajor(*p.RefundAmount, p.Currency))
	}
	switch p.State {
	case grabapi.PacketExhausted:
		if p.ExhaustedAt != "" {
			return "exhausted at " + p.ExhaustedAt + ": every share grabbed"
		}
		return "exhausted: every share grabbed"
	case grabapi.PacketExpired:
		return "expired " + p.ExpiresAt + refund() + ", not yet moved by the operator's expiry"
	case grabapi.PacketRefunding:
		return "refunding" + refund() + " to the sender: settlement is delivering it"
	case grabapi.PacketRefunded:
		return "refunded at " + orNone(p.RefundedAt) + refund() + " (acknowledged by the balance system)"
	case grabapi.PacketLive:
		return "live, expires " + expiresIn(p.ExpiresAt, now)
	}
	if p.Expired {
		return "expired, the remainder refunded to the sender"
	}
	return "live, expires " + expiresIn(p.ExpiresAt, now)
}

// expiresIn is "in 5m (2026-01-01T00:00:00Z)" for an RFC 3339 time, or the text as
// it is when it does not parse.
func expiresIn(at string, now time.Time) string {
	t, err := time.Parse(time.RFC3339, at)
	if err != nil {
		return orNone(at)
	}
	if t.Before(now) {
		return "due (" + at + ")"
	}
	return "in " + age(now, t) + " (" + at + ")"
}
