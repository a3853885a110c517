#!/usr/bin/env bash
# Makes sure promtool is installed: the alert rules in config/prometheus are tested
# with `promtool test rules` (test/packaging). Debian ships promtool in its
# prometheus package. As root it installs the package when promtool is missing,
# without starting the Prometheus server the package brings along; elsewhere it says
# how and exits 0, and the rule tests skip saying why (outside CI; with CI=true they
# fail).
set -euo pipefail

command -v promtool >/dev/null 2>&1 && exit 0

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
	echo "promtool is missing; the alert rule tests need it: sudo apt-get install -y prometheus" >&2
	exit 0
fi
echo "installing prometheus (for promtool, which tests the alert rules)"
# The package's maintainer scripts would start a Prometheus server; a policy-rc.d
# that refuses every start keeps it stopped (only when no policy is in place).
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
	printf '#!/bin/sh\nexit 101\n' >"$policy"
	chmod 0755 "$policy"
	trap 'rm -f "$policy"' EXIT
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v promtool >/dev/null 2>&1 || { echo "prometheus is installed but promtool is not on PATH" >&2; exit 1; }
