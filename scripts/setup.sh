#!/usr/bin/env bash
# Install the project's dependencies into .venv (or the active virtual environment).
#   bash scripts/setup.sh           runtime dependencies
#   bash scripts/setup.sh test      runtime + test dependencies, at constraints-test.txt's versions
# Without a GPU, torch's CPU build is installed first ($TORCH_CPU_SPEC, default torch==2.13.0), so pip
# never pulls the multi-GB CUDA build; with one, torch>=2.11 comes from your index as usual.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    python -m pip install -q "torch>=2.11"
  else
    python -m pip install -q "${TORCH_CPU_SPEC:-torch==2.13.0}"
  fi
fi
if [ "${1:-}" = "test" ]; then
  python -m pip install -q -r requirements-test.txt -c constraints-test.txt  # the tested versions, exactly
else
  python -m pip install -q -r requirements.txt
fi
# the package itself, editable and without dependencies, for its commands (fms-train, fms-prepare-data,
# fms-inspect-data, fms-export-model, fms-to-hf); skipped when every command of pyproject.toml is there
# and points where pyproject.toml says
if ! python -c 'import importlib.metadata as m, tomllib
wanted = tomllib.load(open("pyproject.toml", "rb"))["project"]["scripts"]
assert wanted.items() <= {(e.name, e.value) for e in m.distribution("fms-fsdp").entry_points}' 2>/dev/null; then
  python -m pip install -q --no-deps -e .
fi
