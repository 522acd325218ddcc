#!/usr/bin/env bash
# The second CI lane: Python 3.12 with the newest megatron-core that supports it (0.19.x),
# running the model and parallel tests (the code paths that touch megatron-core's API) and
# the tests that run SGLang's own code (tests/sglang).
#
#   bash scripts/test_py312.sh [pytest args]     # default: tests/models tests/parallel tests/sglang
#
# torch comes from PyPI here (a CUDA build, about 3 GB of downloads; it runs on CPU):
# PyPI has no CPU wheel of torch for cp312, and 2.14.1 is what megatron-core 0.19.x was
# measured with and what sglang 0.5.23 pins. The venv lives in .venv312 so it never
# disturbs the main lane's .venv.
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
venv="$root/.venv312"
export PYTHON="$py" VENV="$venv" TORCH_VERSION=2.14.1
bash scripts/setup.sh --dev

# SGLang's server code without its GPU parts (sglang-kernel, flashinfer, ...: CUDA only), plus
# the light packages the modules tests/sglang imports need (io_struct, weight_updater,
# utils.common, weight_sync.tensor_bucket). --no-deps keeps torch at 2.14.1; torchvision 0.29.1
# is the release built against it.
SGLANG_VERSION=0.5.23
stamp="$venv/.sglang-$SGLANG_VERSION"
if [ ! -f "$stamp" ]; then
  pip=("$venv/bin/python" -m pip)
  echo "+ pip install --no-deps sglang==$SGLANG_VERSION torchvision==0.29.1"
  "${pip[@]}" install --no-deps "sglang==$SGLANG_VERSION" torchvision==0.29.1
  echo "+ pip install (sglang's light dependencies)"
  "${pip[@]}" install "torch==$TORCH_VERSION" orjson msgspec pybase64 requests packaging pillow starlette \
    pydantic pyzmq tqdm IPython aiohttp fastapi uvicorn psutil triton "transformers==5.19.0" \
    apache-tvm-ffi sentencepiece compressed-tensors gguf openai partial-json-parser
  "$venv/bin/python" -c 'import sglang.srt.managers.io_struct, sglang.srt.utils.common' 2>/dev/null
  touch "$stamp"
fi

[ "$#" -gt 0 ] || set -- tests/models tests/parallel tests/sglang
bash scripts/test.sh "$@"
