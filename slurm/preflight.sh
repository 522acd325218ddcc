#!/usr/bin/env bash
# First contact with a cluster: one node, at most 15 minutes, a pass/fail table naming what
# failed. Run it before the first `sbatch slurm/tg_30b.sh`:
#
#   sbatch slurm/preflight.sh [key=value ...]               RECIPE=recipes/tg_30b.yaml by default
#   RECIPE=recipes/tg_235b.yaml sbatch slurm/preflight.sh   another recipe, same checks
#
# The node is split in two halves of NODE_GPUS (default 8): trainer ranks on one, the
# recipe's SGLang engines (its engine TP and flags, through slurm/task.sh exactly as the
# real job starts them) on the other. The checks, each a line of the table:
#   plan                    the recipe reduced to the node (megatron_tg.launch.preflight reduce:
#                           the recipe's TP/CP/PP, EP cut to fit, one prompt x 2 rollouts)
#   NCCL versions           torch and NCCL of the trainer's Python ($PYTHON) and the engines'
#                           (ENGINE_PYTHON, default ENGINE_CMD's interpreter or $PYTHON);
#                           FAIL when the NCCL releases differ (NCCL refuses such a group)
#   engines started         SGLang up with the recipe's flags (the command line is in the row)
#   router health           the router's health-check flags outlast the recipe's longest
#                           weight-sync pause (megatron_tg/launch/router_health.py)
#   engines answer, generate   /model_info and one generation with log-probs per engine
#   seeded sampling repeats the same seed twice gives the same tokens (a FAIL only when the
#                           recipe sets rollout.sampling_seed: deterministic inference is on)
#   trainer run, TG step    the real trainer (python -m megatron_tg.train) runs one TG step
#   weight sync             its weight-update group formed, one sync sent; the engines
#                           report the new weight version
#   checkpoint save/load    the distributed checkpoint is written, and a second trainer
#                           run resumes from it and trains step 2
#   routing replay          on for an MoE model (rollout.routing_replay), engines started for it
# Model: the recipe's (model.hf_checkpoint); for a fast check pass a truncated checkpoint
# with model.hf_checkpoint=DIR model.hf_config=DIR. A recipe whose TP x PP or engine TP
# needs more than half a node (235B, 480B) fails the plan line naming the sizes; give it a
# layout that fits as overrides (e.g. parallel.pp=1 rollout.engine_tp=4).
# Knobs: NODE_GPUS, PREFLIGHT_TIMEOUT (s, 840: the table is printed before the 15 min
# limit), STEP_CPUS_PER_TASK (default: the node's CPUs / NODE_GPUS), and those of slurm/lib.sh (ENGINE, ENGINE_ARGS, TRAINER_CMD, PYTHON, JUDGE_URL, ...).
# On CPU the same script runs on the local test cluster with embedded engines
# (tests/slurm/test_preflight.py: ACCEL=cpu ENGINE=embedded RECIPE=recipes/tiny_cpu.yaml).
#
#SBATCH --job-name=tg_preflight
#SBATCH --nodes=1
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=00:15:00
#SBATCH --output=runs/slurm/%x-%j.log
set -euo pipefail
export RECIPE="${RECIPE:-recipes/tg_30b.yaml}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -f "$here/lib.sh" ]; then TG_ROOT="${TG_ROOT:-$(dirname "$here")}"; else TG_ROOT="${TG_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}"; fi
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$TG_ROOT/slurm/lib.sh"

NODE_GPUS="${NODE_GPUS:-8}"
PREFLIGHT_TIMEOUT="${PREFLIGHT_TIMEOUT:-840}"
# Each half of the node is one "node" of the plan: train and rollout get NODE_GPUS / 2.
export GPUS_PER_NODE="$((NODE_GPUS / 2))" TRAIN_NODES=1 ROLLOUT_NODES=1
export HEALTH_TIMEOUT="${HEALTH_TIMEOUT:-600}"
# Trainer and engines share the node: each task (one per GPU) gets its share of the CPUs.
cpus="${SLURM_CPUS_ON_NODE:-$NODE_GPUS}"
export STEP_CPUS_PER_TASK="${STEP_CPUS_PER_TASK:-$((cpus / NODE_GPUS > 0 ? cpus / NODE_GPUS : 1))}"
PF_CHECKS=("plan" "NCCL versions" "engines started" "router health" "engines answer /model_info" "generate with log-probs"
           "seeded sampling repeats" "trainer run (1 step)" "TG train step" "weight sync to engines" "checkpoint save"
           "trainer resume run" "checkpoint load (resume)" "routing replay")

