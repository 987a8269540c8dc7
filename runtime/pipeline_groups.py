"""The pipeline's process groups, made a kind at a time: a call per kind of group, not per group.

Two sorts of group, for every coordinate ``c`` of the other axes (dp, tp, ...):

- **p2p**: a two-rank group per *direction* ``src -> dst`` between pipeline ranks that exchange messages,
  ``{rank(c, pp=src), rank(c, pp=dst)}``, so that on NCCL each direction has its own communicator (the reason:
  :mod:`mcompile.runtime.pipeline`'s docstring);
- **tied**: a group per set of pipeline ranks sharing a parameter (GPT-2's wte / lm_head on the first and last
  stage), whose gradients are summed over it.

A *kind* is a list of such pipeline-rank sets that share no pipeline rank; its groups over every ``c`` are then
disjoint, and :func:`mcompile.runtime.launch.subgroups` makes all of them in one call (one split of the world's
communicator on NCCL). Kinds are found first fit, in a fixed order, the same on every rank: a set joins the
first kind that holds none of its ranks. The directions of a pipeline are the edges of a path, or of a ring
where stages wrap round (interleaved schedules), two per neighbour pair; first fit, in sorted order, needs 4
kinds for any path and any ring of even length, 6 for an odd ring (a rank's four edges, two kinds per
neighbour pair, can never share one; greedy edge colouring's bound is 2·4 − 1 = 7). At dp16·pp8·tp8 (1024
ranks) that is 4 calls for 1F1B's 14 directions, 1792 groups, each of which was a ``new_group`` that every
rank of the world called before.
"""

from __future__ import annotations

import itertools

from mcompile.runtime.launch import subgroups

__all__ = ["disjoint_kinds", "p2p_directions", "make_p2p_groups", "make_tied_groups"]


def disjoint_kinds(sets: list[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """``sets`` (of pipeline ranks) split into kinds, no pipeline rank twice in a kind: each set, in order, joins
    the first kind that shares no rank with it (a new kind when none)."""
    kinds: list[list[tuple[int, ...]]] = []
    used: list[set[int]] = []
    for s in sets:
        for kind, ranks in zip(kinds, used):
            if ranks.isdisjoint(s):
                kind.append(s)
                ranks.update(s)
                break
        else:
            kinds.append([s])
            used.append(set(s))
    return kinds


def p2p_directions(actions: list[list], num_stages: int, pp: int) -> list[tuple[int, int]]:
    """The (sending, receiving) pipeline ranks of every message of the schedule, sorted: a forward sends stage
    ``s``'s outputs to the rank of ``s + 1``, a backward the gradients of its inputs to the rank of ``s - 1``;
    a rank's messages to itself (two consecutive stages on one rank) need no group."""
    pairs = set()
    for a in (a for acts in actions for a in acts):
        if a.kind == "F" and a.stage < num_stages - 1:
            pairs.add((a.stage % pp, (a.stage + 1) % pp))
        elif a.kind == "B" and a.stage > 0:
            pairs.add((a.stage % pp, (a.stage - 1) % pp))
    return sorted(p for p in pairs if p[0] != p[1])


def _others(mesh) -> list[dict[str, int]]:
    """Every coordinate of the axes other than pp, in row-major order."""
    others = [a for a in mesh.axis_names if a != "pp"]
    return [dict(zip(others, combo)) for combo in itertools.product(*[range(mesh.size(a)) for a in others])]


def make_p2p_groups(mesh, coords: dict[str, int], directions: list[tuple[int, int]]) -> dict[tuple[int, int], object]:
    """This rank's group of each direction it sends or receives on ((src, dst) pipeline ranks -> group), every
    direction's groups made a kind at a time (module docstring); every rank calls it with the same directions."""
    out = {}
    for kind in disjoint_kinds(directions):
        partition = [tuple(mesh.rank_of(**c, pp=r) for r in d) for d in kind for c in _others(mesh)]
        group = subgroups(partition, tag="p2p " + ",".join(f"{s}->{d}" for s, d in kind))
        for d in kind:
            if coords["pp"] in d:
                out[d] = group
    return out


def make_tied_groups(mesh, coords: dict[str, int], param_ranks: dict[str, set[int]]) -> dict[str, tuple]:
    """For each parameter living on several pipeline ranks and on this rank, ``(group, members)``: the group of
    those pipeline ranks at this rank's other coordinates, and its global ranks. One group per distinct set of
    pipeline ranks (parameters sharing a set share it), the sets made a kind at a time."""
    sets = sorted({tuple(sorted(r)) for r in param_ranks.values() if len(r) > 1})
    out = {}
    for kind in disjoint_kinds(sets):
        partition = [tuple(mesh.rank_of(**c, pp=r) for r in ranks) for ranks in kind for c in _others(mesh)]
        group = subgroups(partition, tag="pipeline parameter sync " + ",".join(map(str, kind)))
        for ranks in kind:
            if coords["pp"] not in ranks:
                continue
            members = [mesh.rank_of(**{**coords, "pp": r}) for r in ranks]
            for fqn, r in param_ranks.items():
                if tuple(sorted(r)) == ranks:
                    out[fqn] = (group, members)
    return out
