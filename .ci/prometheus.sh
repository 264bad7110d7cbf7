#!/usr/bin/env bash
# Debian's Prometheus server, for tests/test_prometheus.py (which starts its own on 127.0.0.1 and stops it):
#
#   bash .ci/prometheus.sh    install the `prometheus` package if there is no `prometheus` on PATH
#
# Needs root and apt-get; without them it says why and exits 0 (the Prometheus tests then skip, naming
# this script). Installing the package starts no server here (no systemd in the container).
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "prometheus.sh: needs root and apt-get to install Debian's prometheus; the Prometheus tests will skip"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends prometheus >/dev/null || {
    apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends prometheus >/dev/null
}
command -v prometheus >/dev/null
