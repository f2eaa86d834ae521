#!/usr/bin/env bash
# Install the Debian packages the tests need (Prometheus and promtool), when they
# are missing. Needs root (as on CI) or sudo; prints what to do otherwise.
set -euo pipefail
need=()
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
  SUDO=""
elif command -v sudo >/dev/null 2>&1; then
  SUDO="sudo"
else
  echo "system-deps: missing ${need[*]}; install Debian's 'prometheus' package as root" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# The package starts a system service where systemd runs; the tests start their
# own Prometheus on a free loopback port, so stop it if it came up.
$SUDO systemctl stop prometheus 2>/dev/null || true
command -v prometheus >/dev/null && command -v promtool >/dev/null
