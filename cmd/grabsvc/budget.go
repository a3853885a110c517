package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/types"

	"redpacket.io/operator/grabsvc"
	"redpacket.io/operator/store/redisconn"
)

// runBudget is budget mode (--budget): one pod of the budget's shared grab fleet,
// serving its runtime packets. It reads nothing from the API server: the budget's
// identity, shards and credentials come from the command line and mounted files,
// and the operator reports the budget's status. It returns when ctx is done and
// everything stopped.
func runBudget(ctx context.Context, o options, stderr io.Writer) error {
	log, err := o.newLogger(stderr, "budget", o.namespace+"/"+o.budget)
	if err != nil {
		return err
	}

	senderToken, err := grabsvc.ReadKeyFile(o.senderTokenFile)
	if err != nil {
		return fmt.Errorf("--sender-token-file: %w", err)
	}
	sender, err := grabsvc.NewSenderCredential(senderToken)
	if err != nil {
		return fmt.Errorf("--sender-token-file: %w", err)
	}
	tokens, err := o.tokenVerifier()
	if err != nil {
		return err
	}
	if tokens == nil {
		log.Warn("no --token-key-file: grabs of the budget's packets carry no user token")
	}

	var windows grabsvc.SendWindows
	if o.sendWindows != "" {
		// An unreadable window or zone stops creations, not the pod: grabs of the
		// packets already sent go on, and every creation answers 503 saying why.
		if windows, err = grabsvc.ParseSendWindows(strings.Split(o.sendWindows, ","), o.sendTimeZone); err != nil {
			log.Error("the budget's send windows cannot be read: no packet is created until they are fixed", "err", err)
			windows = grabsvc.ClosedSendWindows(err)
		}
	}

	// The daily quotas count the day in the budget's zone. An unreadable zone
	// counts UTC days rather than stop grabs and creations; the log says so.
	zone, zerr := time.LoadLocation(o.sendTimeZone)
	if zerr != nil {
		log.Error("the budget's time zone cannot be read: the daily quotas count days in UTC", "err", zerr)
		zone = time.UTC
	}

	rc, err := o.redis.NewPipelinedClient(redisconn.GrabClientOptions(o.redisTimeout))
	if err != nil {
		return err
	}
	defer func() { _ = rc.Close() }()

	reg := prometheus.NewRegistry()
	srv, err := grabsvc.NewPacketServer(grabsvc.PacketConfig{
		Budget: grabsvc.Budget{Namespace: o.namespace, Name: o.budget, UID: types.UID(o.budgetUID),
			Shards: o.budgetShards},
		Redis:         rc.Pipeliner,
		Ping:          rc.Client,
		Sender:        sender,
		Tokens:        tokens,
		UserLimiter:   grabsvc.NewKeyedLimiter(o.ratePerUser, o.burstPerUser, o.limitEntries),
		ClientLimiter: grabsvc.NewKeyedLimiter(o.ratePerClient, o.burstPerClient, o.limitEntries),
		RedisTimeout:  o.redisTimeout,
		Metrics:       grabsvc.NewPacketMetrics(reg),
		Gatherer:      reg,
		Log:           log,
		Page:          o.page,
		SendWindows:   windows,
		ClaimSecret:   o.claimSecret,
		Quotas:        o.quotas,
		TimeZone:      zone,
		OneServer:     o.redis.Mode == redisconn.ModeStandalone,
	})
	if err != nil {
		return err
	}

	fr, err := o.openFront(srv.Handler(), log, "budget grab service listening", "shards", o.budgetShards,
		"auth", tokens != nil, "page", o.page)
	if err != nil {
		return err
	}
	defer fr.stopPprof()

	// Rotated Secrets are mounted in place: re-read both credentials periodically.
	bg, stopBG := context.WithCancel(context.WithoutCancel(ctx))
	defer stopBG()
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(o.refreshInterval)
		defer t.Stop()
		for {
			select {
			case <-bg.Done():
				return
			case <-t.C:
			}
			reloadTokenKey(tokens, o.tokenKeyFile, log)
			reloadSenderToken(sender, o.senderTokenFile, log)
		}
	})

	serveErr := fr.serve(ctx, srv, o)
	log.Info("http server stopped")
	stopBG()
	wg.Wait()
	return serveErr
}

// reloadSenderToken picks up a rotated sender credential.
func reloadSenderToken(c *grabsvc.SenderCredential, path string, log *slog.Logger) {
	token, err := grabsvc.ReadKeyFile(path)
	if err != nil {
		log.Warn("re-reading the sender credential failed; keeping the current one", "err", err)
		return
	}
	_ = c.Set(token)
}
