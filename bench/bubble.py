"""The measured pipeline bubble of each schedule against its formula (a wall-clock comparison).

    python bench/bubble.py [--rounds 3] [--write | --out PATH]

Stages that sleep fixed times on 4 gloo processes (2 cores cannot distort a sleep): the bubble
measured from the recorded timeline against :func:`mcompile.runtime.schedules.bubble_fraction`.
The formula assumes free messages and exact action times; here every action runs a little longer
than its sleep and every message costs a gloo round trip. Both are measured in the same run, and the
ideal simulation with those durations plus a per-hop latency of 2 ms bounds what the formula can be
off by: a schedule is ``within`` when the measurement lies between the formula - 0.01 and that
simulation + 0.02 (best of ``--rounds``: a machine's load only adds idle time). The default test tier
checks what is deterministic (tests/test_pipeline.py: each rank runs its schedule's actions in order;
the formula against the simulation); this is the timing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # pipeline_cases.sleep_pipeline: the workers import it by name

import _results  # noqa: E402 - bench/_results.py: where the JSON goes (bench/ is the script's folder)


def measure(name: str, p: int, m: int, v: int, t_f: float, t_b: float, t_w: float) -> tuple[float, float]:
    """One run: the mean bubble over ranks from the recorded timeline, and the ideal simulation's
    bubble with the measured action durations and 2 ms per message."""
    from pipeline_cases import sleep_pipeline

    from mcompile.ir.timeline import bubble, chrome_trace
    from mcompile.runtime.launch import spawn
    from mcompile.runtime.schedules import build_schedule, simulate

    events = [e for r in spawn(sleep_pipeline, p, name, m, v, t_f, t_b, t_w) for e in r]
    b = bubble(chrome_trace(events))
    dur = {k: [e["end"] - e["start"] for e in events if e["cat"] == k] for k in "FBW"}
    mean = {k: (sum(x) / len(x) if x else 0.0) for k, x in dur.items()}
    slow = simulate(build_schedule(name, p, v, m), mean["F"] * v + 0.002 * v, mean["B"] * v + 0.002 * v,
                    mean["W"] * v, virtual=v)
    return sum(b.values()) / len(b), 1 - min(slow[1]) / slow[0]


def main() -> None:
    from mcompile.runtime.schedules import SCHEDULES, bubble_fraction

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="runs per schedule (the best is kept)")
    _results.add_arguments(ap, "bubble")
    args = ap.parse_args()
    p, m = 4, 8
    t_f, t_b, t_w = 0.03, 0.06, 0.03
    t0 = time.perf_counter()
    rows = {}
    for name in SCHEDULES:
        v = 2 if name == "interleaved" else 1
        formula = bubble_fraction(name, p, m, v, t_f, t_b, t_w)
        tries = [measure(name, p, m, v, t_f, t_b, t_w) for _ in range(args.rounds)]
        best, upper = min(tries)
        rows[name] = {"virtual": v, "formula": formula, "measured_best": best, "simulation_upper": upper,
                      "tries": [{"measured": b, "simulation": u} for b, u in tries],
                      "within": formula - 0.01 <= best <= upper + 0.02}
        print(f"{name:12s} formula {formula:.3f}  measured {best:.3f}  simulation {upper:.3f}  "
              f"{'within' if rows[name]['within'] else 'OUTSIDE'}", flush=True)
    result = {"benchmark": "bubble", "pp": p, "microbatches": m, "sleep_s": {"F": t_f, "B": t_b, "W": t_w},
              "schedules": rows,
              "interleaved_and_zbh1_below_1f1b": rows["interleaved"]["measured_best"] < rows["1f1b"]["measured_best"]
              and rows["zbh1"]["measured_best"] < rows["1f1b"]["measured_best"],
              "wall_s": time.perf_counter() - t0}
    _results.save("bubble", result, args.write, args.out)


if __name__ == "__main__":
    main()
