#!/usr/bin/env bash
# The whole test suite (the slow tier too) on another torch release, in a virtual environment of its own (.venv-torch<V>):
#   bash scripts/test_torch.sh 2.11.0 [pytest arguments]
# The index's build of that release is installed (a CUDA build, which runs on the CPU here), then the
# test dependencies and this package; torch releases from 2.11 (the floor requirements.txt declares)
# to 2.14 are tested (docs/troubleshooting.md).
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: bash scripts/test_torch.sh <torch version, e.g. 2.11.0> [pytest arguments]}"
shift
venv=".venv-torch${version}"
"$venv/bin/python" -m pip --version >/dev/null 2>&1 || "${PYTHON:-python3}" -m venv --clear "$venv"  # new, or half made
"$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null \
  || "$venv/bin/python" -m pip install -q --no-cache-dir "torch==$version"  # no cached copy of a multi-GB wheel
"$venv/bin/python" -m pip install -q -r requirements-test.txt
"$venv/bin/python" -m pip install -q --no-deps -e .
echo "torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
exec "$venv/bin/python" -m pytest -n 2 --dist loadfile -m "" "$@"  # as scripts/test.sh, both tiers (-m "")
