#!/usr/bin/env bash
# Create (or bring up to date) the project's virtual environment; safe to run again.
#
#   bash scripts/setup.sh          # runtime: pip install -e .
#   bash scripts/setup.sh --dev    # plus the test extras: pip install -e ".[test]"
#
# Environment: PYTHON (interpreter to build the venv with, default python3.11),
# VENV (venv directory, default .venv in the repo root), TORCH_VERSION (default 2.13.0).
#
# torch is installed first and pinned: on CPU machines torch==2.13.0 is a local CPU wheel,
# whereas letting pip resolve pyproject's "torch>=2.6" itself would pull a CUDA build of
# several GB. Once the pin is in, that range is already met and pip leaves torch alone.
# NVIDIA apex is deliberately absent: the PyPI package of that name is an unrelated web toolkit.
set -euo pipefail

# The pin can be changed for another lane (the Python 3.12 lane uses 2.14.1 from PyPI).
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3.11}"
venv="${VENV:-$root/.venv}"

mode=runtime
for arg in "$@"; do
  case "$arg" in
    --dev) mode=dev ;;
    -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup.sh: unknown argument '$arg' (expected --dev)" >&2; exit 2 ;;
  esac
done

run() { echo "+ $*"; "$@"; }
py_version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])'; }

if ! command -v "$python" >/dev/null 2>&1; then
  echo "setup.sh: '$python' not found; install Python >= 3.11 or set PYTHON=/path/to/python3" >&2
  exit 1
fi
want="$(py_version "$python")" || { echo "setup.sh: cannot run '$python'; set PYTHON=..." >&2; exit 1; }

# The stamp holds what the last complete setup installed (line 1) and its mode (line 2). A
# changed pyproject.toml, torch pin or Python version makes it stale. It is written last,
# so an interrupted setup runs again in full next time.
stamp="$venv/.megatron-tg-setup"
hash="$("$python" -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())')"
key="pyproject=$hash torch=$TORCH_VERSION python=$want"
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(sed -n 1p "$stamp")" = "$key" ]; then
  done_mode="$(sed -n 2p "$stamp")"
  if [ "$done_mode" = dev ] || [ "$done_mode" = "$mode" ]; then
    echo "setup.sh: $venv is up to date ($done_mode install of this pyproject.toml); nothing to do"
    exit 0
  fi
fi

if [ -x "$venv/bin/python" ]; then
  have="$(py_version "$venv/bin/python")"
  if [ "$have" != "$want" ]; then
    # Not deleted automatically: it may be someone's hand-made environment.
    echo "setup.sh: $venv has Python $have but $python is $want; remove it or set VENV=..." >&2
    exit 1
  fi
  echo "setup.sh: updating $venv (Python $have)"
else
  echo "setup.sh: creating $venv with $python (Python $want)"
  run "$python" -m venv "$venv"
fi

pip=("$venv/bin/python" -m pip)
run "${pip[@]}" install --upgrade pip
run "${pip[@]}" install "torch==$TORCH_VERSION"
if [ "$mode" = dev ]; then
  run "${pip[@]}" install -e ".[test]"
else
  run "${pip[@]}" install -e .
fi
run "$venv/bin/python" -c "import torch, megatron_tg; print('torch', torch.__version__, '| megatron_tg', megatron_tg.__version__)"

printf '%s\n%s\n' "$key" "$mode" > "$stamp"
echo "setup.sh: done; activate with: source ${venv#"$root"/}/bin/activate"
