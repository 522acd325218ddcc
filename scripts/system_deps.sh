#!/usr/bin/env bash
# Debian packages the project uses beyond Python, installed with apt-get when running as root
# and missing; otherwise the missing ones are named (install them with your package manager).
#
#   bash scripts/system_deps.sh --runtime   what training and grading need on every node that
#                                           runs the rollout side: bubblewrap (the agent sandbox),
#                                           util-linux's prlimit/setpriv (its limits), git (SWE
#                                           task mirrors, checkouts and test patches)
#   bash scripts/system_deps.sh             the above plus what the tests need: slurm-wlm + munge
#                                           (the tests of slurm/ run a real local Slurm
#                                           controller), shellcheck (launch scripts stay clean)
set -euo pipefail

mode="test"
for arg in "$@"; do
  case "$arg" in
    --runtime) mode=runtime ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "system_deps.sh: unknown argument '$arg' (expected --runtime)" >&2; exit 2 ;;
  esac
done

need=()
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
command -v git >/dev/null 2>&1 || need+=(git)
{ command -v prlimit && command -v setpriv; } >/dev/null 2>&1 || need+=(util-linux)
if [ "$mode" = test ]; then
  command -v slurmctld >/dev/null 2>&1 || need+=(slurm-wlm)
  command -v munged >/dev/null 2>&1 || need+=(munge)
  command -v shellcheck >/dev/null 2>&1 || need+=(shellcheck)
fi
[ "${#need[@]}" -eq 0 ] && exit 0

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "system_deps.sh: installing ${need[*]}"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
else
  echo "system_deps.sh: missing ${need[*]} (install them with your package manager;" \
       "what needs them will report it)" >&2
fi
