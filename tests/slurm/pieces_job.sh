#!/usr/bin/env bash
# A batch job built from slurm/lib.sh's pieces one at a time, for test_slurm_jobs.py:
# node resolution, the plan's role assignment, a server step, the /health wait, teardown.
# Prints "check: key=value" lines for the test to assert on. Submitted with the same
# environment as the wrappers (PYTHON, ENGINE_CMD, JOB_DIR, PORT_BASE, ...).
#SBATCH --nodes=2
#SBATCH --exclusive
set -euo pipefail
# sbatch runs a spooled copy: the repo is the submit dir.
TG_ROOT="$SLURM_SUBMIT_DIR"
# shellcheck source-path=SCRIPTDIR source=../../slurm/lib.sh
source "$TG_ROOT/slurm/lib.sh"
export RECIPE=recipes/tiny_cpu.yaml ACCEL=cpu ENGINE=embedded GPUS_PER_NODE=1 TRAIN_NODES=1 ROLLOUT_NODES=1
tg_defaults
tg_collect_overrides rollout.engine=sglang
tg_plan_flags

tg_resolve_nodes
echo "check: hosts=${TG_HOSTS[*]}"
echo "check: addrs=${TG_ADDRS[*]}"

TG_JOB_DIR="$JOB_DIR"
export TG_JOB_DIR
mkdir -p "$TG_JOB_DIR/logs"
tg_plan env --nodes "${#TG_HOSTS[@]}" --hosts "$(IFS=,; echo "${TG_HOSTS[*]}")" \
  --addrs "$(IFS=,; echo "${TG_ADDRS[*]}")" --job-dir "$TG_JOB_DIR" >"$TG_JOB_DIR/plan.env"
# shellcheck source=/dev/null
source "$TG_JOB_DIR/plan.env"
echo "check: train=${TG_TRAIN_HOSTS[*]} rollout=${TG_ROLLOUT_HOSTS[*]} master=$TG_MASTER_ADDR:$TG_MASTER_PORT"
echo "check: servers=${TG_SERVER_NAME[*]} urls=${TG_SERVER_URL[*]}"

tg_make_key  # as tg_main does: every server the job starts needs the job's key file
trap tg_teardown EXIT
tg_start_servers engine
tg_wait_healthy engine
echo "check: healthy=yes"
echo "check: steps_running=$(squeue -h -s -j "$SLURM_JOB_ID" -o '%j' | grep -c '^tg-' || true)"
tg_teardown
echo "check: steps_after_teardown=$(squeue -h -s -j "$SLURM_JOB_ID" -o '%j' | grep -c '^tg-' || true)"
