package cluster

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// trackedSysctls are the kernel settings that the kubelet, kube-proxy and the CNI
// bridge plugin are known to change. They are recorded before the node starts and put
// back when it stops.
var trackedSysctls = []string{
	"vm.overcommit_memory",
	"vm.panic_on_oom",
	"kernel.panic",
	"kernel.panic_on_oops",
	"kernel.keys.root_maxkeys",
	"kernel.keys.root_maxbytes",
	"net.ipv4.ip_forward",
	"net.ipv4.conf.all.forwarding",
	"net.ipv4.conf.all.route_localnet",
	"net.ipv4.conf.default.forwarding",
	"net.ipv6.conf.all.forwarding",
	"net.bridge.bridge-nf-call-iptables",
	"net.bridge.bridge-nf-call-ip6tables",
	"net.netfilter.nf_conntrack_max",
	"net.netfilter.nf_conntrack_tcp_timeout_established",
	"net.netfilter.nf_conntrack_tcp_timeout_close_wait",
	"net.netfilter.nf_conntrack_tcp_be_liberal",
}

// hostPaths are the paths outside the node's own folder that the kubelet and
// containerd use whatever they are told. Those that did not exist before the node
// started are removed when it stops.
var hostPaths = []string{
	"/var/lib/kubelet",
	"/var/log/containers",
	"/var/log/pods",
	"/var/lib/cni",
	"/opt/containerd",
	"/run/containerd",
	"/var/run/netns",
	"/run/netns",
	"/etc/cni",
}

// HostState is what a node changes on the host, read at one moment: settings, links,
// addresses, firewall rules, mounts, network namespaces, cgroups and paths. Two
// states taken before a node started and after it stopped must be equal.
type HostState struct {
	Sysctls   map[string]string
	Links     []string
	LoAddrs   []string
	IPTables  map[string][]string // "ipv4"/"ipv6" → rules and chains, without counters
	NFTables  []string
	Mounts    []string
	NetNS     []string
	Cgroups   []string // top-level folders of each cgroup hierarchy
	Paths     map[string]bool
	Processes []string // processes of a node (their command line names a node folder)
}

// ReadHostState reads the host's state now.
func ReadHostState() HostState {
	st := HostState{Sysctls: map[string]string{}, IPTables: map[string][]string{}, Paths: map[string]bool{}}
	for _, k := range trackedSysctls {
		if v, err := readSysctl(k); err == nil {
			st.Sysctls[k] = v
		}
	}
	st.Links = linkNames()
	st.LoAddrs = loAddresses()
	st.IPTables["ipv4"] = iptablesRules("iptables-save")
	st.IPTables["ipv6"] = iptablesRules("ip6tables-save")
	st.NFTables = nftTables()
	st.Mounts = mountPoints()
	st.NetNS = netnsEntries()
	st.Cgroups = cgroupTops()
	for _, p := range hostPaths {
		_, err := os.Lstat(p)
		st.Paths[p] = err == nil
	}
	st.Processes = nodeProcesses()
	return st
}

// Diff lists what differs between two states, one line each; none means equal.
func (st HostState) Diff(after HostState) []string {
	var out []string
	for _, k := range trackedSysctls {
		if st.Sysctls[k] != after.Sysctls[k] {
			out = append(out, fmt.Sprintf("sysctl %s: %q before, %q after", k, st.Sysctls[k], after.Sysctls[k]))
		}
	}
	out = append(out, listDiff("link", st.Links, after.Links)...)
	out = append(out, listDiff("address on lo", st.LoAddrs, after.LoAddrs)...)
	for _, fam := range []string{"ipv4", "ipv6"} {
		out = append(out, listDiff(fam+" firewall rule", st.IPTables[fam], after.IPTables[fam])...)
	}
	out = append(out, listDiff("nftables table", st.NFTables, after.NFTables)...)
	out = append(out, listDiff("mount", st.Mounts, after.Mounts)...)
	out = append(out, listDiff("network namespace", st.NetNS, after.NetNS)...)
	out = append(out, listDiff("cgroup", st.Cgroups, after.Cgroups)...)
	for _, p := range hostPaths {
		if st.Paths[p] != after.Paths[p] {
			out = append(out, fmt.Sprintf("path %s: exists %v before, %v after", p, st.Paths[p], after.Paths[p]))
		}
	}
	out = append(out, listDiff("node process", st.Processes, after.Processes)...)
	return out
}

