"""Cost-driven auto-parallel search: the fastest layout the runtime can execute, under a memory limit.

``mc.search(model, world=N, hardware="h100", global_batch=B, seq=S)`` → :class:`SearchResult`, a list
of :class:`Candidate` ranked by predicted step time (each unpacks as ``layout, estimate``). The
ideas are Alpa's (Zheng et al., OSDI 2022: an outer search over meshes and pipeline stages, an inner
exact solver for the operators' placements) on Megatron's space of layouts (Narayanan et al. SC'21:
tp inside a node, pp across, dp outside; microbatch size, interleaving and recompute as knobs).

The model is analysed ONCE
--------------------------
Capture costs seconds and grows with depth (DESIGN §10: ~10 s for GPT-3's 96 layers). A
:class:`SearchWorkload` captures a 2-layer version — a preset built with 2 layers, or a module whose
longest ``nn.ModuleList`` of identical blocks is cut to 2 in a shallow copy (the user's module is
untouched; if that capture fails the whole model is captured) — canonicalises and annotates it once,
and re-plans that one graph per (tp, sequence parallel) (~0.1 s each) instead of re-capturing.
:mod:`mcompile.cost.model` then prices one layer and scales by the real depth.

The space (only what the runtime executes)
------------------------------------------
- mesh ``dp x pp x cp x ep x tp = world`` (mesh order dp, pp, cp, ep, tp: tp on neighbouring GPUs); tp passes the
  planner's divisibility checks (:func:`mcompile.sharding.planner.check_divisibility`: heads, kv heads,
  every contraction weight); pp <= the layers found; dp x ep divides the global batch; ep only for a
  model with MoE layers, dividing their expert count and the dp x ep data-parallel ranks (Megatron folds
  expert parallelism into data parallelism: ep takes ranks from dp, never from tp or pp); cp (context
  parallelism: the sequence split over cp ranks for the whole model) of the sizes dividing world/tp for
  which 2·cp divides the sequence (the load-balanced causal layout's chunks) and, unless ``cp=`` names
  them, each chunk holds at least ``MIN_CP_CHUNK`` = 128 tokens (a FlashAttention tile); under cp the
  microbatch size is 1 (a cp layout whose microbatch b divides by cp is, up to the tensors of the
  sequence alone such as RoPE tables, the layout with dp·cp data-parallel ranks and microbatch b/cp:
  the same tokens per rank and microbatch, without the cp communication), sequence parallelism needs tp
  to divide seq/cp, ZeRO shards over dp·cp, and each cp layout takes the attention variant
  :func:`mcompile.cost.model.choose_cp_attention` picks for it (``cp_attention="auto"``, what
  ``Config(cp_attention="auto")`` runs; the pick does not depend on recompute or overlap, nor on bf16
  vs FP8 matmuls — attention runs in bf16 either way —, so the pruning below keeps the same variant)
  or each variant asked for (``cp_attention=``); activations fall as
  1/cp, which is how cp wins where a long sequence does not fit otherwise;
- microbatch size b dividing the per-rank batch B/(dp·ep) (m = B/(dp·ep·b) microbatches);
- schedule: pp = 1 → gradient accumulation; pp > 1 → 1f1b, zbh1 and interleaved with every
  v > 1 such that pp·v divides the layers and pp divides m (the runtime's rules); gpipe only on
  request (same bubble as 1f1b, more memory: always dominated);
- sequence parallelism on/off when tp > 1 (and tp divides the sequence); recompute none /
  selective / full / auto; ZeRO 0/1/2/3 when dp > 1 (``Config(zero=)``); communication overlap on/off
  (``Layout.overlap``: tp collective matmul and ZeRO-3 prefetch, ``Config(overlap=, tp_overlap=)``);
  matmul precision bf16 / FP8 where the hardware has FP8 (``Layout.precision``, ``Config(fp8="current")``).
  ``auto`` (``Config(recompute="auto")``, passes/remat.py) is priced by :func:`mcompile.cost.model.stage_auto`:
  each pipeline rank gets the activation budget the memory model leaves under the limit, and the
  recompute time of the named policies' lower envelope at that budget; its memory is the budget used,
  so it fits exactly where full recompute fits.

Pruning (exact: never discards a layout that could rank first)
--------------------------------------------------------------
1. Memory lower bound per (tp, sp, pp, dp, ZeRO): the model state (parameters, gradients, optimizer)
   averaged over the pipeline ranks — no layout of the group can need less on its largest rank.
   Groups above the limit are skipped whole.
2. Microbatch size: for a fixed schedule, a rank's in-flight activations min(in-flight, m)·b never
   fall as b grows (m = B/(dp·b)), so once even full recompute is over the limit at b, every larger
   b is skipped.
3. Recompute dominance: for fixed everything else, recompute none → selective → full strictly adds
   time (m·t_r; an overlapped region it lengthens — the dp buckets', ZeRO-3's gathers — exposes at most
   (2 − κ)·t_r less: :func:`mcompile.cost.model.overlapped`) and
   removes memory, so the first named mode that fits is the only named one priced. ``auto`` is
   priced beside it wherever it fits (it is never slower than that mode: the envelope at the budget
   left is at most the mode's point); where none fits, auto IS none (same time and memory) and is
   kept out of the ranking (``SearchResult.priced`` still lists it).
4. Overlap and precision: overlap on is never slower than off at the same memory (an overlapped region
   costs at most what the two cost in turn: :func:`mcompile.cost.model.overlapped`), and FP8 matmuls never
   slower than bf16 at the same memory; so only overlap on (where allowed) and the fastest allowed
   precision are priced. Where overlap changes nothing (tp = 1 and ZeRO < 3) its off twin is the same
   layout: priced only when exhaustive, never ranked.
ZeRO stages are all priced (none dominates: ZeRO-1's optimizer step is 1/dp of ZeRO-0's, ZeRO-3 at one
microbatch can hide all of its collectives while ZeRO-2 still gathers after the optimizer).
The smallest footprint seen is kept for the error when nothing fits. ``exhaustive=True`` turns all
four off (tests/test_search.py checks the pruned search against it).

Explaining the choice: :meth:`SearchResult.choices` prices the best layout with each of its overlap,
ZeRO and precision choices flipped (overlap off, ZeRO one stage lower — or 1 where it took 0 —, bf16
instead of FP8) on the search's own settings and stage cuts; ``explain()`` and ``mcompile explain``
print what each choice saves in step time and memory.

Stage cuts: the partitioner's, priced by the cost model
------------------------------------------------------
:func:`mcompile.cost.workload.estimate` assumes ⌈L/p⌉ layers on every pipeline rank. The search instead
takes the cuts the runtime would make: :mod:`mcompile.passes.pp.stages`'s exact min-max split at layer
granularity (its roofline cost proxy at the search's sequence length, microbatch 1). With a full-depth
capture that is :func:`mcompile.passes.pp.stages.partition` itself; with a 2-layer capture it is the same
dynamic program (``partition._min_max``) over the depth's item weights — [embedding + layer, layer,
…, layer + head] — read off the captured block, which is what ``partition`` computes on the full
graph when the layers are identical. Each pipeline rank then has n_r layers (the sum over its
virtual chunks), and the cost model's own functions price the layout with n_r layers on rank r where
``estimate`` gives ⌈L/p⌉ (:func:`mcompile.cost.model.price_ranks`: ``step_terms`` and ``peak_memory``, on
:class:`mcompile.cost.model.Sections` cached per (tp, sp, ep, cp, microbatch size, precision)): per rank
T_r = n_r·t_layer + [first]·t_pre + [last]·t_post + t_p2p; the slowest rank sets the pipeline
(m·T + bubble), the rank with most parameters sets the data-parallel reduction and the optimizer,
and memory is the largest over all ranks (:func:`price`; with ``uniform=True`` it is ``estimate``
exactly, the same functions on the same layers, which tests/test_search.py checks). ``Candidate.estimate``
is this priced estimate; ``estimate.details["uniform_step_time_s"]`` keeps the ⌈L/p⌉ number.

Placements inside a block: an exact solver
------------------------------------------
:func:`block_placements` chooses, for every node of ONE repeated block on one tp axis, a strategy
among the rule registry's candidates (the same ones :mod:`mcompile.sharding.propagate` scores greedily),
minimising compute + communication time exactly, as an integer program solved by HiGHS (its
docstring states the program). At training sizes it returns Megatron's layout — the planner's — for
Llama and GPT blocks, at an objective equal to the greedy's; where the cost model prefers otherwise
(a few tokens per microbatch, replicated weights allowed) it finds the cheaper layout the greedy
misses. The search itself prices the planner's layout per tp (what the runtime executes); the solver
is the check that this layout is optimal under the cost model, not yet a source of plans.

parallelize(plan="auto")
------------------------
:func:`auto_layout`: the search for the world size, on rank 0 (``mcompile.api`` broadcasts the
choice), with the runtime's precision (parameters and gradients fp32, matmuls in the Config's dtype);
options the user gave restrict the space.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import operator
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from mcompile.cost import model as C
from mcompile.cost.hardware import Hardware, get_hardware
from mcompile.cost.model import Estimate, Layout, Recompute, Schedule
from mcompile.cost.workload import Workload, estimate
from mcompile.ir.compat import quiet_highs

if TYPE_CHECKING:
    from mcompile.sharding.rules import TensorMeta

__all__ = ["search", "price", "Candidate", "SearchResult", "SearchError", "SearchWorkload", "enumerate_layouts",
           "StageSplit", "stage_split", "auto_layout", "explain_pair", "explain_choices", "block_placements",
           "BlockSolution"]

log = logging.getLogger("mcompile.search")

DEFAULT_SCHEDULES = ("1f1b", "zbh1", "interleaved")
_COST_SCHEDULE = {"1f1b": Schedule.ONE_F_ONE_B, "zbh1": Schedule.ZB_H1, "zb-h1": Schedule.ZB_H1,
                  "interleaved": Schedule.INTERLEAVED, "gpipe": Schedule.GPIPE}
_RUNTIME_SCHEDULE = {Schedule.ONE_F_ONE_B: "1f1b", Schedule.ZB_H1: "zbh1", Schedule.INTERLEAVED: "interleaved",
                     Schedule.GPIPE: "gpipe"}
RECOMPUTE_ORDER = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)  # increasing time, decreasing memory
DEFAULT_RECOMPUTE = ("none", "selective", "full", "auto")
DEFAULT_ZERO = (0, 1, 2, 3)
DEFAULT_PRECISION = ("bf16", "fp8")  # fp8 only where the hardware has FP8 tensor cores


class SearchError(ValueError):
    """No layout can be searched or fits; the message says what was tried and what to change."""


# --------------------------------------------------------------------------- the workload, captured once


class SearchWorkload(Workload):
    """A :class:`mcompile.cost.workload.Workload` (captured ONCE, re-planned for each (tp, sequence parallel): the same
    profiles ``estimate`` prices with) and what the search adds: the blocks of the captured graph, the
    divisibility checks per tp and the stage splits per pipeline shape."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._weights: dict[int, tuple[float, float, float]] = {}  # seq -> (pre, layer, post) stage proxy
        self._splits: dict[tuple[int, int, int], StageSplit] = {}  # (pp, virtual, seq) -> stage split

    @cached_property
    def trunk(self):
        from mcompile.sharding.blocks import analyse

        return analyse(self.captured.gm, self.captured.params)

    @property
    def depth(self) -> int:
        """Layers of the real model (the capture may hold fewer)."""
        return self.n_layers or self.trunk.num_layers or 1

    @property
    def full_depth(self) -> bool:
        return self.trunk.num_layers == self.depth

    def tp_error(self, tp: int) -> str | None:
        """Why tp cannot shard this model (the planner's divisibility checks), or None."""
        from mcompile.sharding.planner import check_divisibility
        from mcompile.sharding.propagate import PlanError

        try:
            check_divisibility(self.captured, tp)
        except PlanError as e:
            return str(e).split(". File")[0]
        return None

    @classmethod
    def of(cls, model, example_inputs=(), example_kwargs=None, *, dtype=torch.bfloat16,
           capture_layers: int = 2) -> SearchWorkload:
        """:meth:`mcompile.cost.workload.Workload.of`, its refusals as :class:`SearchError`."""
        try:
            return super().of(model, example_inputs, example_kwargs, dtype=dtype, capture_layers=capture_layers)
        except TypeError as e:
            raise TypeError(str(e).replace("a Workload is made of", "search() takes")) from None
        except ValueError as e:
            if type(e) is not ValueError:
                raise
            raise SearchError(str(e)) from None


