"""Planning cost on meta-device models: capture, plan and lowering time and peak RSS.

    python bench/plan_time.py [--quick]

Writes bench/results/plan_time.json (figures, machine, commit). Each case runs in a fresh
process so RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

CASES = [
    ("llama3-8b", "dp=8,tp=8", False),
    ("llama3-70b", "dp=64,tp=8", False),
    ("llama3-70b", "dp=64,tp=8", True),
    ("gpt3-175b", "dp=8,tp=8", True),
    ("llama3-405b", "dp=16,tp=8", True),
]

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import mcompile as mc
from mcompile.models import get_preset
from mcompile.api import compile_plan
name, mesh, sp = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
pre = get_preset(name)
t1 = time.perf_counter()
model = pre.build(device="meta")
t2 = time.perf_counter()
c = compile_plan(model, mc.Mesh.parse(mesh, fake=True), pre.example_inputs(device="meta"), sequence_parallel=sp)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "build_s": t2 - t1, "plan_s": t3 - t2,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "collectives": len(c.plan.collectives), "params": len(c.plan.params)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the first two cases")
    args = ap.parse_args()
    rows = []
    for name, mesh, sp in CASES[:2] if args.quick else CASES:
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CHILD, name, mesh, "1" if sp else "0"],
                             capture_output=True, text=True, check=True)
        row = {"model": name, "mesh": mesh, "sequence_parallel": sp, **json.loads(out.stdout.strip().splitlines()[-1]),
               "wall_s": time.perf_counter() - t}
        print(row, flush=True)
        rows.append(row)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "benchmark": "plan_time",
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "commit": commit,
        "rows": rows,
    }
    path = Path(__file__).parent / "results" / "plan_time.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
