#!/usr/bin/env bash
# The README's first command: set up, then run the main job on its embedded CPU default.
#
# The didactic reproduction (`python -m megatron_tg.demo`, paper Figure 1/3 at toy scale) is
# not built yet. Until it is, this runs the real TG loop end to end on the CPU default:
# a tiny Qwen3-MoE policy (random weights, real HF checkpoint + tokenizer) trained by 2 gloo
# ranks at TP=2 with an embedded CPU engine, the agentic coding harness on the built-in tasks
# and the tool-format rubric: generate -> judge -> GRPO + gated KL -> weight sync ->
# checkpoint/log, then the curves drawn to a PNG. A random policy learns nothing useful; the
# run shows the machinery, with every metric the trainer logs.
#
#   bash scripts/demo.sh [--steps N] [--out DIR]      (defaults: 4 steps, runs/demo)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${VENV:-$root/.venv}"
steps=4
out=runs/demo
while [ "$#" -gt 0 ]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "demo.sh: unknown argument '$1' (expected --steps N, --out DIR)" >&2; exit 2 ;;
  esac
done
bash scripts/setup.sh
bash scripts/system_deps.sh
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}" OMP_NUM_THREADS=1
py="$venv/bin/python"
policy="$out/policy"
"$py" -m megatron_tg.models.tiny --out "$policy" >/dev/null
rm -rf "$out/run"
"$py" -m torch.distributed.run --nproc-per-node 2 --master-port "$("$py" -c 'from megatron_tg.rollout.engine.launch import free_port; print(free_port())')" \
  -m megatron_tg.train --recipe recipes/tiny_cpu.yaml \
  model.hf_config="$policy" model.hf_checkpoint="$policy" \
  parallel.tp=2 parallel.sequence_parallel=true steps="$steps" checkpoint.interval=2 \
  logging.run_dir="$out/run" checkpoint.dir="$out/run/checkpoints" \
  rollout.prompts_per_step=2 rollout.group_size=2 rollout.buffer_size=2 \
  rollout.max_new_tokens=48 rollout.max_turns=2
"$py" tools/plot_run.py "$out/run" --out "$out/curves.png" >/dev/null
"$py" - "$out/run" <<'PY'
import sys
from megatron_tg.train.metrics import read_metrics
keys = ["loss", "criteria/tests_pass", "criteria/search_lines", "kl/frac_gated",
        "kl/mean_gated", "entropy/all", "sync/bytes", "time/step"]
print("step " + " ".join(f"{k.split('/')[-1]:>13}" for k in keys))
for r in read_metrics(sys.argv[1]):
    print(f"{r['step']:4d} " + " ".join(f"{r.get(k, float('nan')):13.4g}" for k in keys))
PY
echo "demo: metrics in $out/run/metrics.jsonl, curves in $out/curves.png, checkpoints in $out/run/checkpoints"
