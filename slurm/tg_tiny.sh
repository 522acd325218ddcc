#!/usr/bin/env bash
# The CPU twin of slurm/tg_30b.sh: the same code path (plan, server steps, /health wait,
# trainer step, USR1 -> checkpoint -> requeue, teardown) on 2 CPU nodes with the tiny
# recipe. Differences are overrides only: embedded CPU engines instead of SGLang (they
# serve SGLang's HTTP API), gloo, no GPU requests, one trainer rank and one engine; the
# rollout service runs as its own step on the rollout node.
#
#   sbatch slurm/tg_tiny.sh model.hf_checkpoint=DIR model.hf_config=DIR [key=value ...]
#                                                  from the repo root (once: mkdir -p runs/slurm);
#                                                  DIR: a tiny HF policy with its tokenizer
#   bash slurm/tg_tiny.sh --dry-run                print the plan; start nothing
#   TRAINER_CMD="python my_trainer.py" sbatch slurm/tg_tiny.sh   any program honouring the
#                                                  trainer contract (exit 0 done, 75 requeue)
#
# The trainer is the real one by default ($PYTHON -m megatron_tg.train, one rank), the
# engine the embedded CPU engine (python -m megatron_tg.rollout.engine). Tests against the
# local controller (tests/slurm/cluster.sh): tests/slurm/test_tg_tiny_e2e.py runs exactly
# that; tests/slurm/test_slurm_jobs.py swaps in a fake server (ENGINE_CMD) and a stand-in
# trainer (TRAINER_CMD).
#
# allocation: whole nodes, no GPUs
#SBATCH --job-name=tg_tiny
#SBATCH --nodes=2
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=00:30:00
# time limit and preemption, as in tg_30b.sh (a tiny step takes seconds, so 60 s of warning)
#SBATCH --signal=B:USR1@60
#SBATCH --requeue
# output: appended across requeues; plan and one log per server in runs/slurm/%x-%j/
#SBATCH --output=runs/slurm/%x-%j.log
#SBATCH --open-mode=append
set -euo pipefail
export RECIPE="${RECIPE:-recipes/tiny_cpu.yaml}"
export ACCEL="${ACCEL:-cpu}" ENGINE="${ENGINE:-embedded}" GPUS_PER_NODE="${GPUS_PER_NODE:-1}"
export TRAIN_NODES="${TRAIN_NODES:-1}" ROLLOUT_NODES="${ROLLOUT_NODES:-1}"
export HEALTH_TIMEOUT="${HEALTH_TIMEOUT:-300}"
# The rollout side (manager, agent sandboxes, judge client) as its own step on the rollout
# node, as on a GPU cluster (docs/rollout-service.md); SERVICE=0 keeps it in trainer rank 0.
export SERVICE="${SERVICE-1}"
# sbatch runs a spooled copy of this file, away from lib.sh: then the repo is the submit dir.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -f "$here/lib.sh" ]; then TG_ROOT="${TG_ROOT:-$(dirname "$here")}"; else TG_ROOT="${TG_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}"; fi
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$TG_ROOT/slurm/lib.sh"
# tiny_cpu generates in the trainer's process (rollout.engine: embedded); here the rollouts
# come from engine servers as on a GPU cluster, and the trainer talks to them as to SGLang.
TG_BASE_OVERRIDES=(rollout.engine=sglang parallel.backend=gloo)
tg_main "$@"
