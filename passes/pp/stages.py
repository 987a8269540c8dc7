"""Pipeline stage partitioning: cut the captured graph into ``pp x virtual`` contiguous stages.

Cuts are taken only at narrow points of the trunk (:mod:`mcompile.sharding.blocks`): one activation crosses
each cut, and everything that depends on no parameter (masks, positions, RoPE tables, the labels'
token count) is recomputed by every stage that needs it. Two granularities:

- ``"layer"``: cuts only where a repeated block begins (the embedding stays with the first layer,
  the head and loss with the last one) — Megatron's layer-wise split;
- ``"sublayer"``: any narrow point between the first block and the head — in a pre-norm
  transformer also between attention and MLP, which balances stages more finely;
- ``"auto"`` (the runtime's default): whole layers, unless cutting inside them lowers the most
  expensive stage (or there are fewer layers than stages).

The cost of a node is a roofline time proxy from its annotation, ``max(flops, intensity * bytes)``
(FLOPs and bytes of the node's forward at batch 1 and the planning sequence length; ``intensity``
in FLOP/byte is the machine balance, ~300 on an H100 in bf16): backward and recompute scale every
node alike, so forward cost balances the whole step. The partition minimises the most expensive
stage exactly (dynamic programming over the cut candidates, ``O(K n^2)`` vectorised), optionally
under a memory limit per stage (parameters plus the stage's activations times the microbatches it
holds in flight under 1F1B: ``pp - rank``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import sympy

from mcompile.ir import meta as M
from mcompile.sharding.blocks import Trunk, analyse

__all__ = ["PartitionError", "StagePartition", "partition", "min_max_reference"]

GRANULARITIES = ("layer", "sublayer", "auto")


class PartitionError(ValueError):
    """The requested pipeline split cannot be made; the message lists valid choices."""


@dataclass
class StagePartition:
    pp: int
    virtual: int
    granularity: str
    trunk: Trunk = field(repr=False)
    cuts: list[int]  # trunk positions where stages 1..K-1 begin
    stage_cost: list[float]  # the cost proxy of each stage (FLOP-equivalents of one sample's forward)
    stage_params: list[int]  # parameters (elements) first used in each stage
    stage_act_bytes: list[float]  # activation bytes written by each stage for one microbatch
    optimum: float  # the min-max stage cost at this granularity (== max(stage_cost) unless pinned)
    pinned: bool = False

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual

    @property
    def imbalance(self) -> float:
        """max stage cost / mean stage cost - 1."""
        mean = sum(self.stage_cost) / len(self.stage_cost)
        return max(self.stage_cost) / mean - 1 if mean else 0.0

    def bounds(self) -> list[tuple[int, int]]:
        edges = [0, *self.cuts, len(self.trunk.nodes)]
        return list(zip(edges[:-1], edges[1:]))

    def stage_of_position(self, position: int) -> int:
        s = 0
        for c in self.cuts:
            if position >= c:
                s += 1
        return s

    def stage_of(self, name: str) -> int | None:
        """Stage of a captured node; None for input-only nodes (recomputed where needed)."""
        if name in self.trunk.input_only or name not in self.trunk.pos:
            return None
        return self.stage_of_position(self.trunk.pos[name])

    def rank_of_stage(self, stage: int) -> int:
        """Pipeline rank holding ``stage`` (virtual stages round-robin, as Megatron interleaves)."""
        return stage % self.pp

    def layers(self, stage: int) -> tuple[float, float]:
        lo, hi = self.bounds()[stage]
        return self.trunk.layer_of(lo), self.trunk.layer_of(hi) if hi < len(self.trunk.nodes) else \
            float(self.trunk.num_layers)

    def cut_nodes(self) -> list[str]:
        return [self.trunk.nodes[c].name for c in self.cuts]


def _cost_arrays(trunk: Trunk, symbols: dict, batch: int, seq: int, intensity: float):
    subs = {}
    if "batch" in symbols:
        subs[symbols["batch"]] = batch
    if "seq" in symbols:
        subs[symbols["seq"]] = seq

    seen: dict = {}  # every layer repeats its nodes' expressions: each substituted once (~0.1 ms a subs)

    def ev(x) -> float:
        if x is None:
            return 0.0
        if isinstance(x, int | float):
            return float(x)
        if x not in seen:
            seen[x] = float(sympy.sympify(x).subs(subs))
        return seen[x]

    cost, act = [], []
    for n in trunk.nodes:
        if n.name in trunk.input_only:
            cost.append(0.0)
            act.append(0.0)
            continue
        flops = ev(n.meta.get(M.FLOPS))
        nbytes = ev(n.meta.get(M.BYTES_READ)) + ev(n.meta.get(M.BYTES_WRITTEN))
        cost.append(max(flops, intensity * nbytes))
        act.append(ev(n.meta.get(M.OUT_BYTES)))
    return cost, act


def _candidates(trunk: Trunk, granularity: str) -> list[int]:
    if granularity not in GRANULARITIES:
        raise PartitionError(f"granularity={granularity!r}: use one of {', '.join(GRANULARITIES)}")
    if not trunk.layer_starts:
        raise PartitionError("no repeated blocks found in the graph: pin the stage cuts by node name")
    runs = trunk.runs or [(trunk.layer_starts, trunk.layers_end)]  # every stack (blocks.py), not only the longest
    if granularity == "layer":
        return sorted({p for starts, end in runs for p in starts + ([end] if end is not None and end != runs[-1][1]
                                                                    else [])})
    lo, hi = runs[0][0][0], runs[-1][1] if runs[-1][1] is not None else len(trunk.nodes)
    pts = [p for p in trunk.narrow if lo < p < hi]
    # one candidate per run of adjacent narrow points (they differ by views and casts only): the last
    return [p for i, p in enumerate(pts) if i + 1 == len(pts) or pts[i + 1] != p + 1]


def _min_max(weights: np.ndarray, k: int, mem: tuple | None = None, mem_limit=None,
             inflight=None) -> tuple[float, list[int]]:
    """Split ``weights`` (n items) into k contiguous non-empty groups minimising the largest sum;
    returns (optimum, group start indices 1..k-1). ``mem`` = (bytes held once, bytes held per
    microbatch in flight) per item: group g is infeasible above ``mem_limit`` with ``inflight[g]``."""
    n = len(weights)
    pre = np.concatenate([[0.0], np.cumsum(weights)])
    if mem is not None:
        ppre = np.concatenate([[0.0], np.cumsum(mem[0])])
        apre = np.concatenate([[0.0], np.cumsum(mem[1])])
    inf = math.inf
    best = np.full(n + 1, inf)
    best[0] = 0.0
    choice = np.zeros((k + 1, n + 1), dtype=np.int64)
    for g in range(1, k + 1):
        new = np.full(n + 1, inf)
        for j in range(g, n - (k - g) + 1):
            i = np.arange(g - 1, j)
            seg = pre[j] - pre[i]
            val = np.maximum(best[i], seg)
            if mem is not None and mem_limit is not None:
                need = (ppre[j] - ppre[i]) + (apre[j] - apre[i]) * inflight[g - 1]
                val = np.where(need > mem_limit, inf, val)
            t = int(np.argmin(val))
            new[j] = val[t]
            choice[g, j] = i[t]
        best = new
    if not np.isfinite(best[n]):
        return inf, []
    starts, j = [], n
    for g in range(k, 0, -1):
        i = int(choice[g, j])
        starts.append(i)
        j = i
    starts = sorted(starts)[1:]
    return float(best[n]), starts


def min_max_reference(weights: list[float], k: int) -> float:
    """Exhaustive min-max over every way to cut ``weights`` into k contiguous groups (tests)."""
    n = len(weights)
    out = math.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = [0, *cuts, n]
        out = min(out, max(sum(weights[a:b]) for a, b in zip(edges[:-1], edges[1:])))
    return out


def partition(
    captured,
    pp: int,
    virtual: int = 1,
    *,
    granularity: str = "layer",
    seq: int = 2048,
    intensity: float = 300.0,
    layers_per_stage: list[int] | None = None,
    cuts: list[str] | None = None,
    memory_limit: float | None = None,
    bytes_per_param: float = 18.0,
    microbatch: int = 1,
    trunk: Trunk | None = None,
) -> StagePartition:
    """Cut ``captured`` (a :class:`mcompile.capture.export.Captured`) into ``pp * virtual`` stages.

    ``layers_per_stage`` (one entry per stage) or ``cuts`` (captured node names where stages
    1..K-1 begin) pin the split instead of optimising it. ``memory_limit`` (bytes per rank, with
    ``bytes_per_param`` for weights, gradients and optimizer state) makes stages over it infeasible.
    """
    if pp < 1 or virtual < 1:
        raise PartitionError(f"pp={pp} and virtual={virtual} must be positive")
    trunk = trunk or analyse(captured.gm, captured.params)
    if granularity == "auto":  # whole layers unless cutting inside them lowers the slowest stage
        kw = dict(seq=seq, intensity=intensity, layers_per_stage=layers_per_stage, cuts=cuts,
                  memory_limit=memory_limit, bytes_per_param=bytes_per_param, microbatch=microbatch, trunk=trunk)
        try:
            whole = partition(captured, pp, virtual, granularity="layer", **kw)
        except PartitionError:
            return partition(captured, pp, virtual, granularity="sublayer", **kw)
        finer = partition(captured, pp, virtual, granularity="sublayer", **kw)
        return finer if max(finer.stage_cost) < max(whole.stage_cost) * (1 - 1e-9) else whole
    k = pp * virtual
    num_layers = sum(len(starts) for starts, _ in trunk.runs) or trunk.num_layers  # every stack's
    if k == 1:
        cost, act = _cost_arrays(trunk, captured.symbols, microbatch, seq, intensity)
        return _result(captured, trunk, pp, virtual, granularity, [], cost, act, sum(cost), False)
    if num_layers and k > num_layers and granularity == "layer" and not cuts:
        valid = [d for d in range(1, num_layers + 1)]
        raise PartitionError(
            f"pp={pp} x virtual={virtual} = {k} stages is more than the model's {num_layers} layers: each stage "
            f"needs at least one layer; valid pp x virtual products: 1..{num_layers} "
            f"(e.g. pp in {_fmt([d for d in valid if d <= num_layers // virtual])} at virtual={virtual}), "
            "or granularity='sublayer' to cut inside layers")
    cost, act = _cost_arrays(trunk, captured.symbols, microbatch, seq, intensity)
    if layers_per_stage is not None or cuts is not None:
        pos = _pinned(trunk, k, layers_per_stage, cuts)
        return _result(captured, trunk, pp, virtual, granularity, pos, cost, act, None, True)
    cand = _candidates(trunk, granularity)
    if len(cand) + 1 < k:
        raise PartitionError(
            f"{k} stages need {k - 1} cuts but the graph has {len(cand)} places to cut at granularity "
            f"{granularity!r}: use pp x virtual <= {len(cand) + 1}"
            + ("" if granularity == "sublayer" else " or granularity='sublayer'"))
    edges = [0, *cand, len(trunk.nodes)]
    weights = np.array([sum(cost[a:b]) for a, b in zip(edges[:-1], edges[1:])])
    mem = None
    inflight = None
    if memory_limit is not None:  # parameters held once, activations once per microbatch in flight (1F1B)
        pcount = _param_counts(captured, trunk)
        mem = (np.array([sum(pcount[a:b]) for a, b in zip(edges[:-1], edges[1:])]) * bytes_per_param,
               np.array([sum(act[a:b]) for a, b in zip(edges[:-1], edges[1:])]))  # act: at the microbatch size
        inflight = [max(1, pp - (g % pp)) for g in range(k)]
    opt, starts = _min_max(weights, k, mem, memory_limit, inflight)
    if not starts and k > 1:
        raise PartitionError(f"no split into {k} stages fits in memory_limit={memory_limit:.3g} bytes per rank")
    pos = [edges[i] for i in starts]
    return _result(captured, trunk, pp, virtual, granularity, pos, cost, act, opt, False)


def _param_counts(captured, trunk: Trunk) -> list[float]:
    """Elements of the parameters whose first use is each trunk node."""
    out = [0.0] * len(trunk.nodes)
    for ph in captured.gm.graph.nodes:
        if ph.op == "placeholder" and ph.name in captured.params:
            users = [trunk.pos[u.name] for u in ph.users if u.name in trunk.pos]
            if users:
                out[min(users)] += float(math.prod(int(s) for s in ph.meta["val"].shape))
    return out


def _pinned(trunk: Trunk, k: int, layers_per_stage, cuts) -> list[int]:
    if layers_per_stage is not None and cuts is not None:
        raise PartitionError("give layers_per_stage or cuts, not both")
    if layers_per_stage is not None:
        starts = sorted(p for run, _ in trunk.runs for p in run) or trunk.layer_starts  # every stack's layers
        if len(layers_per_stage) != k or any(n < 1 for n in layers_per_stage) or \
                sum(layers_per_stage) != len(starts):
            raise PartitionError(
                f"layers_per_stage={list(layers_per_stage)} must have {k} positive entries summing to the model's "
                f"{len(starts)} layers")
        acc = list(itertools.accumulate(layers_per_stage))[:-1]
        return [starts[a] for a in acc]
    names = {n.name: i for i, n in enumerate(trunk.nodes)}
    if len(cuts) != k - 1:
        raise PartitionError(f"{k} stages need {k - 1} cuts, got {len(cuts)}")
    out = []
    narrow = set(trunk.narrow)
    for c in cuts:
        if c not in names or names[c] not in narrow:
            near = [trunk.nodes[p].name for p in trunk.narrow][:12]
            raise PartitionError(f"cannot cut before {c!r}: not a place where one activation crosses; valid cut "
                                 f"nodes include {', '.join(near)} ...")
        out.append(names[c])
    if out != sorted(set(out)):
        raise PartitionError(f"cuts {cuts} must be distinct and in program order")
    return out


def _result(captured, trunk, pp, virtual, granularity, pos, cost, act, opt, pinned) -> StagePartition:
    edges = [0, *pos, len(trunk.nodes)]
    pcount = _param_counts(captured, trunk)
    sc = [float(sum(cost[a:b])) for a, b in zip(edges[:-1], edges[1:])]
    return StagePartition(
        pp=pp, virtual=virtual, granularity=granularity, trunk=trunk, cuts=list(pos), stage_cost=sc,
        stage_params=[int(sum(pcount[a:b])) for a, b in zip(edges[:-1], edges[1:])],
        stage_act_bytes=[float(sum(act[a:b])) for a, b in zip(edges[:-1], edges[1:])],
        optimum=max(sc) if opt is None else float(opt), pinned=pinned,
    )


def _fmt(xs) -> str:
    return ", ".join(str(x) for x in xs)


def plan_stages(compiled, schedule, virtual, microbatches, granularity, layers_per_stage, cuts, seq):
    """The stage partition and the schedule, recorded in the plan (the compiler's plan_stages pass)."""
    from mcompile.runtime.schedules import bubble_fraction, build_schedule

    pp = compiled.mesh.size("pp")
    build_schedule(schedule, pp, virtual, microbatches)  # validates microbatches / interleaving first
    part = partition(compiled.captured, pp, virtual, granularity=granularity, seq=seq,
                     layers_per_stage=list(layers_per_stage) if layers_per_stage else None,
                     cuts=list(cuts) if cuts else None)
    compiled.partition = part
    plan = compiled.plan
    plan.stage_cuts = part.cut_nodes()
    plan.schedule = schedule
    local = [0] * part.num_stages  # this rank's elements of each stage's parameters (tied: first stage)
    trunk = part.trunk
    param_stages = {}  # fqn -> every stage using it (tied weights: two)
    for ph in compiled.captured.param_nodes:
        uses = [trunk.pos[u.name] for u in ph.users if u.name in trunk.pos]
        if uses:
            fqn = compiled.captured.params[ph.name]
            local[part.stage_of_position(min(uses))] += plan.params[fqn].local_numel
            param_stages[fqn] = sorted({part.stage_of_position(u) for u in uses})
    plan.pipeline = {
        "pp": pp, "virtual": virtual, "microbatches": microbatches, "granularity": part.granularity, "seq": seq,
        "stages": [{"rank": s % pp, "layers": list(part.layers(s)), "params": part.stage_params[s],
                    "local_params": local[s],
                    "cost": part.stage_cost[s], "act_bytes_per_sample": part.stage_act_bytes[s]}
                   for s in range(part.num_stages)],
        "param_stages": param_stages,
        "imbalance": part.imbalance, "optimum": part.optimum, "pinned": part.pinned,
        "bubble": bubble_fraction(schedule, pp, microbatches, virtual),
    }
