"""Start-up of ``mc.parallelize``: seconds per rank for the tiny Llama at dp=2 x tp=2 on 4 gloo CPU
processes, on a first run (an empty capture cache: rank 0 runs torch.export and broadcasts the
program) and on a second run (rank 0 reads the capture from the cache), with and without the cache
and the broadcast (the "unshared" run: every rank captures, as before issue 18).

    python bench/startup.py [--write] [--out PATH]

Each run is a fresh set of processes (``mcompile.runtime.launch.spawn``) calling ``parallelize``
twice: the first call pays the process's one-off costs (torch.distributed's set-up, the first use of
torch's export and tracing machinery), the second is the same process with the cache warm. "seconds"
is the wall time of the ``parallelize`` call itself on each rank (``import mcompile`` and its lazy
imports come before it).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402


def worker(rank, world, cache, share):
    import warnings

    import torch

    warnings.simplefilter("ignore")
    import mcompile as mc
    import mcompile.api as api
    from mcompile.models import get_preset

    os.environ["MCOMPILE_CACHE"] = cache
    if not share:  # every rank captures on its own (the behaviour before the capture was shared)
        api._from_rank0 = lambda produce: produce()
    pre = get_preset("llama3-tiny")
    torch.manual_seed(0)
    model = pre.build()
    ids = torch.randint(0, 256, (4, 16))
    parallelize, mesh = mc.parallelize, mc.Mesh(dp=2, tp=2)  # the package's lazy imports: not parallelize's
    seconds = []
    for _ in range(2):  # a fresh process's first call, then a second call in the same process
        t = time.perf_counter()
        pm = parallelize(model, mesh, (ids, ids), capture_cache=share)
        seconds.append(time.perf_counter() - t)
    loss = float(pm.train_step(ids, ids))
    return seconds, loss


def main() -> None:
    ap = argparse.ArgumentParser()
    _results.add_arguments(ap, "startup")
    args = ap.parse_args()
    from mcompile.runtime.launch import spawn

    rows = []
    cache = tempfile.mkdtemp(prefix="mcompile-startup-")
    for run, share in (("first", True), ("cached", True), ("unshared", False)):
        t = time.perf_counter()
        out = spawn(worker, 4, cache, share)
        rows.append({"run": run, "capture_shared_and_cached": share,
                     "first_call_seconds_per_rank": [s[0] for s, _ in out],
                     "second_call_seconds_per_rank": [s[1] for s, _ in out],
                     "first_call_max_s": max(s[0] for s, _ in out), "second_call_max_s": max(s[1] for s, _ in out),
                     "loss": out[0][1], "processes_wall_s": time.perf_counter() - t})
        print(rows[-1], flush=True)
    assert len({r["loss"] for r in rows}) == 1, "the runs trained differently"
    _results.save("startup", {"benchmark": "startup", "model": "llama3-tiny", "mesh": "dp=2,tp=2",
                              "processes": 4, "rows": rows}, args.write, args.out)


if __name__ == "__main__":
    main()
