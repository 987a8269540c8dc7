"""Functions the gloo worker processes run for tests/test_watchdog.py: fn(rank, world, *args); and the entry point
of the processes its abort test starts (``python -c "import watchdog_cases; watchdog_cases.abort_main(...)"``).

Module-level so the workers can import them by name.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mcompile.runtime.comm import DistCommunicator
from mcompile.runtime.watchdog import HangSettings, process_log, watchdog_of

WAIT_FOR_REPORT_S = 60.0  # the planted rank's patience: past it the test fails on a missing report, not a hang


def _wait_for(path: Path, needle: str, deadline_s: float = WAIT_FOR_REPORT_S) -> bool:
    """Whether ``path`` holds ``needle`` within ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if path.exists() and needle in path.read_text():
            return True
        time.sleep(0.05)
    return False


def late_rank(rank, world, dump_dir, timeout_s):
    """dp=2 x tp=2: three all-reduces over tp, each followed by one over dp; rank 1 holds back its second tp
    all-reduce until the watchdogs of the ranks that wait (0, and through it 2; 3) have reported (or
    WAIT_FOR_REPORT_S passed), then issues it, so every rank finishes and the pool lives on. Returns this rank's
    report text ("" if none) and whether its log is empty of unfinished entries at the end. The process's previous
    watchdog settings are restored."""
    from mcompile.runtime.launch import device_mesh

    mesh = device_mesh("cpu", (2, 2), ("dp", "tp"))
    before = process_log().settings
    comm = DistCommunicator(mesh, HangSettings(timeout_s=timeout_s, dump_dir=dump_dir))
    try:
        x = torch.ones(4)
        for i in range(3):
            if rank == 1 and i == 1:
                for r in (0, 2, 3):
                    _wait_for(Path(dump_dir) / f"rank{r}.txt", "has not completed")
            comm.all_reduce(x, "tp", "sum")
            comm.all_reduce(x, "dp", "sum")
        _every_path(comm)
        dist.barrier()
        report = Path(dump_dir) / f"rank{rank}.txt"
        # every rank's watchdog publishes once it sees the incident: wait for this rank's own lines too
        _wait_for(report, f"rank {rank}")
        dist.barrier()
        return report.read_text() if report.exists() else "", comm.log.oldest_unfinished() is None
    finally:
        process_log(before)


def _every_path(comm) -> None:
    """The communicator's other calls, for the log to finish: started collectives and their waits (gloo's
    reduce-scatter work never says it completed), a ring step and a started one, a started collective the runtime
    launched itself (a ZeRO bucket's reduce-scatter) and a synchronous one (``timed``)."""
    from mcompile.runtime.comm import _REDUCE_SCATTER

    x = torch.ones(4, 2)
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        comm.wait(comm.start(kind, x, "tp"))
    comm.sendrecv_ring([x], "tp")
    comm.start_sendrecv_ring([x], "dp").wait()
    out = torch.empty(2, 2)
    work = comm.launched("reduce_scatter", "dp", x, _REDUCE_SCATTER(out, x, group=comm.groups["dp"], async_op=True))
    work.wait()
    with comm.timed("all_reduce", "dp", x):
        dist.all_reduce(x, group=comm.groups["dp"])


def normal_run(rank, world, mesh, options, dump_dir):
    """Two train steps of the tiny Llama with the watchdog at a short timeout: whether any report was written,
    this rank's unfinished entries (none expected), how many entries each key of its log issued, and the watchdog's
    ticks. The process's previous watchdog settings are restored."""
    import mcompile as mc

    from conftest import build

    before = process_log().settings
    try:
        model, inputs = build("llama3-tiny", batch=4)
        pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, hang_timeout_s=20.0, hang_dump_dir=dump_dir,
                            **options)
        log = pm._comm.log
        dog = watchdog_of(log)
        ticks, incidents = dog.ticks, int(dog.store.add("incidents", 0))  # (earlier tests' incidents counted)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
        for _ in range(2):
            pm.train_step(*inputs)
            opt.step()
            opt.zero_grad()
        pm(*inputs)
        dist.barrier()
        time.sleep(2.5 * dog.tick_s())  # the watchdog looks at least twice more
        state = log.state()
        return {"reports": sorted(os.listdir(dump_dir)) if os.path.isdir(dump_dir) else [],
                "unfinished": state["unfinished"], "issued": {k: v["issued"][0] for k, v in state["keys"].items()},
                "ticks": dog.ticks - ticks, "incidents": int(dog.store.add("incidents", 0)) - incidents}
    finally:
        process_log(before)


def abort_main(dump_dir: str, timeout_s: float) -> None:
    """One rank of the abort test (environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): tp=2, rank 1 skips the
    second all-reduce. Rank 0's watchdog (hang_abort) reports and ends the process with its exit code; rank 1 waits
    for that report, then leaves."""
    import datetime

    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # far above the hang timeout
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    comm = DistCommunicator(mesh, HangSettings(timeout_s=timeout_s, dump_dir=dump_dir, abort=True))
    x = torch.ones(4)
    comm.all_reduce(x, "tp", "sum")
    if rank == 1:  # the planted bug: no second all-reduce
        found = _wait_for(Path(dump_dir) / "rank0.txt", "has not completed")
        time.sleep(0.5)
        os._exit(0 if found else 3)
    comm.all_reduce(x, "tp", "sum")
    os._exit(4)  # never reached: the watchdog ends this process
