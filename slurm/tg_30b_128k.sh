#!/usr/bin/env bash
# Qwen3-Coder-30B-A3B with targeted guidance on 131,072-token rollouts (recipes/tg_30b_128k.yaml:
# tg_30b with context parallelism 2) on 8-GPU H100 nodes.
#
#   sbatch slurm/tg_30b_128k.sh [key=value ...]               from the repo root (once: mkdir -p runs/slurm)
#   bash slurm/tg_30b_128k.sh --dry-run [--nodes N]           print the role/node/GPU plan; start nothing
#   TRAIN_NODES=.. bash slurm/tg_30b_128k.sh [--opt=val ...]  size --nodes from the plan, then sbatch
#
# 7 nodes: 4 train (32 ranks: TP2 x CP2 x EP8, dp 8) + 2 rollout (8 SGLang engines x TP2, behind an
# sglang-router) + 1 judge (SGLang, TP8). The style rubric has LLM-judged criteria, so give
# JUDGE_MODEL=DIR (served on the judge node) or JUDGE_URL=http://.. JUDGE_NAME=.. (external;
# then JUDGE_NODES is 0 and the job needs 6 nodes: submit with bash slurm/tg_30b_128k.sh).
# Knobs (TRAIN_NODES, ROLLOUT_NODES, JUDGE_MODEL, ENGINE_ARGS, ...): header of slurm/lib.sh.
# Site options (--partition, --account, --qos) go on the sbatch command line.
#
# allocation: whole nodes; the planner checks the count against the recipe at job start
#SBATCH --job-name=tg_30b_128k
#SBATCH --nodes=7
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
# time limit and preemption: USR1 10440 s before the end (one step plus one checkpoint save,
# as `megatron-tg plan --recipe recipes/tg_30b_128k.yaml model.hf_config=tests/fixtures/hf_configs/qwen3-coder-30b-a3b-instruct.json`
# prints it; the planner refuses a shorter USR1_LEAD) -> the trainer checkpoints and exits
# 75 -> the job requeues itself and resumes (SLURM_RESTART_COUNT counts the restarts)
#SBATCH --signal=B:USR1@10440
#SBATCH --requeue
# output: appended across requeues; plan and one log per server in runs/slurm/%x-%j/
#SBATCH --output=runs/slurm/%x-%j.log
#SBATCH --open-mode=append
set -euo pipefail
export RECIPE="${RECIPE:-recipes/tg_30b_128k.yaml}"
export USR1_LEAD="${USR1_LEAD:-10440}"  # = the --signal above; checked by the planner
export HEALTH_TIMEOUT="${HEALTH_TIMEOUT:-1800}"
# sbatch runs a spooled copy of this file, away from lib.sh: then the repo is the submit dir.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -f "$here/lib.sh" ]; then TG_ROOT="${TG_ROOT:-$(dirname "$here")}"; else TG_ROOT="${TG_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}"; fi
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$TG_ROOT/slurm/lib.sh"
tg_main "$@"
