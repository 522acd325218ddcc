#!/usr/bin/env bash
# The first-GPU-run check on one CUDA GPU: torch and megatron-core only (no Transformer
# Engine, SGLang or network), at most 8 minutes, one JSON (default gpu_check.json).
#   bash scripts/gpu_check.sh [OUT.json]
# What it covers and what it cannot: megatron_tg/testing/gpu_check.py and docs/gpu-check.md.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check.json}"
py="${PYTHON:-python}"
if [[ -x .venv/bin/python && -z "${PYTHON:-}" ]]; then py=.venv/bin/python; fi
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec timeout 480 "$py" -m megatron_tg.testing.gpu_check --out "$out"
