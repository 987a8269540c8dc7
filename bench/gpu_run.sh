#!/usr/bin/env bash
# The one prepared command for a lent GPU machine, run from the repository root:
#
#     MCOMPILE_COMMIT=<sha>[+dirty] bash bench/gpu_run.sh [extra bench/kernels.py options]
#     MCOMPILE_COMMIT=<sha>[+dirty] BENCH=gpu_step BUDGET=400 HARD_LIMIT=450 bash bench/gpu_run.sh
#
# Installs nothing. It prints nvidia-smi and the versions, makes the project importable through a
# folder of symbolic links laid out as pyproject.toml's package-dir maps it (mcompile/ holds the
# files of mcompile/, mcompile/kernels -> kernels/, ...; plain PYTHONPATH=. cannot find
# mcompile.kernels, whose source is ./kernels), then runs `python bench/$BENCH.py` under the time
# budget. The JSON and the console log ($BENCH.json, $BENCH.log) are written straight into $OUT when
# it is set (else bench/results/): bench/kernels.py and bench/gpu_step.py rewrite their JSON after
# every item, so a run stopped by the command's time limit still leaves everything measured until
# then, marked incomplete.
#
# Environment: BENCH (kernels: bench/kernels.py, the default; gpu_step: bench/gpu_step.py), PYTHON
# (python3), BUDGET (480 s, counted from the script's start, compilation included: items not started
# by then are skipped and listed), HARD_LIMIT (540 s: a `timeout` around the benchmark; with the ~30 s
# of versions and imports before it, the whole command stays under a 600 s limit; gpu_step's 8-minute
# run: BUDGET=400 HARD_LIMIT=450), MCOMPILE_COMMIT (the commit to record where the copied tree has no .git).
set -uo pipefail
cd "$(dirname "$0")/.."

py="${PYTHON:-python3}"
budget="${BUDGET:-480}"
hard_limit="${HARD_LIMIT:-540}"
dest="${OUT:-bench/results}"
mkdir -p "$dest"
bench="${BENCH:-kernels}"
case "$bench" in kernels|gpu_step) ;; *) echo "BENCH=$bench: use kernels or gpu_step" >&2; exit 2 ;; esac
log="$dest/$bench.log"
unset TRITON_INTERPRET  # the real kernels, not the interpreter
export PYTHONUNBUFFERED=1

{
  echo "== bench/gpu_run.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) commit ${MCOMPILE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  echo "== budget ${budget} s, hard limit ${hard_limit} s, results in ${dest}"
  nvidia-smi || echo "nvidia-smi failed (rc $?)"
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,power.limit,temperature.gpu --format=csv \
    || true
  "$py" - <<'EOF'
import platform
import sys

import torch

print("python", sys.version.split()[0], platform.platform())
print("torch", torch.__version__, "cuda", torch.version.cuda, "cuda available", torch.cuda.is_available())
try:
    import triton
    print("triton", triton.__version__)
except ImportError as exc:
    print("triton: not importable:", exc)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"sm_{p.major}{p.minor}", f"{p.total_memory / 2**30:.1f} GiB", p.multi_processor_count, "SMs")
print("torch._scaled_mm:", hasattr(torch, "_scaled_mm"), " torch.cuda._sleep:", hasattr(torch.cuda, "_sleep"))
EOF
} 2>&1 | tee "$log"

# the package as pyproject.toml lays it out, from symbolic links (nothing installed, nothing written in the tree)
view="$(mktemp -d)/site"
if ! "$py" bench/pkg_view.py "$view" 2>&1 | tee -a "$log"  # (bench/pkg_view.py: shared with bench/mutants.py)
then
  echo "could not lay out the package view" | tee -a "$log"
  exit 2
fi
export PYTHONPATH="$view${PYTHONPATH:+:$PYTHONPATH}"
# -P: not the current folder first (there ./mcompile would shadow the view and miss mcompile.kernels)
if ! "$py" -P -c "import mcompile.kernels.fp8 as m; print('mcompile.kernels from', m.__file__)" 2>&1 | tee -a "$log"
then
  echo "mcompile.kernels is not importable through the package view" | tee -a "$log"
  exit 2
fi

timeout --signal=TERM --kill-after=20 "$hard_limit" \
  "$py" "bench/$bench.py" --budget "$budget" --out "$dest/$bench.json" "$@" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
echo "== bench/$bench.py exited $rc$( [ "$rc" = 124 ] && echo ' (stopped by HARD_LIMIT)'); $(date -u +%H:%M:%SZ)" \
  | tee -a "$log"
ls -l "$dest" || true
exit "$rc"
