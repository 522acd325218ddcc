#!/usr/bin/env bash
# Debian packages the test suite uses beyond Python: bubblewrap (the agent sandbox), git (the
# SWE task mirrors, checkouts and test patches),
# util-linux's prlimit/setpriv (its limits), slurm-wlm + munge (the tests of slurm/ run a
# real local Slurm controller), shellcheck (the launch scripts are kept shellcheck-clean). Installed with apt-get when running as root and
# missing; otherwise the missing ones are named, and the tests that need them say so.
set -euo pipefail

need=()
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
command -v git >/dev/null 2>&1 || need+=(git)
command -v prlimit >/dev/null 2>&1 || need+=(util-linux)
command -v slurmctld >/dev/null 2>&1 || need+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || need+=(munge)
command -v shellcheck >/dev/null 2>&1 || need+=(shellcheck)
[ "${#need[@]}" -eq 0 ] && exit 0

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "system_deps.sh: installing ${need[*]}"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
else
  echo "system_deps.sh: missing ${need[*]} (install them with your package manager;" \
       "the tests that need them will report it)" >&2
fi
