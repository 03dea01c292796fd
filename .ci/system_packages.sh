#!/usr/bin/env bash
# The system packages the slow tier needs: Slurm and munge (tests/test_slurm.py runs sbatch against a real
# Slurm) and iproute2 (tests/test_multinode.py and tests/test_kubernetes.py make "nodes" in network
# namespaces), installed with apt-get as root where missing. Under CI=true a failed install ends CI here, in one
# line, instead of the tests that need them being skipped; elsewhere it is a warning.
set -euo pipefail
sbin="${FMS_CI_SBIN:-/usr/sbin}"  # where Debian puts slurmctld and ip, off a normal user's PATH
has() { command -v "$1" >/dev/null || [ -x "$sbin/$1" ]; }
missing=()
has slurmctld || missing+=(slurm-wlm munge)
has ip || missing+=(iproute2)
[ ${#missing[@]} -gt 0 ] || exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null && exit 0
fi
if [[ "${CI:-}" =~ ^(true|True|TRUE|1)$ ]]; then  # as tests/no_silent_skip.py reads it
  echo "error: could not install ${missing[*]} (needs root and apt-get); CI runs every test, so it stops here" >&2
  exit 1
fi
echo "warning: could not install ${missing[*]}; tests/test_slurm.py or tests/test_multinode.py will be skipped" >&2
