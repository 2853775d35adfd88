#!/usr/bin/env bash
# A real multi-node Slurm test cluster on ONE machine (root, no systemd).
#
# Each slurmd runs in its own network namespace AND UTS namespace, so jobs
# really see separate hosts (node1, node2 with their own IPs on a private
# bridge that has no uplink).  munged, MariaDB, slurmdbd and slurmctld run in
# the root namespace.  Facts behind every choice: docs/slurm-testbed.md
# (shared docs) and tests/slurm/README.md.
#
# Usage: cluster.sh up [N]|down|status|env|install  (install: only the apt packages)
#   N (or NODES)       number of compute nodes for `up`: 1-16, default 2; node<i> has the
#                      address 10.250.0.<10+i> (node1 .11 ... node16 .26)
#   DDPFLOW_SLURM_DIR  state dir (default /tmp/ddpflow-slurm): configs, logs, PIDs
# Exit code 77 from `up` means "this machine cannot host the cluster" (the
# pytest fixture turns it into a skip); any other failure is a real error.
set -euo pipefail

STATE=${DDPFLOW_SLURM_DIR:-/tmp/ddpflow-slurm}
# what every node claims (smaller nodes reproduce a site's: DDPFLOW_SLURM_NODE_CPUS=2
# DDPFLOW_SLURM_NODE_MEM_MB=4000); a running cluster of another shape is rebuilt by `up`
NODE_CPUS=${DDPFLOW_SLURM_NODE_CPUS:-4}
NODE_MEM_MB=${DDPFLOW_SLURM_NODE_MEM_MB:-8000}
STATE=${STATE%/}
# `up` wipes the state dir: accept only an absolute path whose last part names slurm.
[[ $STATE == /* && ${STATE##*/} == *slurm* ]] \
    || { echo "DDPFLOW_SLURM_DIR='$STATE': need an absolute path ending in *slurm*" >&2; exit 2; }
CLUSTER=ddpflow
ACCOUNT=ddpflow
PARTITION=debug
SHORT_PARTITION=short
MAX_NODES=16                # node<i> at $SUBNET.<10+i>: .11 ... .26
PREFIX=ddpf                 # prefix of every kernel object we create (netns, links)
BRIDGE=${PREFIX}-br0
SUBNET=10.250.0
CTL_IP=${SUBNET}.1
MYSQL_PORT=3316             # own port + socket: never collides with a system MariaDB
DBD_PORT=6819
SLURM_CONF_FILE=$STATE/etc/slurm.conf
ETC_LINK=/etc/slurm/slurm.conf  # so plain `sinfo` works and env-stripped job steps find it
HOSTS_BEGIN="# >>> ddpflow slurm testbed (tests/slurm/cluster.sh) >>>"
HOSTS_END="# <<< ddpflow slurm testbed (tests/slurm/cluster.sh) <<<"
PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server)
export SLURM_CONF=$SLURM_CONF_FILE

