package cluster

import (
	"fmt"
)

// containerdConfig keeps every path of containerd under the node's folder. The one
// setting that is not obvious: restrict_oom_score_adj, since the machine's capability
// bounding set lacks CAP_SYS_RESOURCE and runc could not start a pod sandbox
// otherwise ("failed to update /proc/self/oom_score_adj: Permission denied").
func (c *Cluster) containerdConfig() string {
	return fmt.Sprintf(`version = 2
root = %q
state = %q
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = %q

[plugins."io.containerd.internal.v1.opt"]
  path = %q

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = %q
`, c.path("containerd", "root"), c.path("containerd", "state"), c.containerd,
		c.path("containerd", "opt"), c.opts.PauseImage, c.path("cni", "net.d"))
}

// cniConfig is a bridge network for the pods, with host-local addresses whose state
// stays in the node's folder. No masquerading: pods only talk to this machine.
func (c *Cluster) cniConfig() string {
	return fmt.Sprintf(`{
  "cniVersion": "0.4.0",
  "name": "redpacket-node",
  "plugins": [
    {
      "type": "bridge",
      "bridge": %q,
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": %q}]],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dataDir": %q
      }
    }
  ]
}
`, BridgeName, PodCIDR, c.path("cni", "ipam"))
}

// kubeletConfig: cgroupfs on the host's cgroup v1, no swap check, webhook
// authentication and authorization, every port on the node's address, image GC and
// eviction thresholds low enough that a small disk evicts nothing, and no resolver
// for the pods (there is no cluster DNS, and pods ask nothing outside the machine).
func (c *Cluster) kubeletConfig(ca *authority, serving certFiles) string {
	return fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: %[1]s
port: 10250
readOnlyPort: 0
healthzBindAddress: %[1]s
healthzPort: 10248
tlsCertFile: %[2]q
tlsPrivateKeyFile: %[3]q
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: %[4]q}
authorization:
  mode: Webhook
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://%[5]s
imageServiceEndpoint: unix://%[5]s
podCIDR: %[6]s
podLogsDir: %[7]q
maxPods: 60
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: "100Mi"
  nodefs.available: "1%%"
  nodefs.inodesFree: "1%%"
  imagefs.available: "1%%"
resolvConf: ""
serializeImagePulls: false
registerNode: true
rotateCertificates: false
serverTLSBootstrap: false
enableServer: true
shutdownGracePeriod: 0s
`, NodeIP, serving.cert, serving.key, ca.certPath(), c.containerd, PodCIDR, c.path("pod-logs"))
}

// kubeProxyConfig: iptables mode; masquerade every Service connection, so that a pod
// reaching a Service backed by another pod on the same bridge gets its answer
// through the host (the machine has no br_netfilter); conntrack left alone.
func (c *Cluster) kubeProxyConfig(kubeconfig string) (string, error) {
	healthz, err := freePort()
	if err != nil {
		return "", err
	}
	metrics, err := freePort()
	if err != nil {
		return "", err
	}
	return fmt.Sprintf(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: %q
mode: iptables
clusterCIDR: %s
hostnameOverride: %s
bindAddress: %s
healthzBindAddress: 127.0.0.1:%d
metricsBindAddress: 127.0.0.1:%d
nodePortAddresses: ["%s/32"]
iptables:
  masqueradeAll: true
  syncPeriod: 10s
  minSyncPeriod: 0s
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
`, kubeconfig, PodCIDR, NodeName, NodeIP, healthz, metrics, NodeIP), nil
}
