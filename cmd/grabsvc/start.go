package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"

	"redpacket.io/operator/grabsvc"
)

// newLogger is the service's JSON logger at --log-level; every line names what the
// pod serves (key is "activity" or "budget", name its namespace/name).
func (o options) newLogger(stderr io.Writer, key, name string) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(o.logLevel)); err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	return slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: level})).With(key, name), nil
}

// front is the pod's HTTP side for either kind: the grab listener, its server and
// the optional pprof listener. Both kinds serve and drain it the same way.
type front struct {
	ln        net.Listener
	hs        *http.Server
	stopPprof func()
}

// openFront listens on --listen for h and starts pprof when --pprof-listen asks for
// it; msg and attrs are the "listening" log line. On error nothing stays open.
func (o options) openFront(h http.Handler, log *slog.Logger, msg string, attrs ...any) (*front, error) {
	ln, err := net.Listen("tcp", o.listen)
	if err != nil {
		return nil, fmt.Errorf("listening on %s: %w", o.listen, err)
	}
	hs := grabsvc.NewHTTPServer(o.listen, h)
	hs.ErrorLog = slog.NewLogLogger(log.Handler(), slog.LevelWarn)
	log.Info(msg, append([]any{"addr", ln.Addr().String()}, attrs...)...)

	stopPprof, err := servePprof(o.pprofListen, log)
	if err != nil {
		_ = ln.Close()
		return nil, err
	}
	return &front{ln: ln, hs: hs, stopPprof: stopPprof}, nil
}

// serve answers until ctx is done, then drains s (grabsvc.Serve). pprof stays up
// until stopPprof, which the caller defers.
func (f *front) serve(ctx context.Context, s grabsvc.Drainer, o options) error {
	return grabsvc.Serve(ctx, f.hs, f.ln, s, o.shutdownDelay, o.shutdownTimeout)
}
