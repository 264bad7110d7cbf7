#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine, for the tests of `launcher=slurm` and
# `hydra/launcher=submitit_slurm`: munge, a private MariaDB, slurmdbd (accounting, so that a killed job
# is reported FAILED), slurmctld and slurmd, all on localhost.
#
#   bash .ci/slurm.sh up      install the Debian packages if needed, write the configs, start the daemons
#   bash .ci/slurm.sh down    stop the daemons
#
# Needs root and apt-get; without them it says why and exits 0 (the SLURM tests then skip, naming this
# script). It never touches a SLURM config it did not write.
set -euo pipefail

MARKER="# written by runner/.ci/slurm.sh"
CONF=/etc/slurm/slurm.conf
DBD_CONF=/etc/slurm/slurmdbd.conf
CPUS=${RUNNER_SLURM_CPUS:-8}  # advertised (SlurmdParameters=config_overrides): jobs may share the cores

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
    local memory_mb
    memory_mb=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024))
    mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
    cat >"$CONF" <<EOF
$MARKER
ClusterName=runner
SlurmctldHost=localhost
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
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
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
    pgrep -x slurmd >/dev/null || slurmd -N localhost
    wait_for 60 slurmd cluster_ready
}

up() {
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
    if cluster_ready; then
        say "already up: $(sinfo -h -o '%P %D node(s) %c CPUs %T')"
        return
    fi
    install_packages
    write_configs
    start_daemons
    say "up: $(sinfo -h -o '%P %D node(s) %c CPUs %T')"
}

down() {
    for daemon in slurmd slurmctld slurmdbd mariadbd munged; do
        pkill -x "$daemon" || true
    done
}

case "${1:-up}" in
    up) up ;;
    down) down ;;
    *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
