#!/usr/bin/env bash
# Builds the local control plane (kube-apiserver, kubectl, etcd) and the node components of
# the real single-node cluster (kubelet, kube-controller-manager, kube-scheduler, kube-proxy)
# from the Go modules pinned under hack/tools into bin/. With the argument "traefik" it builds
# only the Traefik proxy (v3.6.12: the v3.7 releases import a nested module that no proxy
# serves) that serves Gateway API routes and Ingresses in the tests (make test asks for it;
# make demo does not need it, so the default run leaves it out). A stamp of each module's go.mod and go.sum is
# kept beside the binaries, so a binary is rebuilt only when its pinned versions change.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
bin="$root/bin"
mkdir -p "$bin"

# build MODULE_DIR STAMP_NAME PACKAGE=BINARY...
build() {
	local dir="$root/hack/tools/$1" name=$2
	shift 2
	local stamp
	stamp=$(cat "$dir/go.mod" "$dir/go.sum" | sha256sum | cut -c1-16)
	local missing=0
	for pair in "$@"; do
		[ -x "$bin/${pair#*=}" ] || missing=1
	done
	if [ "$missing" = 0 ] && [ "$(cat "$bin/.$name.stamp" 2>/dev/null)" = "$stamp" ]; then
		echo "control plane: $name is up to date"
		return
	fi
	for pair in "$@"; do
		echo "control plane: building ${pair#*=} from ${pair%=*}"
		(cd "$dir" && CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o "$bin/${pair#*=}" "${pair%=*}")
	done
	echo "$stamp" >"$bin/.$name.stamp"
}

if [ "${1:-}" = traefik ]; then
	build traefik traefik github.com/traefik/traefik/v3/cmd/traefik=traefik
	exit 0
fi

build etcd etcd go.etcd.io/etcd/server/v3=etcd
build kube kube k8s.io/kubernetes/cmd/kube-apiserver=kube-apiserver k8s.io/kubernetes/cmd/kubectl=kubectl \
	k8s.io/kubernetes/cmd/kubelet=kubelet k8s.io/kubernetes/cmd/kube-controller-manager=kube-controller-manager \
	k8s.io/kubernetes/cmd/kube-scheduler=kube-scheduler k8s.io/kubernetes/cmd/kube-proxy=kube-proxy
