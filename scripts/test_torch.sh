#!/usr/bin/env bash
# The tests that touch what differs between torch releases (`-m torch_api`, both tiers: DCP, FSDP2, the pipeline,
# torchft, compile, the private APIs of fms_fsdp/compat.py, the fault matrix and a checkpoint resume; features
# run together, `composition`, and the package's own checks over torch calls that other tests make,
# `pinned_torch`, only on the pinned torch) on another torch release, in a virtual environment of its own
# (.venv-torch<V>):
#   bash scripts/test_torch.sh 2.11.0 [pytest arguments]     (-m "not harness": the whole suite but the lm-eval tests)
# The index's build of that release is installed (a CUDA build, which runs on the CPU here), then the
# test dependencies at constraints-test.txt's versions and this package; torch releases from 2.11 (the floor
# requirements.txt declares) to 2.14 are tested (docs/troubleshooting.md). It stops if the environment
# imports another torch than the one asked for.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: bash scripts/test_torch.sh <torch version, e.g. 2.11.0> [pytest arguments]}"
shift
venv=".venv-torch${version}"
"$venv/bin/python" -m pip --version >/dev/null 2>&1 || "${PYTHON:-python3}" -m venv --clear "$venv"  # new, or half made
"$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null \
  || "$venv/bin/python" -m pip install -q --no-cache-dir "torch==$version"  # no cached copy of a multi-GB wheel
"$venv/bin/python" -m pip install -q -r requirements-test.txt -c constraints-test.txt "torch==$version"
"$venv/bin/python" -m pip install -q --no-deps -e .
imported=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
if [ "${imported%%+*}" != "$version" ]; then
  echo "error: $venv imports torch $imported, not $version; remove $venv and run again" >&2
  exit 1
fi
echo "torch $imported"
exec "$venv/bin/python" -m pytest -n 2 --dist loadfile -m "torch_api and not composition and not pinned_torch" "$@"
