"""Sharding propagation: choose a rule strategy for every node, one mesh axis at a time.

Walks the captured graph in topological order. Each node's rule lists strategies; the propagator
scores each against where the inputs currently are and takes the cheapest (ties: the rule's order):

    cost(strategy) = sum over tensor inputs of redistribute(current -> required)
    redistribute:  same -> 0 | R -> S: slice, eps (+ all-gather of the gradient in backward)
                   P -> R: all-reduce 2B | P -> S: reduce-scatter B (+ all-gather B in backward)
                   S -> R: all-gather B (+ reduce-scatter B in backward) | anything else -> inf
    B = bytes of the value at the planning hints (batch, seq); a redistribution already made for
    the same value and target costs 0 (it is reused, as Megatron fuses QKV's one all-gather).

Parameters are placed by their first use and never redistributed afterwards (a tied weight keeps
the placement of its first use). A value computed from parameters alone (Gemma's ``1 + w``, Cohere's
``w.to(float32)``, a weight cast before its linear) is placed the same way: its op waits, like the
parameter, until an op reading it meets an activation, and takes the strategy that gives that op what
it asks for. Placed by its own op first, every placement would tie at no cost and the rule's first
(a shard) would win: a norm's weight split over features, its output gathered each layer. A replicated
value broadcast along a new dim (``expand``: DeepSeek's group mask over its groups' experts) waits too:
whole or split along that dim, both free, so its reader chooses.

The :class:`AxisPolicy` says what one axis may shard: which activation dims (batch for dp; features,
heads, vocab — and the sequence under sequence parallelism — for tp), whether contraction weights
must be sharded, whether Partial values may pass through non-contraction ops. The result is only
placements; inserting collectives is the lowering pass's job.

An op with no rule runs replicated and is reported (``AxisResult.fallbacks`` -> ``FallbackWarning``
and ``Plan.fallbacks``) unless it is free: an input-only value (computed from no parameter, see
:mod:`mcompile.sharding.blocks`) whose inputs every rank already holds whole.
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field
from typing import NoReturn

import sympy
import torch
import torch.fx as fx
from torch.utils._sympy.symbol import SymT, symbol_is_type

from mcompile.capture.export import BATCH, SEQ, Captured
from mcompile.ir.placements import BlockShard, Partial, Replicate, Shard
from mcompile.ir.plan import PlanError
from mcompile.sharding.rules import OpInfo, Strategy, TensorMeta, get_rule, replicate_all, tensor_input_nodes

__all__ = ["AxisPolicy", "AxisResult", "PlanError", "FallbackWarning", "propagate_axis", "requires_grad_nodes"]

R = Replicate()
INF = float("inf")
REPLICATED_TOKENS = 1e18  # cp: the price of computing a token activation whole on every rank (see AxisPolicy)
aten = torch.ops.aten
# Ops whose non-first tensor inputs are weights that a tensor-parallel plan must shard.
CONTRACTION_WEIGHT_ARGS = {
    aten.linear.default: (1,),
    aten.mm.default: (1,),
    aten.addmm.default: (2,),
    aten.matmul.default: (1,),
    aten.embedding.default: (0,),
}
_NO_GRAD_OPS = {aten.detach.default, aten.detach_.default, aten.sym_size.int}
# the weight operand of a contraction, for the planner's hints and the layout check (mcompile.sharding.quality)
_WEIGHT_USES = {aten.linear.default: 1, aten.matmul.default: 1, aten.mm.default: 1, aten.addmm.default: 2,
                aten.bmm.default: 1}  # bmm: experts' weights [E, in, out] (Llama-4's feed_forward.experts)
# a library's custom op, by name (mcompile.sharding.rules.matmul.grouped_mm): transformers' grouped GEMM of experts [E,
# in, out]
_WEIGHT_USES_BY_NAME = {"transformers.grouped_mm_fallback.default": 1}
# how a weight may reach its contraction (Falcon's ``x @ self.weight.T``: numpy_T, then matmul)
_TO_WEIGHT = {aten.t.default, aten.numpy_T.default, aten.transpose.int, aten.permute.default, aten.to.dtype,
              aten._to_copy.default, aten.alias.default, aten.view.default,
              aten.select.int}  # one expert's matrix of stacked experts (DBRX's w1.view(E, f, d)[e])


def _to_weight(w) -> torch.fx.Node | None:
    while isinstance(w, torch.fx.Node) and w.op == "call_function" and w.target in _TO_WEIGHT:
        w = w.args[0]
    return w if isinstance(w, torch.fx.Node) and w.op == "placeholder" else None


def _weight_of(node: torch.fx.Node) -> torch.fx.Node | None:
    """The parameter placeholder a contraction multiplies by (through transposes and casts), or None."""
    if node.target is aten.einsum.default:  # XLNet's "ibnd,hnd->ibh": an activation by a weight
        ops = node.args[1] if len(node.args) > 1 else ()
        return _to_weight(ops[1]) if len(ops) == 2 and _to_weight(ops[0]) is None else None
    i = _WEIGHT_USES.get(node.target, _WEIGHT_USES_BY_NAME.get(str(node.target)))
    if i is None or len(node.args) <= i:
        return None
    return _to_weight(node.args[i])


log = logging.getLogger("mcompile.propagate")


class FallbackWarning(UserWarning):
    """An op has no sharding rule: it runs replicated."""


_SAME_VALUE = {torch.ops.aten.to.dtype, torch.ops.aten.to.device, torch.ops.aten.to.dtype_layout,
               torch.ops.aten._to_copy.default, torch.ops.aten.clone.default, torch.ops.aten.contiguous.default,
               torch.ops.aten.alias.default, torch.ops.aten.detach.default}


# dropout masks a Partial alike on every rank (passes/lower_dropout.py): linear in it, the reduction may wait
_MASKED = _SAME_VALUE | {torch.ops.aten.dropout.default}
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default}
_SCALES = {torch.ops.aten.mul.Tensor, torch.ops.aten.div.Tensor}

_LATENT_STOP = {aten.linear.default, aten.mm.default, aten.matmul.default, aten.bmm.default, aten.addmm.default,
                aten.embedding.default, aten.scaled_dot_product_attention.default}


def _contraction(n: fx.Node) -> bool:
    """A matmul-like op (linear, attention, a convolution, an einsum of two operands: XLNet's projections by
    [h, heads, d] weights) or a custom op (a scan, an MoE layer)."""
    return n.target in _LATENT_STOP or n.target in (aten.convolution.default, aten.conv1d.default,
                                                    aten.conv2d.default) or \
        (n.target is aten.einsum.default and len(n.args) > 1 and len(n.args[1]) > 1) or \
        str(getattr(n.target, "namespace", "aten")) != "aten"


# ops that read their input's memory with strides from the capture's layout (passes/canonicalize.py
# ``as_strided_of_storage`` gives them a contiguous copy of the storage's owner, whose layout every program keeps)
_STORAGE_READERS = {torch.ops.aten.as_strided.default}


def _check_storage_read(node: fx.Node, best, place: dict, policy: AxisPolicy) -> None:
    """Refuse an ``as_strided`` whose input a rank's program may hold in another layout than the capture's: its
    strides would read other elements there (a silently wrong value and gradient). Its input, every view between
    it and the tensor owning its storage and that tensor must stay whole on a split axis, computed by the
    capture's own ops (an all-gathered or re-sliced value is laid out in its own order)."""
    x = node.args[0]
    if x.op == "call_function" and x.target is torch.ops.aten.clone.default and \
            x.kwargs.get("memory_format") is torch.contiguous_format:
        return  # the canonical form: any layout of the owner is made the capture's by the copy
    chain = [x]
    while chain[-1].op == "call_function" and (chain[-1].target is operator.getitem or any(
            r.alias_info is not None for r in getattr(getattr(chain[-1].target, "_schema", None), "returns", ()))) \
            and chain[-1].args and isinstance(chain[-1].args[0], fx.Node):
        chain.append(chain[-1].args[0])
    moved = [f"{c.name} ({place.get(c.name)})" for c in chain if place.get(c.name) not in (None, R)]
    if moved or any(not isinstance(p, Replicate) for p in best.inputs):
        raise PlanError(
            f"{node.name} ({node.target}) reads the memory of {x.name} with strides taken from the capture's layout, "
            f"and on {policy.axis} the value it views is split ({', '.join(moved) or 'its input'}): a rank's "
            "program holds it in another layout, where those strides read other elements. mcompile rewrites "
            "as_strided over a view of a tensor that was contiguous in the capture (passes/canonicalize.py "
            "as_strided_of_storage); this one is not. Write it without as_strided (Tensor.unfold for overlapping "
            "windows, view/reshape, slicing), or plan without this axis")


