#!/usr/bin/env bash
# The compat run (docs/testing.md): mcompile on the oldest torch pyproject.toml claims, in its own environment.
#   bash scripts/compat.sh                 torch 2.11.0 in /tmp/venv211; writes bench/results/compat_torch211.json
#   TORCH_SPEC="torch==2.12.0" VENV=/tmp/venv212 bash scripts/compat.sh
# The environment gets torch first (PyPI's wheel: the CUDA build, ~4.6 GB with its NVIDIA libraries; it runs on
# CPU as well), then pyproject's other dependencies and the test tools named here, and mcompile itself with
# --no-deps (an unpinned `pip install -e .` would re-resolve torch). Then bench/compat.py imports every module and
# runs a parity case of each capability (bench/compat.py TESTS), exiting non-zero if any import or test fails.
set -euo pipefail
cd "$(dirname "$0")/.."
torch_spec="${TORCH_SPEC:-torch==2.11.0}"
venv="${VENV:-/tmp/venv211}"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
stamp="$venv/.mcompile-compat-${torch_spec//[^a-zA-Z0-9.]/_}"
if [ ! -f "$stamp" ]; then
  "$venv/bin/python" -m pip install -q "$torch_spec"
  # pyproject's [project] dependencies other than torch, read from the file, plus what the tests import
  deps=$("$venv/bin/python" - <<'EOF'
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if not d.startswith("torch")))
EOF
)
  mapfile -t dep_list <<<"$deps"
  "$venv/bin/python" -m pip install -q "${dep_list[@]}" "pytest>=8" "hypothesis>=6.100" "pytest-timeout>=2.3" \
    "transformers>=5.0"
  "$venv/bin/python" -m pip install -q --no-deps -e .
  touch "$stamp"
fi
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
exec "$venv/bin/python" bench/compat.py --write "$@"
