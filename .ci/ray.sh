#!/usr/bin/env bash
# A real two-node Ray cluster on this machine, for the tests of `launcher=ray`: a head node and a second
# node (two raylets), inside a network namespace of their own with only a loopback interface, where Ray
# keeps 127.0.0.1 (outside one it replaces it with the machine's address). Commands reach the cluster
# from inside that namespace: `nsenter --net=/run/netns/runner-ray python -m runner launcher=ray
# launcher.address=127.0.0.1:6379 ...`.
#
#   bash .ci/ray.sh up     start the cluster (Ray Train must be installed: the `ray` extra)
#   bash .ci/ray.sh down   stop it and remove the namespace
#
# Needs root (network namespaces); without it, or without Ray, it says why and exits 0 (the Ray tests then
# skip, naming this script).
set -euo pipefail

NS=runner-ray
PORT=6379
CPUS=${RUNNER_RAY_CPUS:-2}  # per node; jobs may share the machine's cores

say() { echo "ray.sh: $*"; }
in_ns() { nsenter --net="/run/netns/$NS" "$@"; }
nodes_up() { in_ns ray status --address "127.0.0.1:$PORT" 2>/dev/null | grep -c "^ 1 node_" ; }

up() {
    if ! python -c "import ray.train" 2>/dev/null; then
        say "Ray Train is not installed (pip install -e '.[ray]'): the Ray tests will skip"
        exit 0
    fi
    if [ "$(id -u)" != 0 ]; then
        say "needs root for a network namespace: the Ray tests will skip"
        exit 0
    fi
    if ip netns list | grep -qw "$NS" && [ "$(nodes_up || true)" -ge 2 ]; then
        say "already up"
        return
    fi
    down >/dev/null 2>&1 || true
    # A cluster on a loopback-only namespace needs no token; where ~/.ray/auth_token exists, Ray 2.60's head
    # turns token authentication on and the second node, without the token, fails to join.
    export RAY_AUTH_MODE=disabled
    ip netns add "$NS"
    in_ns ip link set lo up
    local common=(--num-cpus="$CPUS" --object-store-memory=150000000 --disable-usage-stats
        --node-ip-address=127.0.0.1)
    in_ns ray start --head --port="$PORT" --dashboard-host=127.0.0.1 "${common[@]}" >/tmp/runner-ray-head.log 2>&1 \
        || { say "the head did not start:"; tail -20 /tmp/runner-ray-head.log; exit 1; }
    in_ns ray start --address="127.0.0.1:$PORT" "${common[@]}" >/tmp/runner-ray-node.log 2>&1 \
        || { say "the second node did not start:"; tail -20 /tmp/runner-ray-node.log; exit 1; }
    for _ in $(seq 100); do
        [ "$(nodes_up || true)" -ge 2 ] && { say "up: 2 nodes at 127.0.0.1:$PORT in netns $NS"; return; }
        sleep 0.3
    done
    say "the cluster did not report 2 nodes"
    exit 1
}

down() {
    if ip netns list 2>/dev/null | grep -qw "$NS"; then
        in_ns ray stop --force >/dev/null 2>&1 || true
        ip netns pids "$NS" | xargs -r kill -9 || true
        ip netns del "$NS"
    fi
    say "down"
}

case "${1:-up}" in
    up) up ;;
    down) down ;;
    *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