def _selected(n: fx.Node, src: fx.Node | None) -> bool:
    """``n`` is ``where(cond, src, 0)``: its tensor kept or zeroed (linear in it, a Partial stays one)."""
    return n.target is torch.ops.aten.where.ScalarOther and len(n.args) == 3 and n.args[2] == 0 and \
        (src is None or n.args[1] is src)


def _numel(shape) -> int:
    """A size to compare: a symbolic dim (batch, seq) counts as large, the same for every value."""
    return math.prod(int(d) if isinstance(d, int) else 1 << 20 for d in shape)


def _sums_partials(node: fx.Node, s, in_metas, outs) -> bool:
    """``s`` adds (or subtracts) two Partials into a Partial no larger than its larger input — one reduction
    of the sum instead of one of each (BERT's word + position + token-type embeddings, each vocab-parallel:
    Megatron's single all-reduce; an MoE layer's routed experts plus its shared expert, both row-parallel
    sums, as Megatron's MoE layer reduces them) — or passes a Partial through a copy that changes neither its
    dtype nor its shape (HF GPT-2's ``position_embeds.to(device)`` before that add) or a view (the routed
    experts' [tokens, h] output viewed back to [b, s, h]) or a scale by a replicated factor (Qwen2-MoE's gated
    shared expert), or adds partial rows into their tokens' places (``index_add``, JetMoE's experts): the
    reduction waits at no cost. Only
    for Partials read by this node alone: one that something else needs whole is reduced anyway (a residual
    stream read by the next norm and the residual add stays replicated, as Megatron's)."""
    def readers(a: fx.Node) -> list[fx.Node]:
        return [u for u in a.users if u.op == "output" or u.meta.get("val") is not None]  # asserts aside

    if any(isinstance(p, Partial) and readers(a) != [node] for a, p in zip(tensor_input_nodes(node), s.inputs)):
        return False
    def to_an_add(of_partials: bool = False) -> bool:
        prev, after = node, readers(node)
        summed = False  # joined other partial sums on the way (index_add's rows into a running sum)
        while len(after) == 1 and (after[0].target in _MASKED or after[0].target in _VIEWS or
                                   after[0].target in _SCALES or _selected(after[0], prev) or
                                   after[0].target is torch.ops.aten.index_add.default):
            summed = summed or after[0].target is torch.ops.aten.index_add.default
            prev, after = after[0], readers(after[0])
        if not (len(after) == 1 and after[0].target in (torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor)):
            return False
        if not of_partials or summed:
            # (an expert's output scaled by its routing weight and added into the experts' running sum: one
            # reduction of the sum replaces one per expert, as Megatron's MoE layer reduces once at its exit)
            return True
        # a scale waits only for an add whose other term is a contraction's output too (a Partial it can join):
        # added to the replicated residual stream, the reduction would come at the same cost and the factor's
        # gradient would need a backward all-reduce (Megatron's f) for nothing
        from mcompile.ir.moe import moe_ffn

        def contraction_term(n: fx.Node, depth: int = 0) -> bool:
            # seen through copies and views, and through scales: two parallel branches each scaled by its own
            # multiplier before they are summed (Falcon-H1's attention and Mamba mixer, ``out * 1.0``) join
            if n.op != "call_function" or depth > 8:
                return False
            if n.target is moe_ffn or _contraction(n):
                return True
            if n.target in _SAME_VALUE or n.target in _VIEWS:
                return isinstance(n.args[0], fx.Node) and contraction_term(n.args[0], depth + 1)
            if n.target in _SCALES:  # the scaled term is the one a contraction wrote, the factor the other
                return sum(contraction_term(a, depth + 1) for a in n.args if isinstance(a, fx.Node)) == 1
            return False

        other = [a for a in after[0].args if isinstance(a, fx.Node) and a is not prev]
        return len(other) == 1 and contraction_term(other[0])

    if node.target in _MASKED or node.target in _VIEWS:  # only on the way to such an add
        if len(in_metas) != 1 or in_metas[0].dtype != outs[0].dtype or node.target in _MASKED and \
                tuple(in_metas[0].shape) != tuple(outs[0].shape):
            return False
        return to_an_add()
    if node.target is torch.ops.aten.index_add.default:
        # experts' outputs added back to their tokens (JetMoE: ``zeros.index_add(0, idx, out)``) sum partial sums
        # into one no larger than the experts' top-k rows: reduced once after, as the routed experts' sum is
        return len(in_metas) == 3 and _numel(outs[0].shape) <= _numel(in_metas[2].shape)
    if _selected(node, None):
        # an unrolled loop's update kept or not (mcompile/capture/loops.py: where(mask[i], rows, 0)): a scale by 1 or 0
        return isinstance(s.inputs[-1], Partial) and to_an_add(of_partials=True)
    if node.target in _SCALES:
        # a Partial scaled by a replicated factor (Qwen2-MoE's shared expert times the sigmoid of its [1, h]
        # gate, before the routed experts' sum is added): linear in the Partial, so the scaled pieces still sum
        # to the scaled whole; only on the way to such an add, and only where the scale does not broadcast the
        # Partial larger (a reduction of the output would then cost more than one of the input)
        k = [i for i, p in enumerate(s.inputs) if isinstance(p, Partial)]
        if len(k) != 1 or not all(isinstance(p, Replicate) for i, p in enumerate(s.inputs) if i != k[0]) or \
                in_metas[k[0]].dtype != outs[0].dtype or \
                _numel(outs[0].shape) > _numel(in_metas[k[0]].shape):
            return False
        return to_an_add(of_partials=True)
    if node.target not in (torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor) or len(in_metas) != 2 or \
            not all(isinstance(p, Partial) for p in s.inputs):
        return False
    size = [_numel(m.shape) for m in (*in_metas, outs[0])]
    return size[2] <= max(size[:2])


