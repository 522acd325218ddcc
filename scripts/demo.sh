#!/usr/bin/env bash
# The README's first command: set up, then run the main job on its embedded CPU default —
# the paper's didactic experiment at toy scale (python -m megatron_tg.demo): an SFT'd tiny
# Qwen3-MoE base model, converted to megatron, then grpo / opsd / tg through the real TG loop
# (megatron-core trainer, embedded engine over SGLang's HTTP API, async rollout manager,
# judge, weight sync, checkpoints) and forward vs reverse KL with the EMA expert (--full:
# the whole direction x expert grid over 3 seeds; --quick: CI-sized and seeded); prints the
# table and writes OUT/summary.json and OUT/curves.png.
#
#   bash scripts/demo.sh [--quick] [--out DIR] [...]   (arguments go to python -m megatron_tg.demo;
#                                                       default --out runs/demo)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${VENV:-$root/.venv}"
bash scripts/setup.sh
bash scripts/system_deps.sh --runtime  # bubblewrap, util-linux, git (as root: apt-get; else named)
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}" OMP_NUM_THREADS=1
exec "$venv/bin/python" -m megatron_tg.demo "$@"
