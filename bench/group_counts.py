"""Process-group creations per rank at a simulated 1024 ranks (dp16·pp8·tp8): the pipeline's groups and the
DeviceMesh's per-axis groups, counted on torch's fake process group in one process (no communication).

    python bench/group_counts.py [--write] [--out PATH]

torch.distributed's rule: every rank of the world calls every group creation, in the same order. So what a
rank pays grows with the world-wide calls it makes. Counted for one rank (dp=5, pp=3, tp=3) and a tied weight
on the first and last pipeline ranks, for 1F1B (14 directions) and interleaved 1F1B (v=2, 16 directions):

- ``per_group``: the pipeline's groups as made before (runtime/pipeline.py up to 3af6683): one ``new_group``
  per group, through ``launch.process_group``, in the same order;
- ``kinds_new_group``: now, without a split (gloo, NCCL without a bound device): one
  ``launch.subgroups`` call per kind, each looping ``new_group`` over its groups inside torch;
- ``kinds_split``: now, NCCL bound to a device (``init_distributed`` binds it): one ``split_group`` per kind.
  No NCCL here, so ``split_group`` is a fake that makes the rank's group alone; its seconds are not NCCL's.
- ``device_mesh``: ``init_device_mesh`` for the mesh's axes, unbound (torch loops ``new_group`` over every
  slice of every axis) and bound (torch's ``split_group`` per axis, faked as above).

Seconds are this process's wall time for the calls, the least of three runs after a first (Python only on the
fake group: on a real world an unbound ``new_group`` of a non-member costs about the same, a member's adds its
communicator's set-up).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

RANK_COORDS = {"dp": 5, "pp": 3, "tp": 3}
TIED = {"wte": {0, 7}, "lm_head": {0, 7}}


@contextlib.contextmanager
def _world(rank: int, world: int, bound: bool):
    """Rank ``rank`` of a fake world; ``bound``: its group bound to a device, with split_group faked (counted)
    and torch.accelerator reported available (DeviceMesh's split path asks it)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mcompile.runtime import launch

    counts = {"new_group": 0, "split_group": 0}
    real_new = c10d.new_group

    def new_group(*args, **kwargs):
        counts["new_group"] += 1
        return real_new(*args, **kwargs)

    def split_group(parent_pg=None, split_ranks=None, timeout=None, pg_options=None, group_desc=None, **_):
        counts["split_group"] += 1  # the rank's group alone, made by its members only (one process here)
        mine = next((g for g in split_ranks if rank in g), None)
        return None if mine is None else real_new(mine, use_local_synchronization=True)

    saved = [(m, "new_group", m.new_group) for m in (dist, c10d, device_mesh)]
    saved += [(dist, "split_group", dist.split_group), (device_mesh, "split_group", device_mesh.split_group),
              (launch, "splits_world", launch.splits_world),
              (torch.accelerator, "is_available", torch.accelerator.is_available)]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        for m in (dist, c10d, device_mesh):
            m.new_group = new_group
        if bound:
            dist.group.WORLD.bound_device_id = torch.device("cuda", 0)
            dist.split_group = device_mesh.split_group = split_group
            launch.splits_world = lambda: True
            torch.accelerator.is_available = lambda: True
        yield counts
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        dist.group.WORLD.bound_device_id = None
        dist.destroy_process_group()


def _timed(counts: dict, fn) -> dict:
    before = dict(counts)
    t0 = time.perf_counter()
    fn()
    return {"new_group": counts["new_group"] - before["new_group"],
            "split_group": counts["split_group"] - before["split_group"],
            "seconds": round(time.perf_counter() - t0, 4)}


def _per_group(mesh, directions, param_ranks) -> None:
    """The pipeline's groups as runtime/pipeline.py made them before: a ``new_group`` per group, all ranks."""
    from mcompile.runtime.launch import process_group
    from mcompile.runtime.pipeline_groups import _others

    for ranks in sorted({tuple(sorted(r)) for r in param_ranks.values() if len(r) > 1}):
        for c in _others(mesh):
            process_group([mesh.rank_of(**c, pp=r) for r in ranks], tag="pipeline parameter sync")
    for src, dst in directions:
        for c in _others(mesh):
            process_group([mesh.rank_of(**c, pp=r) for r in (src, dst)], tag=f"p2p {src}->{dst}")


def measure() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from mcompile.ir.mesh import Mesh
    from mcompile.runtime.pipeline_groups import make_p2p_groups, make_tied_groups, p2p_directions
    from mcompile.runtime.schedules import build_schedule

    mesh = Mesh(dp=16, pp=8, tp=8)
    rank = mesh.rank_of(**RANK_COORDS)
    coords = mesh.coords(rank)
    out: dict = {"mesh": mesh.spec(), "world": mesh.size(),
                 "rank": rank, "pipeline": {}, "device_mesh": {}}
    for schedule, v in (("1f1b", 1), ("interleaved", 2)):
        directions = p2p_directions(build_schedule(schedule, 8, v, 8 * v), 8 * v, 8)

        def now(directions=directions):
            make_p2p_groups(mesh, coords, directions)
            make_tied_groups(mesh, coords, TIED)

        row = {"directions": len(directions), "groups": 128 * (len(directions) + 1)}
        for name, bound, fn in (("per_group", False, lambda d=directions: _per_group(mesh, d, TIED)),
                                ("kinds_new_group", False, now), ("kinds_split", True, now)):
            runs = []
            for _ in range(4):  # the first pays one-off imports; the least of the others (shared cores)
                with _world(rank, mesh.size(), bound) as counts:
                    runs.append(_timed(counts, fn))
            row[name] = min(runs[1:], key=lambda r: r["seconds"])
        out["pipeline"][f"{schedule} v={v}"] = row
    for name, bound in (("unbound", False), ("bound", True)):
        with _world(rank, mesh.size(), bound) as counts:
            out["device_mesh"][name] = _timed(
                counts, lambda: init_device_mesh("cpu", mesh.shape, mesh_dim_names=mesh.axis_names))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _results.add_arguments(ap, "group_counts")
    args = ap.parse_args()
    _results.save("group_counts", {"name": "group_counts", **measure()}, args.write, args.out)


if __name__ == "__main__":
    main()
