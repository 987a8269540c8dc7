"""What the hang watchdog's record costs a collective when nothing hangs (mcompile.runtime.watchdog).

    python bench/watchdog_overhead.py [--calls 2000] [--write | --out PATH]

Two measurements, each the median of ``--repeats`` alternated runs:

- ``record_us``: the host time of the record alone around one collective, in one process without any
  process group: ``with log.collective(op, group): pass`` (a synchronous call on gloo: an entry made,
  appended, finished and retired) and the started form (``started(work)`` then the wrapped ``wait()``),
  against the context the communicator uses with the watchdog off (``UNWATCHED``);
- ``all_reduce_us``: a 16-element all-reduce through ``DistCommunicator.all_reduce`` on a gloo group of one
  process with the watchdog on (timeout 300 s) and off (``hang_timeout_s=0``), per call, median and minimum
  of the alternated runs: the record's cost within a real call, without a peer's scheduling (on 2 processes
  of our shared 2-core machine a loopback all-reduce takes ~2 ms +- 30% from run to run, which hides a few
  microseconds either way).

Nothing goes to the store while nothing hangs (the thread reads one counter per tick, 5 s at the default
timeout), so the record is the whole per-collective cost. On NCCL a synchronous call records one CUDA
event more (not measured here: no GPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import _results  # noqa: E402 - bench/_results.py: where the JSON goes (bench/ is the script's folder)


class _Work:
    def is_completed(self) -> bool:
        return False  # as gloo's reduce-scatter work: finished only by the host's wait

    def wait(self) -> bool:
        return True


def _per_call(fn, calls: int) -> float:
    t0 = time.perf_counter()
    fn(calls)
    return (time.perf_counter() - t0) / calls * 1e6


def record_costs(calls: int, repeats: int) -> dict:
    from mcompile.runtime.comm import UNWATCHED
    from mcompile.runtime.watchdog import CollectiveLog

    log = CollectiveLog(0)

    def off(n):
        for _ in range(n):
            with UNWATCHED:
                pass

    def sync(n):
        for _ in range(n):
            with log.collective("all_reduce", "tp[0,1]"):
                pass

    def started(n):
        work = _Work()
        for _ in range(n):
            with log.collective("reduce_scatter", "dp[0,2]") as e:
                w = e.started(work)
            w.wait()

    runs = {name: [] for name in ("off", "sync", "started")}
    for _ in range(repeats):
        for name, fn in (("off", off), ("sync", sync), ("started", started)):
            runs[name].append(_per_call(fn, calls))
    assert log.oldest_unfinished() is None
    return {name: round(statistics.median(v), 3) for name, v in runs.items()}


def _all_reduce_worker(rank, world, calls, repeats):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from mcompile.runtime.comm import DistCommunicator
    from mcompile.runtime.watchdog import HangSettings

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    on = DistCommunicator(mesh, HangSettings(timeout_s=300.0))
    off = DistCommunicator(mesh, HangSettings(timeout_s=0.0))
    assert on.log is not None and off.log is None
    x = torch.ones(16)
    for _ in range(200):  # warm-up
        on.all_reduce(x, "dp", "sum")
    runs = {"on": [], "off": []}
    for i in range(repeats):  # alternated, each first in turn
        for name, comm in ((("on", on), ("off", off)) if i % 2 else (("off", off), ("on", on))):
            t0 = time.perf_counter()
            for _ in range(calls):
                comm.all_reduce(x, "dp", "sum")
            runs[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: {"median": round(statistics.median(v), 2), "min": round(min(v), 2)} for name, v in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=500, help="all-reduces per timed run (the record alone: 200x)")
    ap.add_argument("--repeats", type=int, default=5)
    _results.add_arguments(ap, "watchdog_overhead")
    args = ap.parse_args()
    record = record_costs(200 * args.calls, args.repeats)
    from mcompile.runtime.launch import spawn

    (all_reduce,) = spawn(_all_reduce_worker, 1, args.calls, 8 * args.repeats)
    result = {
        "benchmark": "watchdog_overhead",
        "record_us": record,
        "record_overhead_us": {"sync": round(record["sync"] - record["off"], 3),
                               "started": round(record["started"] - record["off"], 3)},
        "all_reduce_us": all_reduce,
        "all_reduce_overhead_us": {k: round(all_reduce["on"][k] - all_reduce["off"][k], 2) for k in ("median", "min")},
        "calls": args.calls, "repeats": args.repeats,
    }
    _results.save("watchdog_overhead", result, args.write, args.out)


if __name__ == "__main__":
    main()
