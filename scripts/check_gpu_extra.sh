#!/usr/bin/env bash
# Does the cluster install (`pip install -e ".[gpu]"` on Python 3.12) resolve, and what does it
# get? A pip dry run: it resolves against the package index and reads metadata, installs
# nothing (wheels whose index gives no separate metadata are fetched to read it). Prints the
# versions a cluster install gets: torch (sglang pins it), its NCCL, sglang, the router,
# transformer-engine, megatron-core; fails if resolution fails or the PyPI `apex` (an
# unrelated web toolkit) would be installed.
#
#   bash scripts/check_gpu_extra.sh [PYTHON3.12]     # default: .venv312/bin/python
#
# Not checked here (no GPU): that transformer-engine's CUDA extension builds, and that
# sglang's CUDA kernels load; the first GPU run does (docs/first-gpu-run.md).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${1:-$root/.venv312/bin/python}"
[ -x "$py" ] || { echo "check_gpu_extra.sh: no Python at '$py' (run bash scripts/test_py312.sh first, or pass one)" >&2; exit 1; }
"$py" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
  || { echo "check_gpu_extra.sh: '$py' is not Python 3.12" >&2; exit 1; }
report="$(mktemp)"
trap 'rm -f "$report"' EXIT
if ! "$py" -m pip install --dry-run --ignore-installed --quiet \
      --report "$report" ".[gpu]" >"$report.log" 2>&1; then
  grep -v '^WARNING: Location' "$report.log" | tail -n 30 >&2
  echo "check_gpu_extra.sh: pip could not resolve .[gpu] for Python 3.12" >&2
  rm -f "$report.log"
  exit 1
fi
rm -f "$report.log"
"$py" - "$report" <<'PY'
import json, sys
rows = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
        for i in json.load(open(sys.argv[1]))["install"]}
if "apex" in rows:
    sys.exit("check_gpu_extra.sh: the resolution installs PyPI's 'apex', an unrelated web toolkit")
want = ("torch", "nvidia-nccl-cu12", "nvidia-nccl-cu13", "sglang", "sglang-router",
        "transformer-engine", "transformer-engine-torch", "megatron-core")
missing = [n for n in ("torch", "sglang", "sglang-router", "transformer-engine", "megatron-core") if n not in rows]
if missing:
    sys.exit(f"check_gpu_extra.sh: .[gpu] resolved without {missing}")
print(f"check_gpu_extra.sh: .[gpu] on Python 3.12 resolves {len(rows)} packages; "
      + ", ".join(f"{n} {rows[n]}" for n in want if n in rows))
PY
