#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install mcompile into it.
#   bash scripts/env.sh        runtime dependencies
#   bash scripts/env.sh dev    plus the test and lint tools
# torch is installed first, pinned (override: TORCH_SPEC="torch==2.11.0" or any pip spec), because
# an unpinned torch pulls a multi-GB CUDA build where only the CPU wheel is wanted.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
[ -x .venv/bin/python ] || "$py" -m venv .venv
stamp=".venv/.mcompile-installed-$(cat pyproject.toml | sha1sum | cut -c1-12)-${extra:-base}-${torch_spec//[^a-zA-Z0-9.]/_}"
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q "$torch_spec"
  if [ "$extra" = "dev" ]; then
    .venv/bin/python -m pip install -q -e ".[dev]"
  else
    .venv/bin/python -m pip install -q -e .
  fi
  touch "$stamp"
fi
