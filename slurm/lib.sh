# shellcheck shell=bash
# The body of every slurm/tg_*.sh: plan the roles, start the servers as srun steps, wait
# for their /health, run the trainer, forward Slurm's signals, requeue, tear down.
# Sourced by the wrappers, which set RECIPE and the #SBATCH header and then call tg_main.
#
# One script, three ways in (see tg_main):
#   bash slurm/tg_30b.sh --dry-run [--nodes N]   outside Slurm: print the plan, start nothing
#   bash slurm/tg_30b.sh [sbatch opts] [k=v ..]  outside Slurm: size --nodes from the plan, sbatch
#   sbatch slurm/tg_30b.sh [k=v ..]              the batch job itself (DRY_RUN=1: plan only)
#
# Knobs (environment; empty = from the recipe through megatron-tg plan):
#   run       RECIPE, OVERRIDES ("k=v k=v", before the command line's), JOB_DIR
#             (default runs/slurm/<job name>-<job id>), DRY_RUN=1
#   sizes     TRAIN_NODES, ROLLOUT_NODES, JUDGE_NODES, GPUS_PER_NODE, ACCEL=gpu|cpu
#   rollout   ENGINE=sglang|embedded, ENGINE_MODEL, ENGINE_CMD, ENGINE_ARGS,
#             ROUTER=0|1, ROUTER_CMD, ROUTER_ARGS
#   judge     JUDGE_MODEL, JUDGE_NAME, JUDGE_TP, JUDGE_CMD, JUDGE_ARGS, or JUDGE_URL (external)
#   service   SERVICE=0|1 (the rollout side as its own step; empty: the recipe's
#             rollout.service), SERVICE_CMD, SERVICE_ARGS
#   trainer   TRAINER_CMD (default "$PYTHON -m megatron_tg.train"), PYTHON (default python3)
#   network   PORT_BASE (default 29500; every port of the job is an offset from it)
#   placement STEP_CPUS_PER_TASK (empty: a step gets its whole nodes; set: --exact with
#             that many CPUs per task, so steps can share a node)
#   timing    HEALTH_TIMEOUT (s, default 1800), HEALTH_POLL (s, 5), TEARDOWN_GRACE (s, 30),
#             TRAIN_EXIT_WAIT (s, 300: how long ranks may outlive the first one to exit),
#             USR1_LEAD (s: the job's --signal=B:USR1@N; the planner refuses one shorter than a
#             step plus a checkpoint save)
#
# Only what this script started is ever stopped: its own steps, by step id
# ($SLURM_JOB_ID.<step>, looked up by the step's name), never by process name.

TG_EX_REQUEUE=75  # the trainer's "checkpointed, requeue me" exit status (EX_TEMPFAIL)
TG_BASE_OVERRIDES=()  # the wrapper's own overrides (tg_tiny.sh: CPU), set after sourcing

# The plan, as megatron-tg plan --format env writes it to $TG_JOB_DIR/plan.env.
# Parallel arrays: TG_STEP_*[i] is srun step i, TG_SERVER_*[j] HTTP server j.
TG_ACCEL="" TG_MASTER_ADDR="" TG_MASTER_PORT="" TG_SYNC_MASTER="" TG_ROUTER_URL="" TG_JUDGE_URL="" TG_KEY_FILE=""
TG_TRAIN_ARGS=() TG_BLOCKERS=()
TG_STEP_NAME=() TG_STEP_ROLE=() TG_STEP_NODELIST=() TG_STEP_NNODES=() TG_STEP_NTASKS=()
TG_STEP_TASKS_PER_NODE=() TG_STEP_GPUS_PER_TASK=() TG_STEP_GPUS_PER_NODE=() TG_STEP_OVERLAP=()
TG_STEP_OUTPUT=()
TG_SERVER_NAME=() TG_SERVER_ROLE=() TG_SERVER_HOST=() TG_SERVER_URL=() TG_SERVER_LOG=() TG_SERVER_STEP=()

tg_log() { printf '[tg %s] %s\n' "$(date '+%F %T')" "$*"; }
tg_die() { tg_log "ERROR: $*" >&2; exit 1; }

# ------------------------------------------------------------------ knobs -> planner flags