pf_row() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$PF_RESULTS"; }

# Print the table (every check not reached is SKIP, naming the one that stopped the run).
pf_finish() {
  local name why="${1:-}"
  for name in "${PF_CHECKS[@]}"; do
    if ! cut -f1 "$PF_RESULTS" | grep -qxF -- "$name"; then pf_row "$name" SKIP "${why:-not reached}"; fi
  done
  kill "${PF_WATCHDOG:-}" 2>/dev/null || true
  tg_teardown
  local rc=0
  "$PYTHON" -m megatron_tg.launch.preflight table --results "$PF_RESULTS" || rc=$?
  tg_log "preflight table: $PF_RESULTS; logs: $TG_JOB_DIR/logs"
  exit "$rc"
}

pf_stop() { pf_row "$1" FAIL "$2"; pf_finish "after '$1' failed"; }

pf_trainer() {  # name extra-override... -> runs the trainer step, records a row
  local name="$1" rc=0 trainer=()
  shift
  read -r -a trainer <<<"$TRAINER_CMD"
  tg_start_step "$TG_TRAIN_STEP" "${trainer[@]}" "${TG_TRAIN_ARGS[@]}" "$@"
  tg_wait_step "$TG_TRAIN_STEP" || rc=$?
  local log="$TG_JOB_DIR/logs/step-${TG_STEP_NAME[$TG_TRAIN_STEP]}.log"
  if [ "$rc" -ne 0 ]; then
    pf_stop "$name" "exit $rc; last line: $(tail -n 1 "$log" 2>/dev/null | cut -c1-200); log $log"
  fi
  pf_row "$name" PASS "exit 0 ($*); log $log"
}

