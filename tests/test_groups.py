"""The pipeline's process groups at a simulated 1024 ranks (dp16·pp8·tp8), in this process.

torch.distributed's rule is that every rank of the world calls every group creation, in the same order. One
rank of a 1024-rank world runs the group-building code (:mod:`mcompile.runtime.pipeline_groups`) on torch's fake
process group (no processes, no communication), with ``new_group`` and ``split_group`` counted: a rank's
world-wide calls must grow with the kinds of groups, not with their number (before: one ``new_group`` per group,
2048 calls for 1F1B at pp=8 with a tied weight). The split path (NCCL, a bound device) has no backend here, so
``split_group`` is a fake that checks its partition and hands each rank its group; the path without a split
runs torch's own ``new_group`` on the fake group. The groups' contents are checked too: each of a rank's
directions gets a group of exactly its two ranks, the two directions between two ranks different ones.
"""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from mcompile.ir.mesh import Mesh
from mcompile.runtime import launch, pipeline_groups
from mcompile.runtime.pipeline_groups import disjoint_kinds, make_p2p_groups, make_tied_groups, p2p_directions
from mcompile.runtime.schedules import build_schedule

MESH = Mesh(dp=16, pp=8, tp=8)  # 1024 ranks
TIED = {"wte": {0, 7}, "lm_head": {0, 7}, "norm": {3}}  # one set of pipeline ranks sharing weights
SCHEDULES = [("1f1b", 1), ("interleaved", 2)]  # a path of 14 directions; a ring of 16 (stages wrap round)
RANKS = [MESH.rank_of(dp=5, pp=p, tp=3) for p in (0, 3, 7)]  # first, middle and last pipeline rank


class _Counting:
    """Counts torch.distributed's group creations, wherever they are called from (DeviceMesh imports its own)."""

    def __init__(self, monkeypatch):
        import torch.distributed.device_mesh as device_mesh
        import torch.distributed.distributed_c10d as c10d

        self.new_group = self.split_group = 0
        real = c10d.new_group

        def new_group(*args, **kwargs):
            self.new_group += 1
            return real(*args, **kwargs)

        for module in (dist, c10d, device_mesh):
            monkeypatch.setattr(module, "new_group", new_group)


class _Group:
    def __init__(self, members):
        self.members = tuple(members)


@pytest.fixture
def fake_world(request):
    """This process as rank ``request.param`` of a 1024-rank world on torch's fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # one default group per process: a test that left its own behind is a leak to fix there (tests destroy theirs)
    assert not dist.is_initialized(), "a default process group is left from another test of this process"
    dist.init_process_group("fake", store=FakeStore(), rank=request.param, world_size=MESH.size(),
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield request.param
    finally:
        dist.destroy_process_group()


def _directions(schedule: str, v: int) -> list[tuple[int, int]]:
    pp = MESH.size("pp")
    return p2p_directions(build_schedule(schedule, pp, v, pp * v), pp * v, pp)


def _check_contents(rank, p2p, tied, members_of):
    """Each direction through this rank has its two ranks; a pair's two directions have two groups; the tied
    weights share one group of the first and last pipeline ranks at this rank's dp and tp."""
    coords = MESH.coords(rank)
    for (src, dst), group in p2p.items():
        assert coords["pp"] in (src, dst)
        assert set(members_of(group)) == {MESH.rank_of(**{**coords, "pp": r}) for r in (src, dst)}
        if (dst, src) in p2p:
            assert p2p[(dst, src)] is not group
    ends = [MESH.rank_of(**{**coords, "pp": r}) for r in (0, 7)]
    if coords["pp"] in (0, 7):
        assert sorted(tied) == ["lm_head", "wte"] and tied["wte"][0] is tied["lm_head"][0]
        assert tied["wte"][1] == ends and sorted(members_of(tied["wte"][0])) == ends
    else:
        assert tied == {}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule,v", SCHEDULES)
