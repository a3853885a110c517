// Package rpactl is the kubectl-rpa plugin: kubectl subcommands for RedPacketActivity
// resources. `kubectl rpa status` prints an activity's money table and checks its
// conservation invariant, `pause` and `resume` patch spec.paused, `token` mints a
// user token with the activity's HMAC key, `replay-dead-letters` moves parked
// settlement entries back into the stream (of an activity, or of a budget named
// rpb/NAME), and `rain` runs a bounded rehearsal load against the activity's grab
// service. For a RedPacketBudget, `packets` lists its live packets and money,
// `packet` shows one with who got what, and `send` creates one with the sender
// credential, through the budget's grab Service.
//
// It reads the user's kubeconfig the way kubectl does ($KUBECONFIG, ~/.kube/config,
// --kubeconfig, --context, -n/--namespace) and prints tables in kubectl's style.
// cmd/kubectl-rpa is its main package.
package rpactl

import (
	"context"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/internal/version"
)

// BinaryName is the plugin's file name; kubectl runs it for `kubectl rpa`.
const BinaryName = "kubectl-rpa"

// resourceName is how kubectl names the kind in its messages, such as
// "redpacketactivity.redpacket.io/quiz-night patched".
var resourceName = "redpacketactivity." + redpacketv1alpha1.GroupVersion.Group

// Streams are where a command reads and writes.
type Streams struct {
	In          io.Reader
	Out, ErrOut io.Writer
}

// kubeFlags are the kubeconfig flags every subcommand takes, as kubectl names them.
type kubeFlags struct {
	kubeconfig, context, namespace string
}

// session is a subcommand's connection to the API server.
type session struct {
	config    *rest.Config
	client    client.Client
	namespace string
}

// connect loads the kubeconfig (the --kubeconfig file, else $KUBECONFIG, else
// ~/.kube/config; the --context or the current context) and returns a client and the
// namespace to work in (-n, else the context's namespace, else "default").
func (f *kubeFlags) connect() (*session, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = f.kubeconfig
	overrides := &clientcmd.ConfigOverrides{CurrentContext: f.context}
	overrides.Context.Namespace = f.namespace
	loader := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, overrides)
	cfg, err := loader.ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("loading the kubeconfig: %w", err)
	}
	ns, _, err := loader.Namespace()
	if err != nil {
		return nil, fmt.Errorf("finding the namespace in the kubeconfig: %w", err)
	}
	cfg = rest.CopyConfig(cfg)
	cfg.UserAgent = BinaryName + "/" + version.Version()
	c, err := client.New(cfg, client.Options{Scheme: newScheme()})
	if err != nil {
		return nil, fmt.Errorf("creating the API client: %w", err)
	}
	return &session{config: cfg, client: c, namespace: ns}, nil
}

func newScheme() *runtime.Scheme {
	s := runtime.NewScheme()
	if err := corev1.AddToScheme(s); err != nil {
		panic(err)
	}
	if err := redpacketv1alpha1.AddToScheme(s); err != nil {
		panic(err)
	}
	return s
}

// activity reads the named activity in the session's namespace, saying which one was
// missing when it is.
func (s *session) activity(ctx context.Context, name string) (*redpacketv1alpha1.RedPacketActivity, error) {
	a := &redpacketv1alpha1.RedPacketActivity{}
	if err := s.client.Get(ctx, client.ObjectKey{Namespace: s.namespace, Name: name}, a); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("redpacketactivity %q not found in namespace %q", name, s.namespace)
		}
		return nil, fmt.Errorf("reading redpacketactivity %s/%s: %w", s.namespace, name, err)
	}
	return a, nil
}

// secret reads a Secret of the session's namespace.
func (s *session) secret(ctx context.Context, name, what string) (*corev1.Secret, error) {
	sec := &corev1.Secret{}
	if err := s.client.Get(ctx, client.ObjectKey{Namespace: s.namespace, Name: name}, sec); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("secret %q (%s) not found in namespace %q", name, what, s.namespace)
		}
		return nil, fmt.Errorf("reading secret %s/%s (%s): %w", s.namespace, name, what, err)
	}
	return sec, nil
}

// NewCommand returns the kubectl-rpa command with its subcommands, writing to
// streams. Run it with ExecuteContext.
func NewCommand(streams Streams) *cobra.Command {
	flags := &kubeFlags{}
	root := &cobra.Command{
		Use: BinaryName,
		// Usage lines and help name the command as people type it under kubectl.
		Annotations: map[string]string{cobra.CommandDisplayNameAnnotation: "kubectl rpa"},
		Short:       "Inspect and operate red-packet activities (RedPacketActivity)",
		Long: `kubectl rpa inspects and operates red-packet activities (RedPacketActivity).

It uses your kubeconfig like kubectl does: $KUBECONFIG or ~/.kube/config, with
--kubeconfig, --context and -n/--namespace.`,
		Version:       version.Version(),
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.CompletionOptions.DisableDefaultCmd = true
	root.SetIn(streams.In)
	root.SetOut(streams.Out)
	root.SetErr(streams.ErrOut)
	root.SetVersionTemplate(version.String(BinaryName) + "\n")
	pf := root.PersistentFlags()
	pf.StringVar(&flags.kubeconfig, "kubeconfig", "", "path to the kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
	pf.StringVar(&flags.context, "context", "", "the kubeconfig context to use")
	pf.StringVarP(&flags.namespace, "namespace", "n", "", "the namespace of the activity (default: the context's namespace)")

	root.AddCommand(
		newStatusCommand(flags, streams),
		newPauseCommand(flags, streams, true),
		newPauseCommand(flags, streams, false),
		newTokenCommand(flags, streams),
		newReplayCommand(flags, streams),
		newRainCommand(flags, streams),
		newPacketsCommand(flags, streams),
		newPacketCommand(flags, streams),
		newSendCommand(flags, streams),
		&cobra.Command{
			Use:   "version",
			Short: "Print the plugin's version",
			Args:  cobra.NoArgs,
			RunE: func(cmd *cobra.Command, _ []string) error {
				_, err := fmt.Fprintln(streams.Out, version.String(BinaryName))
				return err
			},
		},
	)
	return root
}

// newTable returns a writer that aligns tab-separated columns as kubectl's tables do.
// Flush it when done.
func newTable(out io.Writer) *tabwriter.Writer {
	return tabwriter.NewWriter(out, 6, 4, 3, ' ', 0)
}