@dataclass
class AxisPolicy:
    axis: str
    size: int
    shard_inputs_dim0: bool = False  # dp: user inputs are split on the batch dim
    allowed_symbols: frozenset = frozenset()  # which of batch/seq an activation dim of this axis may contain
    allow_static_dims: bool = True  # may shard dims with no batch/seq symbol (features, heads, vocab)
    shard_contraction_weights: bool = False  # tp: every linear/embedding weight must be sharded
    params_replicated: bool = False  # dp: parameters replicated (no ZeRO yet)
    partial_passthrough: bool = False  # may a Partial flow through a non-contraction op
    prefer_seq_reduce_scatter: bool = False  # sequence parallel: P -> S(seq) beats P -> R
    redistribute_to_static_dims: bool = False  # may a collective/slice shard a static dim
    param_overrides: dict = field(default_factory=dict)  # FQN -> placement for this axis
    node_overrides: dict = field(default_factory=dict)  # node name -> placement of its output
    param_hints: dict = field(default_factory=dict)  # placeholder name -> placement offered to rules first
    # values a rank may slice on a static dim (the query heads of a fused projection kept whole for its one
    # key/value head: planner.kv_sliced); any other static dim is sharded by a contraction only
    sliced_static: frozenset = frozenset()
    # values kept whole for each rank to take its share of every block of heads where an attention reads them
    # (planner.head_blocks' keys and values): never broadcast split (repeat_kv's expand sharded over the query
    # group could only be gathered again before the attention, which reads blocks)
    whole_broadcast: frozenset = frozenset()
    expert_parallel: bool = False  # ep: MoE nodes may take their expert-parallel strategy (lowering moe_ep)
    # cp: every value computed from parameters that has a token dim (seq, or batch*seq flattened) is split on
    # it (load-balanced chunks, mcompile.passes.cp.ops); attention takes its context-parallel lowering; the loss is the
    # ranks' sum (inputs arrive whole: input-only values such as positions and shifted labels are computed
    # whole, then sliced where they meet the split activations)
    context_parallel: bool = False

    @property
    def loss_partial(self) -> bool:
        """Whether the step's loss is the sum of this axis's ranks' (dp, ep, cp), not replicated (tp)."""
        return self.shard_inputs_dim0 or self.context_parallel