tg_defaults() {
  : "${RECIPE:?the wrapper sets RECIPE}"
  PYTHON="${PYTHON:-python3}"
  TRAINER_CMD="${TRAINER_CMD:-$PYTHON -m megatron_tg.train}"
  HEALTH_TIMEOUT="${HEALTH_TIMEOUT:-1800}"
  HEALTH_POLL="${HEALTH_POLL:-5}"
  TEARDOWN_GRACE="${TEARDOWN_GRACE:-30}"
  TRAIN_EXIT_WAIT="${TRAIN_EXIT_WAIT:-300}"
  # task.sh runs in the steps' environment, which is this one's exported part.
  export PYTHON TG_ROOT
}

# Flags for megatron-tg plan, one group per concern; unset knobs stay with the recipe.
tg_plan_flags() {
  TG_PLAN_FLAGS=(--recipe "$RECIPE")
  local pair flag var
  for pair in \
      --train-nodes=TRAIN_NODES --rollout-nodes=ROLLOUT_NODES --judge-nodes=JUDGE_NODES \
      --gpus-per-node=GPUS_PER_NODE --accel=ACCEL \
      --engine=ENGINE --engine-model=ENGINE_MODEL --router=ROUTER \
      --judge-model=JUDGE_MODEL --judge-name=JUDGE_NAME --judge-url=JUDGE_URL --judge-tp=JUDGE_TP \
      --service=SERVICE \
      --port-base=PORT_BASE --usr1-lead=USR1_LEAD; do
    flag="${pair%%=*}" var="${pair#*=}"
    if [ -n "${!var:-}" ]; then TG_PLAN_FLAGS+=("$flag" "${!var}"); fi
  done
}

# key=value overrides: the wrapper's (TG_BASE_OVERRIDES), then $OVERRIDES, then the command line.
tg_collect_overrides() {
  local extra=()
  read -r -a extra <<<"${OVERRIDES:-}"
  TG_OVERRIDES=("${TG_BASE_OVERRIDES[@]}" "${extra[@]}" "$@")
}

tg_plan() {  # format [planner args...] -> stdout
  local format="$1"
  shift
  "$PYTHON" -m megatron_tg.cli plan "${TG_PLAN_FLAGS[@]}" --format "$format" "$@" -- "${TG_OVERRIDES[@]}"
}

# ------------------------------------------------------------------ nodes

# Allocation order from Slurm, and the address each node is reached by (NodeAddr: the
# emulated test nodes share 127.0.0.1 and have names no resolver knows).
tg_resolve_nodes() {
  mapfile -t TG_HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  local -A addr=()
  local name value field fields=()
  while read -r -a fields; do
    name="" value=""
    for field in "${fields[@]}"; do
      case "$field" in
        NodeName=*) name="${field#NodeName=}" ;;
        NodeAddr=*) value="${field#NodeAddr=}" ;;
      esac
    done
    if [ -n "$name" ]; then addr[$name]="${value:-$name}"; fi
  done < <(scontrol -o show node "$SLURM_JOB_NODELIST")
  TG_ADDRS=()
  for name in "${TG_HOSTS[@]}"; do TG_ADDRS+=("${addr[$name]:-$name}"); done
  [ "${#TG_HOSTS[@]}" -eq "${SLURM_JOB_NUM_NODES:-${#TG_HOSTS[@]}}" ] \
    || tg_die "scontrol gave ${#TG_HOSTS[@]} hosts for $SLURM_JOB_NUM_NODES nodes ($SLURM_JOB_NODELIST)"
}

# ------------------------------------------------------------------ steps

TG_STEP_PID=()      # srun pid per started step (index = plan step index)
TG_STARTED=()       # step indices in start order
TG_TRAIN_STEP=""    # index of the trainer's step once started
TG_SIGNAL=""        # USR1/TERM once Slurm asked us to stop
TG_INTERRUPTED=0    # a trap ran while we were in `wait`

tg_step_index() {  # role -> the first plan step of that role
  local i
  for i in "${!TG_STEP_ROLE[@]}"; do
    if [ "${TG_STEP_ROLE[i]}" = "$1" ]; then echo "$i"; return 0; fi
  done
  return 1
}

tg_step_id() {  # step index -> "$SLURM_JOB_ID.<n>" while Slurm knows the step
  squeue -h -s -j "$SLURM_JOB_ID" -o '%i %j' 2>/dev/null | awk -v n="${TG_STEP_NAME[$1]}" '$2 == n {print $1; exit}'
}

tg_step_alive() { [ -n "${TG_STEP_PID[$1]:-}" ] && kill -0 "${TG_STEP_PID[$1]}" 2>/dev/null; }

