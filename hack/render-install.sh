#!/usr/bin/env bash
# Renders the install manifests (config/default) with the operator image of one
# version: hack/render-install.sh VERSION [OUT]. OUT defaults to dist/install.yaml.
# The image, redpacket-operator:VERSION, is what `make image` builds and tags.
# kustomize runs in process (hack/render, the kustomize Go API): no kubectl needed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
version=${1:?usage: hack/render-install.sh VERSION [OUT]}
out=${2:-$root/dist/install.yaml}
mkdir -p "$(dirname "$out")"
(cd "$root" && "${GO:-go}" run ./hack/render config/default) |
	sed -e "s|redpacket-operator:latest|redpacket-operator:$version|g" >"$out"
grep -q "redpacket-operator:$version" "$out" || { echo "render: no operator image in $out" >&2; exit 1; }
echo "wrote $out (image redpacket-operator:$version)"