func listDiff(what string, before, after []string) []string {
	var out []string
	for _, a := range after {
		if !slices.Contains(before, a) {
			out = append(out, fmt.Sprintf("%s added: %s", what, a))
		}
	}
	for _, b := range before {
		if !slices.Contains(after, b) {
			out = append(out, fmt.Sprintf("%s removed: %s", what, b))
		}
	}
	return out
}

func sysctlPath(key string) string {
	return filepath.Join("/proc/sys", strings.ReplaceAll(key, ".", "/"))
}

func readSysctl(key string) (string, error) {
	b, err := os.ReadFile(sysctlPath(key))
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(b)), nil
}

func writeSysctl(key, value string) error {
	return os.WriteFile(sysctlPath(key), []byte(value+"\n"), 0o644)
}

func linkNames() []string {
	out, err := exec.Command("ip", "-o", "link", "show").Output()
	if err != nil {
		return nil
	}
	var names []string
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		name := strings.TrimSuffix(f[1], ":")
		if i := strings.IndexByte(name, '@'); i >= 0 {
			name = name[:i]
		}
		names = append(names, name)
	}
	sort.Strings(names)
	return names
}

func loAddresses() []string {
	out, err := exec.Command("ip", "-o", "addr", "show", "dev", "lo").Output()
	if err != nil {
		return nil
	}
	var addrs []string
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		for i := 0; i+1 < len(f); i++ {
			if f[i] == "inet" || f[i] == "inet6" {
				addrs = append(addrs, f[i+1])
			}
		}
	}
	sort.Strings(addrs)
	return addrs
}

// iptablesRules reads the rules and chains of every table, as "table rule" lines
// without packet counters.
func iptablesRules(save string) []string {
	out, err := exec.Command(save).Output()
	if err != nil {
		return nil
	}
	var rules []string
	table := ""
	for _, line := range strings.Split(string(out), "\n") {
		switch {
		case line == "" || strings.HasPrefix(line, "#") || line == "COMMIT":
		case strings.HasPrefix(line, "*"):
			table = line[1:]
		case strings.HasPrefix(line, ":"):
			// ":CHAIN POLICY [counters]"
			f := strings.Fields(line)
			rules = append(rules, table+" "+f[0]+" "+f[1])
		default:
			rules = append(rules, table+" "+line)
		}
	}
	sort.Strings(rules)
	return rules
}

func nftTables() []string {
	out, err := exec.Command("nft", "list", "tables").Output()
	if err != nil {
		return nil
	}
	var tables []string
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if line = strings.TrimSpace(line); line != "" {
			tables = append(tables, line)
		}
	}
	sort.Strings(tables)
	return tables
}

// mountPoints lists the mount points of this mount namespace.
func mountPoints() []string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	defer f.Close()
	var points []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 {
			points = append(points, unescapeMount(fields[4]))
		}
	}
	sort.Strings(points)
	return points
}