# --------------------------------------------------------------------------- stage cuts


@dataclass(frozen=True)
class StageSplit:
    """The partitioner's split of the layers over pp x virtual stages."""

    layers_per_stage: tuple[int, ...]  # one per stage (pp·virtual), stage s on pipeline rank s % pp
    layers_per_rank: tuple[int, ...]  # sum over each rank's virtual stages
    imbalance: float  # the partitioner's cost proxy: slowest stage / mean stage - 1
    cut_nodes: tuple[str, ...] = ()  # captured node names where stages 1.. begin (full-depth capture only)

    def __str__(self) -> str:
        return f"{_runs(self.layers_per_stage)} layers per stage (imbalance {self.imbalance:.1%})"


def _runs(counts) -> str:
    """Layer counts per stage, run-length encoded past a few stages: "4+4+3" or "2 (x15)+3 (x32)+2"."""
    counts = list(counts)
    if len(counts) <= 6:
        return "+".join(map(str, counts))
    out, i = [], 0
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        out.append(f"{counts[i]} (x{j - i})" if j - i > 1 else str(counts[i]))
        i = j
    return "+".join(out)


def _bytes(x: float) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if x >= 2**k:
            return f"{x / 2**k:.1f} {unit}"
    return f"{x:.0f} B"


def _layer_weights(work: SearchWorkload, seq: int) -> tuple[float, float, float]:
    """(pre, one layer, post) in the partitioner's cost proxy, read off the captured blocks."""
    from mcompile.passes.pp.stages import _cost_arrays

    cache = work._weights
    if seq in cache:
        return cache[seq]
    trunk = work.trunk
    cost, _ = _cost_arrays(trunk, work.captured.symbols, 1, seq, 300.0)
    starts = list(trunk.layer_starts)
    if not starts:
        out = 0.0, float(sum(cost)), 0.0
    else:
        end = trunk.layers_end if trunk.layers_end is not None else len(cost)
        edges = starts + [end]
        layers = [sum(cost[a:b]) for a, b in zip(edges[:-1], edges[1:])]
        counts = work.layer_counts  # dense and MoE layers captured one each: the real model's mean layer
        mean = (float(np.mean(layers)) if not counts or len(counts) != len(layers)
                else float(sum(x * float(c) for x, c in zip(layers, counts.values())) / float(sum(counts.values()))))
        out = float(sum(cost[:starts[0]])), mean, float(sum(cost[end:]))
    cache[seq] = out
    return out


def stage_split(work: SearchWorkload, pp: int, virtual: int, seq: int) -> StageSplit:
    """The runtime's stage cuts for (pp, virtual), as layer counts (module docstring)."""
    cache = work._splits
    if (pp, virtual, seq) not in cache:
        cache[(pp, virtual, seq)] = _stage_split(work, pp, virtual, seq)
    return cache[(pp, virtual, seq)]


def _stage_split(work: SearchWorkload, pp: int, virtual: int, seq: int) -> StageSplit:
    L = work.depth
    k = pp * virtual
    if k == 1:
        return StageSplit((L,), (L,), 0.0)
    from mcompile.passes.pp.stages import _min_max, partition

    if work.full_depth:
        part = partition(work.captured, pp, virtual, seq=seq, trunk=work.trunk)
        starts = work.trunk.layer_starts
        counts = tuple(sum(1 for x in starts if lo <= x < hi) for lo, hi in part.bounds())
        cuts, imb = tuple(part.cut_nodes()), part.imbalance
    else:
        pre, lay, post = _layer_weights(work, seq)
        w = np.full(L, lay)
        w[0] += pre
        w[-1] += post
        _, starts = _min_max(w, k)
        edges = [0, *starts, L]
        counts = tuple(b - a for a, b in zip(edges[:-1], edges[1:]))
        sc = [float(w[a:b].sum()) for a, b in zip(edges[:-1], edges[1:])]
        cuts, imb = (), max(sc) / (sum(sc) / len(sc)) - 1
    per_rank = tuple(sum(counts[s] for s in range(r, k, pp)) for r in range(pp))
    return StageSplit(counts, per_rank, imb, cuts)


# --------------------------------------------------------------------------- pricing


def price(layout: Layout, model, *, hardware: str | Hardware = "h100", global_batch: int, seq: int | None = None,
          precision: str | None = None, param_dtype: str = "bf16", grad_dtype: str = "fp32",
          attention_kernel: str = "flash", efficiency: C.Efficiency | None = None, uniform: bool = False,
          stages: StageSplit | None = None, example_inputs: tuple = (), example_kwargs: dict | None = None,
          dtype: torch.dtype = torch.bfloat16, memory_limit: float | None = None,
          moe_imbalance: float = 1.0) -> Estimate:
    """Price one layout as the search does: :func:`mcompile.cost.workload.estimate` with the partitioner's
    stage cuts (``uniform=True``: the cost model's ⌈L/p⌉ layers on every rank instead). ``model`` as
    for :func:`search`; reuse a :class:`SearchWorkload` to price many layouts. ``memory_limit``: bytes
    per GPU (default the hardware's HBM): ``fits``, and the budget ``recompute="auto"`` gets.
    ``precision``: the matmul precision (default: the layout's, else "bf16"). ``moe_imbalance``:
    :func:`mcompile.cost.workload.estimate`'s."""
    layout = C.resolve_precision(layout, precision)
    work = SearchWorkload.of(model, example_inputs, example_kwargs, dtype=dtype)
    prof = work.profile(layout.tp, layout.sequence_parallel)
    seq = seq or prof.seq_len
    st = C.cost_settings(hardware, global_batch, seq, layout.precision, param_dtype, grad_dtype, attention_kernel,
                         efficiency, memory_limit, moe_imbalance)
    C.validate_layout(layout, prof, global_batch, seq)
    if uniform:
        split = None
        layers = (math.ceil(work.depth / layout.pp),) * layout.pp
    else:
        split = stages or stage_split(work, layout.pp, layout.virtual, seq)
        layers = split.layers_per_rank
    sec = C.Sections(prof, layout.microbatch_size, st, ep=layout.ep, cp=layout.cp)
    return _finish(layout, work, prof, sec, layers, split, st)


def _finish(layout, work, prof, sec, layers, split, st: C.CostSettings) -> Estimate:
    """The full Estimate: workload.estimate's with the step time, memory and FLOPs priced on the given per-rank
    layer counts (:func:`mcompile.cost.model.price_ranks`)."""
    base = estimate(layout, work, hardware=st.hw, global_batch=st.global_batch, seq=st.seq,
                      precision=st.precision, param_dtype=st.param_dtype, grad_dtype=st.grad_dtype,
                      attention_kernel=st.attention_kernel, efficiency=st.efficiency, memory_limit=st.limit,
                      moe_imbalance=st.moe_imbalance)
    priced = C.price_ranks(layout, prof, sec, layers, st)
    terms, det, auto = priced.terms, priced.details, priced.auto
    step = sum(terms.values())
    mem, mem_d = priced.memory_bytes, dict(priced.memory_breakdown)
    info = {"stage": mem_d.pop("stage"), "inflight_microbatches": float(mem_d.pop("inflight_microbatches"))}
    mem_d = {k: float(v) for k, v in mem_d.items()}
    details = {**base.details, **{k: float(v) for k, v in det.items()}, **info,
               "uniform_step_time_s": base.step_time_s, "uniform_memory_bytes": base.memory_bytes,
               "layers_per_rank": list(layers),
               "stage_split": split}
    hardware_flops = base.hardware_flops
    if auto is not None:
        details["auto_mix"] = {i: a["mix"] for i, a in auto.items()}
        details["activation_budget"] = C.activation_budget(auto)
        # the recompute FLOPs of the slowest rank's mix on every layer (as workload.estimate does)
        hardware_flops = C.matmul_flops(layout, prof, st.global_batch, st.seq, auto[det["slow_stage"]]["mix"])[1]
    return dataclasses.replace(base, step_time_s=step, breakdown=terms, memory_bytes=mem, memory_breakdown=mem_d,
                               fits=mem <= st.limit, tokens_per_s=st.global_batch * st.seq / step,
                               hardware_flops=hardware_flops, details=details)


