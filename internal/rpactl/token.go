package rpactl

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/apimachinery/pkg/types"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/pkg/hmackey"
	"redpacket.io/operator/settlement"
)

// Bounds of --ttl: a token is a bearer credential for grabbing in the user's name,
// and grab services refuse one whose exp lies further ahead than their
// --token-max-lifetime (grabsvc.DefaultTokenMaxLifetime unless set otherwise).
const (
	DefaultTokenTTL = time.Hour
	MaxTokenTTL     = grabsvc.DefaultTokenMaxLifetime
)

func newTokenCommand(flags *kubeFlags, streams Streams) *cobra.Command {
	var ttl time.Duration
	var packet string
	cmd := &cobra.Command{
		Use:   "token NAME|rpb/BUDGET USER",
		Short: "Mint a grab token for USER with the activity's or the budget's HMAC key",
		Long: `Mint the bearer token that lets USER grab in the activity NAME, or grab the runtime
packets of the budget rpb/BUDGET (all of them, or with --packet the one packet ID),
signed with the key in the Secret named by spec.grabService.auth.tokenSecretRef (key
"key"), in the grab service's token format (docs/grab-api.md#tokens). It prints the
token alone, for
  curl -H "Authorization: Bearer $(kubectl rpa token NAME USER)" ...
Reading the Secret needs "get" on secrets in the namespace.`,
		Example: `  kubectl rpa token quiz-night u-1001
  kubectl rpa token quiz-night u-1001 --ttl 10m
  kubectl rpa token rpb/group-packets u-1001
  kubectl rpa token rpb/group-packets u-1001 --packet order-42`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if ttl <= 0 || ttl > MaxTokenTTL {
				return fmt.Errorf("--ttl %s is outside (0, %s]", ttl, MaxTokenTTL)
			}
			if msg := grabsvc.CheckUserID(args[1]); msg != "" {
				return fmt.Errorf("USER: %s", msg)
			}
			budgetName, isBudget := budgetArg(args[0])
			if packet != "" {
				if !isBudget {
					return fmt.Errorf("--packet names a runtime packet of a budget; %q is an activity (name a budget as rpb/NAME)", args[0])
				}
				if msg := grabsvc.CheckPacketID(packet); msg != "" {
					return fmt.Errorf("--packet %q: the packet id %s", packet, msg)
				}
			}
			s, err := flags.connect()
			if err != nil {
				return err
			}
			exp := time.Now().Add(ttl)
			var tok string
			if isBudget {
				b, err := s.budget(cmd.Context(), budgetName)
				if err != nil {
					return err
				}
				key, err := s.tokenKey(cmd.Context(), "redpacketbudget "+b.Namespace+"/"+b.Name, b.TokenSecret)
				if err != nil {
					return err
				}
				tok, err = mintBudgetToken(key, b, packet, args[1], exp)
				if err != nil {
					return err
				}
			} else {
				a, err := s.activity(cmd.Context(), args[0])
				if err != nil {
					return err
				}
				key, err := s.activityTokenKey(cmd.Context(), a)
				if err != nil {
					return err
				}
				if tok, err = mintToken(key, a, args[1], exp); err != nil {
					return err
				}
			}
			_, err = fmt.Fprintln(streams.Out, tok)
			return err
		},
	}
	cmd.Flags().DurationVar(&ttl, "ttl", DefaultTokenTTL, "how long the token is valid; at most "+MaxTokenTTL.String()+", the grab service's default --token-max-lifetime")
	cmd.Flags().StringVar(&packet, "packet", "", "with rpb/BUDGET: bind the token to this one packet id; empty: good for every packet of the budget")
	return cmd
}

// mintToken signs the token of user for activity a, valid until exp, with the grab
// service's own signer and audience (the activity's namespace/name and UID).
func mintToken(key []byte, a *redpacketv1alpha1.RedPacketActivity, user string, exp time.Time) (string, error) {
	aud := grabsvc.AudienceOf(grabsvc.NewResource(a))
	tok, err := grabsvc.SignToken(key, grabsvc.TokenClaims{UserID: user, Activity: aud.Activity, ActivityUID: aud.UID, Exp: exp.Unix()})
	if err != nil {
		return "", fmt.Errorf("signing the token of %s for %s: %w", user, aud.Activity, err)
	}
	return tok, nil
}

// mintBudgetToken signs the token of user for the runtime packets of budget b (its
// namespace/name and UID, which the budget's grab fleet checks), narrowed to the one
// packet when packet is not empty, valid until exp.
func mintBudgetToken(key []byte, b *budgetView, packet, user string, exp time.Time) (string, error) {
	claims := grabsvc.TokenClaims{UserID: user, Budget: b.Namespace + "/" + b.Name, BudgetUID: types.UID(b.UID),
		Packet: packet, Exp: exp.Unix()}
	tok, err := grabsvc.SignToken(key, claims)
	if err != nil {
		return "", fmt.Errorf("signing the token of %s for budget %s: %w", user, claims.Budget, err)
	}
	return tok, nil
}

// errNoAuth says that an activity or a budget takes no tokens.
var errNoAuth = errors.New("spec.grabService.auth is not set: its grab service takes no tokens")

// tokenKey reads the HMAC key of user tokens from secret, the Secret that
// spec.grabService.auth.tokenSecretRef of owner names ("" when auth is not set),
// parsed as the grab pods parse the mounted key file (hmackey.Parse: trailing
// line breaks are not part of the key).
func (s *session) tokenKey(ctx context.Context, owner, secret string) ([]byte, error) {
	if secret == "" {
		return nil, fmt.Errorf("%s: %w", owner, errNoAuth)
	}
	sec, err := s.secret(ctx, secret, "spec.grabService.auth.tokenSecretRef")
	if err != nil {
		return nil, err
	}
	raw, ok := sec.Data[settlement.SecretKey]
	if !ok {
		return nil, fmt.Errorf("secret %s/%s has no %q key", s.namespace, secret, settlement.SecretKey)
	}
	key, err := hmackey.Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("secret %s/%s, key %q: %w", s.namespace, secret, settlement.SecretKey, err)
	}
	return key, nil
}

// activityTokenKey reads the HMAC key of the activity's user tokens (tokenKey).
func (s *session) activityTokenKey(ctx context.Context, a *redpacketv1alpha1.RedPacketActivity) ([]byte, error) {
	var secret string
	if a.Spec.GrabService.Auth != nil {
		secret = a.Spec.GrabService.Auth.TokenSecretRef.Name
	}
	return s.tokenKey(ctx, "redpacketactivity "+a.Namespace+"/"+a.Name, secret)
}
