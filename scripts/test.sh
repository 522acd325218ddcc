#!/usr/bin/env bash
# The project's test command (README, CI): bring the dev venv up to date, then run pytest.
#
#   bash scripts/test.sh                         # every test under tests/
#   bash scripts/test.sh tests/config -k merge   # arguments go to pytest unchanged
#
# With no paths given pytest runs pyproject's testpaths (tests/). VENV and PYTHON are
# passed on to scripts/setup.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${VENV:-$root/.venv}"

bash scripts/setup.sh --dev
bash scripts/system_deps.sh

# Two workers (pytest-xdist; TG_TEST_WORKERS=0 runs in one process): many tests wait on
# processes, engines or a Slurm job more than they compute, so two halve the suite's wall
# time on these 2-core machines. tests/conftest.py keeps each module (its shared fixtures)
# and all of tests/slurm (one local Slurm controller) on one worker.
workers="${TG_TEST_WORKERS:-2}"
par=()
if [ "$workers" != 0 ] && [ "$workers" != 1 ]; then
  par=(-n "$workers" --dist loadfile)
fi
echo "+ $venv/bin/python -m pytest ${par[*]} $*"
rc=0
"$venv/bin/python" -m pytest "${par[@]}" "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
  # pytest's "no tests collected": a wrong path or filter, not a pass.
  echo "test.sh: pytest collected no tests (exit 5); check the paths and -k/-m filters" >&2
  exit 1
fi
exit "$rc"