# --------------------------------------------------------------------------- the space


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class _Space:
    """What may vary, and the reasons whole parts of the space were invalid (for errors)."""

    world: int
    depth: int
    global_batch: int
    seq: int
    schedules: tuple[str, ...]
    recompute: tuple[Recompute, ...]
    zero: tuple[int, ...]
    sequence_parallel: tuple[bool, ...]
    microbatch_sizes: tuple[int, ...] | None
    overlap_grad_reduce: bool
    overlap: tuple[bool, ...] = (True, False)
    precision: tuple[str | None, ...] = (None,)
    experts: int | None = None  # routed experts per MoE layer (None: a dense model, no ep)
    ep_sizes: tuple[int, ...] | None = None  # the ep sizes allowed (None: every one that divides)
    cp_sizes: tuple[int, ...] | None = None  # the cp sizes allowed (None: every one that applies)
    cp_attention: tuple[str, ...] = ("auto",)  # "auto" (choose_cp_attention's pick) or the variants to price
    heads: int | None = None  # the model's query heads (a2a needs cp to divide them on a tp rank)
    tried: list = field(default_factory=list, compare=False)

    def cps(self, tp: int) -> Iterator[int]:
        """The cp sizes with ``tp``: 1, and those allowed that divide world/tp and for which 2·cp divides the
        sequence (the load-balanced layout's chunks) and a cp attention variant asked for applies; unless
        given (``cp=``), only those whose chunks hold at least :data:`MIN_CP_CHUNK` tokens."""
        for cp in _divisors(self.world // tp):
            if cp == 1:
                if self.cp_sizes is None or 1 in self.cp_sizes:
                    yield cp
                continue
            if self.cp_sizes is not None and cp not in self.cp_sizes:
                continue
            if self.cp_sizes is None and self.seq < 2 * cp * MIN_CP_CHUNK:
                continue
            if self.seq % (2 * cp):
                if self.cp_sizes is not None:
                    self.tried.append(f"tp={tp} cp={cp}: 2*cp = {2 * cp} does not divide seq={self.seq}")
                continue
            if not self.cp_variants(tp, cp):
                self.tried.append(f"tp={tp} cp={cp}: cp_attention={'/'.join(self.cp_attention)} does not apply "
                                  f"(a2a needs cp to divide the {self.heads} query heads / tp)")
                continue
            yield cp

    def cp_variants(self, tp: int, cp: int) -> tuple[str, ...]:
        """The variants asked for that apply at (tp, cp): ("auto",) stands for choose_cp_attention's pick."""
        if cp == 1:
            return ("ring",)
        if "auto" in self.cp_attention:
            return ("auto",)
        ok = C.cp_variants_allowed(Layout(tp=tp, cp=cp), self.heads)
        return tuple(v for v in self.cp_attention if v in ok)

    def eps(self, data: int) -> list[int]:
        """The ep sizes of ``data`` = dp x ep data-parallel ranks: ep divides them (Megatron folds ep into
        data parallelism) and the experts; 1 alone for a dense model."""
        if self.experts is None:
            return [1]
        return [e for e in _divisors(data) if self.experts % e == 0
                and (self.ep_sizes is None or e in self.ep_sizes)]

    def groups(self, tp_error) -> Iterator[tuple[int, bool, int, int, int, int, int]]:
        """(tp, sp, pp, dp, ep, zero, cp) of every valid mesh; invalid ones are explained in ``tried``."""
        for tp in _divisors(self.world):
            why = tp_error(tp) if tp > 1 else None
            if why:
                self.tried.append(f"tp={tp}: {why}")
                continue
            for cp in self.cps(tp):
                yield from self._groups(tp, cp)

    def _groups(self, tp: int, cp: int) -> Iterator[tuple[int, bool, int, int, int, int, int]]:
        at = f"tp={tp} cp={cp}" if cp > 1 else f"tp={tp}"
        sps = [sp for sp in self.sequence_parallel if not sp or (tp > 1 and (self.seq // cp) % tp == 0)]
        if not sps:
            self.tried.append(f"{at}: sequence parallelism was required but tp does not divide "
                              + (f"the {self.seq // cp} positions of a rank" if cp > 1 else f"seq={self.seq}"))
            return
        for pp in _divisors(self.world // (tp * cp)):
            data = self.world // (tp * cp * pp)
            if pp > self.depth:
                self.tried.append(f"{at} pp={pp}: more pipeline stages than the model's {self.depth} layers")
                continue
            if self.global_batch % data:
                self.tried.append(f"{at} pp={pp} dp={data}: the global batch {self.global_batch} does not "
                                  f"divide by dp={data}")
                continue
            zs = [z for z in self.zero if not (z and data * cp == 1)]  # ZeRO shards over dp x cp (x ep)
            if not zs:
                self.tried.append(f"{at} pp={pp} dp=1: ZeRO-{'/'.join(map(str, self.zero))} was required "
                                  "but needs dp > 1")
            for ep in self.eps(data):
                for sp in sps:
                    for z in zs:
                        if ep > 1 and z == 3:  # the runtime's ZeRO-3 gathers over dp only (runtime/module.py)
                            self.tried.append(f"{at} pp={pp} ep={ep}: ZeRO-3 with ep is not run by the runtime")
                            continue
                        yield tp, sp, pp, data // ep, ep, z, cp

    def variants(self, pp: int, data: int, cp: int = 1) -> Iterator[tuple[Schedule, int, int]]:
        """(schedule, virtual, microbatch size) on ``data`` = dp x ep data-parallel ranks, microbatch sizes
        increasing; under cp > 1 microbatch size 1 only (module docstring, "The space")."""
        per_dp = self.global_batch // data
        sizes = [b for b in _divisors(per_dp) if (self.microbatch_sizes is None or b in self.microbatch_sizes)
                 and (cp == 1 or b == 1)]
        if pp == 1:
            scheds = [(Schedule.ONE_F_ONE_B, 1)]
        else:
            scheds = []
            for name in self.schedules:
                s = _COST_SCHEDULE[name]
                if s != Schedule.INTERLEAVED:
                    scheds.append((s, 1))
                elif self.depth % pp == 0:
                    scheds += [(s, v) for v in _divisors(self.depth // pp) if v > 1]
        for s, v in scheds:
            for b in sizes:
                if s == Schedule.INTERLEAVED and (per_dp // b) % pp:
                    continue  # the runtime's interleaved schedule needs microbatches divisible by pp
                yield s, v, b

    def options(self, tp: int, z: int, exhaustive: bool = True) -> list[tuple[bool, str | None]]:
        """(overlap, precision) pairs of a mesh group: all of them, or (``exhaustive=False``) only the
        fastest — overlap on and the lowest precision allowed, which are never slower at the same memory
        (module docstring, pruning 4)."""
        if exhaustive:
            return [(o, pr) for pr in self.precision for o in self.overlap]
        return [(max(self.overlap), min(self.precision, key=_PRECISION_SPEED.get))]

    def layout(self, tp, sp, pp, dp, z, s, v, b, rec, overlap: bool = True, precision: str | None = None,
               ep: int = 1, cp: int = 1, cp_attention: str = "ring") -> Layout:
        return Layout(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, virtual=v, microbatch_size=b, schedule=s,
                      sequence_parallel=sp, recompute=rec, zero=z, overlap_grad_reduce=self.overlap_grad_reduce,
                      overlap=overlap, precision=precision, cp_attention=cp_attention)


_PRECISION_SPEED = {"fp8": 0, "bf16": 1, None: 1, "fp32": 2}  # fastest matmuls first
# the fewest tokens in each of the 2·cp chunks of a context-parallel layout the search enumerates by default: a
# FlashAttention tile (128 rows); shorter chunks leave the blocks of ring attention part empty, which the cost
# model's roofline does not price (module docstring, "The space")
MIN_CP_CHUNK = 128


def _tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _space(work: SearchWorkload, world: int, global_batch: int, seq: int, schedules, recompute, zero,
           sequence_parallel, microbatch_sizes, overlap_grad_reduce, overlap=(True, False),
           precision=(None,), ep=None, cp=None, cp_attention="auto") -> _Space:
    bad = [s for s in schedules if s not in _COST_SCHEDULE]
    if bad:
        raise SearchError(f"schedules {bad}: use any of gpipe, 1f1b, interleaved, zbh1")
    bad = [z for z in _tuple(zero) if z not in (0, 1, 2, 3) or isinstance(z, bool)]
    if bad:
        raise SearchError(f"zero {bad}: use any of 0, 1, 2, 3")
    bad = [x for x in _tuple(precision) if x not in _PRECISION_SPEED]
    if bad:
        raise SearchError(f"precision {bad}: use any of bf16, fp8, fp32")
    if not _tuple(overlap) or any(not isinstance(o, bool) for o in _tuple(overlap)):
        raise SearchError(f"overlap={overlap!r}: a tuple of True/False")
    asked = {Recompute(x).value for x in recompute}
    rec = tuple(r for r in (*RECOMPUTE_ORDER, Recompute.AUTO) if r.value in asked)
    if not isinstance(world, int) or world < 1:
        raise SearchError(f"world={world!r} must be a positive number of GPUs")
    moe = work.profile(1, False).moe
    ep_sizes = None
    if ep is not None:
        ep_sizes = _tuple(ep)
        bad = [e for e in ep_sizes if not isinstance(e, int) or isinstance(e, bool) or e < 1]
        if bad:
            raise SearchError(f"ep {bad}: positive expert-parallel sizes")
        if moe is None and any(e > 1 for e in ep_sizes):
            raise SearchError(f"ep={ep!r}: {work.name or 'the model'} has no mixture-of-experts layer to shard over ep")
    cp_sizes = None
    if cp is not None:
        cp_sizes = _tuple(cp)
        bad = [c for c in cp_sizes if not isinstance(c, int) or isinstance(c, bool) or c < 1]
        if bad:
            raise SearchError(f"cp {bad}: positive context-parallel sizes")
    cpa = _tuple(cp_attention)
    bad = [v for v in cpa if v not in ("auto", *C.CP_VARIANTS)]
    if bad or not cpa:
        raise SearchError(f"cp_attention={cp_attention!r}: 'auto' (the cheapest that applies) or any of "
                          f"{', '.join(C.CP_VARIANTS)}")
    return _Space(world, work.depth, int(global_batch), int(seq), tuple(schedules), rec, _tuple(zero),
                  tuple(bool(x) for x in sequence_parallel),
                  tuple(microbatch_sizes) if microbatch_sizes else None, overlap_grad_reduce,
                  tuple(dict.fromkeys(_tuple(overlap))), tuple(dict.fromkeys(_tuple(precision))),
                  moe.experts if moe is not None else None, ep_sizes, cp_sizes, tuple(dict.fromkeys(cpa)),
                  work.profile(1, False).heads)


def enumerate_layouts(model, world: int, *, global_batch: int, seq: int, schedules=DEFAULT_SCHEDULES,
                      recompute=DEFAULT_RECOMPUTE, zero=DEFAULT_ZERO, sequence_parallel=(False, True),
                      microbatch_sizes=None, overlap_grad_reduce: bool = True, overlap=(True, False),
                      precision=None, example_inputs: tuple = (), example_kwargs: dict | None = None, ep=None,
                      cp=None, cp_attention="auto", hardware: str | Hardware = "h100",
                      attention_kernel: str = "flash") -> Iterator[Layout]:
    """Every layout of the search space, unpruned (what :func:`search` ranks, before pruning).
    ``precision``: None (layouts without one: priced at estimate()'s) or the precisions to enumerate.
    ``cp``/``cp_attention`` as for :func:`search`; ``hardware`` and ``attention_kernel``: what
    ``cp_attention="auto"`` picks the variant of a cp layout on (:func:`mcompile.cost.model.choose_cp_attention`)."""
    work = SearchWorkload.of(model, example_inputs, example_kwargs)
    sp = _space(work, world, global_batch, seq, schedules, recompute, zero, sequence_parallel, microbatch_sizes,
                overlap_grad_reduce, overlap, precision, ep, cp, cp_attention)
    picks: dict[tuple, str] = {}

    def pick(tp, spar, cp_, ep_, b, pr):
        key = (tp, spar, cp_, ep_, b, pr)
        if key not in picks:
            picks[key] = C.choose_cp_attention(Layout(tp=tp, cp=cp_, ep=ep_, microbatch_size=b, sequence_parallel=spar,
                                                      precision=pr), hardware, seq=seq, model=work.profile(tp, spar),
                                               attention_kernel=attention_kernel)[0]
        return picks[key]

    for tp, spar, pp, dp, ep_, z, cp_ in sp.groups(work.tp_error):
        for s, v, b in sp.variants(pp, dp * ep_, cp_):
            for rec in sp.recompute:
                for ov, pr in sp.options(tp, z):
                    for cpa in sp.cp_variants(tp, cp_):
                        if cpa == "auto":
                            cpa = pick(tp, spar, cp_, ep_, b, pr)
                        yield sp.layout(tp, spar, pp, dp, z, s, v, b, rec, ov, pr, ep=ep_, cp=cp_, cp_attention=cpa)


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, repr=False)
class Candidate:
    """One ranked layout, a ``(layout, estimate)`` pair: ``layout, est = candidate``, ``candidate[1]``,
    ``for layout, est in mc.search(...)``; the stage split and the ways to run it as attributes."""

    layout: Layout
    estimate: Estimate
    stages: StageSplit | None = None

    def __iter__(self):
        return iter((self.layout, self.estimate))

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i):
        return (self.layout, self.estimate)[i]

    def __repr__(self) -> str:  # the Estimate's repr holds the whole hardware profile: one line instead
        return f"Candidate({self})"

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s

    @property
    def precision(self) -> str:
        """The matmul precision this candidate was priced at."""
        return self.layout.precision or self.estimate.details.get("precision", "bf16")

    def mesh(self, fake: bool = False):
        """The :class:`mcompile.Mesh` (axes of size 1 dropped; dp, pp, cp, ep, tp in that order)."""
        from mcompile.ir.mesh import Mesh

        lay = self.layout
        axes = {a: n for a, n in (("dp", lay.dp), ("pp", lay.pp), ("cp", lay.cp), ("ep", lay.ep), ("tp", lay.tp))
                if n > 1}
        axes = axes or {"dp": 1}
        return Mesh.fake(**axes) if fake else Mesh(**axes)

    def options(self) -> dict:
        """:class:`mcompile.Config` fields that run this layout."""
        lay = self.layout
        out = {"sequence_parallel": lay.sequence_parallel,
               "microbatches": int(self.estimate.global_batch // (lay.data_ranks * lay.microbatch_size)),
               "recompute": lay.recompute.value, "zero": lay.zero}
        if not lay.overlap:  # Config's default is overlap=True, tp_overlap="auto" (collective matmul where it pays)
            out.update(overlap=False, tp_overlap="off")
        if self.precision == "fp8":
            out["fp8"] = "current"
        if lay.cp > 1:  # the variant priced (Config(cp_attention="auto") picks the same: choose_cp_attention)
            out["cp_attention"] = lay.cp_attention
        if lay.recompute == Recompute.AUTO:  # the activation bytes every rank can hold (cost.activation_budget)
            budget = self.estimate.details.get("activation_budget")
            out["activation_budget"] = int(budget) if budget is not None else 0
        if lay.pp > 1:
            out.update(schedule=_RUNTIME_SCHEDULE[lay.schedule], virtual_stages=lay.virtual,
                       pipeline_seq=self.estimate.seq)
        return out

    def __str__(self) -> str:
        e = self.estimate
        return (f"{self.layout}: {e.step_time_s:.4g} s/step, {e.tflops_per_gpu:.3g} TFLOP/s per GPU, "
                f"{_bytes(e.memory_bytes)}" + (f", {self.stages}" if self.stages else ""))


class SearchResult(list):
    """The ranked candidates (best first) and how the search went. Each item is a
    :class:`Candidate`, a ``(layout, estimate)`` pair: ``for layout, est in result``, ``result[0]``."""

    def __init__(self, items, *, workload, world, hardware, global_batch, seq, memory_limit, stats, seconds):
        super().__init__(items)
        self.workload, self.world, self.hardware = workload, world, hardware
        self.global_batch, self.seq, self.memory_limit = global_batch, seq, memory_limit
        self.stats, self.seconds = stats, seconds
        self.priced: list[tuple[float, float, Layout]] = []  # (step time, memory, layout) of every layout priced
        self._reprice = None  # prices a layout on the search's settings (set by search(): choices())

    @property
    def best(self) -> Candidate:
        return self[0]

    HEADER = ("#", "dp", "pp", "cp", "ep", "tp", "v", "mbs", "m", "schedule", "sp", "recompute", "zero", "overlap",
              "matmul", "step s", "TFLOP/s", "MFU", "memory", "layers/stage", "largest terms")

    def rows(self) -> list[list[str]]:
        """The ranking as rows of text under :attr:`HEADER` (the CLI's table and :meth:`table`)."""
        rows = []
        for i, c in enumerate(self, 1):
            lay, e = c.layout, c.estimate
            top = sorted(e.breakdown.items(), key=lambda kv: -kv[1])[:3]
            rows.append([str(i), str(lay.dp), str(lay.pp), str(lay.cp) + (f" {lay.cp_attention}" if lay.cp > 1 else ""),
                         str(lay.ep), str(lay.tp), str(lay.virtual),
                         str(lay.microbatch_size),
                         str(int(e.details["microbatches"])), _RUNTIME_SCHEDULE[lay.schedule] if lay.pp > 1 else "-",
                         "yes" if lay.sequence_parallel else "-", lay.recompute.value, str(lay.zero),
                         ("on" if lay.overlap else "off") if lay.tp > 1 or lay.zero >= 3 else "-", c.precision,
                         f"{e.step_time_s:.4g}", f"{e.tflops_per_gpu:.3g}", f"{e.mfu:.1%}", _bytes(e.memory_bytes),
                         _runs(c.stages.layers_per_stage) if c.stages and lay.pp > 1 else "-",
                         ", ".join(f"{k} {v / e.step_time_s:.0%}" for k, v in top)])
        return rows

    def summary(self) -> tuple[str, str]:
        """(title, how the search went) lines."""
        s = self.stats
        return (f"{self.workload.name or 'model'} on {self.world} x {self.hardware.name}, global batch "
                f"{self.global_batch} x seq {self.seq}, memory limit {_bytes(self.memory_limit)}",
                f"searched {s['space']} layouts over {s['groups']} meshes x options in {self.seconds:.2f} s: "
                f"{s['priced']} priced, {s['pruned_memory']} over the memory limit, {s['pruned_dominated']} "
                "dominated (a cheaper recompute mode fits)")

    def table(self) -> str:
        """The ranking as an aligned text table."""
        head, rows = list(self.HEADER), self.rows()
        widths = [max(len(r[j]) for r in [head, *rows]) for j in range(len(head))]
        left = {"schedule", "recompute", "overlap", "matmul", "layers/stage", "largest terms"}
        fmt = lambda r: "  ".join(x.ljust(w) if h in left else x.rjust(w)  # noqa: E731
                                  for h, x, w in zip(head, r, widths)).rstrip()
        return "\n".join([*self.summary(), fmt(head), *map(fmt, rows)])

    def explain(self, i: int = 0, j: int | None = None) -> str:
        """Why candidate ``i`` beats candidate ``j`` (default: the runner-up): what differs in the
        layout, and every step-time and memory term that differs, largest first; then what each of
        candidate ``i``'s overlap / ZeRO / precision choices saves (:meth:`choices`)."""
        if not self:
            return "no layout fits"
        head = f"only one layout fits: {self[0]}" if len(self) < 2 else explain_pair(self[i], self[i + 1 if j is None
                                                                                              else j])
        return head + "\n" + explain_choices(self[i], self.choices(i))

    def choices(self, i: int = 0) -> list[dict]:
        """Candidate ``i``'s overlap, ZeRO and matmul-precision choices, each against its counterfactual —
        the same layout with that one choice flipped (overlap off, ZeRO one stage lower, bf16 instead
        of fp8; or, where the candidate took the other side, the choice it turned down), priced on the
        search's settings and stage cuts: ``{"choice", "chosen", "alternative", "step_time_s",
        "alternative_step_time_s", "saves_s", "memory_bytes", "alternative_memory_bytes",
        "saves_bytes", "alternative_fits", "applies"}``."""
        c = self[i]
        lay, e = c.layout, c.estimate
        out = []

        def add(name, chosen, alt, alt_layout, applies=True):
            a = self._reprice(alt_layout) if self._reprice else None
            if a is None:
                return
            out.append({"choice": name, "chosen": chosen, "alternative": alt, "step_time_s": e.step_time_s,
                        "alternative_step_time_s": a.step_time_s, "saves_s": a.step_time_s - e.step_time_s,
                        "memory_bytes": e.memory_bytes, "alternative_memory_bytes": a.memory_bytes,
                        "saves_bytes": a.memory_bytes - e.memory_bytes, "alternative_fits": a.fits,
                        "applies": applies})

        applies = lay.tp > 1 or lay.zero >= 3
        add("overlap", "on" if lay.overlap else "off", "off" if lay.overlap else "on",
            dataclasses.replace(lay, overlap=not lay.overlap), applies)
        if lay.zero > 0:
            add("zero", str(lay.zero), str(lay.zero - 1), dataclasses.replace(lay, zero=lay.zero - 1))
        elif lay.dp > 1:
            add("zero", "0", "1", dataclasses.replace(lay, zero=1))
        if c.precision == "fp8":
            add("precision", "fp8", "bf16", dataclasses.replace(lay, precision="bf16"))
        elif c.precision == "bf16" and self.hardware.fp8_flops is not None:
            add("precision", "bf16", "fp8", dataclasses.replace(lay, precision="fp8"))
        return out

    def to_dict(self) -> dict:
        return {"world": self.world, "hardware": self.hardware.name, "global_batch": self.global_batch,
                "seq": self.seq, "memory_limit": self.memory_limit, "seconds": self.seconds, "stats": self.stats,
                "candidates": [_candidate_dict(c) for c in self],
                "choices": self.choices(0) if self and self._reprice else []}


def _candidate_dict(c: Candidate) -> dict:
    e = c.estimate
    return {"layout": dataclasses.asdict(c.layout) | {"schedule": c.layout.schedule.value,
                                                      "recompute": c.layout.recompute.value,
                                                      "precision": c.precision},
            "describe": str(c.layout), "mesh": dict(c.mesh(fake=True).axes), "options": c.options(),
            "step_time_s": e.step_time_s, "uniform_step_time_s": e.details.get("uniform_step_time_s"),
            "breakdown": e.breakdown, "memory_bytes": e.memory_bytes, "memory_breakdown": e.memory_breakdown,
            "tflops_per_gpu": e.tflops_per_gpu, "mfu": e.mfu, "tokens_per_s": e.tokens_per_s,
            "layers_per_stage": list(c.stages.layers_per_stage) if c.stages else None,
            "stage_imbalance": c.stages.imbalance if c.stages else None,
            "cut_nodes": list(c.stages.cut_nodes) if c.stages else None}


_FIELDS = ("dp", "pp", "cp", "ep", "tp", "virtual", "microbatch_size", "schedule", "sequence_parallel", "recompute",
           "zero", "overlap", "precision", "cp_attention")


def explain_pair(a: Candidate, b: Candidate) -> str:
    """Why ``a`` is predicted faster than (or as fast as) ``b``: their layout differences and the
    breakdown terms that differ, largest difference first."""
    ea, eb = a.estimate, b.estimate
    diff = [f"{f}: {_v(getattr(a.layout, f))} vs {_v(getattr(b.layout, f))}" for f in _FIELDS
            if getattr(a.layout, f) != getattr(b.layout, f)]
    d = eb.step_time_s - ea.step_time_s
    lines = [f"best:      {a}", f"runner-up: {b}",
             f"the best is {d:.4g} s per step faster ({d / eb.step_time_s:.2%} of the runner-up's "
             f"{eb.step_time_s:.4g} s)" if d > 0 else "both are predicted equally fast",
             "layout differences: " + ("; ".join(diff) or "none")]
    terms = sorted(set(ea.breakdown) | set(eb.breakdown),
                   key=lambda k: -abs(eb.breakdown.get(k, 0) - ea.breakdown.get(k, 0)))
    rows = [(k, ea.breakdown.get(k, 0.0), eb.breakdown.get(k, 0.0)) for k in terms]
    rows = [r for r in rows if abs(r[2] - r[1]) > 1e-12 * max(eb.step_time_s, 1e-30)]
    if rows:
        lines.append("step-time terms that differ (best vs runner-up, runner-up minus best):")
        for k, x, y in rows:
            lines.append(f"  {k:<10} {x:>10.4g} s  {y:>10.4g} s   {y - x:+.4g} s")
    mrows = [(k, ea.memory_breakdown.get(k, 0.0), eb.memory_breakdown.get(k, 0.0))
             for k in ("params", "grads", "optimizer", "activations", "zero_buffers", "cp_buffers")]
    mrows = [r for r in mrows if abs(r[2] - r[1]) > 1]
    if mrows:
        lines.append("memory of the largest rank that differs (best vs runner-up):")
        for k, x, y in mrows:
            lines.append(f"  {k:<11} {_bytes(x):>10}  {_bytes(y):>10}   {'+' if y >= x else '-'}{_bytes(abs(y - x))}")
    return "\n".join(lines)


def _v(x) -> str:
    return x.value if hasattr(x, "value") else str(x)


_CHOICE_TEXT = {"overlap": "communication overlap (tp collective matmul, ZeRO-3 prefetch)", "zero": "ZeRO stage",
                "precision": "matmul precision"}


def explain_choices(c: Candidate, choices: list[dict]) -> str:
    """The lines of :meth:`SearchResult.explain` on a candidate's overlap / ZeRO / precision choices:
    each against its counterfactual, with the step time and memory it saves (negative: costs)."""
    lines = [f"choices of {c.layout} (each against the same layout with that choice flipped):"]
    for ch in choices:
        what = _CHOICE_TEXT.get(ch["choice"], ch["choice"])
        d, mb = ch["saves_s"], ch["saves_bytes"]
        rel = d / ch["alternative_step_time_s"] if ch["alternative_step_time_s"] else 0.0
        if not ch["applies"]:
            lines.append(f"  {what}: {ch['chosen']} — no effect on this layout (tp=1, ZeRO < 3): {d:+.4g} s per step")
            continue
        fits = "" if ch["alternative_fits"] else " (and would not fit)"
        lines.append(f"  {what}: {ch['chosen']} instead of {ch['alternative']} saves {d:+.4g} s per step "
                     f"({rel:+.1%} of {ch['alternative_step_time_s']:.4g} s) and {'+' if mb >= 0 else '-'}"
                     f"{_bytes(abs(mb))} per GPU{fits}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the search


class _Cell(NamedTuple):
    """Layouts of a group that differ only in recompute and overlap: one (schedule, virtual, microbatch size,
    matmul precision, cp attention variant)."""

    prof: C.ModelProfile
    sec: C.Sections
    per: C.PerParam
    split: StageSplit
    schedule: str  # the cost model's schedule name
    v: int
    m: float  # microbatches
    zero: int
    precision: str
    ep: int
    cp: int
    cp_attention: str
    overlaps: list  # the overlap settings to price
    same: set  # overlap settings that make the same layout as another one priced (not ranked)
    layout_at: Callable  # (recompute, overlap, precision, ep, cp, cp_attention) -> Layout


class _Pricer:
    """The search's pricing state (module docstring, "Pruning"): the settings per matmul precision, the
    :class:`mcompile.cost.model.Sections` and stage splits made so far, every layout priced (``found``: (step,
    memory, index, layout, layers per rank, split, ranked)), the smallest footprint seen (the error when
    nothing fits), the groups pruned whole and the counts (``stats``)."""

    def __init__(self, work: SearchWorkload, space: _Space, st: C.CostSettings, precisions: tuple, exhaustive: bool):
        self.work, self.space, self.st, self.exhaustive = work, space, st, exhaustive
        self.precision = precisions[0]
        self.st_of = {pr: dataclasses.replace(st, precision=pr) for pr in precisions}
        self.limit = st.limit
        self.sections: dict[tuple, C.Sections] = {}
        self.splits: dict[tuple, StageSplit] = {}
        self.found: list[tuple] = []
        self.smallest: list = [math.inf, None]
        self.stats = dict(space=0, groups=0, priced=0, pruned_memory=0, pruned_dominated=0, pruned_groups=0)
        self.pruned_groups: list[tuple] = []
        self.links: dict | None = None  # the current group's pp, tp and dp links (C.layout_links)

    def sec_of(self, tp, sp, b, pr=None, ep=1, cp=1) -> C.Sections:
        pr = pr or self.precision
        key = (tp, sp, b, pr, ep, cp)
        if key not in self.sections:
            st = self.st_of.get(pr) or dataclasses.replace(self.st, precision=pr)
            self.sections[key] = C.Sections(self.work.profile(tp, sp), b, st, pr, ep, cp)
        return self.sections[key]

    def split_of(self, pp, v) -> StageSplit:
        if (pp, v) not in self.splits:
            self.splits[(pp, v)] = stage_split(self.work, pp, v, self.st.seq)
        return self.splits[(pp, v)]

    def group(self, tp, sp, pp, dp, ep, z, cp) -> None:
        """One group (tp, sp, pp, dp, ep, ZeRO, cp): its memory lower bound (pruning 1), then its (schedule,
        virtual, microbatch size) variants, each schedule's stopping at the first microbatch size over the
        limit (pruning 2)."""
        space, stats, exhaustive = self.space, self.stats, self.exhaustive
        stats["groups"] += 1
        prof = self.work.profile(tp, sp)
        variants = list(space.variants(pp, dp * ep, cp))
        options = space.options(tp, z, exhaustive)
        asked_cp = space.cp_variants(tp, cp)  # ("auto",): one layout, choose_cp_attention's variant
        n_options = len(space.options(tp, z)) * len(asked_cp)
        stats["space"] += len(variants) * len(space.recompute) * n_options
        stats["pruned_dominated"] += len(variants) * len(space.recompute) * (n_options - len(options) * len(asked_cp))
        # 1. memory lower bound of the group: model state averaged over the pipeline ranks (E/ep experts a rank)
        per = C.state_per_param(self.st.param_dtype, self.st.grad_dtype, z, dp, ep, cp)
        lay_params, lay_experts = C.expert_split(prof, ep)
        total_params = self.work.depth * lay_params + prof.pre.params + prof.post.params - prof.tied_params
        if not exhaustive and sum(per.of(total_params, self.work.depth * lay_experts)) / pp > self.limit:
            stats["pruned_groups"] += 1
            stats["pruned_memory"] += len(variants) * len(space.recompute) * len(options) * len(asked_cp)
            self.pruned_groups.append((tp, sp, pp, dp, ep, z, cp))
            return
        over_at: dict[tuple, int] = {}  # (schedule, v) -> smallest microbatch size over the limit
        self.links = None  # a new mesh: its links are the first layout's
        for s, v, b in variants:
            if not exhaustive and (s, v) in over_at:  # memory never falls as the microbatch grows (docstring)
                stats["pruned_memory"] += len(space.recompute) * len(options) * len(asked_cp)
                continue
            fitted = False
            for pr in dict.fromkeys(o[1] for o in options):
                sec = self.sec_of(tp, sp, b, pr, ep, cp)
                ovs = [o for o, q in options if q == pr]
                for cpa in (sec.cp_choice if a == "auto" else a for a in asked_cp):
                    layout_at = functools.partial(space.layout, tp, sp, pp, dp, z, s, v, b)  # (rec, overlap, ...)
                    cell = _Cell(prof, sec, per, self.split_of(pp, v), s.value, v, self.st.global_batch / (dp * ep * b),
                                 z, pr, ep, cp, cpa, ovs,
                                 # overlap off where it changes nothing (tp = 1, ZeRO < 3) is the same layout twice:
                                 # priced when exhaustive, not ranked
                                 {False} if (tp == 1 and z < 3 and True in ovs) else set(), layout_at)
                    fitted = self.named(cell) | fitted
                    if Recompute.AUTO in space.recompute:  # priced wherever it fits (docstring, pruning 3)
                        fitted = self.auto(cell) | fitted
            if not fitted:
                over_at[(s, v)] = b

    def named(self, c: _Cell) -> bool:
        """The named recompute modes of one cell, none → selective → full: the first that fits is the only one
        priced (pruning 3) unless exhaustive. Whether one fits."""
        stats, found, limit, smallest = self.stats, self.found, self.limit, self.smallest
        named = [r for r in self.space.recompute if r != Recompute.AUTO]
        cpb = c.sec.cp_buffers(c.cp_attention)
        layers = c.split.layers_per_rank
        fitted = False
        for k, rec in enumerate(named):
            mem, _ = C.peak_memory(c.prof, c.sec, layers, c.per, c.schedule, c.v, c.m, rec.value, detail=False,
                                   zero=c.zero, grad_dtype=self.st.grad_dtype, cp_buffers=cpb)
            if mem < smallest[0]:
                smallest[:] = [mem, c.layout_at(rec, c.overlaps[0], c.precision, c.ep, c.cp, c.cp_attention)]
            if mem > limit:
                stats["pruned_memory"] += len(c.overlaps)
                continue
            for ov in c.overlaps:
                lay = c.layout_at(rec, ov, c.precision, c.ep, c.cp, c.cp_attention)
                self.links = self.links or C.layout_links(lay, self.st)
                terms, _ = C.step_terms(lay, c.prof, c.sec, layers, self.st_of[c.precision], self.links)
                stats["priced"] += 1
                found.append((sum(terms.values()), mem, len(found), lay, layers, c.split, ov not in c.same))
            fitted = True
            if not self.exhaustive:  # 3. recompute dominance: the slower named modes need no pricing
                stats["pruned_dominated"] += (len(named) - k - 1) * len(c.overlaps)
                break
        return fitted

    def auto(self, c: _Cell) -> bool:
        """recompute="auto" of one cell, at each overlap, wherever it fits. Whether it fits."""
        stats, found, limit, smallest = self.stats, self.found, self.limit, self.smallest
        cpb = c.sec.cp_buffers(c.cp_attention)
        layers = c.split.layers_per_rank
        fitted = False
        for ov in c.overlaps:
            auto = C.auto_stages(c.prof, c.sec, layers, c.per, c.schedule, c.v, c.m, limit, overlap=ov, zero=c.zero,
                                 grad_dtype=self.st.grad_dtype, cp_attention=c.cp_attention)
            mem, _ = C.peak_memory(c.prof, c.sec, layers, c.per, c.schedule, c.v, c.m, "auto", detail=False,
                                   zero=c.zero, grad_dtype=self.st.grad_dtype, auto=auto, cp_buffers=cpb)
            lay = c.layout_at(Recompute.AUTO, ov, c.precision, c.ep, c.cp, c.cp_attention)
            if mem < smallest[0]:
                smallest[:] = [mem, lay]
            if mem > limit:
                stats["pruned_memory"] += 1
                continue
            self.links = self.links or C.layout_links(lay, self.st)
            terms, _ = C.step_terms(lay, c.prof, c.sec, layers, self.st_of[c.precision], self.links, auto=auto)
            stats["priced"] += 1
            # where it reduces to none (none fits, and is priced), the same layout twice: not ranked
            ranked = not (C.auto_is_none(auto) and Recompute.NONE in self.space.recompute) and ov not in c.same
            found.append((sum(terms.values()), mem, len(found), lay, layers, c.split, ranked))
            fitted = True
        return fitted


def search(model, world: int | None = None, *, hardware: str | Hardware = "h100", global_batch: int,
           example_inputs: tuple = (), example_kwargs: dict | None = None, seq: int | None = None, top_k: int = 5,
           memory_limit: float | None = None, precision=DEFAULT_PRECISION, param_dtype: str = "bf16",
           grad_dtype: str = "fp32", attention_kernel: str = "flash", efficiency: C.Efficiency | None = None,
           schedules=DEFAULT_SCHEDULES, recompute=DEFAULT_RECOMPUTE, zero=DEFAULT_ZERO,
           sequence_parallel=(False, True), microbatch_sizes=None, overlap_grad_reduce: bool = True,
           overlap=(True, False), dtype: torch.dtype = torch.bfloat16, exhaustive: bool = False, ep=None,
           moe_imbalance: float = 1.0, cp=None, cp_attention="auto") -> SearchResult:
    """The ``top_k`` fastest layouts of ``model`` on ``world`` GPUs that fit in ``memory_limit`` bytes
    per GPU (default: the hardware's HBM), ranked by predicted step time (module docstring).

    ``model``: a module with ``example_inputs`` (a meta-device one is fine), a preset name or Preset,
    or a :class:`mcompile.cost.workload.Workload`. ``seq`` defaults to the model's maximum sequence length.
    ``precision``: the matmul precisions to search (a name or a tuple; those the hardware cannot run —
    FP8 before Hopper — are left out); each candidate's ``layout.precision`` says which it takes.
    ``param_dtype``/``grad_dtype``/``attention_kernel``/``efficiency`` are :func:`mcompile.cost.workload.estimate`'s.
    ``schedules``, ``recompute``, ``zero``, ``overlap``, ``sequence_parallel``, ``microbatch_sizes``
    and ``ep`` (expert-parallel sizes, MoE models only) restrict the space, as do ``cp`` (context-parallel
    sizes; None: every one for which 2·cp divides ``seq``) and ``cp_attention`` ("auto": each cp layout
    with :func:`mcompile.cost.model.choose_cp_attention`'s pick, what ``Config(cp_attention="auto")`` runs; or
    the variants to price, a name or a tuple). ``moe_imbalance``: the busiest
    ep rank's routed tokens over the mean (:func:`mcompile.cost.workload.estimate`). ``exhaustive``: price every
    layout, no pruning (tests)."""
    t0 = time.perf_counter()
    hw = get_hardware(hardware)  # an unknown name: the error lists the known profiles
    if world is None:
        raise SearchError("search() needs world=N, the number of GPUs")
    asked = _tuple(precision)
    precisions = tuple(pr for pr in asked if pr != "fp8" or hw.fp8_flops is not None)
    if not precisions:
        raise SearchError(f"{hw.name} has no FP8 tensor cores: search precision='bf16' (asked: {', '.join(asked)})")
    work = SearchWorkload.of(model, example_inputs, example_kwargs, dtype=dtype)
    prof1 = work.profile(1, False)
    seq = seq or prof1.seq_len or _input_seq(example_inputs)
    if not seq:
        raise SearchError("search() needs seq= (the model states no maximum sequence length)")
    st = C.cost_settings(hw, global_batch, seq, precisions[0], param_dtype, grad_dtype, attention_kernel, efficiency,
                         memory_limit, moe_imbalance)
    space = _space(work, world, global_batch, seq, schedules, recompute, zero, sequence_parallel, microbatch_sizes,
                   overlap_grad_reduce, overlap, precisions, ep, cp, cp_attention)
    pricer = _Pricer(work, space, st, precisions, exhaustive)
    for group in space.groups(work.tp_error):
        pricer.group(*group)
    stats, found, limit = pricer.stats, pricer.found, st.limit
    if stats["groups"] == 0:
        raise SearchError(_nothing_valid(work, space))
    if not found:
        raise SearchError(_nothing_fits(work, space, pricer.pruned_groups, pricer.smallest, limit, st, pricer.sec_of,
                                        pricer.split_of))
    found.sort(key=lambda r: (r[0], r[1], r[2]))
    top = []
    for *_, lay, layers, split, _ in [r for r in found if r[6]][:max(1, top_k)]:
        prof = work.profile(lay.tp, lay.sequence_parallel)
        sec = pricer.sec_of(lay.tp, lay.sequence_parallel, lay.microbatch_size, lay.precision, lay.ep, lay.cp)
        est = _finish(lay, work, prof, sec, layers, split, pricer.st_of[lay.precision])
        top.append(Candidate(lay, est, split if lay.pp > 1 else None))
    res = SearchResult(top, workload=work, world=world, hardware=hw, global_batch=int(global_batch), seq=int(seq),
                       memory_limit=limit, stats=stats, seconds=time.perf_counter() - t0)
    res.priced = [(r[0], r[1], r[3]) for r in found]
    res._reprice = functools.partial(_reprice, work=work, st=st, sec_of=pricer.sec_of, split_of=pricer.split_of)
    return res


def _reprice(layout: Layout, *, work, st: C.CostSettings, sec_of, split_of) -> Estimate:
    """Price a layout of a finished search (its counterfactuals: :meth:`SearchResult.choices`) on the
    search's own settings, stage cuts and cached sections."""
    layout = C.resolve_precision(layout, layout.precision or st.precision)
    pr = layout.precision
    prof = work.profile(layout.tp, layout.sequence_parallel)
    split = split_of(layout.pp, layout.virtual)
    sec = sec_of(layout.tp, layout.sequence_parallel, layout.microbatch_size, pr, layout.ep, layout.cp)
    return _finish(layout, work, prof, sec, split.layers_per_rank, split, dataclasses.replace(st, precision=pr))


def _input_seq(example_inputs) -> int | None:
    first = next((t for t in example_inputs if isinstance(t, torch.Tensor) and t.ndim > 1), None)
    return int(first.shape[1]) if first is not None else None


def _nothing_valid(work: SearchWorkload, space: _Space) -> str:
    tried = "\n  ".join(space.tried) or "(nothing)"
    return (f"no dp x pp x tp factorization of world={space.world} can run {work.name or 'the model'} "
            f"({space.depth} layers, global batch {space.global_batch}); tried:\n  {tried}\n"
            "use a world size whose factors divide the model's heads and the global batch, or change the batch")


def _most_saving(recompute: tuple) -> Recompute:
    """The mode of ``recompute`` that needs the least memory (auto's least is full's: full is named first)."""
    for r in (Recompute.FULL, Recompute.AUTO, Recompute.SELECTIVE, Recompute.NONE):
        if r in recompute:
            return r
    return recompute[-1]


def _nothing_fits(work, space, pruned_groups, smallest, limit, st, sec_of, split_of) -> str:
    # the groups pruned by their lower bound: their real footprints at each schedule's smallest microbatch
    # under the most memory-saving recompute mode allowed
    for tp, sp, pp, dp, ep, z, cp in pruned_groups:
        prof = work.profile(tp, sp)
        seen = set()
        for s, v, b in space.variants(pp, dp * ep, cp):
            if (s, v) in seen:
                continue
            seen.add((s, v))
            sec = sec_of(tp, sp, b, ep=ep, cp=cp)
            lay = space.layout(tp, sp, pp, dp, z, s, v, b, _most_saving(space.recompute), ep=ep, cp=cp,
                               cp_attention=sec.cp_choice)
            mem, _ = C.layout_memory(lay, prof, sec, split_of(pp, v).layers_per_rank, st)
            if mem < smallest[0]:
                smallest[:] = [mem, lay]
    mem, lay = smallest
    if lay is None:
        return (f"no layout of {work.name or 'the model'} on {space.world} GPUs: no schedule and microbatch size of "
                f"the allowed ones ({', '.join(space.schedules)}; microbatch sizes "
                f"{space.microbatch_sizes or 'any'}) is valid for its meshes; allow more schedules or sizes")
    allow = [what for what, ok in (("ZeRO-3", 3 in space.zero),
                                   ("full recompute", bool({Recompute.FULL, Recompute.AUTO} & set(space.recompute))),
                                   ("sequence parallelism", True in space.sequence_parallel)) if not ok]
    return (f"no layout of {work.name or 'the model'} on {space.world} GPUs fits in {_bytes(limit)} per GPU: "
            f"the smallest footprint found is {_bytes(mem)}, with {lay}; use more GPUs or a larger memory_limit"
            + (f", or allow {' and '.join(allow)}" if allow else ""))


# --------------------------------------------------------------------------- parallelize(plan="auto")

_PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "bf16"}
_SEARCHED_OPTIONS = ("sequence_parallel", "recompute", "zero", "schedule")  # fixed by the user: a restriction
_CHOSEN_OPTIONS = ("microbatches", "virtual_stages", "layers_per_stage", "stage_cuts")  # only the search sets
AUTO_LAYOUT_CP = (1,)  # the cp sizes plan="auto" may choose (auto_layout's docstring)


def auto_layout(model, world: int, example_inputs: tuple, example_kwargs: dict | None, options: dict, *,
                hardware=None, global_batch: int | None = None, device_type: str = "cpu",
                distributed_optimizer: bool = False):
    """What ``parallelize(..., plan="auto")`` runs (on rank 0): the best layout for this world, as a
    (mesh axes, Config options, explanation) triple. Options the user gave keep their values (the
    searched ones restrict the space); the runtime keeps parameters and gradients in fp32. Overlap as
    ``Config(overlap=)``, matmuls in the Config's dtype (no FP8 unasked).

    ZeRO: the optimizer is created after ``parallelize`` returns, by the user, and ZeRO-1/2 keep the
    gradients in sharded buffers that only :class:`mcompile.runtime.zero.DistributedOptimizer` updates
    (a torch optimizer over ``pm.parameters()`` would see no gradients: ``train_step`` refuses to run).
    So the search chooses only ZeRO 0 — the plain loop ``opt = torch.optim.AdamW(pm.parameters())``
    works — unless ``distributed_optimizer=True`` says the optimizer will be a DistributedOptimizer
    (then ZeRO 0/1), or ``zero`` is given (that level).

    Context parallelism is not chosen here yet (cp = 1: :data:`AUTO_LAYOUT_CP`): ``plan="auto"`` has not
    been run end to end with a cp mesh; :func:`search` explores it."""
    from mcompile.ir.config import Config, Inputs

    given = [k for k in _CHOSEN_OPTIONS if k in options]
    if given:
        raise ValueError(f"plan='auto' chooses {', '.join(given)} itself: leave them out, or give a mesh")
    config = Config(**options)
    hardware = hardware or ("cpu-gloo" if device_type == "cpu" else "h100")
    tensors = [t for t in list(example_inputs) + list((example_kwargs or {}).values()) if isinstance(t, torch.Tensor)]
    if global_batch is None:
        if config.inputs == Inputs.LOCAL:
            raise ValueError("plan='auto' with inputs='local' needs global_batch= (the template is one rank's slice)")
        if not tensors or tensors[0].ndim == 0:
            raise ValueError("plan='auto' needs global_batch= (no batched example input to read it from)")
        global_batch = int(tensors[0].shape[0])
    seq = int(tensors[0].shape[1]) if tensors and tensors[0].ndim > 1 else None
    # recompute="auto" only when asked for: its budget comes from the cost model's memory estimate, and
    # passes/remat.py refuses a budget under its own minimum on the real joint graph
    # ZeRO 0, or 0/1 with a DistributedOptimizer (docstring; 2 and 3 run as passes on the joint program: opt in
    # with zero=); overlap as configured (Config(overlap=True) by default); the compute dtype, never FP8 unasked
    zero_levels = (0, 1) if distributed_optimizer else (0,)
    restrict = {"recompute": RECOMPUTE_ORDER, "zero": zero_levels, "overlap": (bool(config.overlap),),
                "cp": AUTO_LAYOUT_CP}
    if "sequence_parallel" in options:
        restrict["sequence_parallel"] = (bool(options["sequence_parallel"]),)
    if "recompute" in options:
        restrict["recompute"] = (options["recompute"],)
    if "zero" in options:
        restrict["zero"] = (options["zero"],)
    if "schedule" in options:
        restrict["schedules"] = (options["schedule"],)
    res = search(model, world, hardware=hardware, global_batch=global_batch, example_inputs=example_inputs,
                 example_kwargs=example_kwargs, seq=seq, top_k=2, precision=_PRECISION[config.dtype],
                 param_dtype="fp32", grad_dtype="fp32", dtype=config.dtype, **restrict)
    best = res[0]
    chosen = best.options()
    if "activation_budget" in options:  # the user's budget for recompute="auto" wins over the estimate's
        chosen.pop("activation_budget", None)
    why = (f"plan='auto' on {world} x {res.hardware.name}: {best}\n"
           f"{res.stats['space']} layouts searched in {res.seconds:.2f} s\n{res.explain()}")
    return dict(best.mesh(fake=True).axes), {**options, **chosen}, why


# --------------------------------------------------------------------------- exact placements of one block


@dataclass
class BlockSolution:
    """Placements of ONE repeated block on one tp axis, solved exactly, next to the planner's greedy ones.

    ``objective_s`` / ``greedy_objective_s``: seconds per microbatch on one rank, forward and backward,
    of the block's compute plus its redistributions (:func:`block_placements`)."""

    tp: int
    sequence_parallel: bool
    layer: int
    nodes: list[str]
    strategies: dict[str, object]  # node name -> the chosen rule Strategy
    params: dict[str, object]  # parameter FQN -> placement, exact
    greedy_params: dict[str, object]  # parameter FQN -> placement, the planner's (mcompile.sharding.propagate)
    objective_s: float
    greedy_objective_s: float
    compute_s: float
    comm_s: float
    greedy_compute_s: float
    greedy_comm_s: float
    variables: int
    constraints: int
    solve_s: float
    strategy_names: dict[str, str] = field(default_factory=dict)  # FQN -> rule strategy name of its first consumer

    @property
    def matches_planner(self) -> bool:
        return self.params == self.greedy_params

    def text(self) -> str:
        sp = " with SP" if self.sequence_parallel else ""
        lines = [f"block {self.layer} ({len(self.nodes)} nodes) at tp={self.tp}{sp}: "
                 f"exact {self.objective_s * 1e3:.4g} ms (compute {self.compute_s * 1e3:.4g}, comm "
                 f"{self.comm_s * 1e3:.4g}) vs the planner's {self.greedy_objective_s * 1e3:.4g} ms per microbatch; "
                 f"{self.variables} variables, {self.constraints} constraints, {self.solve_s:.2f} s"]
        w = max(len(k) for k in self.params) if self.params else 0
        for fqn, p in self.params.items():
            g = self.greedy_params.get(fqn)
            lines.append(f"  {fqn:<{w}}  {p!r:<10} {self.strategy_names.get(fqn, ''):<14} "
                         f"{'=' if p == g else '!='} planner {g!r}")
        return "\n".join(lines)


def block_placements(model, tp: int, *, sequence_parallel: bool = False, hardware: str | Hardware = "h100",
                     microbatch_size: int = 1, seq: int | None = None, precision: str = "bf16",
                     require_sharded_weights: bool = True, efficiency: C.Efficiency | None = None,
                     example_inputs: tuple = (), example_kwargs: dict | None = None) -> BlockSolution:
    """Choose a rule strategy for every node of ONE repeated block (the first layer that
    :mod:`mcompile.sharding.blocks` finds; every layer has its signature) on one tp axis, exactly, by an
    integer program solved with HiGHS (Alpa's intra-operator pass, Zheng et al. 2022, on our rules).

    Variables: s[v,k] ∈ {0,1} — node v runs strategy k of its rule (:mod:`mcompile.sharding.rules`, filtered as
    :mod:`mcompile.sharding.propagate` filters them: a tp axis never shards the batch, the sequence only under
    SP, Partial never flows through a non-contraction op, a fused projection keeps its block layout;
    with ``require_sharded_weights`` every contraction weight is sharded, the planner's tp policy);
    x[w,q] ∈ {0,1} — parameter w has placement q; y[e,p,q] ∈ [0,1] — edge e (value u into input i of
    node v) carries u in placement p where v needs q; z[u,p,q] >= y[e,p,q] for every edge e leaving u —
    a redistribution of u to q is paid once however many nodes read it (the propagator's reuse: one
    all-gather feeds q, k and v).

    Constraints: Σ_k s[v,k] = 1; Σ_q x[w,q] = 1 and s[v,k] <= x[w,q] where strategy k reads w as q;
    Σ_q y[e,p,q] = Σ_{k: u's output is p} s[u,k] and Σ_p y[e,p,q] = Σ_{k: v's input i is q} s[v,k]
    (pairs p→q the lowering cannot do have no y: they are infeasible); values entering the block and
    the one leaving it (the residual stream) keep the planner's placements, so blocks chain.

    Objective (seconds per microbatch on one rank, forward + backward, the cost model's constants):
    Σ s[v,k]·t_v·share_k + Σ z[u,p,q]·c(p→q), t_v the node's roofline time (:mod:`mcompile.cost.model`),
    share_k = 1/tp when strategy k shards the node's work; c: R→S a slice (its backward all-gathers the
    gradient), P→R an all-reduce, P→S a reduce-scatter (+ all-gather back), S→R an all-gather
    (+ reduce-scatter back), on the tp link of ``hardware``; tensors at ``microbatch_size`` × ``seq``.

    The planner's greedy choice is priced by the same objective (``greedy_objective_s``): the exact
    optimum can only be lower or equal."""
    t0 = time.perf_counter()
    work = SearchWorkload.of(model, example_inputs, example_kwargs)
    prog = _BlockProgram(work, tp, sequence_parallel=sequence_parallel, hardware=hardware,
                         microbatch_size=microbatch_size, seq=seq, precision=precision,
                         require_sharded_weights=require_sharded_weights, efficiency=efficiency)
    prog.candidates()
    prog.node_columns()
    prog.edge_rows()
    prog.exit_rows()
    return prog.solution(prog.solve(), t0)


class _BlockProgram:
    """The integer program of :func:`block_placements`, built in the order its columns and rows are numbered.

    One object because every part reads the same block, planner result and link constants, and adds to
    the same columns (``cols_cost``, ``cols_int``) and rows: :meth:`candidates` (each node's strategies),
    :meth:`node_columns` (s and x), :meth:`edge_rows` (y and z), :meth:`exit_rows` (the residual stream
    keeps its placement), :meth:`solve` (HiGHS), :meth:`solution` (the exact and the greedy assignment
    priced alike). The cost helpers (:meth:`redistribute`, :meth:`node_time`) are the objective's terms."""

    def __init__(self, work: SearchWorkload, tp: int, *, sequence_parallel: bool, hardware: str | Hardware,
                 microbatch_size: int, seq: int | None, precision: str, require_sharded_weights: bool,
                 efficiency: C.Efficiency | None):
        from mcompile.sharding.propagate import requires_grad_nodes

        self.work, self.tp, self.precision = work, tp, precision
        self.require_sharded_weights = require_sharded_weights
        cap, trunk = work.captured, work.trunk
        self.cap = cap
        if not trunk.layer_starts:
            raise SearchError("no repeated blocks found in the graph: nothing to solve per block")
        self.sp = sp = bool(sequence_parallel and tp > 1)
        compiled = work.compiled(tp, sp)
        self.greedy = compiled.axes[0].result if tp > 1 else None
        if self.greedy is None:
            raise SearchError("block_placements needs tp > 1 (one tp axis to place on)")
        self.policy = compiled.axes[0].policy
        self.hw = hw = get_hardware(hardware)
        self.eff = eff = (efficiency or C.DEFAULT_EFFICIENCY).for_hardware(hw)
        prof = work.profile(1, False)
        seq = seq or prof.seq_len or 2048
        self.sub = {cap.symbols[k]: v for k, v in (("batch", microbatch_size), ("seq", seq)) if k in cap.symbols}
        self.beta, self.alpha = C.axis_link(Layout(tp=tp), "tp", hw, eff)
        self.rg = requires_grad_nodes(cap.gm, set(cap.params))
        lo = trunk.layer_starts[0]
        hi = trunk.layer_starts[1] if len(trunk.layer_starts) > 1 else (trunk.layers_end or len(trunk.nodes))
        self.block = trunk.nodes[lo:hi]
        self.in_block = {n.name for n in self.block}
        self.seq_sym = cap.symbols.get("seq")
        self.batch_sym = cap.symbols.get("batch")
        # the program, filled by the parts in order
        self.producers: list = []
        self.params_in: dict = {}
        self.cands: dict[str, list] = {}
        self.inputs_of: dict[str, list] = {}
        self.cols_cost: list[float] = []
        self.cols_int: list[bool] = []
        self.rows: list[tuple[float, float, list[int], list[float]]] = []
        self.svar: dict = {}
        self.xvar: dict = {}
        self.zvar: dict[tuple, int] = {}

    # -- the objective's terms: bytes, redistributions and node times at microbatch_size x seq

    def nbytes(self, meta: TensorMeta) -> float:
        numel = 1
        for d in meta.shape:
            numel *= int(d.subs(self.sub)) if hasattr(d, "subs") else int(d)
        return float(numel * meta.dtype.itemsize)

    @staticmethod
    def static(meta: TensorMeta, dim: int) -> bool:
        d = meta.shape[dim % meta.ndim]
        return not getattr(d, "free_symbols", None)

    def shard_allowed(self, meta: TensorMeta, p) -> bool:  # mcompile.sharding.propagate's rule for a tp axis
        from mcompile.ir.placements import BlockShard, Shard

        if not isinstance(p, Shard | BlockShard):
            return True
        d = meta.shape[p.dim % meta.ndim]
        free = getattr(d, "free_symbols", set())
        if not free:
            return self.policy.allow_static_dims
        if self.batch_sym in free:
            return False
        return self.sp and d == self.seq_sym

    def coll(self, kind: str, b: float) -> float:
        return float(C.collective_time(kind, b, self.tp, self.beta, self.alpha))

    def redistribute(self, src: str, p, q, meta: TensorMeta) -> float:
        """Seconds to turn value ``src`` from placement p into q, forward and backward (inf: not lowered)."""
        from mcompile.ir.placements import Partial, Replicate, Shard

        if p == q:
            return 0.0
        if isinstance(q, Shard) and self.static(meta, q.dim):
            return math.inf  # static dims are sharded by contractions, never by a collective
        b, grad = self.nbytes(meta), src in self.rg
        coll = self.coll
        if isinstance(p, Replicate) and isinstance(q, Shard):
            return 1e-9 + (coll("all_gather", b) if grad else 0.0)
        if isinstance(p, Partial) and isinstance(q, Replicate) and (p.reduce_op == "sum" or not grad):
            return coll("all_reduce", b)
        if isinstance(p, Partial) and p.reduce_op == "sum" and isinstance(q, Shard):
            return coll("reduce_scatter", b) + (coll("all_gather", b) if grad else 0.0)
        if isinstance(p, Shard) and isinstance(q, Replicate):
            return coll("all_gather", b) + (coll("reduce_scatter", b) if grad else 0.0)
        return math.inf

    def node_time(self, n) -> float:
        """The node's roofline time on one rank, unsharded, forward and backward."""
        from mcompile.ir.annotate import BACKWARD_MULTIPLIER
        from mcompile.ir.meta import BYTES_READ, BYTES_WRITTEN, FLOPS

        sub, hw, eff, precision = self.sub, self.hw, self.eff, self.precision
        f = float(sympy_sub(n.meta.get(FLOPS, 0), sub))
        y = float(sympy_sub(n.meta.get(BYTES_READ, 0), sub)) + float(sympy_sub(n.meta.get(BYTES_WRITTEN, 0), sub))
        cat = C.node_category(n)
        cls = C.op_class(cat)
        bw = hw.hbm_bandwidth * eff.memory
        if cls == "gemm":
            t = max(f / (hw.peak_flops(precision) * eff.gemm), y / bw)
            return t * (1 + BACKWARD_MULTIPLIER.get(cat, 2))
        if cls == "attention":
            t = max(f / (hw.peak_flops("bf16" if precision == "fp8" else precision) * eff.attention), y / bw)
            return t * (1 + BACKWARD_MULTIPLIER.get(cat, 2))
        return y / bw * (1 + C.BACKWARD_BYTES.get(cat, 1))

    @staticmethod
    def sharded(pl) -> bool:
        from mcompile.ir.placements import BlockShard, Partial, Shard

        return isinstance(pl, Shard | BlockShard | Partial)

    # -- values and the placements of what enters the block

    @staticmethod
    def value(a) -> tuple[str, int]:
        """(producer, output index) of the value an argument reads (through a getitem)."""
        if a.op == "call_function" and a.target is operator.getitem:
            return a.args[0].name, a.args[1]
        return a.name, 0

    def fixed_placement(self, name: str, idx: int):
        """The planner's placement of value (name, idx): what enters or leaves the block keeps it."""
        from mcompile.ir.placements import Replicate

        pl = self.greedy.placements.get(name, Replicate())
        return pl[idx] if isinstance(pl, tuple) else (pl if pl is not None else Replicate())

    # -- the candidate strategies of each node

    def candidates(self) -> None:
        """Each producing node's rule strategies, filtered as the planner filters them on a tp axis
        (``cands``), its tensor inputs (``inputs_of``) and every placement a strategy reads each parameter
        in (``params_in``, rejected strategies included: x has a column per placement any rule asks for)."""
        from mcompile.ir.placements import BlockShard, Partial, Replicate
        from mcompile.sharding.propagate import CONTRACTION_WEIGHT_ARGS, _out_metas
        from mcompile.sharding.rules import OpInfo, TensorMeta, get_rule, replicate_all, tensor_input_nodes

        cap, greedy, policy, params_in = self.cap, self.greedy, self.policy, self.params_in
        self.producers = [n for n in self.block if n.target is not operator.getitem and _out_metas(n)]
        for n in self.producers:
            ins = tensor_input_nodes(n)
            metas = [TensorMeta.of(a.meta["val"]) for a in ins]
            outs = _out_metas(n)
            current = tuple(greedy.params.get(a.name) if a.name in cap.params else self.fixed_placement(*self.value(a))
                            for a in ins)
            info = OpInfo(n, n.target, tuple(n.args), dict(n.kwargs), metas, outs, self.tp, current)
            rule = get_rule(n.target)
            options = (rule(info) if rule is not None else []) or [replicate_all(info)]
            weight_args = CONTRACTION_WEIGHT_ARGS.get(n.target, ())
            keep = []
            for s in options:
                ok = all(self.shard_allowed(o, p) for o, p in zip(outs, s.outputs))
                ok = ok and not (any(isinstance(p, Partial) for p in s.inputs) and any(isinstance(p, Partial)
                                                                                      for p in s.outputs))
                for i, (a, req) in enumerate(zip(ins, s.inputs)):
                    if a.name in cap.params:
                        hint = policy.param_hints.get(a.name)
                        if isinstance(req, Partial) or (isinstance(hint, BlockShard) and req != hint) or \
                                (self.require_sharded_weights and i in weight_args and isinstance(req, Replicate)):
                            ok = False
                        params_in.setdefault(a.name, set()).add(req)
                if ok and s not in keep:
                    keep.append(s)
            if not keep:
                raise SearchError(f"{n.name} ({n.target}): no strategy fits a tp axis")
            self.cands[n.name] = keep
            self.inputs_of[n.name] = list(zip(ins, metas))

    # -- the integer program's columns and rows

    def var(self, cost: float = 0.0, integer: bool = False) -> int:
        self.cols_cost.append(cost)
        self.cols_int.append(integer)
        return len(self.cols_cost) - 1

    def node_columns(self) -> None:
        """s[v,k] (cost: the node's time, 1/tp of it where the strategy shards the work) and x[w,q], one
        choice each."""
        tp, rows, var = self.tp, self.rows, self.var
        for n in self.producers:
            t = self.node_time(n)
            self.svar[n.name] = [var(t / (tp if any(self.sharded(p) for p in (*s.inputs, *s.outputs)) else 1), True)
                                 for s in self.cands[n.name]]
            rows.append((1, 1, self.svar[n.name], [1.0] * len(self.svar[n.name])))
        for ph, places in self.params_in.items():
            self.xvar[ph] = {q: var(0.0, True) for q in sorted(places, key=repr)}
            rows.append((1, 1, list(self.xvar[ph].values()), [1.0] * len(self.xvar[ph])))

    def out_indicator(self, u: str, idx: int) -> dict:
        """placement -> [(column, coefficient)] saying value (u, idx) has that placement (fixed: {})."""
        if u not in self.cands:
            return {self.fixed_placement(u, idx): []}
        out: dict = {}
        for s, c in zip(self.cands[u], self.svar[u]):
            out.setdefault(s.outputs[idx], []).append(c)
        return out

    def edge_rows(self) -> None:
        """Every input of every node: a parameter read as q needs x[w,q]; a value gets y[e,p,q] for each
        pair the lowering can do, and z[u,p,q] (the redistribution's cost, paid once per value) above them."""
        rows, var, zvar = self.rows, self.var, self.zvar
        for name in self.cands:
            cands, svar = self.cands[name], self.svar[name]
            for i, (a, meta) in enumerate(self.inputs_of[name]):
                if a.name in self.cap.params:
                    for s, c in zip(cands, svar):
                        rows.append((-math.inf, 0, [c, self.xvar[a.name][s.inputs[i]]], [1.0, -1.0]))
                    continue
                u, idx = self.value(a)
                src = self.out_indicator(u, idx)
                need: dict = {}
                for s, c in zip(cands, svar):
                    need.setdefault(s.inputs[i], []).append(c)
                y = {}
                for p in src:
                    for q in need:
                        cost = self.redistribute(u, p, q, meta)
                        if math.isfinite(cost):
                            y[(p, q)] = var()
                            if p != q:
                                key = (u, idx, p, q)
                                if key not in zvar:
                                    zvar[key] = var(cost)
                                rows.append((0, math.inf, [zvar[key], y[(p, q)]], [1.0, -1.0]))
                for p, cs in src.items():  # Σ_q y[p,q] = [u is p]
                    yc = [y[(p, q)] for q in need if (p, q) in y]
                    if cs:
                        rows.append((0, 0, yc + cs, [1.0] * len(yc) + [-1.0] * len(cs)))
                    else:
                        rows.append((1, 1, yc, [1.0] * len(yc)))
                for q, cs in need.items():  # Σ_p y[p,q] = [v needs q]
                    yc = [y[(p, q)] for p in src if (p, q) in y]
                    rows.append((0, 0, yc + cs, [1.0] * len(yc) + [-1.0] * len(cs)))

    def exit_rows(self) -> None:
        """Values leaving the block keep the planner's placement (the next block expects it)."""
        from mcompile.sharding.propagate import _out_metas

        in_block = self.in_block
        for n in self.producers:
            for idx in range(len(_out_metas(n))):
                users = [u for u in n.users if u.name not in in_block or
                         (u.target is operator.getitem and any(w.name not in in_block for w in u.users))]
                if users:
                    want = self.fixed_placement(n.name, idx)
                    cs = self.out_indicator(n.name, idx).get(want, [])
                    if not cs:
                        raise SearchError(f"{n.name}: no strategy produces the placement {want!r} the next block reads")
                    self.rows.append((1, 1, cs, [1.0] * len(cs)))

    def solve(self) -> np.ndarray:
        """The columns and rows handed to HiGHS, solved to optimality: the columns' values."""
        h = quiet_highs("the exact per-block placement solver (mcompile.search.block_placements)")
        import highspy  # importable: quiet_highs required it

        n_cols = len(self.cols_cost)
        h.addVars(n_cols, np.zeros(n_cols), np.ones(n_cols))
        h.changeColsCost(n_cols, np.arange(n_cols, dtype=np.int32), np.array(self.cols_cost, dtype=np.float64))
        ints = np.array([i for i, b in enumerate(self.cols_int) if b], dtype=np.int32)
        h.changeColsIntegrality(len(ints), ints, np.array([highspy.HighsVarType.kInteger] * len(ints)))
        inf = highspy.kHighsInf
        for lo_, hi_, idx, val in self.rows:
            h.addRow(lo_ if math.isfinite(lo_) else -inf, hi_ if math.isfinite(hi_) else inf,
                     len(idx), np.array(idx, dtype=np.int32), np.array(val, dtype=np.float64))
        h.run()
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            raise SearchError(f"the block's integer program was not solved to optimality: {h.getModelStatus()}")
        return np.array(h.getSolution().col_value)

    # -- the answer, and the planner's greedy assignment priced by the same objective

    def price_assignment(self, strategies: dict, param_pl: dict) -> tuple[float, float]:
        """(compute, comm) seconds of one strategy per node: the objective at that assignment."""
        cands, svar, cols_cost = self.cands, self.svar, self.cols_cost
        compute = sum(cols_cost[svar[name][cands[name].index(s)]] for name, s in strategies.items())
        paid = set()
        comm = 0.0
        for name, s in strategies.items():
            for i, (a, meta) in enumerate(self.inputs_of[name]):
                if a.name in self.cap.params:
                    continue
                u, idx = self.value(a)
                p = strategies[u].outputs[idx] if u in strategies else self.fixed_placement(u, idx)
                q = s.inputs[i]
                if p != q and (u, idx, q) not in paid:
                    paid.add((u, idx, q))
                    comm += self.redistribute(u, p, q, meta)
        return compute, comm

    def greedy_strategies(self) -> dict:
        """node name -> the candidate the planner chose (None where it chose outside the candidates)."""
        g_strats = {}
        for name in self.cands:
            g = self.greedy.strategies.get(name)
            match = [s for s in self.cands[name] if g is not None and s.inputs == g.inputs and s.outputs == g.outputs]
            g_strats[name] = match[0] if match else None
        return g_strats

    def solution(self, sol: np.ndarray, t0: float) -> BlockSolution:
        """The chosen strategies and parameter placements, each assignment priced, as a BlockSolution."""
        cap, cands, xvar, greedy = self.cap, self.cands, self.xvar, self.greedy
        chosen = {name: cands[name][int(np.argmax(sol[self.svar[name]]))] for name in cands}
        params = {cap.params[ph]: max(xs, key=lambda q: sol[xs[q]]) for ph, xs in xvar.items()}
        greedy_params = {cap.params[ph]: greedy.params[ph] for ph in xvar}
        compute, comm = self.price_assignment(chosen, params)
        g_strats = self.greedy_strategies()
        if any(s is None for s in g_strats.values()):
            g_compute = g_comm = math.inf  # the planner chose outside the space (cannot happen with the same filters)
        else:
            g_compute, g_comm = self.price_assignment(g_strats, greedy_params)
        names = {}
        for name in cands:
            for a, _ in self.inputs_of[name]:
                if a.name in cap.params and cap.params[a.name] not in names:
                    names[cap.params[a.name]] = chosen[name].name or "local"
        return BlockSolution(
            tp=self.tp, sequence_parallel=self.sp, layer=0, nodes=[n.name for n in self.block], strategies=chosen,
            params=params, greedy_params=greedy_params, objective_s=compute + comm,
            greedy_objective_s=g_compute + g_comm, compute_s=compute, comm_s=comm, greedy_compute_s=g_compute,
            greedy_comm_s=g_comm, variables=len(self.cols_cost), constraints=len(self.rows),
            solve_s=time.perf_counter() - t0, strategy_names=names)


def sympy_sub(x, sub) -> float:
    """A node annotation (int, float or sympy in batch/seq) at the given sizes."""
    if isinstance(x, int | float):
        return float(x)
    import sympy

    return float(sympy.sympify(x).subs(sub))
