#!/usr/bin/env bash
# Qwen3-Coder-30B-A3B with targeted guidance, colocated (recipes/tg_30b_colocated.yaml): the
# trainer and the SGLang engines take turns on the same 8-GPU H100 nodes (docs/colocated.md).
#
#   sbatch slurm/tg_30b_colocated.sh [key=value ...]          from the repo root (once: mkdir -p runs/slurm)
#   bash slurm/tg_30b_colocated.sh --dry-run [--nodes N]      print the plan; start nothing
#
# 3 nodes: 2 train nodes that also run the 8 SGLang engines x TP 2 (engine k of a node on its
# GPUs 2k, 2k+1, the GPUs of the trainer ranks that write its weights; engines and trainer
# share the GPUs through srun --overlap) + 1 judge node (SGLang, TP 8). The style rubric has
# LLM-judged criteria: give JUDGE_MODEL=DIR (served on the judge node), or JUDGE_URL=http://..
# JUDGE_NAME=.. for an external judge, and then the job is the 2 nodes alone: submit with
# bash slurm/tg_30b_colocated.sh, which sizes --nodes from the plan.
# Knobs: header of slurm/lib.sh (ROLLOUT_NODES must stay unset: colocated engines have no nodes).
# Site options (--partition, --account, --qos) go on the sbatch command line.
#
# allocation: whole nodes; the planner checks the count against the recipe at job start
#SBATCH --job-name=tg_30b_colocated
#SBATCH --nodes=3
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
# time limit and preemption: USR1 11070 s before the end (one colocated step plus one
# checkpoint save, as `megatron-tg plan --recipe recipes/tg_30b_colocated.yaml
# model.hf_config=tests/fixtures/hf_configs/qwen3-coder-30b-a3b-instruct.json` prints it; the
# planner refuses a shorter USR1_LEAD) -> the trainer checkpoints and exits 75 -> the job
# requeues itself and resumes
#SBATCH --signal=B:USR1@11070
#SBATCH --requeue
# output: appended across requeues; plan and one log per server in runs/slurm/%x-%j/
#SBATCH --output=runs/slurm/%x-%j.log
#SBATCH --open-mode=append
set -euo pipefail
export RECIPE="${RECIPE:-recipes/tg_30b_colocated.yaml}"
export USR1_LEAD="${USR1_LEAD:-11070}"  # = the --signal above; checked by the planner
export HEALTH_TIMEOUT="${HEALTH_TIMEOUT:-1800}"
# sbatch runs a spooled copy of this file, away from lib.sh: then the repo is the submit dir.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -f "$here/lib.sh" ]; then TG_ROOT="${TG_ROOT:-$(dirname "$here")}"; else TG_ROOT="${TG_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}"; fi
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$TG_ROOT/slurm/lib.sh"
tg_main "$@"
