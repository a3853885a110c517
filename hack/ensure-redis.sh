#!/usr/bin/env bash
# Makes sure redis-server, redis-cli and redis-benchmark are installed. On a machine
# without them it installs Debian's packages when run as root, and otherwise says how.
set -euo pipefail

missing=()
for b in redis-server redis-cli redis-benchmark; do
	command -v "$b" >/dev/null 2>&1 || missing+=("$b")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
	echo "missing: ${missing[*]}; install them with: sudo apt-get install -y redis-server redis-tools" >&2
	exit 1
fi
echo "installing redis-server and redis-tools (missing: ${missing[*]})"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq redis-server redis-tools >/dev/null
