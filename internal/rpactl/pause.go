package rpactl

import (
	"context"
	"fmt"

	"github.com/spf13/cobra"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// newPauseCommand returns `pause` (pause true) or `resume` (pause false).
func newPauseCommand(flags *kubeFlags, streams Streams, pause bool) *cobra.Command {
	use, short, done := "resume NAME", "Open grabbing again (spec.paused: false)", "resumed"
	if pause {
		use, short, done = "pause NAME", "Stop grabbing without losing anything (spec.paused: true)", "paused"
	}
	return &cobra.Command{
		Use:   use,
		Short: short,
		Long: short + `.

The controller applies the change to Redis at its next reconcile; grabs then answer
"paused" (HTTP 409) until the activity is resumed. Wait for it with
  kubectl wait --for=jsonpath='{.status.phase}'=Paused rpa/NAME`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := flags.connect()
			if err != nil {
				return err
			}
			changed, err := s.setPaused(cmd.Context(), args[0], pause)
			if err != nil {
				return err
			}
			if !changed {
				done = "unchanged (already " + done + ")"
			}
			_, err = fmt.Fprintf(streams.Out, "%s/%s %s\n", resourceName, args[0], done)
			return err
		},
	}
}

// setPaused sets spec.paused of the named activity with a JSON merge patch and
// reports whether it changed. The activity must exist: the patch never creates one.
func (s *session) setPaused(ctx context.Context, name string, paused bool) (bool, error) {
	a, err := s.activity(ctx, name)
	if err != nil {
		return false, err
	}
	if a.Spec.Paused == paused {
		return false, nil
	}
	patch := client.RawPatch(types.MergePatchType, fmt.Appendf(nil, `{"spec":{"paused":%t}}`, paused))
	if err := s.client.Patch(ctx, a, patch); err != nil {
		return false, fmt.Errorf("patching spec.paused of redpacketactivity %s/%s: %w", s.namespace, name, err)
	}
	return true, nil
}
