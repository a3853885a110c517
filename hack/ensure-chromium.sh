#!/usr/bin/env bash
# Makes sure Debian's chromium is installed, the browser the grab service's rain page
# is tested in (grabsvc/page_test.go, through the DevTools protocol). As root it
# installs it when missing; elsewhere it says how and exits 0, and the page tests skip
# saying why (outside CI; with CI=true they fail).
set -euo pipefail

[ -x /usr/bin/chromium ] && exit 0

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
	echo "chromium is missing; the rain page tests need it: sudo apt-get install -y chromium" >&2
	exit 0
fi
echo "installing chromium (for the rain page tests)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
