#!/usr/bin/env bash
# A real Slurm controller on this one machine, for the `slurm` tests and for trying the
# launch scripts by hand: munged + slurmctld + one slurmd per emulated node, with fake GPUs.
#
#   bash tests/slurm/cluster.sh start [--nodes N]   # idempotent; prints `export SLURM_CONF=...`
#   eval "$(bash tests/slurm/cluster.sh env)"       # point sbatch/squeue/scontrol at it
#   bash tests/slurm/cluster.sh status
#   bash tests/slurm/cluster.sh stop                # stops only the daemons this script started
#
# Options (also from the environment): --state-dir DIR (TG_SLURM_STATE; default
# $TMPDIR/megatron-tg-slurm), --nodes N (TG_SLURM_NODES, 2), --gpus-per-node G (8),
# --cpus-per-node C (16), --port-base P (TG_SLURM_PORT_BASE, 17000: slurmctld on P,
# slurmd nK on P+K).
#
# Needs root (slurmd starts job steps as the submitting user) and the Debian packages
# `slurm-wlm munge`. Everything it writes lives under the state dir: its own munge key and
# socket, so a munged or Slurm already running on the machine is neither used nor touched.
# Emulated nodes n1..nN all point at 127.0.0.1; config_overrides lets them declare more
# CPUs than the machine has, and the GPUs are character devices standing in for /dev/nvidia*.
set -euo pipefail

usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; }

cmd="${1:-}"
[ $# -gt 0 ] && shift
state="${TG_SLURM_STATE:-${TMPDIR:-/tmp}/megatron-tg-slurm}"
nodes="${TG_SLURM_NODES:-2}"
gpus=8
cpus=16
port_base="${TG_SLURM_PORT_BASE:-17000}"
while [ $# -gt 0 ]; do
  case "$1" in
    --state-dir) state="$2"; shift 2 ;;
    --nodes) nodes="$2"; shift 2 ;;
    --gpus-per-node) gpus="$2"; shift 2 ;;
    --cpus-per-node) cpus="$2"; shift 2 ;;
    --port-base) port_base="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "cluster.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
conf="$state/etc/slurm.conf"
munge_dir="$state/munge"
socket="$munge_dir/munge.socket"
host="$(hostname -s)"

die() { echo "cluster.sh: $*" >&2; exit 1; }

# ---------------------------------------------------------------- pids of our daemons
# A pid file names one of ours only while that process still runs with our config or
# socket on its command line; a stale file (or a recycled pid) is never acted on.
our_pid() {  # pidfile marker -> prints the pid when it is live and ours
  local pid
  [ -s "$1" ] || return 1
  pid="$(tr -dc '0-9' <"$1")"
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$2" || return 1
  echo "$pid"
}
ctld_pid() { our_pid "$state/run/slurmctld.pid" "$conf"; }
slurmd_pid() { our_pid "$state/run/slurmd-$1.pid" "$conf"; }
munged_pid() { our_pid "$munge_dir/munged.pid" "$socket"; }

wait_gone() {  # pid seconds
  local i
  for ((i = 0; i < $2 * 10; i++)); do
    [ -d "/proc/$1" ] || return 0
    sleep 0.1
  done
  return 1
}

stop_pids() {  # "name pid"...: TERM to all at once (each takes 2-3 s to exit), KILL stragglers
  local entry pid
  for entry in "$@"; do
    echo "cluster.sh: stopping ${entry% *} (pid ${entry##* })"
    kill -TERM "${entry##* }" 2>/dev/null || true
  done
  for entry in "$@"; do
    pid="${entry##* }"
    wait_gone "$pid" 15 || { kill -KILL "$pid" 2>/dev/null || true; wait_gone "$pid" 5 || true; }
  done
}

# ---------------------------------------------------------------- configuration
# The config's identity: a running cluster is reused only when it was started with the
# same shape; a node-count change needs a restart, `scontrol reconfigure` does not do it.
shape() { echo "nodes=$nodes gpus=$gpus cpus=$cpus port_base=$port_base"; }

write_config() {
  mkdir -p "$state"/{etc,run,log,ctld,dev} "$state"/spool
  local i
  for ((i = 0; i < gpus; i++)); do
    # Character devices are all gres.conf needs; 1:3 is /dev/null's, harmless to open.
    [ -c "$state/dev/gpu$i" ] || mknod "$state/dev/gpu$i" c 1 3
  done
  cat >"$conf" <<EOF
# Written by tests/slurm/cluster.sh ($(shape)); rewritten on every start.
ClusterName=tgtest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port_base
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
# Our own munged; cred_expire=10 cuts a requeued job's restart delay from ~142 s to ~14 s.
AuthInfo=socket=$socket,cred_expire=10
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool/%n
SlurmctldPidFile=$state/run/slurmctld.pid
SlurmdPidFile=$state/run/slurmd-%n.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No systemd or cgroups here: plain process tracking, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Heterogeneous jobs are placed by backfill, requeued jobs by the main loop; 1 s intervals
# (defaults 30 s and 60 s) keep the tests fast.
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=600
GresTypes=gpu
SlurmdParameters=config_overrides
NodeName=n[1-$nodes] NodeHostname=$host NodeAddr=127.0.0.1 Port=$((port_base + 1))-$((port_base + nodes)) CPUs=$cpus Gres=gpu:$gpus State=UNKNOWN
PartitionName=debug Nodes=n[1-$nodes] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  echo "NodeName=n[1-$nodes] Name=gpu File=$state/dev/gpu[0-$((gpus - 1))]" >"$state/etc/gres.conf"
  shape >"$state/shape"
}

