#!/usr/bin/env bash
# The second CI lane: Python 3.12 with the newest megatron-core that supports it (0.19.x),
# running the model and parallel tests (the code paths that touch megatron-core's API).
#
#   bash scripts/test_py312.sh [pytest args]     # default: tests/models tests/parallel
#
# torch comes from PyPI here (a CUDA build, about 3 GB of downloads; it runs on CPU):
# PyPI has no CPU wheel of torch for cp312, and 2.14.1 is what megatron-core 0.19.x was
# measured with. The venv lives in .venv312 so it never disturbs the main lane's .venv.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

find_py312() {
  if [ -n "${PYTHON312:-}" ]; then echo "$PYTHON312"; return; fi
  if python3.12 -c 'import sys' >/dev/null 2>&1; then command -v python3.12; return; fi
  if command -v pyenv >/dev/null 2>&1; then
    local v
    v="$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | tail -n 1 || true)"
    if [ -n "$v" ]; then echo "$(pyenv root)/versions/$v/bin/python3.12"; return; fi
  fi
  return 1
}

if ! py="$(find_py312)"; then
  echo "test_py312.sh: no Python 3.12 found (set PYTHON312=/path/to/python3.12)" >&2
  exit 1
fi
[ "$#" -gt 0 ] || set -- tests/models tests/parallel
export PYTHON="$py" VENV="$root/.venv312" TORCH_VERSION=2.14.1
bash scripts/setup.sh --dev
# SGLang's own request contract and routed-experts reader (tests/models/
# test_sglang_routed_experts.py) without its GPU parts: the wheel without dependencies plus
# what those imports need; torchvision without dependencies so torch stays 2.14.1.
"$VENV/bin/python" -m pip install --no-deps sglang==0.5.23 torchvision==0.29.1
"$VENV/bin/python" -m pip install orjson msgspec psutil pybase64 requests packaging pillow \
  starlette pydantic pyzmq tqdm IPython aiohttp triton apache-tvm-ffi sentencepiece \
  compressed-tensors gguf openai partial-json-parser
bash scripts/test.sh "$@"
