#!/usr/bin/env bash
# The README's first command: set up, then run the main job on its embedded CPU default.
#
# The main job (the didactic TG reproduction, `python -m megatron_tg.demo`) is not built
# yet. Until it is, this runs the largest real pieces that exist, end to end:
#   1. the Qwen3-Coder-30B-A3B policy's shard plan under the tg_30b recipe's layout,
#      built by the real megatron-core model builder on the meta device;
#   2. the CPU recipe resolved, validated and laid out (dry run).
# Arguments are ignored for now.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${VENV:-$root/.venv}"
bash scripts/setup.sh
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
echo "== Qwen3-Coder-30B-A3B under TP=2, EP=8, ETP=1 (recipes/tg_30b.yaml) =="
"$venv/bin/megatron-tg" describe --hf-config tests/fixtures/hf_configs/qwen3-coder-30b-a3b-instruct.json \
  --tp 2 --ep 8 --etp 1
echo "== recipes/tiny_cpu.yaml (dry run) =="
"$venv/bin/megatron-tg" config --recipe recipes/tiny_cpu.yaml --dry-run
