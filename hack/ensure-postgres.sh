#!/usr/bin/env bash
# Makes sure PostgreSQL 15's server programs (initdb, postgres, pg_ctl) are installed
# in /usr/lib/postgresql/15/bin, where Debian puts them and where test/pgtest and
# cmd/balance's tests look for them. On a machine without them it installs Debian's
# postgresql package when run as root, and otherwise says how. The tests start their
# own throwaway clusters: they need no running server.
set -euo pipefail

bin=/usr/lib/postgresql/15/bin
missing=()
for b in initdb postgres pg_ctl; do
	[ -x "$bin/$b" ] || missing+=("$b")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
	echo "missing in $bin: ${missing[*]}; install them with: sudo apt-get install -y postgresql" >&2
	exit 1
fi
echo "installing postgresql (missing in $bin: ${missing[*]})"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq postgresql >/dev/null
for b in initdb postgres pg_ctl; do
	[ -x "$bin/$b" ] || { echo "postgresql installed, but $bin/$b is still missing (is Debian's default version 15?)" >&2; exit 1; }
done