log() { printf '[cluster] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
skip() { log "CANNOT RUN HERE: $*"; exit 77; }

# Number of nodes: from the running cluster if there is one, else $NODES.
node_count() {
    if [[ -f $STATE/nodes ]]; then cat "$STATE/nodes"; else echo "${NODES:-2}"; fi
}
node_ip() { echo "$SUBNET.$((10 + $1))"; }
node_names() { local i; for ((i = 1; i <= $(node_count); i++)); do printf 'node%d ' "$i"; done; }

# Alive = exists and not a zombie.  PID 1 here reaps orphans only every few
# seconds, so a dead daemon lingers as a zombie that `kill -0` still "sees".
alive() {
    local st
    st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
    [[ -n $st && $st != Z ]]
}

# ---------------------------------------------------------------- preflight
preflight() {
    [[ $(id -u) -eq 0 ]] || skip "needs root (network namespaces, mknod, daemons as root)"
    local n=${NODES:-2}
    [[ $n =~ ^[1-9][0-9]?$ ]] && ((n <= MAX_NODES)) \
        || die "the node count must be 1-$MAX_NODES, got '$n'"
    command -v ip >/dev/null && command -v nsenter >/dev/null && command -v unshare >/dev/null \
        || skip "needs iproute2 (ip) and util-linux (nsenter, unshare)"
    # Probe the two kernel features we rely on before touching anything.
    local probe=${PREFIX}-probe$$
    if ! ip netns add "$probe" 2>/dev/null; then skip "'ip netns add' not permitted"; fi
    ip netns del "$probe"
    unshare --uts true 2>/dev/null || skip "'unshare --uts' not permitted"
}

# Install only what is missing; policy-rc.d (exit 101) keeps postinst from
# starting services (we start our own, with our own configs).
install_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' \
            || missing+=("$p")
    done
    ((${#missing[@]} == 0)) && return 0
    command -v apt-get >/dev/null || skip "packages missing (${missing[*]}) and no apt-get"
    log "installing ${missing[*]}"
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
    fi
    local apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends)
    # Try the cached package lists first; refresh them only if that fails.
    if ! "${apt[@]}" "${missing[@]}" >"/tmp/${PREFIX}-apt.log" 2>&1; then
        { apt-get update -q && "${apt[@]}" "${missing[@]}"; } >>"/tmp/${PREFIX}-apt.log" 2>&1 \
            || skip "apt-get install ${missing[*]} failed (see /tmp/${PREFIX}-apt.log)"
    fi
}

# ---------------------------------------------------------------- network
net_up() {
    ip link add "$BRIDGE" type bridge
    ip addr add "$CTL_IP/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    local i ns
    for ((i = 1; i <= $(node_count); i++)); do
        ns=${PREFIX}-node$i
        ip netns add "$ns"
        ip link add "${PREFIX}-n$i" type veth peer name eth0 netns "$ns"
        ip link set "${PREFIX}-n$i" master "$BRIDGE" up
        ip -n "$ns" addr add "$(node_ip "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up     # gloo/torch bind to loopback too
    done
}

# Slurm, MASTER_ADDR and gloo all resolve node names: one marked block, edited
# in place (/etc/hosts may be a bind mount, so no rename-based `sed -i`).
hosts_strip() {
    grep -qxF "$HOSTS_BEGIN" /etc/hosts || return 0   # rewrite only when needed
    local kept
    kept=$(awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" \
        '$0==b{skip=1;next} $0==e{skip=0;next} !skip' /etc/hosts)
    printf '%s\n' "$kept" >/etc/hosts
}
hosts_add() {
    hosts_strip
    local i
    {
        echo "$HOSTS_BEGIN"
        for ((i = 1; i <= $(node_count); i++)); do echo "$(node_ip "$i") node$i"; done
        echo "$HOSTS_END"
    } >>/etc/hosts
}

# ---------------------------------------------------------------- configs
write_configs() {
    local names ips i ctl
    ctl=$(hostname -s)   # slurmctld only starts if SlurmctldHost's name equals this
    names=$(node_names | xargs | tr ' ' ',')
    ips=$(for ((i = 1; i <= $(node_count); i++)); do printf '%s,' "$(node_ip "$i")"; done)
    mkdir -p "$STATE"/{etc,log,run,pids,ctld,spool,dev}
    cat >"$SLURM_CONF_FILE" <<EOF
# Generated by tests/slurm/cluster.sh -- do not edit, rerun 'up'.
ClusterName=$CLUSTER
SlurmctldHost=$ctl($CTL_IP)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Without this a requeued job waits ~121 s for its old credential to expire.
AuthInfo=cred_expire=10
MpiDefault=none
# No cgroup plugins: linuxproc tracking works inside namespaces on this host.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=500
GresTypes=gpu
# Lets every node claim CPUs/RealMemory/GRES the real machine does not have.
SlurmdParameters=config_overrides
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
# Fast turnaround for tests: quick scheduling, short kill grace, requeue allowed,
# finished jobs stay visible in squeue/scontrol for 5 min.
ReturnToService=2
KillWait=5
MinJobAge=300
JobRequeue=1
SchedulerParameters=bf_interval=2,sched_interval=2
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$CTL_IP
AccountingStoragePort=$DBD_PORT
AccountingStorageTRES=gres/gpu
# per-step CPU time and peak memory for sacct (the report's cluster efficiency, as seff)
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=task=2
NodeName=$names NodeAddr=${ips%,} CPUs=$NODE_CPUS RealMemory=$NODE_MEM_MB Gres=gpu:2 State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
PartitionName=$SHORT_PARTITION Nodes=ALL MaxTime=00:10:00 State=UP
EOF
    # A GPU GRES without File= is silently dropped (node goes INVAL): fake
    # char devices (major 1 minor 3 = /dev/null) stand in for the GPUs.
    for i in 0 1; do mknod -m 666 "$STATE/dev/gpu$i" c 1 3; done
    echo "Name=gpu File=$STATE/dev/gpu[0-1]" >"$STATE/etc/gres.conf"
    write_slurmdbd_conf
}

write_slurmdbd_conf() {
    # slurmdbd reads slurmdbd.conf next to $SLURM_CONF and refuses it unless 0600.
    local f=$STATE/etc/slurmdbd.conf
    install -m 600 /dev/null "$f"
    cat >"$f" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$STATE/log/slurmdbd.log
PidFile=$STATE/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$MYSQL_PORT
StorageUser=slurm
StoragePass=slurmtest
StorageLoc=slurm_acct_db
EOF
}

# /etc/slurm/slurm.conf -> our config: clients and job steps whose SLURM_*
# environment was stripped (Snakemake's jobstep plugin) still find the cluster.
link_conf() {
    mkdir -p /etc/slurm
    if [[ -e $ETC_LINK && ! -L $ETC_LINK ]]; then
        die "$ETC_LINK exists and is not our symlink; refusing to replace it"
    fi
    ln -sfn "$SLURM_CONF_FILE" "$ETC_LINK"
}
unlink_conf() {
    if [[ -L $ETC_LINK && $(readlink "$ETC_LINK") == "$SLURM_CONF_FILE" ]]; then
        rm -f "$ETC_LINK"
    fi
}

# ---------------------------------------------------------------- daemons
# Start a daemon in the foreground-mode background: nohup, </dev/null and
# output to a file, or a harness waiting for our stdout to close hangs.
# Every command we start exec()s into the daemon, so $! is the daemon's PID.
spawn() {
    local name=$1
    shift
    # 9>&- : daemons must not inherit (and hold forever) the cluster.sh lock.
    nohup "$@" </dev/null >>"$STATE/log/$name.out" 2>&1 9>&- &
    echo $! >"$STATE/pids/$name.pid"
}

# Poll a command until it succeeds; fail loudly with the daemon log on timeout.
wait_for() {
    local what=$1 secs=$2 logf=$3
    shift 3
    local end=$((SECONDS + secs))
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= end)); then
            log "timeout waiting for $what; tail of $logf:"
            tail -n 20 "$logf" >&2 || true
            die "$what did not come up in ${secs}s"
        fi
        sleep 0.2
    done
}

start_munge() {
    # No systemd/tmpfiles.d here, so nobody creates /run/munge for us.
    install -d -o munge -g munge -m 755 /run/munge
    install -d -o munge -g munge -m 700 "$STATE/munge"
    dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
    chown munge:munge "$STATE/munge/munge.key"
    chmod 400 "$STATE/munge/munge.key"
    # setpriv exec()s munged directly (runuser would fork), so the PID is munged's.
    spawn munged setpriv --reuid=munge --regid=munge --init-groups -- /usr/sbin/munged -F \
        --key-file="$STATE/munge/munge.key" --log-file="$STATE/munge/munged.log" \
        --pid-file="$STATE/munge/munged.pid" --seed-file="$STATE/munge/munged.seed"
    wait_for munge 15 "$STATE/munge/munged.log" sh -c 'munge -n | unmunge'
}

mysql_cmd() { mariadb --no-defaults --socket="$STATE/mysqld/mysqld.sock" -u root "$@"; }

start_mariadb() {
    # Own datadir per `up`: the accounting DB starts empty, like the job ids.
    install -d -o mysql -g mysql -m 750 "$STATE/mysql" "$STATE/mysqld"
    mariadb-install-db --no-defaults --user=mysql --datadir="$STATE/mysql" \
        --auth-root-authentication-method=socket --skip-test-db \
        >"$STATE/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed (see log)"
    spawn mariadb mariadbd --no-defaults --user=mysql --datadir="$STATE/mysql" \
        --socket="$STATE/mysqld/mysqld.sock" --pid-file="$STATE/mysqld/mariadb.pid" \
        --port=$MYSQL_PORT --bind-address=127.0.0.1 --skip-name-resolve \
        --innodb-buffer-pool-size=64M --log-error="$STATE/log/mariadb.log"
    wait_for mariadb 60 "$STATE/log/mariadb.log" \
        mariadb-admin --no-defaults --socket="$STATE/mysqld/mysqld.sock" -u root ping
    mysql_cmd -e "CREATE DATABASE slurm_acct_db;
        CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmtest';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
}

start_slurmdbd() {
    spawn slurmdbd slurmdbd -D
    wait_for slurmdbd 30 "$STATE/log/slurmdbd.log" sacctmgr -n list cluster
    # The Snakemake slurm plugin validates the account, so create a real one.
    sacctmgr -i add cluster "$CLUSTER" >/dev/null
    sacctmgr -i add account "$ACCOUNT" Cluster="$CLUSTER" Description=tests Organization=ddpflow \
        >/dev/null
    sacctmgr -i add user root Account="$ACCOUNT" DefaultAccount="$ACCOUNT" >/dev/null
}

start_slurmctld() {
    spawn slurmctld slurmctld -D -i
    wait_for slurmctld 30 "$STATE/log/slurmctld.log" scontrol ping
}

# NOT `ip netns exec`: it remounts /sys, hides the cgroup mounts and slurmd
# dies ("Unable to initialize cgroup plugin").  nsenter + unshare --uts (no
# --fork) + exec all replace themselves, so $! is slurmd's own PID.
start_slurmds() {
    local i
    for ((i = 1; i <= $(node_count); i++)); do
        spawn "slurmd-node$i" nsenter --net="/run/netns/${PREFIX}-node$i" unshare --uts \
            sh -c "hostname node$i && exec slurmd -D -N node$i"
    done
}

nodes_ready() {
    local states
    states=$(sinfo -h -N -o '%t' 2>/dev/null | sort -u)
    [[ $states == idle ]] && (($(sinfo -h -N -o '%N' | sort -u | wc -l) == $(node_count)))
}

# ---------------------------------------------------------------- status
# Usable = every recorded daemon alive and every node in a schedulable state.
cluster_healthy() {
    [[ -d $STATE/pids ]] || return 1
    local f n=0
    for f in "$STATE"/pids/*.pid; do
        [[ -e $f ]] || return 1
        alive "$(cat "$f")" || return 1
        n=$((n + 1))
    done
    ((n == 4 + $(node_count))) || return 1   # munged mariadb slurmdbd slurmctld
    scontrol ping >/dev/null 2>&1 || return 1
    local bad
    bad=$(sinfo -h -N -o '%t' 2>/dev/null | grep -cvE '^(idle|mix|alloc|comp|plnd)$' || true)
    [[ $bad == 0 ]] && (($(sinfo -h -N -o '%N' | sort -u | wc -l) == $(node_count)))
}

dead_daemons() {
    local f
    for f in "$STATE"/pids/*.pid; do
        [[ -e $f ]] || continue
        alive "$(cat "$f")" || echo "  dead: $(basename "$f" .pid) (pid $(cat "$f"))"
    done
    return 0
}

# Anything of ours present at all (to detect a half-started leftover).
anything_left() {
    [[ -n $(leftovers) ]]
}

# One line per leftover object; empty when the machine is clean.
leftovers() {
    local f pid ns
    if [[ -d $STATE/pids ]]; then
        for f in "$STATE"/pids/*.pid; do
            [[ -e $f ]] || continue
            pid=$(cat "$f")
            alive "$pid" && echo "process $(basename "$f" .pid) (pid $pid) alive"
        done
    fi
    for ns in $(our_netns); do echo "network namespace $ns"; done
    ip link show "$BRIDGE" >/dev/null 2>&1 && echo "bridge $BRIDGE"
    ip -o link show 2>/dev/null | grep -oE "${PREFIX}-n[0-9]+" | sort -u | sed 's/^/veth /'
    grep -qxF "$HOSTS_BEGIN" /etc/hosts && echo "/etc/hosts block"
    [[ -L $ETC_LINK && $(readlink "$ETC_LINK") == "$SLURM_CONF_FILE" ]] && echo "symlink $ETC_LINK"
    return 0
}

our_netns() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}-node[0-9]+$" || true; }

# ---------------------------------------------------------------- teardown
# SIGTERM a group of recorded daemons together, SIGKILL what survives $2 s.
stop_group() {
    local grace=$1
    shift
    local name pids=() pid end
    for name in "$@"; do
        [[ -f $STATE/pids/$name.pid ]] || continue
        pid=$(cat "$STATE/pids/$name.pid")
        kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
    done
    end=$((SECONDS + grace))
    for pid in "${pids[@]}"; do
        while alive "$pid" && ((SECONDS < end)); do sleep 0.1; done
        alive "$pid" && { log "SIGKILL $pid"; kill -KILL "$pid" 2>/dev/null || true; }
    done
    end=$((SECONDS + 5))   # SIGKILL is near-immediate; bounded in case of a zombie
    for pid in "${pids[@]}"; do
        while alive "$pid" && ((SECONDS < end)); do sleep 0.1; done
    done
}

cancel_jobs() {
    # Only ask a controller we started (a dead one makes scontrol retry for seconds).
    [[ -f $STATE/pids/slurmctld.pid ]] && alive "$(cat "$STATE/pids/slurmctld.pid")" \
        || return 0
    scontrol ping >/dev/null 2>&1 || return 0
    scancel --user=root --full 2>/dev/null || true
    local end=$((SECONDS + 15))
    while [[ -n $(squeue -h -t all -o %i 2>/dev/null | head -1) ]] && ((SECONDS < end)); do
        # squeue keeps finished jobs for MinJobAge; only wait for live ones.
        [[ -z $(squeue -h -o %i -t PD,R,CG,CF,S,RQ 2>/dev/null | head -1) ]] && break
        sleep 0.5
    done
}

# Job processes (slurmstepd and their children) live in the node namespaces;
# they were started by our slurmds, so kill them by PID before deleting.
kill_netns_processes() {
    local ns pids
    for ns in $(our_netns); do
        pids=$(ip netns pids "$ns" 2>/dev/null | xargs)
        [[ -z $pids ]] && continue
        log "killing leftover processes in $ns: $pids"
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
    done
}

net_down() {
    local ns l
    for l in $(ip -o link show 2>/dev/null | grep -oE "${PREFIX}-n[0-9]+" | sort -u); do
        ip link del "$l" 2>/dev/null || true
    done
    for ns in $(our_netns); do ip netns del "$ns" 2>/dev/null || true; done
    ip link del "$BRIDGE" 2>/dev/null || true
}

cmd_down() {
    local t0=$SECONDS
    exec 9>"$STATE.lock"
    flock -w 300 9 || die "another cluster.sh holds $STATE.lock"
    teardown
    local left
    left=$(leftovers)
    log "teardown: $((SECONDS - t0)) s"
    if [[ -n $left ]]; then
        log "NOT CLEAN, still present:"
        printf '  %s\n' "$left" >&2
        exit 1
    fi
    log "down: nothing left"
}

teardown() {
    cancel_jobs
    local nodes=() i
    for ((i = 1; i <= MAX_NODES; i++)); do nodes+=("slurmd-node$i"); done
    stop_group 15 "${nodes[@]}" slurmctld
    stop_group 15 slurmdbd
    stop_group 15 mariadb munged
    # The DB (~180 MB) is rebuilt by every `up`; logs stay for post-mortems.
    if [[ ! -f $STATE/pids/mariadb.pid ]] || ! alive "$(cat "$STATE/pids/mariadb.pid")"; then
        rm -rf "$STATE/mysql"
    fi
    kill_netns_processes
    net_down
    hosts_strip
    unlink_conf
    forget_dead_pids
}

# Keep the PID file of anything still alive, so `down` can name it.
forget_dead_pids() {
    local f
    for f in "$STATE"/pids/*.pid; do
        [[ -e $f ]] || continue
        alive "$(cat "$f")" || rm -f "$f"
    done
    [[ -n $(ls -A "$STATE/pids" 2>/dev/null) ]] || rm -rf "$STATE/pids" "$STATE/nodes"
}

# ---------------------------------------------------------------- up
cmd_up() {
    preflight
    exec 9>"$STATE.lock"
    flock -w 300 9 || die "another cluster.sh holds $STATE.lock"
    if [[ -n ${NODES:-} && -f $STATE/nodes && $NODES != "$(cat "$STATE/nodes")" ]]; then
        log "running with $(cat "$STATE/nodes") nodes but NODES=$NODES: rebuilding"
        teardown
    fi
    if [[ -f $STATE/shape && "$NODE_CPUS $NODE_MEM_MB" != "$(cat "$STATE/shape")" ]]; then
        log "nodes of $(cat "$STATE/shape") (CPUs, MB) but $NODE_CPUS $NODE_MEM_MB asked: rebuilding"
        teardown
    fi
    if cluster_healthy; then
        log "already up and healthy ($(node_names | xargs)); nothing to do"
        return 0
    fi
    if anything_left; then
        log "half-started leftover found; tearing it down first"
        teardown
        [[ -z $(leftovers) ]] || die "could not clean leftover: $(leftovers | xargs)"
    fi
    local t0=$SECONDS
    install_packages
    log "install: $((SECONDS - t0)) s"
    t0=$SECONDS
    start_all
    log "start: $((SECONDS - t0)) s ($(node_names | xargs) idle)"
}

start_all() {
    # From scratch: fresh state dir => job ids restart at 1 and the DB is empty.
    rm -rf "$STATE"
    mkdir -p "$STATE"
    echo "${NODES:-2}" >"$STATE/nodes"
    echo "$NODE_CPUS $NODE_MEM_MB" >"$STATE/shape"
    write_configs
    link_conf
    net_up
    hosts_add
    start_munge
    start_mariadb
    start_slurmdbd
    start_slurmctld
    start_slurmds
    wait_for "all nodes idle" 60 "$STATE/log/slurmd-node1.log" nodes_ready
}

cmd_status() {
    if [[ ! -f $STATE/nodes ]]; then
        echo "cluster is down (no $STATE/nodes)"
        return 1
    fi
    sinfo -N -o '%N %P %t %c %m %G' 2>&1 || true
    if cluster_healthy; then
        echo "cluster is up"
    else
        echo "cluster is NOT healthy (slurmctld only notices a dead slurmd after minutes):"
        dead_daemons
        return 1
    fi
}

cmd_env() {
    cat <<EOF
export SLURM_CONF=$SLURM_CONF_FILE
export DDPFLOW_SLURM_DIR=$STATE
export DDPFLOW_SLURM_CLUSTER=$CLUSTER
export DDPFLOW_SLURM_PARTITION=$PARTITION
export DDPFLOW_SLURM_SHORT_PARTITION=$SHORT_PARTITION
export DDPFLOW_SLURM_ACCOUNT=$ACCOUNT
export DDPFLOW_SLURM_NODES="$(node_names | xargs)"
EOF
}

case ${1:-} in
up)
    [[ -z ${2:-} ]] || NODES=$2
    cmd_up
    ;;
down) cmd_down ;;
status) cmd_status ;;
env) cmd_env ;;
install) install_packages ;;
*)
    echo "usage: $0 up [NODES]|down|status|env|install" >&2
    exit 2
    ;;
esac
