package cluster

import (
	"fmt"
	"os/exec"
	"strings"
)

// bridgeGateway is the host's address on the pod bridge: the first address of
// PodCIDR, which the CNI bridge plugin uses as the pods' gateway.
const bridgeGateway = "10.251.0.1"

// confineNetwork makes sure no packet for the node's ranges leaves this machine,
// whatever state kube-proxy's rules are in. It creates the pod bridge before the CNI
// plugin would (the plugin adopts a bridge of its name), routes ServiceCIDR to it,
// so that a connection to a ClusterIP that kube-proxy has not translated yet stays
// on the bridge instead of following the default route, and refuses to forward
// anything from the pods to addresses outside the node's ranges. Teardown removes
// the bridge (and with it the routes) and the rule, as it removes everything it
// finds added.
func confineNetwork() error {
	steps := [][]string{
		{"ip", "link", "add", BridgeName, "type", "bridge"},
		{"ip", "addr", "add", bridgeGateway + "/24", "dev", BridgeName},
		{"ip", "link", "set", BridgeName, "up"},
		{"ip", "route", "add", ServiceCIDR, "dev", BridgeName, "src", bridgeGateway},
		{"iptables", "-w", "-I", "FORWARD", "1", "-s", PodCIDR, "!", "-d", "10.250.0.0/15",
			"-m", "comment", "--comment", "redpacket-node: pods talk to this machine only", "-j", "REJECT"},
	}
	for _, s := range steps {
		if out, err := exec.Command(s[0], s[1:]...).CombinedOutput(); err != nil {
			return fmt.Errorf("%s: %v: %s", strings.Join(s, " "), err, strings.TrimSpace(string(out)))
		}
	}
	return nil
}

// forgetConnections deletes the kernel's connection-tracking entries of the node's
// ranges. Connections that a stopped node never closed stay ESTABLISHED for days; a
// later node that hands out the same ClusterIP or pod address would otherwise have a
// new connection on a reused port translated to a stale destination. conntrack exits
// non-zero when nothing matched, which is fine.
func forgetConnections() {
	for _, r := range []struct{ addr, mask string }{
		{"10.250.0.0", "255.255.255.0"},
		{"10.251.0.0", "255.255.255.0"},
		{"10.252.0.0", "255.255.255.0"},
	} {
		_ = exec.Command("conntrack", "-D", "-d", r.addr, "--mask-dst", r.mask).Run()
		_ = exec.Command("conntrack", "-D", "-s", r.addr, "--mask-src", r.mask).Run()
	}
}