# ---------------------------------------------------------------- daemons
start_munged() {
  munged_pid >/dev/null && return 0
  mkdir -p "$munge_dir"
  chmod 0755 "$state"
  runuser -u munge -- test -x "$munge_dir" \
    || die "munged runs as user munge and cannot reach $munge_dir (a parent directory is private); use a --state-dir such as /tmp/megatron-tg-slurm"
  # munged refuses to run as root ("Logfile is insecure") and checks that its files are
  # owned by its user and not writable by others.
  chown munge: "$munge_dir"
  chmod 0755 "$munge_dir"  # clients connect to the socket in it
  if [ ! -s "$munge_dir/munge.key" ]; then
    runuser -u munge -- dd if=/dev/urandom of="$munge_dir/munge.key" bs=1024 count=1 status=none
    chmod 0400 "$munge_dir/munge.key"
  fi
  runuser -u munge -- munged --socket="$socket" --key-file="$munge_dir/munge.key" \
    --pid-file="$munge_dir/munged.pid" --log-file="$munge_dir/munged.log" \
    --seed-file="$munge_dir/munged.seed"
  local i
  for ((i = 0; i < 50; i++)); do
    munged_pid >/dev/null && [ -S "$socket" ] && return 0
    sleep 0.1
  done
  die "munged did not start; see $munge_dir/munged.log"
}

start_slurmctld() {
  ctld_pid >/dev/null && return 0
  # -c: a fresh controller forgets jobs from an earlier session of this state dir.
  slurmctld -c -f "$conf" || die "slurmctld failed to start; see $state/log/slurmctld.log"
}

start_slurmd() {  # node
  slurmd_pid "$1" >/dev/null && return 0
  slurmd -f "$conf" -N "$1" || die "slurmd $1 failed to start; see $state/log/slurmd-$1.log"
}

wait_idle() {
  local i states
  for ((i = 0; i < 300; i++)); do
    states="$(SLURM_CONF="$conf" sinfo -h -N -o '%N %T' 2>/dev/null || true)"
    if [ "$(grep -c ' idle$' <<<"$states" || true)" -eq "$nodes" ]; then
      return 0
    fi
    sleep 0.1
  done
  die "nodes not idle after 30 s: $(tr '\n' ';' <<<"$states"); see $state/log/"
}

stop_all() {
  local pid f node slurm=()
  for f in "$state"/run/slurmd-*.pid; do
    [ -e "$f" ] || continue
    node="$(basename "$f" .pid)"
    node="${node#slurmd-}"
    if pid="$(slurmd_pid "$node")"; then slurm+=("slurmd-$node $pid"); fi
  done
  if pid="$(ctld_pid)"; then slurm+=("slurmctld $pid"); fi
  if [ "${#slurm[@]}" -gt 0 ]; then stop_pids "${slurm[@]}"; fi
  # munged last: the Slurm daemons authenticate through it until they are gone.
  if pid="$(munged_pid)"; then stop_pids "munged $pid"; fi
}

print_env() { echo "export SLURM_CONF=$conf"; }

case "$cmd" in
  start)
    [ "$(id -u)" -eq 0 ] || die "needs root (slurmd launches job steps as the submitting user)"
    for tool in slurmctld slurmd munged sbatch; do
      command -v "$tool" >/dev/null || die "'$tool' not found; install with: apt-get install -y slurm-wlm munge"
    done
    id munge >/dev/null 2>&1 || die "no 'munge' user; install with: apt-get install -y munge"
    if [ -e "$state/shape" ] && [ "$(cat "$state/shape")" != "$(shape)" ]; then
      echo "cluster.sh: shape changed ($(cat "$state/shape") -> $(shape)); restarting"
      stop_all
    fi
    write_config
    start_munged
    start_slurmctld
    for ((k = 1; k <= nodes; k++)); do start_slurmd "n$k"; done
    wait_idle
    print_env
    ;;
  stop)
    stop_all
    ;;
  status)
    up=0
    if pid="$(munged_pid)"; then echo "munged    pid $pid"; up=$((up + 1)); fi
    if pid="$(ctld_pid)"; then echo "slurmctld pid $pid"; up=$((up + 1)); fi
    for ((k = 1; k <= nodes; k++)); do
      if pid="$(slurmd_pid "n$k")"; then echo "slurmd n$k pid $pid"; up=$((up + 1)); fi
    done
    [ "$up" -gt 0 ] || { echo "cluster.sh: not running (state dir $state)"; exit 1; }
    ;;
  env)
    print_env
    ;;
  -h|--help|"")
    usage
    ;;
  *)
    echo "cluster.sh: unknown command '$cmd'" >&2; usage >&2; exit 2
    ;;
esac