func unescapeMount(s string) string {
	return strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`).Replace(s)
}

func netnsEntries() []string {
	var names []string
	for _, dir := range []string{"/run/netns", "/var/run/netns"} {
		entries, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		for _, e := range entries {
			names = append(names, filepath.Join(dir, e.Name()))
		}
	}
	sort.Strings(names)
	return slices.Compact(names)
}

// cgroupRoots are the mount points of the cgroup hierarchies (v1 controllers or the
// v2 unified one).
func cgroupRoots() []string {
	var roots []string
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for sc.Scan() {
		line := sc.Text()
		i := strings.Index(line, " - ")
		if i < 0 {
			continue
		}
		fsType := strings.Fields(line[i+3:])[0]
		if fsType == "cgroup" || fsType == "cgroup2" {
			roots = append(roots, unescapeMount(strings.Fields(line)[4]))
		}
	}
	return roots
}

func cgroupTops() []string {
	var tops []string
	for _, root := range cgroupRoots() {
		entries, err := os.ReadDir(root)
		if err != nil {
			continue
		}
		for _, e := range entries {
			if e.IsDir() {
				tops = append(tops, filepath.Join(root, e.Name()))
			}
		}
	}
	sort.Strings(tops)
	return tops
}

// nodeDirPrefix starts the name of every node's temporary folder; each node process
// names its folder on its command line.
const nodeDirPrefix = "rpnode-"

// nodeProcesses lists the running processes of any node, as "pid name" lines: those
// whose command line names a node folder (components, containerd and its shims).
// Other processes of the same names, such as the API servers of envtest, are not a
// node's.
func nodeProcesses() []string {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range entries {
		pid := e.Name()
		if pid[0] < '0' || pid[0] > '9' {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", pid, "cmdline"))
		if err != nil || !strings.Contains(string(cmdline), "/"+nodeDirPrefix) {
			continue
		}
		comm, _ := os.ReadFile(filepath.Join("/proc", pid, "comm"))
		out = append(out, pid+" "+strings.TrimSpace(string(comm)))
	}
	sort.Strings(out)
	return out
}

// processesMatching returns the pids whose command line contains every one of words.
func processesMatching(words ...string) []int {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var pids []int
	for _, e := range entries {
		var pid int
		if _, err := fmt.Sscanf(e.Name(), "%d", &pid); err != nil || pid == os.Getpid() {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		cmdline := strings.ReplaceAll(string(b), "\x00", " ")
		all := true
		for _, w := range words {
			if !strings.Contains(cmdline, w) {
				all = false
				break
			}
		}
		if all {
			pids = append(pids, pid)
		}
	}
	return pids
}

// restoreHost undoes what the node changed on the host, comparing with before: it
// unmounts what was mounted, deletes the network namespaces, links, firewall rules,
// chains and nftables tables that were added, removes the cgroups and host paths
// that were created, and writes back every tracked sysctl. Each step runs whatever
// the others did; the errors are joined.
func restoreHost(before HostState) []error {
	var errs []error
	note := func(err error) {
		if err != nil {
			errs = append(errs, err)
		}
	}
	// Mounts, deepest first.
	now := mountPoints()
	slices.Reverse(now)
	for _, m := range now {
		if !slices.Contains(before.Mounts, m) {
			if err := unix.Unmount(m, unix.MNT_DETACH); err != nil && err != unix.EINVAL && err != unix.ENOENT {
				note(fmt.Errorf("unmounting %s: %w", m, err))
			}
		}
	}
	for _, ns := range netnsEntries() {
		if !slices.Contains(before.NetNS, ns) {
			_ = unix.Unmount(ns, unix.MNT_DETACH)
			if err := os.Remove(ns); err != nil && !os.IsNotExist(err) {
				note(fmt.Errorf("removing network namespace %s: %w", ns, err))
			}
		}
	}
	for _, l := range linkNames() {
		if !slices.Contains(before.Links, l) {
			if out, err := exec.Command("ip", "link", "delete", l).CombinedOutput(); err != nil && !strings.Contains(string(out), "Cannot find") {
				note(fmt.Errorf("deleting link %s: %v: %s", l, err, out))
			}
		}
	}
	for _, a := range loAddresses() {
		if !slices.Contains(before.LoAddrs, a) {
			if out, err := exec.Command("ip", "addr", "del", a, "dev", "lo").CombinedOutput(); err != nil {
				note(fmt.Errorf("removing %s from lo: %v: %s", a, err, out))
			}
		}
	}
	note(restoreIPTables("iptables", before.IPTables["ipv4"]))
	note(restoreIPTables("ip6tables", before.IPTables["ipv6"]))
	for _, t := range nftTables() {
		if !slices.Contains(before.NFTables, t) {
			// "table ip kube-proxy" → nft delete table ip kube-proxy
			args := append([]string{"delete"}, strings.Fields(t)...)
			if out, err := exec.Command("nft", args...).CombinedOutput(); err != nil {
				note(fmt.Errorf("nft %s: %v: %s", strings.Join(args, " "), err, out))
			}
		}
	}
	for _, top := range cgroupTops() {
		if !slices.Contains(before.Cgroups, top) {
			note(removeCgroupTree(top))
		}
	}
	for _, p := range hostPaths {
		if !before.Paths[p] {
			if err := os.RemoveAll(p); err != nil {
				note(fmt.Errorf("removing %s: %w", p, err))
			}
		}
	}
	for _, k := range trackedSysctls {
		want, ok := before.Sysctls[k]
		if !ok {
			continue
		}
		if got, err := readSysctl(k); err == nil && got != want {
			note(writeSysctl(k, want))
		}
	}
	return errs
}

// restoreIPTables deletes the rules that were added since before, then flushes and
// deletes the chains that were added, table by table.
func restoreIPTables(cmd string, before []string) error {
	now := iptablesRules(cmd + "-save")
	var errs []string
	run := func(args ...string) {
		if out, err := exec.Command(cmd, append([]string{"-w"}, args...)...).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Sprintf("%s %s: %v: %s", cmd, strings.Join(args, " "), err, strings.TrimSpace(string(out))))
		}
	}
	type chain struct{ table, name string }
	var chains []chain
	for _, r := range now {
		if slices.Contains(before, r) {
			continue
		}
		table, rule, _ := strings.Cut(r, " ")
		if strings.HasPrefix(rule, ":") {
			chains = append(chains, chain{table, strings.Fields(rule)[0][1:]})
			continue
		}
		if strings.HasPrefix(rule, "-A ") {
			args, err := splitRule(rule[3:])
			if err != nil {
				errs = append(errs, err.Error())
				continue
			}
			run(append([]string{"-t", table, "-D"}, args...)...)
		}
	}
	for _, c := range chains {
		run("-t", c.table, "-F", c.name)
	}
	for _, c := range chains {
		run("-t", c.table, "-X", c.name)
	}
	if len(errs) > 0 {
		return fmt.Errorf("restoring %s: %s", cmd, strings.Join(errs, "; "))
	}
	return nil
}

// splitRule splits an iptables-save rule into arguments, honouring double quotes.
func splitRule(s string) ([]string, error) {
	var args []string
	var cur strings.Builder
	inQuote, escaped, have := false, false, false
	for _, r := range s {
		switch {
		case escaped:
			cur.WriteRune(r)
			escaped = false
		case r == '\\':
			escaped = true
		case r == '"':
			inQuote = !inQuote
			have = true
		case r == ' ' && !inQuote:
			if have {
				args = append(args, cur.String())
				cur.Reset()
				have = false
			}
		default:
			cur.WriteRune(r)
			have = true
		}
	}
	if inQuote {
		return nil, fmt.Errorf("unbalanced quotes in rule %q", s)
	}
	if have {
		args = append(args, cur.String())
	}
	return args, nil
}

// removeCgroupTree removes a cgroup folder and its children, deepest first, after
// killing whatever still runs in them.
func removeCgroupTree(top string) error {
	var dirs []string
	_ = filepath.WalkDir(top, func(path string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, path)
		}
		return nil
	})
	slices.Reverse(dirs)
	var last error
	for _, d := range dirs {
		if procs, err := os.ReadFile(filepath.Join(d, "cgroup.procs")); err == nil {
			for _, f := range strings.Fields(string(procs)) {
				var pid int
				if _, err := fmt.Sscanf(f, "%d", &pid); err == nil && pid > 1 {
					_ = unix.Kill(pid, unix.SIGKILL)
				}
			}
		}
		if err := unix.Rmdir(d); err != nil && err != unix.ENOENT {
			last = fmt.Errorf("removing cgroup %s: %w", d, err)
		}
	}
	return last
}
