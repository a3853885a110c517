package grabsvc

import (
	"fmt"
	"strings"
	"time"
	// The zone database is in the binary: a grab image carries no /usr/share/zoneinfo.
	_ "time/tzdata"
)

// SendWindows are the hours of the day, in one time zone, when a budget's packets
// may be created (spec.packets.sendWindows): WeChat Pay's merchant packets, for
// one, send no group packets from 0:00 to 8:00. Each window is "HH:MM-HH:MM", its
// start included and its end excluded, the end after the start ("24:00" is the end
// of the day); a window over midnight is written as two. The zero value allows
// every instant.
type SendWindows struct {
	loc *time.Location
	// spans are [start, end) in minutes of the local day, as written.
	spans [][2]int
	text  string
	// broken is why the windows could not be read (ClosedSendWindows).
	broken error
}

// ClosedSendWindows are windows that could not be read (err): they allow no
// instant, and a creation is answered 503 with err rather than 403, since no window
// will open until the spec is fixed.
func ClosedSendWindows(err error) SendWindows { return SendWindows{broken: err} }

// ParseSendWindows reads windows ("08:00-12:00") in the IANA time zone zone ("" is
// UTC). No windows allow every instant.
func ParseSendWindows(windows []string, zone string) (SendWindows, error) {
	if len(windows) == 0 {
		return SendWindows{}, nil
	}
	loc, err := time.LoadLocation(zone)
	if err != nil {
		return SendWindows{}, fmt.Errorf("send windows: time zone %q: %w", zone, err)
	}
	w := SendWindows{loc: loc}
	for _, s := range windows {
		from, to, ok := strings.Cut(s, "-")
		a, errA := minuteOfDay(from)
		b, errB := minuteOfDay(to)
		if !ok || errA != nil || errB != nil || a >= b || a == 24*60 {
			return SendWindows{}, fmt.Errorf("send window %q is not HH:MM-HH:MM with the start before the end (00:00 to 24:00)", s)
		}
		w.spans = append(w.spans, [2]int{a, b})
	}
	w.text = strings.Join(windows, ", ") + " " + loc.String()
	return w, nil
}

// minuteOfDay reads "HH:MM", 00:00 to 24:00.
func minuteOfDay(s string) (int, error) {
	var h, m int
	if len(s) != 5 || s[2] != ':' {
		return 0, fmt.Errorf("%q is not HH:MM", s)
	}
	if _, err := fmt.Sscanf(s, "%02d:%02d", &h, &m); err != nil || h > 24 || m > 59 || h == 24 && m != 0 {
		return 0, fmt.Errorf("%q is not HH:MM", s)
	}
	return h*60 + m, nil
}

// String is the windows as written, with their time zone.
func (w SendWindows) String() string { return w.text }

// Allows reports whether a packet may be created at t, and, when not, the next
// instant one may: the start of the next window in the zone's local time (a start
// that a daylight-saving jump skips opens at the first instant after it).
func (w SendWindows) Allows(t time.Time) (bool, time.Time) {
	if w.broken != nil {
		return false, time.Time{}
	}
	if len(w.spans) == 0 {
		return true, t
	}
	local := t.In(w.loc)
	day := time.Date(local.Year(), local.Month(), local.Day(), 0, 0, 0, 0, w.loc)
	for d := 0; d <= 1; d++ {
		midnight := day.AddDate(0, 0, d)
		next := time.Time{}
		for _, sp := range w.spans {
			start := wallClock(midnight, sp[0])
			end := wallClock(midnight, sp[1])
			if d == 0 && !t.Before(start) && t.Before(end) {
				return true, t
			}
			if start.After(t) && (next.IsZero() || start.Before(next)) {
				next = start
			}
		}
		if !next.IsZero() {
			return false, next
		}
	}
	return false, wallClock(day.AddDate(0, 0, 2), w.spans[0][0]) // not reached: every day has a window
}

// wallClock is minute m of the local day that starts at midnight (24:00 is the
// next midnight). A wall-clock time that a daylight-saving jump skips is the
// instant of the jump: the first instant at or after it on the local clock.
func wallClock(midnight time.Time, m int) time.Time {
	t := time.Date(midnight.Year(), midnight.Month(), midnight.Day(), m/60, m%60, 0, 0, midnight.Location())
	if got := t.Hour()*60 + t.Minute(); m < 24*60 && got != m {
		start, end := t.ZoneBounds()
		if got < m {
			return end
		}
		return start
	}
	return t
}
