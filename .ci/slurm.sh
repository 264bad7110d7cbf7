#!/usr/bin/env bash
# A real SLURM cluster on this machine, for the tests of `launcher=slurm` and
# `hydra/launcher=submitit_slurm`: munge, a private MariaDB, slurmdbd (accounting, so that a killed job
# is reported FAILED), slurmctld and slurmd, all on localhost (node `localhost`, partition `debug`).
#
#   bash .ci/slurm.sh up             install the Debian packages if needed, write the configs, start the daemons
#   bash .ci/slurm.sh up --nodes 2   also two compute nodes `rnode1` and `rnode2` (partition `multinode`):
#                                    each slurmd in its own network namespace and hostname, on a veth pair
#                                    to a bridge in this namespace (10.251.77.0/24, which exists only on
#                                    this machine); munge and the filesystem are shared
#   bash .ci/slurm.sh down           stop the daemons, remove the namespaces, the bridge and the hosts lines
#
# Needs root and apt-get; without them it says why and exits 0 (the SLURM tests then skip, naming this
# script). It never touches a SLURM config it did not write.
set -euo pipefail

MARKER="# written by runner/.ci/slurm.sh"
CONF=/etc/slurm/slurm.conf
DBD_CONF=/etc/slurm/slurmdbd.conf
CPUS=${RUNNER_SLURM_CPUS:-8}  # advertised (SlurmdParameters=config_overrides): jobs may share the cores
BRIDGE=runner-br0
SUBNET=10.251.77         # the bridge is .1, node i is .(10+i)
NODE_PREFIX=rnode

say() { echo "slurm.sh: $*"; }

wait_for() {  # wait_for <seconds> <what> <command...>
    local seconds=$1 what=$2
    shift 2
    for _ in $(seq $((seconds * 10))); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.1
    done
    say "$what did not come up within ${seconds}s; its log:"
    tail -n 30 "/var/log/slurm/$what.log" 2>/dev/null || true
    exit 1
}

cluster_ready() { sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; }

# up when every node of the cluster's config answers (a node may be busy with a job)
nodes_ready() {
    local want=$1
    [ "$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -cE ' (idle|mixed|allocated|completing)$')" -ge "$want" ]
}

node_names() { for i in $(seq "$1"); do echo "$NODE_PREFIX$i"; done; }

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmdbd >/dev/null && command -v mariadbd >/dev/null \
        && command -v munged >/dev/null; then
        return
    fi
    say "installing slurm-wlm, slurmdbd, munge, mariadb-server"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm slurmdbd munge mariadb-server >/dev/null
}

write_configs() {
    local nodes=$1 memory_mb controller=localhost extra_nodes=""
    memory_mb=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024))
    # (the namespaced nodes come first: slurmctld takes any name for `localhost` while it is the only node)
    if [ "$nodes" -gt 0 ]; then
        # the namespaced slurmds reach the controller on the bridge; a node not heard from for 15 s is down
        controller="localhost($SUBNET.1)"
        extra_nodes="SlurmdTimeout=15"
        for i in $(seq "$nodes"); do
            extra_nodes+=$'\n'"NodeName=$NODE_PREFIX$i NodeAddr=$SUBNET.$((10 + i)) CPUs=$CPUS RealMemory=$memory_mb State=UNKNOWN"
        done
        extra_nodes+=$'\n'"PartitionName=multinode Nodes=$(node_names "$nodes" | paste -sd,) MaxTime=INFINITE State=UP"
    fi
    mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
    cat >"$CONF" <<EOF
$MARKER
ClusterName=runner
SlurmctldHost=$controller
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=2,bf_interval=1
KillWait=5
ReturnToService=2
MpiDefault=none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.%n.log
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.%n.pid
$extra_nodes
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$memory_mb State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$DBD_CONF" <<EOF
$MARKER
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
LogFile=/var/log/slurm/slurmdbd.log
PidFile=/run/slurmdbd.pid
EOF
    chmod 600 "$DBD_CONF"
}

start_daemons() {
    mkdir -p /run/munge /run/mysqld
    chown munge:munge /run/munge
    chown mysql:mysql /run/mysqld
    pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
    if ! pgrep -x mariadbd >/dev/null; then
        runuser -u mysql -- /usr/sbin/mariadbd --bind-address=127.0.0.1 \
            >/var/log/slurm/mariadb.log 2>&1 &
    fi
    wait_for 60 mariadb mariadb -e "SELECT 1"
    mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
        CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
    pgrep -x slurmdbd >/dev/null || slurmdbd
    wait_for 60 slurmdbd sacctmgr -n list cluster
    pgrep -x slurmctld >/dev/null || slurmctld
    wait_for 60 slurmctld scontrol ping
    pgrep -f "^slurmd -N localhost" >/dev/null || slurmd -N localhost
    wait_for 60 slurmd.localhost cluster_ready
}

