package main

import (
	"fmt"
	"strconv"
	"strings"
)

// flagKind is how a manager flag is templated from its value.
type flagKind int

const (
	// stringFlag: --name=VALUE, left out when the value is empty.
	stringFlag flagKind = iota
	// intFlag: --name=N, left out when the value is null.
	intFlag
	// boolFlag: --name when true, left out when false.
	boolFlag
	// portFlag: --name=:PORT, always given; the same port names the container port.
	portFlag
	// grabImageFlag: --grab-image=VALUE, the operator's own image when the value is
	// empty.
	grabImageFlag
)

// managerFlag is one flag of the manager (cmd/manager/main.go) exposed as a chart value.
type managerFlag struct {
	flag string
	// path is the value's path in values.yaml, dot-separated.
	path string
	kind flagKind
}

// managerFlags are the manager's flags the chart sets from values, in the order the
// chart passes the ones config/manager does not set. A flag config/manager sets and
// this table does not know is passed as config/ has it; extraArgs come last, so they
// can add any flag and override any of these (the last occurrence of a flag wins).
var managerFlags = []managerFlag{
	{"leader-elect", "leaderElection", boolFlag},
	{"metrics-bind-address", "metrics.port", portFlag},
	{"health-probe-bind-address", "healthProbe.port", portFlag},
	{"redis-addresses", "redis.addresses", stringFlag},
	{"redis-mode", "redis.mode", stringFlag},
	{"redis-username", "redis.username", stringFlag},
	{"redis-tls", "redis.tls", boolFlag},
	{"grab-image", "grab.image", grabImageFlag},
	{"grab-replicas", "grab.replicas", intFlag},
	{"cleanup-grace-period", "cleanupGracePeriod", stringFlag},
	{"unsettled-retention", "unsettledRetention", stringFlag},
	{"grab-report-timeout", "grabReportTimeout", stringFlag},
	{"redis-timeout", "redisTimeout", stringFlag},
	{"active-resync-period", "activeResyncPeriod", stringFlag},
	{"max-concurrent-reconciles", "maxConcurrentReconciles", intFlag},
	{"redis-client-idle-timeout", "redisClientIdleTimeout", stringFlag},
	{"allowed-redis-hosts", "redis.allowedHosts", stringFlag},
	{"allow-grab-image-override", "grab.allowImageOverride", boolFlag},
}

// configArg is one argument of the manager container in config/manager.
type configArg struct {
	raw, flag, value string
	hasValue         bool
}

// parseConfigArgs splits the manager's arguments into flags and values. Every
// argument must be --flag or --flag=value, so that each can be templated on its own.
func parseConfigArgs(args []string) ([]configArg, error) {
	var out []configArg
	for _, a := range args {
		if !strings.HasPrefix(a, "-") {
			return nil, fmt.Errorf("manager argument %q is not a flag: write --flag=value in config/manager", a)
		}
		name, value, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		out = append(out, configArg{raw: a, flag: name, value: value, hasValue: hasValue})
	}
	return out, nil
}

// flagDefaults are the values.yaml defaults of managerFlags: what config/manager
// sets, and for a flag it leaves out the value that leaves it out of the chart's
// arguments too (so the manager's own default applies). operatorImage is the
// operator's image in config/, which the grab image defaults to.
func flagDefaults(args []configArg, operatorImage string) (map[string]any, error) {
	defaults := map[string]any{}
	byFlag := map[string]configArg{}
	for _, a := range args {
		byFlag[a.flag] = a
	}
	for _, f := range managerFlags {
		a, set := byFlag[f.flag]
		switch f.kind {
		case stringFlag:
			defaults[f.path] = a.value
		case grabImageFlag:
			if set && a.value != operatorImage {
				defaults[f.path] = a.value
			} else {
				defaults[f.path] = ""
			}
		case boolFlag:
			if set && a.hasValue {
				b, err := strconv.ParseBool(a.value)
				if err != nil {
					return nil, fmt.Errorf("--%s=%s in config/manager: %w", f.flag, a.value, err)
				}
				defaults[f.path] = b
			} else {
				defaults[f.path] = set
			}
		case intFlag:
			if !set {
				defaults[f.path] = nil
				continue
			}
			n, err := strconv.Atoi(a.value)
			if err != nil {
				return nil, fmt.Errorf("--%s=%s in config/manager: %w", f.flag, a.value, err)
			}
			defaults[f.path] = n
		case portFlag:
			if !set {
				return nil, fmt.Errorf("config/manager does not set --%s; the chart needs its port", f.flag)
			}
			host, port, ok := strings.Cut(a.value, ":")
			n, err := strconv.Atoi(port)
			if !ok || host != "" || err != nil || n < 1 || n > 65535 {
				return nil, fmt.Errorf("--%s=%s in config/manager: want :PORT", f.flag, a.value)
			}
			defaults[f.path] = n
		}
	}
	return defaults, nil
}

// argsTemplate is the manager container's args list as Helm template lines, each
// starting with indent: config/manager's arguments in their order, those this chart
// knows templated from values, the rest as they are; then the known flags
// config/manager leaves out, each only when its value is set; then extraArgs.
func argsTemplate(args []configArg, indent string) string {
	known := map[string]managerFlag{}
	for _, f := range managerFlags {
		known[f.flag] = f
	}
	var b strings.Builder
	line := func(s string) { b.WriteString(indent + s + "\n") }
	done := map[string]bool{}
	for _, a := range args {
		f, ok := known[a.flag]
		if !ok {
			line("- " + templateEscaper.Replace(yamlQuote(a.raw)))
			continue
		}
		done[f.flag] = true
		flagLines(f, line)
	}
	for _, f := range managerFlags {
		if !done[f.flag] {
			flagLines(f, line)
		}
	}
	line("{{- range .Values.extraArgs }}")
	line("- {{ . | quote }}")
	line("{{- end }}")
	return b.String()
}

func flagLines(f managerFlag, line func(string)) {
	v := ".Values." + f.path
	switch f.kind {
	case stringFlag:
		line("{{- with " + v + " }}")
		line(fmt.Sprintf(`- {{ printf "--%s=%%s" . | quote }}`, f.flag))
		line("{{- end }}")
	case intFlag:
		line(fmt.Sprintf(`{{- if not (kindIs "invalid" %s) }}`, v))
		line(fmt.Sprintf(`- {{ printf "--%s=%%d" (int64 %s) | quote }}`, f.flag, v))
		line("{{- end }}")
	case boolFlag:
		line("{{- if " + v + " }}")
		line(fmt.Sprintf(`- "--%s"`, f.flag))
		line("{{- end }}")
	case portFlag:
		line(fmt.Sprintf(`- {{ printf "--%s=:%%d" (int64 %s) | quote }}`, f.flag, v))
	case grabImageFlag:
		line(fmt.Sprintf(`- {{ printf "--%s=%%s" (default (include "redpacket-operator.image" .) %s) | quote }}`, f.flag, v))
	}
}

// yamlQuote is s as a YAML double-quoted scalar.
func yamlQuote(s string) string { return strconv.Quote(s) }