@dataclass
class AxisResult:
    placements: dict[str, object]  # node name -> placement (tuple for multi-output nodes)
    strategies: dict[str, Strategy]  # node name -> chosen strategy
    params: dict[str, object]  # placeholder name -> placement
    padded: dict[str, int]  # node name -> dim whose (static) size does not divide (vocab padding)
    fallbacks: set[str]
    notes: dict[str, list[str]]


def writes_first_arg(node: fx.Node) -> bool:
    """Whether ``node`` writes into its first argument in place (``copy_``, ``index_put_``, ``add_`` ...)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable or not schema.arguments or not node.args:
        return False
    info = schema.arguments[0].alias_info
    return info is not None and info.is_write and isinstance(node.args[0], fx.Node)


def requires_grad_nodes(gm: fx.GraphModule, param_names: set[str]) -> set[str]:
    rg: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            v = n.meta.get("val")
            if n.name in param_names and isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
                rg.add(n.name)
        elif n.op == "call_function" and n.target not in _NO_GRAD_OPS:
            v = n.meta.get("val")
            vals = v if isinstance(v, list | tuple) else [v]
            is_float = any(isinstance(x, torch.Tensor) and x.dtype.is_floating_point for x in vals)
            if is_float and any(a.name in rg for a in n.all_input_nodes):
                rg.add(n.name)
    return rg


def _bytes(meta: TensorMeta, hints: dict, memo: dict | None = None) -> float:
    numel = 1
    for s in meta.shape:
        if isinstance(s, sympy.Expr):
            v = memo.get(s) if memo is not None else None
            if v is None:
                v = int(s.subs(hints))
                if memo is not None:
                    memo[s] = v
            numel *= v
        else:
            numel *= int(s)
    return float(numel * meta.dtype.itemsize)


def _out_metas(node: fx.Node) -> list[TensorMeta]:
    v = node.meta.get("val")
    vals = v if isinstance(v, list | tuple) else [v]
    return [TensorMeta.of(x) for x in vals if isinstance(x, torch.Tensor)]


class _Repin(Exception):
    def __init__(self, pins: dict, message: str):
        super().__init__(message)
        self.pins = pins


class _Unhint(Exception):
    """A planner hint (``policy.param_hints``) on an unplaced weight that its reader cannot take from the
    placements its other inputs arrive in, where the reader has a strategy without the hint."""

    def __init__(self, names: list[str], message: str):
        super().__init__(message)
        self.names = names


def propagate_axis(
    cap: Captured, policy: AxisPolicy, hints: dict, param_pad_ok=None
) -> AxisResult:
    """Choose placements for every node of ``cap.gm`` on one mesh axis. A parameter read by several nodes takes
    one placement all of them can take: when a later reader cannot take the one its first reader chose, that
    reader's is pinned (``policy.param_hints``: every reader must take it) and the axis planned again."""
    pinned: dict[str, object] = {}
    dropped: set[str] = set()
    while True:
        try:
            return _propagate_axis(cap, policy, hints, param_pad_ok)
        except _Unhint as e:
            # a hint found from the graph's shape (mixer_hints.conv_readers: a linear reading a conv's channels is
            # row-parallel) that the propagation cannot honour: the channels reach the reader whole (Zamba's
            # per-head Python loop indexes the heads one by one). The weight is placed by its reader instead, as
            # every unhinted weight is; the layout check then reports the collectives this costs.
            if any(k in pinned or k in dropped for k in e.names):
                raise PlanError(str(e)) from None
            for k in e.names:
                log.info("hint %r for %s dropped: %s", policy.param_hints[k], cap.params[k], str(e).split(":", 1)[0])
                dropped.add(k)
                del policy.param_hints[k]
        except _Repin as e:
            if any(pinned.get(k) is not None for k in e.pins):  # pinned already, and still no fit: give up
                raise PlanError(str(e)) from None
            for k, req in e.pins.items():
                log.info("parameter %s, read by several nodes, placed %r for all of them (%s)", cap.params[k],
                         req, str(e).split(":", 1)[0])
                pinned[k] = policy.param_hints[k] = req