tg_start_step() {  # step index [command...]; defaults to slurm/task.sh for server steps
  local i="$1"
  shift
  local args=()
  # placement: exactly the plan's nodes and task counts
  args+=(--job-name="${TG_STEP_NAME[i]}" --nodes="${TG_STEP_NNODES[i]}" --nodelist="${TG_STEP_NODELIST[i]}"
         --ntasks="${TG_STEP_NTASKS[i]}" --ntasks-per-node="${TG_STEP_TASKS_PER_NODE[i]}")
  # GPUs: per task for engines packed on a node (Slurm binds each task to its own), per node
  # for the trainer (rank = SLURM_LOCALID picks the device) and node-spanning servers, none
  # for CPU-only helpers. Slurm 22.05's --overlap shares GPUs too, so disaggregated, only
  # GPU-less steps overlap, and they must say --gpus-per-node=0 (--gres=none is rejected when
  # the job asked for --gpus-per-node). Colocated, the engines' and the trainer's steps both
  # take --gpus-per-node and --overlap: they share the node's GPUs, taking turns.
  if [ "${TG_STEP_GPUS_PER_TASK[i]}" -gt 0 ]; then
    args+=(--gpus-per-task="${TG_STEP_GPUS_PER_TASK[i]}")
  elif [ "${TG_STEP_GPUS_PER_NODE[i]}" -gt 0 ]; then
    args+=(--gpus-per-node="${TG_STEP_GPUS_PER_NODE[i]}")
  elif [ "$TG_ACCEL" = gpu ]; then
    args+=(--gpus-per-node=0)
  fi
  if [ "${TG_STEP_OVERLAP[i]}" = 1 ]; then
    args+=(--overlap)
  elif [ -n "${STEP_CPUS_PER_TASK:-}" ]; then
    # GPU steps sharing a node (slurm/preflight.sh): a step takes every CPU of its nodes
    # unless --exact, and the next one would wait for them ("Requested nodes are busy").
    args+=(--exact --cpus-per-task="$STEP_CPUS_PER_TASK")
  fi
  # output: one file per step, appended across requeues; servers also write their own log
  args+=(--output="${TG_STEP_OUTPUT[i]}" --open-mode=append)
  # lifetime: a server rank that dies takes its step down (health wait sees it at once);
  # trainer ranks get TRAIN_EXIT_WAIT after the first exits, time to finish a checkpoint.
  if [ "${TG_STEP_ROLE[i]}" = train ]; then
    args+=(--label --wait="$TRAIN_EXIT_WAIT")
  else
    args+=(--kill-on-bad-exit=1 --export="ALL,TG_STEP_INDEX=$i")
  fi
  if [ $# -eq 0 ]; then set -- bash "$TG_ROOT/slurm/task.sh"; fi
  tg_log "start ${TG_STEP_NAME[i]} on ${TG_STEP_NODELIST[i]}: srun ${args[*]} $*"
  srun "${args[@]}" "$@" &
  TG_STEP_PID[i]=$!
  TG_STARTED+=("$i")
}

tg_start_servers() {  # role...: start every step of these roles
  local i role
  for i in "${!TG_STEP_ROLE[@]}"; do
    for role in "$@"; do
      if [ "${TG_STEP_ROLE[i]}" = "$role" ]; then tg_start_step "$i"; fi
    done
  done
}

tg_sleep() { sleep "$1" & wait $! || true; }  # a trap interrupts this, unlike a bare sleep

tg_server_failure() {  # server index, reason
  local j="$1" log="${TG_SERVER_LOG[$1]}"
  tg_log "ERROR: ${TG_SERVER_ROLE[j]} ${TG_SERVER_NAME[j]} on ${TG_SERVER_HOST[j]} (${TG_SERVER_URL[j]}) $2; log: $log (step log: ${TG_STEP_OUTPUT[${TG_SERVER_STEP[j]}]})" >&2
  if [ -s "$log" ]; then
    tg_log "last lines of $log:" >&2
    tail -n 20 "$log" | sed 's/^/    /' >&2
  fi
}

# Wait until every server of these roles answers /health. Fails fast when a server's step
# has exited, and at HEALTH_TIMEOUT naming every server still down, with its host and log.
tg_wait_healthy() {  # role...
  local pending=() still=() urls=() ok=() j role t0=$SECONDS
  for j in "${!TG_SERVER_ROLE[@]}"; do
    for role in "$@"; do
      if [ "${TG_SERVER_ROLE[j]}" = "$role" ]; then pending+=("$j"); fi
    done
  done
  while [ "${#pending[@]}" -gt 0 ]; do
    if [ -n "$TG_SIGNAL" ]; then tg_log "SIG$TG_SIGNAL while waiting for servers"; return 1; fi
    urls=()
    for j in "${pending[@]}"; do urls+=("${TG_SERVER_URL[j]}"); done
    mapfile -t ok < <("$PYTHON" -m megatron_tg.launch.health --timeout 5 "${urls[@]}")
    still=()
    for j in "${pending[@]}"; do
      if printf '%s\n' "${ok[@]}" | grep -qxF -- "${TG_SERVER_URL[j]}"; then
        tg_log "${TG_SERVER_NAME[j]} healthy on ${TG_SERVER_HOST[j]} after $((SECONDS - t0)) s"
      elif ! tg_step_alive "${TG_SERVER_STEP[j]}"; then
        tg_server_failure "$j" "exited before it became healthy"
        return 1
      else
        still+=("$j")
      fi
    done
    pending=("${still[@]}")
    if [ "${#pending[@]}" -gt 0 ] && [ $((SECONDS - t0)) -ge "$HEALTH_TIMEOUT" ]; then
      for j in "${pending[@]}"; do tg_server_failure "$j" "not healthy after $HEALTH_TIMEOUT s (HEALTH_TIMEOUT)"; done
      return 1
    fi
    if [ "${#pending[@]}" -gt 0 ]; then tg_sleep "$HEALTH_POLL"; fi
  done
}

tg_signal_step() {  # step index, signal: to the tasks themselves (srun would turn TERM into a kill)
  local id
  id="$(tg_step_id "$1")"
  if [ -n "$id" ]; then
    # --ctld: slurmctld knows which nodes run the step; straight to the slurmds, scancel
    # also asks the job's other nodes and reports their "Invalid job id" as an error.
    scancel --ctld --signal="$2" "$id" || true
  elif tg_step_alive "$1"; then
    kill -s "$2" "${TG_STEP_PID[$1]}" 2>/dev/null || true  # not registered yet: srun forwards it
  fi
}

# Stop every step this script started, newest first: TERM to the tasks, TEARDOWN_GRACE
# seconds to exit, then scancel the step. Idempotent; the EXIT trap calls it too.
tg_teardown() {
  [ -z "${TG_TORN_DOWN:-}" ] || return 0
  TG_TORN_DOWN=1
  local i n live=() deadline
  for ((n = ${#TG_STARTED[@]} - 1; n >= 0; n--)); do
    i="${TG_STARTED[n]}"
    if tg_step_alive "$i"; then live+=("$i"); tg_signal_step "$i" TERM; fi
  done
  [ "${#live[@]}" -gt 0 ] || return 0
  tg_log "teardown: stopping ${#live[@]} step(s)"
  deadline=$((SECONDS + TEARDOWN_GRACE))
  for i in "${live[@]}"; do
    while tg_step_alive "$i" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.5; done
    if tg_step_alive "$i"; then
      local id
      id="$(tg_step_id "$i")"
      tg_log "teardown: ${TG_STEP_NAME[i]} still running after $TEARDOWN_GRACE s; scancel ${id:-pid ${TG_STEP_PID[i]}}"
      if [ -n "$id" ]; then scancel "$id" || true; else kill -KILL "${TG_STEP_PID[i]}" 2>/dev/null || true; fi
    fi
    wait "${TG_STEP_PID[i]}" 2>/dev/null || true
  done
  tg_log "teardown: done"
}

# Slurm's warning (--signal=B:USR1@N) or a TERM: pass it to the trainer, whose contract is
# to finish the step, checkpoint and exit 75; the main loop keeps waiting for that.
tg_on_signal() {
  TG_INTERRUPTED=1
  [ -z "$TG_SIGNAL" ] || return 0
  TG_SIGNAL="$1"
  if [ -n "$TG_TRAIN_STEP" ] && tg_step_alive "$TG_TRAIN_STEP"; then
    tg_log "SIG$1: forwarding to the trainer (${TG_STEP_NAME[$TG_TRAIN_STEP]}) and waiting for its checkpoint"
    tg_signal_step "$TG_TRAIN_STEP" "$1"
  else
    tg_log "SIG$1 before the trainer started"
  fi
}

tg_wait_step() {  # step index -> the step's exit status, however many traps interrupt
  local rc
  while :; do
    TG_INTERRUPTED=0
    rc=0
    wait "${TG_STEP_PID[$1]}" || rc=$?
    # >128 with a trap having run means `wait` was cut short, not that srun exited.
    if [ "$TG_INTERRUPTED" = 1 ] && [ "$rc" -gt 128 ]; then continue; fi
    return "$rc"
  done
}

tg_job_state() { scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | head -n1 | cut -d= -f2; }

# Exit 75 asks for a requeue. Only a RUNNING job is requeued: on `scancel` or the time
# limit the job is already COMPLETING, and requeueing it would undo the user's cancel.
tg_requeue() {
  local state
  state="$(tg_job_state)"
  if [ "$state" != RUNNING ]; then
    tg_log "not requeueing: the job is ${state:-gone} (cancelled or out of time), not RUNNING"
    exit "$TG_EX_REQUEUE"
  fi
  tg_teardown  # before the requeue: Slurm ends this script as part of it
  if scontrol requeue "$SLURM_JOB_ID"; then
    tg_log "requeued job $SLURM_JOB_ID; the next run resumes from checkpoint.dir"
    exit 0
  fi
  tg_log "ERROR: scontrol requeue $SLURM_JOB_ID failed (submitted without --requeue?); resubmit to resume" >&2
  exit "$TG_EX_REQUEUE"
}

# ------------------------------------------------------------------ the batch job

# The job's API key (docs/security.md): fresh on every start, requeues included, in a 0700
# directory of the job dir; the plan passes its path (TG_KEY_FILE) to every server and client.
# Only the path is ever printed or put on a command line.
tg_make_key() {
  [ -n "${TG_KEY_FILE:-}" ] || tg_die "the plan names no API key file (TG_KEY_FILE)"
  "$PYTHON" -m megatron_tg.auth new "$(dirname "$TG_KEY_FILE")" >/dev/null \
    || tg_die "cannot write the job's API key to $(dirname "$TG_KEY_FILE")"
  export TG_API_KEY_FILE="$TG_KEY_FILE"  # for the job's tools (preflight probes, launch.health)
  tg_log "API key: $TG_KEY_FILE (new for this run; every server of the job requires it)"
}

tg_run_job() {
  JOB_DIR="${JOB_DIR:-runs/slurm/${SLURM_JOB_NAME:-tg}-$SLURM_JOB_ID}"
  mkdir -p "$JOB_DIR/logs"
  TG_JOB_DIR="$(cd "$JOB_DIR" && pwd)"
  export TG_JOB_DIR
  local stdout
  stdout="$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *StdOut=//p')"
  if [ -n "$stdout" ] && [ -e "$stdout" ]; then ln -sfn "$stdout" "$TG_JOB_DIR/job.log"; fi
  tg_log "job $SLURM_JOB_ID (${SLURM_JOB_NAME:-}) SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST; job dir $TG_JOB_DIR"
  if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
    tg_log "restart ${SLURM_RESTART_COUNT}: the trainer resumes from the newest checkpoint in checkpoint.dir"
  fi

  tg_resolve_nodes
  local hosts addrs
  hosts="$(IFS=,; echo "${TG_HOSTS[*]}")"
  addrs="$(IFS=,; echo "${TG_ADDRS[*]}")"
  local where=(--nodes "${#TG_HOSTS[@]}" --hosts "$hosts" --addrs "$addrs" --job-dir "$TG_JOB_DIR")
  # Writes plan.env (sourced below and by task.sh), plan.txt (printed) and plan.json.
  tg_plan text "${where[@]}" --out-dir "$TG_JOB_DIR" || tg_die "planning failed (above); nothing started"
  # shellcheck source=/dev/null
  source "$TG_JOB_DIR/plan.env"
  if [ "${DRY_RUN:-0}" = 1 ]; then tg_log "DRY_RUN=1: plan only, nothing started"; exit 0; fi
  if [ "${#TG_BLOCKERS[@]}" -gt 0 ]; then
    printf '  %s\n' "${TG_BLOCKERS[@]}" >&2
    tg_die "cannot start: ${#TG_BLOCKERS[@]} blocker(s) above"
  fi
  tg_make_key

  trap tg_teardown EXIT
  trap 'tg_on_signal USR1' USR1
  trap 'tg_on_signal TERM' TERM

  # Engines and judge load in parallel; the router starts once its workers answer
  # (sglang-router gives up on workers that stay down past its own startup timeout).
  tg_start_servers engine judge
  tg_wait_healthy engine judge || { [ -n "$TG_SIGNAL" ] && tg_after_signal_without_trainer; tg_die "servers did not come up; nothing trained"; }
  tg_start_servers router
  tg_wait_healthy router || { [ -n "$TG_SIGNAL" ] && tg_after_signal_without_trainer; tg_die "router did not come up"; }
  # The rollout service connects to the engines (and router, judge) once they answer.
  tg_start_servers rollout_service
  tg_wait_healthy rollout_service || { [ -n "$TG_SIGNAL" ] && tg_after_signal_without_trainer; tg_die "rollout service did not come up"; }
  if [ -n "$TG_SIGNAL" ]; then tg_after_signal_without_trainer; fi

  export MASTER_ADDR="$TG_MASTER_ADDR" MASTER_PORT="$TG_MASTER_PORT"
  export TG_SYNC_MASTER TG_ROUTER_URL TG_JUDGE_URL
  local trainer=()
  read -r -a trainer <<<"$TRAINER_CMD"
  TG_TRAIN_STEP="$(tg_step_index train)"
  tg_start_step "$TG_TRAIN_STEP" "${trainer[@]}" "${TG_TRAIN_ARGS[@]}"
  local rc=0
  tg_wait_step "$TG_TRAIN_STEP" || rc=$?
  case "$rc" in
    0) tg_log "trainer finished all steps"; exit 0 ;;
    "$TG_EX_REQUEUE") tg_log "trainer checkpointed and exited $rc (requeue me)"; tg_requeue ;;
    *) tg_log "ERROR: trainer failed with exit status $rc; see $TG_JOB_DIR/logs/step-${TG_STEP_NAME[$TG_TRAIN_STEP]}.log" >&2
       exit "$rc" ;;
  esac
}

tg_after_signal_without_trainer() {  # nothing to checkpoint yet: USR1 requeues, TERM ends
  if [ "$TG_SIGNAL" = USR1 ]; then tg_requeue; fi
  tg_die "SIGTERM before the trainer started"
}

# ------------------------------------------------------------------ outside Slurm

tg_usage() {
  cat <<EOF
usage: bash $TG_SCRIPT --dry-run [--nodes N] [key=value ...]   print the plan; start nothing
       bash $TG_SCRIPT [sbatch options] [key=value ...]         size --nodes from the plan and submit
       sbatch $TG_SCRIPT [key=value ...]                        the batch job (DRY_RUN=1: plan only)
recipe: $RECIPE; knobs (environment): see the header of slurm/lib.sh
EOF
}

tg_submit() {  # nodes ("" = the plan's) sbatch options... ; overrides are in TG_OVERRIDES
  local nodes="$1" blockers
  shift
  local sized=()
  if [ -n "$nodes" ]; then sized=(--nodes "$nodes"); fi
  nodes="$(tg_plan env "${sized[@]}" | sed -n 's/^TG_NODES=//p')" || true
  [ -n "$nodes" ] || tg_die "planning failed (above); nothing submitted"
  blockers="$(tg_plan text "${sized[@]}" | grep '^BLOCKER' || true)"
  [ -z "$blockers" ] || { echo "$blockers" >&2; tg_die "not submitting; fix the blocker(s) above"; }
  # sbatch opens --output before the script runs and does not create its directory.
  mkdir -p runs/slurm
  tg_log "sbatch --nodes=$nodes $* $TG_SCRIPT ${TG_OVERRIDES[*]}"
  sbatch --nodes="$nodes" "$@" "$TG_SCRIPT" "${TG_OVERRIDES[@]}"
}

tg_main() {
  TG_SCRIPT="${TG_SCRIPT:-$0}"
  tg_defaults
  local dry=0 nodes="" sbatch_opts=() positional=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --dry-run) dry=1 ;;
      --nodes) nodes="$2"; shift ;;
      --nodes=*) nodes="${1#--nodes=}" ;;
      -h|--help) tg_usage; return 0 ;;
      -*) sbatch_opts+=("$1") ;;
      *=*) positional+=("$1") ;;
      *) tg_die "'$1' is neither key=value nor an option; give sbatch options as --opt=value" ;;
    esac
    shift
  done
  tg_collect_overrides "${positional[@]}"
  tg_plan_flags
  if [ -n "${SLURM_JOB_ID:-}" ]; then
    [ "${#sbatch_opts[@]}" -eq 0 ] || tg_die "sbatch options given inside a job: ${sbatch_opts[*]}"
    if [ "$dry" = 1 ]; then DRY_RUN=1; fi
    tg_run_job
  elif [ "$dry" = 1 ]; then
    if [ -n "$nodes" ]; then tg_plan text --nodes "$nodes"; else tg_plan text; fi
  else
    tg_submit "$nodes" "${sbatch_opts[@]}"
  fi
}