pf_job() {
  JOB_DIR="${JOB_DIR:-runs/slurm/${SLURM_JOB_NAME:-tg_preflight}-$SLURM_JOB_ID}"
  mkdir -p "$JOB_DIR/logs"
  TG_JOB_DIR="$(cd "$JOB_DIR" && pwd)"
  export TG_JOB_DIR
  PF_RESULTS="$TG_JOB_DIR/preflight.tsv"
  : >"$PF_RESULTS"
  trap tg_teardown EXIT
  trap 'tg_on_signal USR1' USR1
  trap 'tg_on_signal TERM' TERM
  tg_log "preflight of $RECIPE on $SLURM_JOB_NODELIST ($NODE_GPUS GPUs: $GPUS_PER_NODE train + $GPUS_PER_NODE rollout)"
  # The whole preflight stays inside its time limit: the table is printed before Slurm's.
  ( sleep "$PREFLIGHT_TIMEOUT" && kill -s TERM $$ ) 2>/dev/null &
  PF_WATCHDOG=$!

  tg_resolve_nodes
  local host="${TG_HOSTS[0]}" node_addr="${TG_ADDRS[0]}" run="$TG_JOB_DIR/run" reduce=()
  local judge=()
  if [ -n "${JUDGE_URL:-}" ]; then judge=(--judge-url "$JUDGE_URL"); fi
  if ! mapfile -t reduce < <("$PYTHON" -m megatron_tg.launch.preflight reduce --recipe "$RECIPE" \
                              --gpus "$GPUS_PER_NODE" "${judge[@]}" -- "${TG_OVERRIDES[@]}") \
     || [ "${#reduce[@]}" -eq 0 ]; then
    pf_stop plan "the recipe cannot be reduced to $GPUS_PER_NODE trainer GPUs (error above)"
  fi
  TG_OVERRIDES+=("${reduce[@]}" "logging.run_dir=$run" "checkpoint.dir=$run/ckpt")
  if ! tg_plan text --nodes 2 --hosts "$host,$host" --addrs "$node_addr,$node_addr" --job-dir "$TG_JOB_DIR" \
       --out-dir "$TG_JOB_DIR" >"$TG_JOB_DIR/plan.out" 2>&1; then
    pf_stop plan "$(tail -n 1 "$TG_JOB_DIR/plan.out")"
  fi
  cat "$TG_JOB_DIR/plan.out"
  # shellcheck source=/dev/null
  source "$TG_JOB_DIR/plan.env"
  if [ "${#TG_BLOCKERS[@]}" -gt 0 ]; then pf_stop plan "${TG_BLOCKERS[*]}"; fi
  tg_make_key
  pf_row plan PASS "${reduce[*]}"
  # The engines' interpreter: ENGINE_PYTHON, else ENGINE_CMD's first word when it is a Python.
  local engine_py="${ENGINE_PYTHON:-}" engine_cmd=()
  if [ -z "$engine_py" ]; then
    read -r -a engine_cmd <<<"${ENGINE_CMD:-$PYTHON}"
    case "$(basename "${engine_cmd[0]}")" in python*) engine_py="${engine_cmd[0]}" ;; *) engine_py="$PYTHON" ;; esac
  fi
  "$PYTHON" -m megatron_tg.launch.preflight nccl --results "$PF_RESULTS" --trainer-python "$PYTHON" \
    --engine-python "$engine_py"

  tg_start_servers engine
  if ! tg_wait_healthy engine; then pf_stop "engines started" "not healthy; see the log lines above"; fi
  local first="${TG_SERVER_LOG[0]}" cmdline flag
  cmdline="$(grep -m1 '^+ ' "$first" | cut -c3- || true)"
  for flag in "${TG_ENGINE_ARGS[@]}"; do
    case " $cmdline " in *" $flag "*) ;; *) pf_stop "engines started" "flag $flag missing from: $cmdline" ;; esac
  done
  pf_row "engines started" PASS "${#TG_ENGINE_URLS[@]} engine(s): $cmdline"
  tg_start_servers router
  tg_wait_healthy router || pf_stop "engines started" "the router did not come up"
  local router_cmd="" j
  for j in "${!TG_SERVER_ROLE[@]}"; do
    if [ "${TG_SERVER_ROLE[j]}" = router ]; then router_cmd="$(grep -m1 '^+ ' "${TG_SERVER_LOG[j]}" | cut -c3- || true)"; fi
  done
  "$PYTHON" -m megatron_tg.launch.preflight router --results "$PF_RESULTS" --recipe "$RECIPE" \
    --cmdline "$router_cmd" -- "${TG_OVERRIDES[@]}"

  local seeded=()
  # seeded: the plan turned deterministic inference on (SGLang), or an override sets a seed
  if printf '%s\n' "${TG_ENGINE_ARGS[@]}" "${TG_TRAIN_ARGS[@]}" \
     | grep -qE '^(--enable-deterministic-inference|rollout\.sampling_seed=[0-9-])'; then seeded=(--seeded); fi
  "$PYTHON" -m megatron_tg.launch.preflight probe --results "$PF_RESULTS" "${seeded[@]}" -- "${TG_ENGINE_URLS[@]}"
  # Without answering engines the trainer cannot run; a seeded-sampling failure is reported
  # but does not stop the training checks.
  if grep -qE $'^(engines answer /model_info|generate with log-probs)\tFAIL' "$PF_RESULTS"; then
    pf_finish "after the engine checks failed"
  fi

  export MASTER_ADDR="$TG_MASTER_ADDR" MASTER_PORT="$TG_MASTER_PORT" TG_SYNC_MASTER TG_ROUTER_URL
  TG_TRAIN_STEP="$(tg_step_index train)"
  pf_trainer "trainer run (1 step)" steps=1
  "$PYTHON" -m megatron_tg.launch.preflight train --results "$PF_RESULTS" --run-dir "$run" \
    --ckpt-dir "$run/ckpt" --steps 1 -- "${TG_ENGINE_URLS[@]}"
  pf_trainer "trainer resume run" steps=2
  "$PYTHON" -m megatron_tg.launch.preflight resume --results "$PF_RESULTS" --run-dir "$run" --steps 2 \
    --log "$TG_JOB_DIR/logs/step-${TG_STEP_NAME[$TG_TRAIN_STEP]}.log"
  "$PYTHON" -m megatron_tg.launch.preflight routing --results "$PF_RESULTS" --recipe "$RECIPE" \
    -- "${TG_OVERRIDES[@]}"
  pf_finish
}

tg_defaults
tg_collect_overrides "$@"
tg_plan_flags
[ -n "${SLURM_JOB_ID:-}" ] || tg_die "submit with sbatch slurm/preflight.sh (it runs inside one allocation)"
pf_job
