package rpactl

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	redpacketv1alpha1 "redpacket.io/operator/api/v1alpha1"
	"redpacket.io/operator/grabsvc"
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
	cmd := &cobra.Command{
		Use:   "token NAME USER",
		Short: "Mint a grab token for USER with the activity's HMAC key",
		Long: `Mint the bearer token that lets USER grab in the activity NAME, signed with the key
in the Secret named by spec.grabService.auth.tokenSecretRef (key "key"), in the grab
service's token format (docs/grab-api.md#tokens). It prints the token alone, for
  curl -H "Authorization: Bearer $(kubectl rpa token NAME USER)" ...
Reading the Secret needs "get" on secrets in the namespace.`,
		Example: `  kubectl rpa token quiz-night u-1001
  kubectl rpa token quiz-night u-1001 --ttl 10m`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if ttl <= 0 || ttl > MaxTokenTTL {
				return fmt.Errorf("--ttl %s is outside (0, %s]", ttl, MaxTokenTTL)
			}
			if msg := grabsvc.CheckUserID(args[1]); msg != "" {
				return fmt.Errorf("USER: %s", msg)
			}
			s, err := flags.connect()
			if err != nil {
				return err
			}
			a, err := s.activity(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			key, err := s.tokenKey(cmd.Context(), a)
			if err != nil {
				return err
			}
			tok, err := mintToken(key, a, args[1], time.Now().Add(ttl))
			if err != nil {
				return err
			}
			_, err = fmt.Fprintln(streams.Out, tok)
			return err
		},
	}
	cmd.Flags().DurationVar(&ttl, "ttl", DefaultTokenTTL, "how long the token is valid; at most "+MaxTokenTTL.String()+", the grab service's default --token-max-lifetime")
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

// errNoAuth says that an activity takes no tokens.
var errNoAuth = errors.New("spec.grabService.auth is not set: its grab service takes no tokens")

// tokenKey reads the HMAC key of an activity's user tokens from the Secret named by
// spec.grabService.auth.tokenSecretRef, parsed as the grab pods parse the mounted
// key file (settlement.ParseKey: trailing line breaks are not part of the key).
func (s *session) tokenKey(ctx context.Context, a *redpacketv1alpha1.RedPacketActivity) ([]byte, error) {
	if a.Spec.GrabService.Auth == nil || a.Spec.GrabService.Auth.TokenSecretRef.Name == "" {
		return nil, fmt.Errorf("redpacketactivity %s/%s: %w", a.Namespace, a.Name, errNoAuth)
	}
	name := a.Spec.GrabService.Auth.TokenSecretRef.Name
	sec, err := s.secret(ctx, name, "spec.grabService.auth.tokenSecretRef")
	if err != nil {
		return nil, err
	}
	raw, ok := sec.Data[settlement.SecretKey]
	if !ok {
		return nil, fmt.Errorf("secret %s/%s has no %q key", s.namespace, name, settlement.SecretKey)
	}
	key, err := settlement.ParseKey(raw)
	if err != nil {
		return nil, fmt.Errorf("secret %s/%s, key %q: %w", s.namespace, name, settlement.SecretKey, err)
	}
	return key, nil
}