def _propagate_axis(
    cap: Captured, policy: AxisPolicy, hints: dict, param_pad_ok=None
) -> AxisResult:
    """One pass over the graph (:class:`_AxisPlacement`); :func:`propagate_axis` repeats it when a parameter must
    be pinned or a hint dropped."""
    axis = _AxisPlacement(cap, policy, hints)
    for node in cap.gm.graph.nodes:
        if node.op == "placeholder":
            axis.place_input(node)
        elif node.op != "output":
            axis.place_op(node)
    return axis.finish()


class _AxisPlacement:
    """One axis's propagation (:func:`propagate_axis`): every node placed in graph order, each by the cheapest
    strategy of its rule that fits where its inputs are; parameters, and values of parameters alone, placed by the
    first op that meets an activation."""

    def __init__(self, cap: Captured, policy: AxisPolicy, hints: dict):
        self.cap, self.policy, self.hints = cap, policy, hints
        self.n = policy.size
        self.sym = cap.symbols
        self.rg = requires_grad_nodes(cap.gm, set(cap.params))
        self.place: dict[str, object] = {}
        self.strategies: dict[str, Strategy] = {}
        self.params: dict[str, object] = {}
        self.padded: dict[str, int] = {}
        self.fallbacks: set[str] = set()
        self.notes: dict[str, list[str]] = {}
        self.made: set[tuple[str, object]] = set()  # redistributions already paid for
        self.fqn_of = {**cap.params}
        self.padded_params: dict[str, int] = {}
        # values computed from parameters (mcompile.sharding.blocks: every other value is "input-only")
        self.from_params: set[str] = set(cap.params)
        self.sizes: dict = {}  # a symbolic size at the hints (sympy substitution is the planner's hot spot)
        # values computed from parameters alone, not placed yet: node name -> (its inputs, rule strategies)
        self.waiting: dict[str, tuple[list[fx.Node], list[Strategy]]] = {}

    def shard_allowed(self, meta: TensorMeta, p) -> bool:
        if not isinstance(p, Shard | BlockShard):
            return True
        size = meta.shape[p.dim % meta.ndim]
        free = {s for s in (size.free_symbols if isinstance(size, sympy.Expr) else ())}
        names = {k for k, s in self.sym.items() if s in free}
        if not names and any(symbol_is_type(s, SymT.UNBACKED_INT) for s in free):
            # a data-dependent count of rows picked from the tokens (X-MOD's hidden_states[lang_mask]): a token
            # dim, not a feature dim; split, its row-parallel exit would leave as a reduce-scatter and an
            # all-gather where Megatron all-reduces once (as mcompile.search costs it)
            return False
        if not names and free:
            # a token dim export renamed (a sequence refined to 4*s: DeepSeek-V4's windows of 4) or a size of
            # an input's own symbol: not a static feature dim, and not the batch/seq this axis may split
            return False
        if not names:
            return self.policy.allow_static_dims
        if self.policy.context_parallel:  # the tokens: the sequence, or batch*seq flattened (seq innermost)
            return SEQ in names and (size == self.sym.get(SEQ) or size == self.sym.get(SEQ) * self.sym.get(BATCH, 0))
        if BATCH in names:  # batch, or batch*seq flattened with the batch outermost (the view rule's job)
            return BATCH in self.policy.allowed_symbols
        return SEQ in self.policy.allowed_symbols and size == self.sym.get(SEQ)

    def unplaced(self, a: fx.Node) -> bool:
        return self.place.get(a.name) is None and (a.name in self.cap.params or a.name in self.waiting)

    def route(self, a: fx.Node, req) -> Strategy | None:
        """For an unplaced parameter, a strategy-less stand-in if it may take ``req``; for a waiting value,
        the first strategy of its op that yields ``req`` from inputs that may take what it asks."""
        if a.name in self.cap.params:
            hint = self.policy.param_hints.get(a.name)
            if hint is not None and isinstance(hint, BlockShard | Replicate | Shard) and req != hint:
                # a fused projection later split into blocks: only the block layout; a latent
                # down-projection (planner.latent_hints): only whole; a per-head score bias
                # table (planner.position_bias_hints): only by heads
                return None
            if isinstance(req, Partial) or (self.policy.params_replicated and not isinstance(req, Replicate)):
                return None
            return Strategy((), (req,), name="param")
        ins_a, cands_a = self.waiting[a.name]
        if not self.shard_allowed(_out_metas(a)[0], req):
            return None
        for s in cands_a:
            if s.outputs and s.outputs[0] == req and all(
                    self.route(b, r) is not None if self.unplaced(b) else self.place.get(b.name) == r
                    for b, r in zip(ins_a, s.inputs)):
                return s
        return None

    def kept_whole(self, a: fx.Node) -> bool:
        """Whether a planner hint keeps this unplaced weight (or every parameter it is cast from) whole."""
        if a.name in self.cap.params:
            return isinstance(self.policy.param_hints.get(a.name), Replicate)
        return all(self.kept_whole(b) for b in self.waiting[a.name][0] if self.unplaced(b))

    def settle(self, a: fx.Node, req) -> None:
        """Place an unplaced parameter, or a waiting value and what it waits on, as ``req``."""
        if a.name in self.cap.params:
            self.place[a.name] = self.params[a.name] = req
            if isinstance(req, Shard):
                d = req.dim % a.meta["val"].ndim
                size = a.meta["val"].shape[d]
                if isinstance(size, int) and size % self.n:
                    self.padded_params[a.name] = d
                    self.padded[a.name] = d
            return
        s = self.route(a, req)
        self.strategies[a.name], self.place[a.name] = s, req
        for b, r in zip(self.waiting[a.name][0], s.inputs):
            if self.unplaced(b):
                self.settle(b, r)

    def redistribute_cost(self, src: fx.Node, cur, req, meta: TensorMeta) -> float:
        if cur == req:
            return 0.0
        if (src.name, req) in self.made:
            return 0.0
        b = _bytes(meta, self.hints, self.sizes) * (self.n - 1) / self.n
        grad = src.name in self.rg
        if isinstance(req, Shard) and not self.policy.redistribute_to_static_dims and src.name in self.from_params \
                and src.name not in self.policy.sliced_static:
            size = meta.shape[req.dim % meta.ndim]
            if not isinstance(size, sympy.Expr) or not size.free_symbols:
                # static dims (features, heads) of activations are sharded by contractions, not by collectives;
                # an input-only value (a mask, a zero position bias over heads) is sliced where it is needed
                return INF
        if isinstance(cur, Replicate) and isinstance(req, Shard):
            if src.name in self.policy.sliced_static and not isinstance(meta.shape[req.dim % meta.ndim], sympy.Expr):
                # a rank taking its heads of a value kept whole for that (planner.kv_sliced) is the layout's
                # intent, cheaper than any gather of what those heads computed: its adjoint is not charged
                return 1e-3
            return 1e-3 + (b if grad and not self.policy.context_parallel else 0.0)  # cp: the slice's adjoint is local
        if isinstance(cur, Replicate) and isinstance(req, BlockShard) and isinstance(req.blocks, int) and \
                src.name in self.policy.sliced_static:
            return 1e-3  # a rank taking its share of each block of heads of a value kept whole for that
        if isinstance(cur, Partial) and cur.reduce_op in ("sum", "avg") and isinstance(req, Replicate):
            return 2 * b
        if isinstance(cur, Partial) and cur.reduce_op == "max" and isinstance(req, Replicate) and not grad:
            return 2 * b
        if isinstance(cur, Partial) and cur.reduce_op == "sum" and isinstance(req, Shard):
            return (0.5 * b if self.policy.prefer_seq_reduce_scatter else b) + (b if grad else 0.0)
        if isinstance(cur, Shard) and isinstance(req, Replicate):
            return b + (b if grad else 0.0)
        return INF

    def choose(self, node, cands, ins, current, in_metas, outs, weight_args, token_out):
        """The cheapest strategy of ``cands`` (None, INF: none fits)."""
        best, best_cost = None, INF
        for s in cands:
            if s.lowering == "moe_ep" and not self.policy.expert_parallel:
                continue
            if s.lowering == "cp_attention" and not self.policy.context_parallel:
                continue
            if s.name == "expand_broadcast" and (node.name not in self.from_params
                                                 or node.name in self.policy.whole_broadcast):
                continue  # an input-only value (a mask, a table) stays whole: its consumers take what they need
            cost = 0.0
            for i, (a, req) in enumerate(zip(ins, s.inputs)):
                # an in-place write on a redistributed destination (a fallback's gather) runs on a copy, which
                # the lowering puts back into the rank's piece (passes/lower.py ``_written``: a local slice and
                # copy_), so only the move to the strategy's placement is charged, as for any input
                if a.name in self.cap.params or self.unplaced(a):
                    cur = self.place[a.name]
                    if cur is None:
                        if self.route(a, req) is None:
                            cost = INF
                        elif self.policy.shard_contraction_weights and i in weight_args and isinstance(req, Replicate) \
                                and not self.kept_whole(a):
                            cost = INF
                    elif cur != req:
                        cost = INF
                else:
                    cost += self.redistribute_cost(a, current[i], req, in_metas[i])
                if cost == INF:
                    break
            if cost < INF:
                for o, p in zip(outs, s.outputs):
                    if not self.shard_allowed(o, p):
                        cost = INF
                if (not self.policy.partial_passthrough and any(isinstance(p, Partial) for p in s.inputs)
                        and any(isinstance(p, Partial) for p in s.outputs)
                        and not (self.policy.shard_contraction_weights and _sums_partials(node, s, in_metas, outs))):
                    cost = INF
            if cost < INF and token_out and all(isinstance(p, Replicate) for p in s.outputs):
                cost += REPLICATED_TOKENS  # cp: a replicated token activation repeats its work on every rank
            if cost < best_cost:
                best, best_cost = s, cost
        return best, best_cost

    def place_input(self, node: fx.Node) -> None:
        """A placeholder: a parameter as overridden, replicated or placed by its first use; a user input
        split on its batch dim where the policy says; anything else replicated."""
        v = node.meta.get("val")
        if node.name in self.cap.params:
            fqn = self.fqn_of[node.name]
            if fqn in self.policy.param_overrides:
                self.params[node.name] = self.policy.param_overrides[fqn]
                self.place[node.name] = self.params[node.name]
            elif self.policy.params_replicated:
                self.params[node.name] = self.place[node.name] = R
            else:
                self.place[node.name] = None  # placed by its first use
        elif node.name in self.cap.user_inputs and isinstance(v, torch.Tensor):
            sharded = self.policy.shard_inputs_dim0 and v.ndim >= 1 and isinstance(v.shape[0], torch.SymInt)
            self.place[node.name] = Shard(0) if sharded else R
        else:
            self.place[node.name] = R

    def place_op(self, node: fx.Node) -> None:
        """An op of the graph: its rule's strategies, the cheapest that fits chosen (or the node left waiting
        for an activation, or replicated without a rule)."""
        if any(a.name in self.from_params for a in node.all_input_nodes):
            self.from_params.add(node.name)
        if node.target is operator.getitem:
            src, idx = node.args
            pv = self.place.get(src.name)
            self.place[node.name] = pv[idx] if isinstance(pv, tuple) else pv
            return
        outs = _out_metas(node)
        ins = tensor_input_nodes(node)
        if not outs:  # sym_size, asserts: no tensor to place
            return
        in_metas = self.input_metas(ins)
        current = tuple(
            self.place.get(a.name) if self.place.get(a.name) is not None else self.policy.param_hints.get(a.name, R)
            for a in ins
        )
        info = OpInfo(node, node.target, tuple(node.args), dict(node.kwargs), in_metas, outs, self.n, current,
                      token_symbol=self.sym.get(SEQ) if self.policy.context_parallel else None)
        rule = get_rule(node.target)
        cands = rule(info) if rule is not None else []
        # broadcast of a replicated value (DeepSeek's group mask expanded over its groups' experts): whole or
        # split along the new dim, both free; the op that meets it chooses, as for a value of parameters alone.
        # Not a key/value of a projection kept whole for its few heads (planner.kv_sliced): its broadcast over
        # the query heads takes expand's own heads-split strategy, each rank slicing the heads it attends
        free_broadcast = node.target is aten.expand.default and current == (R,) and node.name in self.from_params \
            and node.name not in self.policy.sliced_static \
            and not self.policy.context_parallel
        if cands and ins and len(outs) == 1 and (free_broadcast or all(self.unplaced(a) for a in ins)) and \
                node.target not in CONTRACTION_WEIGHT_ARGS and node.name not in self.policy.node_overrides:
            self.waiting[node.name] = (ins, cands)  # placed by the first op that meets an activation
            if info.notes:
                self.notes[node.name] = list(info.notes)
            self.place[node.name] = None
            return
        if not cands:  # no rule, or one that proves no split for these inputs (mcompile.sharding.rules)
            # An input-only value (a mask, position ids, a RoPE table) held whole by every rank runs
            # replicated at no cost: nothing to report. Anything else is reported once.
            if node.name in self.from_params or any(not isinstance(c, Replicate) for c in current):
                self.fallbacks.add(str(node.target))
            cands = [replicate_all(info)]
        weight_args = CONTRACTION_WEIGHT_ARGS.get(node.target, ())
        if outs and outs[0].ndim and outs[0].shape[-1] == 1:
            # one output feature (Qwen2-MoE's [1, h] shared-expert gate: a scalar gate): nothing to split
            # column-wise, and a row split would all-reduce its one number; the weight may stay whole
            weight_args = ()
        token_out = self.policy.context_parallel and node.name in self.from_params and any(
            any(self.shard_allowed(o, Shard(d)) for d in range(o.ndim)) for o in outs)
        best, best_cost = self.choose(node, cands, ins, current, in_metas, outs, weight_args, token_out)
        if node.name in self.policy.node_overrides:
            want = self.policy.node_overrides[node.name]
            forced = [s for s in cands if s.outputs and s.outputs[0] == want]
            if not forced:
                raise PlanError(f"override {node.name}={want!r} on axis {self.policy.axis}: no strategy of "
                                f"{node.target} produces it; possible: {sorted({repr(s.outputs[0]) for s in cands})}")
            best = forced[0]
        if token_out and best is not None and best_cost >= REPLICATED_TOKENS:
            self.fallbacks.add(f"{node.target} (whole sequence on every {self.policy.axis} rank)")
        if info.notes:
            self.notes[node.name] = list(info.notes)
        if best is None:
            self.no_fit(node, cands, ins, current, in_metas, outs, weight_args, token_out, info)
        self.commit(node, best, ins, current, outs)

    def input_metas(self, ins: list[fx.Node]) -> list[TensorMeta]:
        """The inputs' metadata, a padded parameter's padded dim at its padded size."""
        in_metas = []
        for a in ins:
            m = TensorMeta.of(a.meta["val"])
            if a.name in self.padded_params:
                d = self.padded_params[a.name]
                shape = list(m.shape)
                shape[d] = math.ceil(shape[d] / self.n) * self.n
                m = TensorMeta(tuple(shape), m.dtype)
            in_metas.append(m)
        return in_metas

    def no_fit(self, node, cands, ins, current, in_metas, outs, weight_args, token_out, info) -> NoReturn:
        """No strategy of ``node`` fits: raise what :func:`propagate_axis` does about it (pin a shared parameter,
        drop a hint, or give up)."""
        # a parameter placed by an earlier reader that this one cannot take (ALBERT shares one layer's weights
        # with every layer: layer 0's query reads a sharded activation, the others a replicated one): the
        # placement this reader needs is pinned for all readers and the axis planned again
        shared = {a.name: self.place[a.name] for a in ins
                  if a.name in self.cap.params and self.place[a.name] is not None}
        for a in shared:
            self.place[a] = None
        alt, _ = self.choose(node, cands, ins, current, in_metas, outs, weight_args, token_out)
        self.place.update(shared)
        if alt is not None:
            raise _Repin({a.name: req for a, req in zip(ins, alt.inputs) if a.name in shared},
                         _no_strategy_message(node, self.policy, ins, self.place, info, self.cap))
        hinted = {a.name: self.policy.param_hints[a.name] for a in ins
                  if a.name in self.cap.params and self.place[a.name] is None and a.name in self.policy.param_hints}
        if hinted:
            for a in hinted:
                del self.policy.param_hints[a]
            try:
                alt, _ = self.choose(node, cands, ins, current, in_metas, outs, weight_args, token_out)
            finally:
                self.policy.param_hints.update(hinted)
            if alt is not None:
                raise _Unhint(list(hinted),
                              _no_strategy_message(node, self.policy, ins, self.place, info, self.cap))
        raise PlanError(_no_strategy_message(node, self.policy, ins, self.place, info, self.cap))

    def commit(self, node: fx.Node, best: Strategy, ins: list[fx.Node], current: tuple, outs) -> None:
        """Run ``node`` by ``best``: its unplaced inputs settled, its redistributions paid, its placement kept."""
        for i, (a, req) in enumerate(zip(ins, best.inputs)):
            if self.unplaced(a):
                self.settle(a, req)
            elif a.name not in self.cap.params and current[i] != req:
                self.made.add((a.name, req))
        if node.target in _STORAGE_READERS and self.n > 1 and not self.policy.shard_inputs_dim0:
            # (dp, ep: presharded, every layout the capture's)
            _check_storage_read(node, best, self.place, self.policy)
        self.strategies[node.name] = best
        self.place[node.name] = best.outputs if len(outs) > 1 else (best.outputs[0] if best.outputs else None)
        # a sharded dim whose static size does not divide (only from a padded vocabulary)
        for o, p in zip(outs, best.outputs):
            if isinstance(p, Shard):
                size = o.shape[p.dim % o.ndim]
                if isinstance(size, int) and size % self.n:
                    self.padded[node.name] = p.dim % o.ndim

    def finish(self) -> AxisResult:
        """The values no activation met, and the parameters nobody reads, placed; the result."""
        for node in self.cap.gm.graph.nodes:  # values of parameters alone that no activation meets: whole, if they can
            if node.name in self.waiting and self.place[node.name] is None:
                req = R if self.route(node, R) is not None else next(
                    s.outputs[0] for s in self.waiting[node.name][1]
                    if s.outputs and self.route(node, s.outputs[0]) is not None)
                self.settle(node, req)
        for node in self.cap.gm.graph.nodes:  # parameters nobody reads
            if node.op == "placeholder" and node.name in self.cap.params and self.place[node.name] is None:
                self.place[node.name] = self.params[node.name] = R
        return AxisResult(self.place, self.strategies, self.params, self.padded, self.fallbacks, self.notes)


def _no_strategy_message(node, policy, ins, place, info, cap) -> str:
    where = (node.meta.get("stack_trace") or "").strip().splitlines()
    loc = where[-2].strip() if len(where) >= 2 else ""
    placed = ", ".join(f"{a.name}={place.get(a.name)!r}" for a in ins)
    why = "; ".join(info.notes) or "no rule strategy fits the inputs' placements"
    return (
        f"cannot place {node.name} ({node.target}) on axis {policy.axis}={policy.size}: {why}. "
        f"Inputs: {placed}. {loc}"
    )