# Node i: network namespace runner-<name> holding one end of a veth pair (eth0, $SUBNET.(10+i)), the
# other end on the bridge, whose address the controller is reached at (made before the daemons start).
# /etc/hosts names the nodes for every namespace (they share the files).
make_network() {
    local nodes=$1 name ns address
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
        ip addr add "$SUBNET.1/24" dev "$BRIDGE"
    fi
    ip link set "$BRIDGE" up
    for i in $(seq "$nodes"); do
        name=$NODE_PREFIX$i ns=runner-$NODE_PREFIX$i address=$SUBNET.$((10 + i))
        if ! ip netns list | grep -qw "$ns"; then
            ip netns add "$ns"
            ip link add "rv-$name" type veth peer name "rvp-$name"
            ip link set "rvp-$name" netns "$ns"
            ip -n "$ns" link set "rvp-$name" name eth0
            ip -n "$ns" addr add "$address/24" dev eth0
            ip -n "$ns" link set lo up
            ip -n "$ns" link set eth0 up
            ip link set "rv-$name" master "$BRIDGE"
            ip link set "rv-$name" up
        fi
        grep -q "^$address $name " /etc/hosts || echo "$address $name $MARKER" >>/etc/hosts
    done
}

# Each node's slurmd in its namespace under its own hostname (a UTS namespace); the job's tasks it
# starts run there too.
start_nodes() {
    local nodes=$1 name
    for name in $(node_names "$nodes"); do
        if ! pgrep -f "^slurmd -N $name\$" >/dev/null; then
            # nsenter, not `ip netns exec`: that remounts /sys, and slurmd needs the cgroup mounts there
            nsenter --net="/run/netns/runner-$name" unshare --uts sh -c "hostname $name && exec slurmd -N $name"
        fi
    done
    wait_for 60 "slurmd.$NODE_PREFIX$nodes" nodes_ready $((nodes + 1))
    for name in $(node_names "$nodes"); do  # back from a test that killed it
        scontrol update nodename="$name" state=resume >/dev/null 2>&1 || true
    done
}

can_make_nodes() {
    command -v ip >/dev/null && command -v nsenter >/dev/null && command -v unshare >/dev/null || return 1
    ip netns list 2>/dev/null | grep -qw "runner-${NODE_PREFIX}1" && return 0  # made before
    ip netns add runner-probe 2>/dev/null && ip netns del runner-probe
}

# How many namespaced nodes the written config has (0: single-node mode).
configured_nodes() { grep -c "^NodeName=$NODE_PREFIX" "$CONF" 2>/dev/null || true; }

up() {
    local nodes=0
    if [ "${1:-}" = "--nodes" ]; then
        case "${2:-}" in
            1) nodes=0 ;;
            2) nodes=2 ;;
            *) echo "usage: $0 up [--nodes 1|2]" >&2; exit 2 ;;
        esac
    fi
    if [ "$(id -u)" -ne 0 ]; then
        say "not root: no SLURM cluster started (the SLURM tests will skip)"
        return
    fi
    if ! command -v apt-get >/dev/null && ! command -v slurmctld >/dev/null; then
        say "no apt-get and no SLURM installed: no cluster started (the SLURM tests will skip)"
        return
    fi
    if [ -f "$CONF" ] && ! grep -qF "$MARKER" "$CONF"; then
        say "$CONF was not written by this script: leaving that cluster alone"
        return
    fi
    if [ "$nodes" -gt 0 ] && ! can_make_nodes; then
        say "cannot make network namespaces here (needs ip, nsenter, unshare and CAP_NET_ADMIN): starting the single node only (the two-node tests will skip)"
        nodes=0
    fi
    if [ "$(configured_nodes)" != "$nodes" ] && [ -f "$CONF" ]; then
        down  # the other mode's cluster
    fi
    if cluster_ready && nodes_ready $((nodes + 1)); then
        say "already up: $(sinfo -h -o '%P %D node(s) %c CPUs %T' | paste -sd';')"
        return
    fi
    install_packages
    write_configs "$nodes"
    if [ "$nodes" -gt 0 ]; then
        make_network "$nodes"
    fi
    start_daemons
    if [ "$nodes" -gt 0 ]; then
        start_nodes "$nodes"
    fi
    say "up: $(sinfo -h -o '%P %D node(s) %c CPUs %T' | paste -sd';')"
}

down() {
    for daemon in slurmd slurmctld slurmdbd mariadbd munged; do
        pkill -x "$daemon" || true
    done
    for daemon in slurmd slurmctld slurmdbd mariadbd munged; do  # gone: an `up` right after starts them
        for _ in $(seq 300); do
            pgrep -x "$daemon" >/dev/null || break
            sleep 0.1
        done
    done
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^runner-$NODE_PREFIX" || true); do
        ip netns pids "$ns" | xargs -r kill -9 || true  # a job's tasks left on a node
        ip netns del "$ns"
    done
    if ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link del "$BRIDGE"
    fi
    if grep -qF "$MARKER" /etc/hosts; then
        grep -vF "$MARKER" /etc/hosts >/etc/hosts.runner && cat /etc/hosts.runner >/etc/hosts && rm /etc/hosts.runner
    fi
}

case "${1:-up}" in
    up) up "${@:2}" ;;
    down) down ;;
    *) echo "usage: $0 up [--nodes 1|2] | down" >&2; exit 2 ;;
esac
