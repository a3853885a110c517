#!/usr/bin/env bash
# Makes sure the parts of the real single-node Kubernetes that come from Debian's
# packages are installed: containerd, runc, the CNI plugins, iptables, conntrack and
# nft (and openssl, whose commands the docs give and pkg/webhooksig's tests run). As root it installs what is missing; elsewhere it says what is missing and
# exits 0, since a node needs root anyway and the tests that need one say so.
set -euo pipefail

declare -A files=(
	[containerd]=/usr/bin/containerd
	[runc]=/usr/sbin/runc
	[containernetworking-plugins]=/usr/lib/cni/bridge
	[iptables]=/usr/sbin/iptables
	[conntrack]=/usr/sbin/conntrack
	[nftables]=/usr/sbin/nft
	[openssl]=/usr/bin/openssl
)
missing=()
for pkg in "${!files[@]}"; do
	[ -e "${files[$pkg]}" ] || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
	echo "node packages missing: ${missing[*]} (a real node needs root: sudo apt-get install -y ${missing[*]})" >&2
	exit 0
fi
echo "installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