@pytest.mark.parametrize("fake_world", RANKS, indirect=True)
def test_split_groups_take_a_call_per_kind_at_1024_ranks(fake_world, schedule, v, monkeypatch):
    """NCCL with a bound device: each kind of group is one ``split_group`` of the world, the same calls on
    every rank; no ``new_group`` at all (each would be a world-wide split for the ranks outside its group)."""
    rank = fake_world
    counts = _Counting(monkeypatch)
    partitions = []

    def split_group(parent_pg=None, split_ranks=None, timeout=None, pg_options=None, group_desc=None):
        counts.split_group += 1
        flat = [r for g in split_ranks for r in g]
        assert len(flat) == len(set(flat)), "a rank in two groups of one split"
        partitions.append((group_desc, split_ranks))
        return next((_Group(g) for g in split_ranks if rank in g), None)

    monkeypatch.setattr(dist, "split_group", split_group, raising=False)
    monkeypatch.setattr(launch, "splits_world", lambda: True)
    directions = _directions(schedule, v)
    coords = MESH.coords(rank)
    p2p = make_p2p_groups(MESH, coords, directions)
    tied = make_tied_groups(MESH, coords, TIED)

    kinds = len(disjoint_kinds(directions)) + 1  # the p2p kinds, and the one tied set
    assert counts.split_group == kinds <= 5 and counts.new_group == 0, (counts.split_group, counts.new_group)
    assert sum(len(p) for _, p in partitions) == 128 * (len(directions) + 1)  # every group made, once
    assert sorted(p2p) == [d for d in directions if coords["pp"] in d]
    _check_contents(rank, p2p, tied, lambda g: g.members)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fake_world", RANKS[1:2], indirect=True)
def test_without_a_split_every_group_is_still_made_in_one_order(fake_world, monkeypatch):
    """Gloo, or NCCL without a bound device: torch cannot split, so each kind is one
    ``new_subgroups_by_enumeration`` that loops ``new_group`` over its groups (a name taken, nothing else, on the
    ranks outside a group); the kinds are as few as with a split, and each rank gets the groups it should."""
    rank = fake_world
    counts = _Counting(monkeypatch)
    made = []
    real = pipeline_groups.subgroups
    monkeypatch.setattr(pipeline_groups, "subgroups", lambda partition, tag: made.append(tag) or real(partition, tag))
    assert not launch.splits_world()
    directions = _directions("1f1b", 1)
    coords = MESH.coords(rank)
    p2p = make_p2p_groups(MESH, coords, directions)
    tied = make_tied_groups(MESH, coords, TIED)
    assert len(made) == 5 and len(made) == len(set(made))  # 4 p2p kinds + 1 tied, each tag its own
    assert counts.new_group == 128 * (14 + 1)
    _check_contents(rank, p2p, tied, dist.get_process_group_ranks)
    # made once per process: the same calls again create nothing
    assert make_p2p_groups(MESH, coords, directions) == p2p and counts.new_group == 128 * 15


@pytest.mark.parametrize("fake_world", RANKS[:1], indirect=True)
def test_split_only_on_nccl_bound_to_a_device(fake_world, monkeypatch):
    """The gate of the split path: NCCL alone (a mixed backend is left unbound by init_distributed), with the
    world's group bound to a device (its communicator made at init: split_group refuses otherwise)."""
    import torch

    world = dist.group.WORLD
    assert not launch.splits_world()  # the fake backend, unbound
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert not launch.splits_world()  # unbound: communicators made lazily, nothing to split from
    world.bound_device_id = torch.device("cuda", 0)
    try:
        assert launch.splits_world()
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
        assert not launch.splits_world()
    finally:
        world.bound_device_id = None


def test_kinds_never_hold_a_pipeline_rank_twice():
    """First fit over every schedule's directions: within a kind no rank twice (else one split would put a rank
    in two groups); a path needs 4 kinds, a ring of odd length 6."""
    for schedule, v in [("gpipe", 1), ("1f1b", 1), ("zbh1", 1), ("interleaved", 2), ("interleaved", 4)]:
        for pp in range(2, 17):
            directions = p2p_directions(build_schedule(schedule, pp, v, pp * v), pp * v, pp)
            kinds = disjoint_kinds(directions)
            assert sorted(d for k in kinds for d in k) == directions
            for kind in kinds:
                flat = [r for d in kind for r in d]
                assert len(flat) == len(set(flat)), (schedule, pp, kind)
            ring = schedule == "interleaved" and pp > 2
            assert len(kinds) == (2 if pp == 2 else 6 if ring and pp % 2 else 4), (schedule, pp, len(kinds))


def test_subgroups_refuses_a_rank_in_two_groups():
    with pytest.raises(ValueError, match="a rank is in two groups of one kind"):
        launch.subgroups([(0, 1), (1, 2)], tag="overlap")
