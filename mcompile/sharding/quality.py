"""Megatron's layout, or a reason: the plan-quality check run on every plan with a tensor-parallel axis.

Parity cannot see a poor layout: a fused projection split as plain rows computes the model exactly and
moves several times Megatron's bytes. So every plan is checked against Megatron's tensor-parallel layout
(Shoeybi et al. 2019, "Megatron-LM", section 3; Korthikanti et al. 2022 for sequence parallelism), per
transformer layer:

1. **Collectives.** A layer enters a tp region at each column-parallel projection and leaves it at the
   row-parallel projection that writes back to the residual width (attention's output projection, an MLP's
   down projection): Megatron runs one forward collective per exit (an all-reduce), two with sequence
   parallelism (the all-gather entering and the reduce-scatter leaving). The all-reduce of a norm's
   statistics over tp-sharded features (OLMo-2's q/k norm over all heads) is the model's, not the
   layout's, and is not counted. The exits are counted from the
   captured model, not the plan: a linear whose input was computed from another contraction
   (:func:`mcompile.sharding.planner._after_contraction`; a low-rank latent or a router kept whole is not one: what
   reads it enters a region), or an MoE layer (``moe_ffn``: its experts' down
   projections, summed). Exits whose values are added together before anything else reads them leave
   as one (an MoE layer's routed experts plus its shared expert — scaled or not by a gate, linear in
   it — a parallel-residual block's attention plus MLP): Megatron adds the partial sums and reduces once.
   An exit whose output is multiplied elementwise by a gate projected from the stream (RWKV's channel mix,
   ``sigmoid(receptance(x)) * value(k)``) has that gate's region leave at the product too: one more exit
   (Megatron has no such construct; the gate's weight, sharded, must be gathered or its product must).
   A layer whose forward tp collectives exceed that count is reported with every collective of the layer
   and the captured node whose value it moves.
2. **Weights.** Every weight matrix a contraction of the layer uses is sharded over tp, unless the plan
   keeps it whole for a reason Megatron shares: a low-rank latent projection (multi-head latent
   attention's down projections, :func:`mcompile.sharding.planner.latent_hints`), an MoE router (a few outputs,
   one per expert, :func:`mcompile.sharding.planner.router_hints`) or the key/value projection of an attention with
   fewer key/value heads than tp ranks (multi-query attention, :func:`mcompile.sharding.planner.kv_hints`), if each
   rank then attends only its own query heads (an attention run whole on every rank is reported), or a
   Mamba-2 mixer's fused in_proj whose B/C groups tp does not divide (:func:`mcompile.sharding.mixer_hints.few_groups`:
   Megatron asserts ``ngroups % tp == 0``; B and C must be whole on every rank, and the rest of the fused
   weight with them), or a token selector's projection (a top-k over per-head scores summed over the heads:
   DeepSeek sparse attention's lightning indexer, :func:`mcompile.sharding.planner.selector_hints`), or a
   hyper-connection's mixing projection (the residual streams to the few weights that mix them, replicated as
   the streams are: :func:`mcompile.sharding.planner.stream_mix_hints`). A
   projection to a single output (Qwen2-MoE's [1, h] shared-expert gate) has nothing to split. Any other
   whole weight is reported.

Findings of alike layers (block repetition: the same finding in layers 0..L-1) are reported once with
their layers. ``compile_plan`` warns a :class:`PlanQualityWarning` and keeps them in
``Compiled.quality``; ``mcompile plan`` prints them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from mcompile.ir.annotate import layer_index
from mcompile.ir.placements import Replicate, is_shard
from mcompile.sharding.propagate import _weight_of

__all__ = ["PlanQualityWarning", "Finding", "check_quality", "tp_exits"]

aten = torch.ops.aten
_STATISTICS = {aten.mean.dim, aten.sum.dim_IntList, aten.var.correction, aten.amax.default}


def _activation_of(node: torch.fx.Node):
    """What a contraction with a weight (:func:`_weight_of`) projects."""
    return node.args[1][0] if node.target is aten.einsum.default else node.args[0]


class PlanQualityWarning(UserWarning):
    """The plan is not Megatron's layout: more tp collectives per layer than Megatron runs, or a weight
    matrix left whole without a reason (see :mod:`mcompile.sharding.quality`)."""


@dataclass(frozen=True)
class Finding:
    layers: tuple[int, ...]
    kind: str  # "collectives" | "whole weight" | "whole attention"
    text: str

    def __str__(self) -> str:
        where = f"layer {self.layers[0]}" if len(self.layers) == 1 else \
            f"layers {', '.join(map(str, self.layers[:4]))}{', ...' if len(self.layers) > 4 else ''}"
        return f"{where}: {self.text}"


_PASS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.to.dtype, aten._to_copy.default,
         aten.clone.default, aten.contiguous.default, aten.alias.default}
_SUM = (aten.add.Tensor, aten.sub.Tensor)


def _scales(node: torch.fx.Node, prev: torch.fx.Node) -> bool:
    """``node`` multiplies (or divides) ``prev`` by a factor without broadcasting it larger: linear in ``prev``,
    so a partial sum stays one (Qwen2-MoE's shared expert times the sigmoid of its [1, h] gate)."""
    if node.target not in (aten.mul.Tensor, aten.div.Tensor) or (node.target is aten.div.Tensor and
                                                                  node.args[0] is not prev):
        return False
    a, b = (getattr(x, "meta", {}).get("val") for x in (prev, node))
    return a is not None and b is not None and tuple(a.shape) == tuple(b.shape)


def _summed_with(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """The add (or sub) that ``node``'s value reaches as its only reader, through views, copies and scales, and
    the add's operand on that way. A dtype check (``_assert_tensor_metadata``, which export adds before a
    ``.to(dtype)``: HY-V4's ``moe_ffn(x).to(float32)``) reads nothing."""
    def readers(n):
        return [u for u in n.users if u.op == "output" or u.meta.get("val") is not None]

    while len(readers(node)) == 1:
        prev, node = node, readers(node)[0]
        if node.target in _SUM:
            return node, prev
        if node.target not in _PASS and not _scales(node, prev):
            return None
    return None


def _accumulated_into(node: torch.fx.Node) -> torch.fx.Node | None:
    """The last ``index_add`` of the running sum ``node``'s rows are added into (through views, copies, scales and
    an unrolled loop's ``where(mask[i], rows, 0)``; the sum a chain of index_adds, each the next one's only
    reader): an eager MoE's experts added back to their tokens one after another (mcompile/capture/loops.py), or
    None."""
    def readers(n):  # (checks of a value, _assert_tensor_metadata, read nothing)
        return [u for u in n.users if u.op == "output" or u.meta.get("val") is not None]

    while len(readers(node)) == 1:
        prev, node = node, readers(node)[0]
        if node.target is aten.index_add.default and len(node.args) > 3 and node.args[3] is prev:
            while len(readers(node)) == 1 and readers(node)[0].target is aten.index_add.default and \
                    readers(node)[0].args[0] is node:
                node = readers(node)[0]
            return node
        selected = node.target is aten.where.ScalarOther and node.args[1] is prev and node.args[2] == 0
        if node.target not in _PASS and not _scales(node, prev) and not selected:
            return None
    return None


def _merge_sums(names: list[str], nodes: dict) -> list[str]:
    """Exits whose values are added together before anything else reads them leave as one: Megatron sums the
    partial outputs and reduces once (an MoE layer's routed experts plus its shared expert; experts added into
    one running sum of their tokens' rows, :func:`_accumulated_into`)."""
    groups = {nodes[k]: k for k in names}
    by_sum: dict = {}
    for n in list(groups):
        r = _accumulated_into(n)
        if r is not None:
            by_sum.setdefault(r, []).append(n)
    for r, ns in by_sum.items():
        groups[r] = "+".join(groups.pop(n) for n in ns)
    merged = True
    while merged:
        merged = False
        by_sum: dict = {}
        for n in groups:
            s = _summed_with(n)
            if s is not None:
                by_sum.setdefault(s[0], []).append((n, s[1]))
        for s, ways in by_sum.items():
            if len(ways) == 2 and ways[0][1] is not ways[1][1]:  # the add's two operands, one from each
                (a, _), (b, _) = ways
                groups[s] = f"{groups.pop(a)}+{groups.pop(b)}"
                merged = True
                break
    return list(groups.values())


_GATE_OPS = {aten.sigmoid.default, aten.silu.default, aten.gelu.default, aten.tanh.default, aten.relu.default,
             aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.contiguous.default, aten.dropout.default,
             aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _gate_projection(mul: torch.fx.Node, exit_value: torch.fx.Node, whole: frozenset) -> torch.fx.Node | None:
    """The projection of the residual stream that gates an exit's output elementwise (RWKV's channel mix:
    ``sigmoid(receptance(x)) * value(k)``): ``mul``'s other operand, a same-shape gate computed by pointwise
    ops from a linear whose input comes from no other contraction. Megatron has no such construct: the gate's
    projection, sharded as every weight is, is a tp region of its own that leaves at the product (one more
    exit; kept whole it would save that collective by computing the whole projection on every rank)."""
    from mcompile.sharding.planner import _after_contraction

    if mul.target not in (aten.mul.Tensor, aten.multiply.Tensor) or len(mul.args) != 2:
        return None
    gate = mul.args[1] if mul.args[0] is exit_value else mul.args[0]
    out = mul.meta.get("val")
    if not isinstance(gate, torch.fx.Node) or out is None or \
            tuple(getattr(gate.meta.get("val"), "shape", ())) != tuple(out.shape):
        return None
    while gate.op == "call_function" and gate.target in _GATE_OPS:
        gate = gate.args[0]
    w = _weight_of(gate) if gate.op == "call_function" else None
    if w is None or w.name in whole or _after_contraction(_activation_of(gate), whole):
        return None
    return gate


def _gated(node: torch.fx.Node, whole: frozenset) -> torch.fx.Node | None:
    """The gate projection (:func:`_gate_projection`) that multiplies an exit's output on its way (through views,
    copies and its bias) to the residual sum, or None."""
    while len(node.users) == 1:
        prev, node = node, next(iter(node.users))
        if node.target in (aten.mul.Tensor, aten.multiply.Tensor):
            return _gate_projection(node, prev, whole)
        if node.target not in _PASS and not (node.target is aten.add.Tensor and any(
                isinstance(a, torch.fx.Node) and a.op == "placeholder" and a.meta["val"].ndim == 1
                for a in node.args)):
            return None
    return None


def tp_exits(gm: torch.fx.GraphModule, whole: frozenset = frozenset()) -> dict[int, list[str]]:
    """Per layer, what leaves a tp region in Megatron's layout: a projection whose input is computed from
    another contraction (attention's output projection, an MLP's down projection), or an MoE layer. A
    projection whose weight is kept whole (``whole``: a low-rank latent, :func:`mcompile.sharding.planner.latent_hints`;
    an MoE router, :func:`mcompile.sharding.planner.router_hints`) is not a region: what reads its replicated output
    enters one (MLA's q_b / kv_b; Llama-4's experts, whose input is scaled by the router's scores). Exits
    summed before any other use count once ("a+b": an MoE layer's routed and shared experts). A projection of
    the stream gating an exit's output elementwise is one more exit (:func:`_gate_projection`)."""
    from mcompile.ir.moe import moe_ffn
    from mcompile.sharding.planner import _after_contraction

    out: dict[int, list[str]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is moe_ffn and layer_index(node) is not None:
            out.setdefault(layer_index(node), []).append(node.name)  # experts' down projections, summed
            continue
        if node.op != "call_function" or _weight_of(node) is None:
            continue
        layer = layer_index(node)
        if layer is None:
            continue
        if _after_contraction(_activation_of(node), whole):
            out.setdefault(layer, []).append(node.name)
            gate = _gated(node, whole)
            if gate is not None:  # the gate's own region leaves at the product
                out[layer].append(gate.name)
    nodes = {n.name: n for n in gm.graph.nodes}
    return {layer: _merge_sums(names, nodes) for layer, names in out.items()}


def _whole_reason(w: torch.fx.Node, latents: dict, routers: dict, kv: dict, mixers: frozenset = frozenset(),
                  selectors: frozenset = frozenset(), banks: frozenset = frozenset(),
                  looked_up: frozenset = frozenset(), streams: frozenset = frozenset()) -> str | None:
    if w.name in kv:
        return "fewer key/value heads than tp ranks: the key/value projection kept whole on every rank"
    if w.name in mixers:
        return "fewer B/C groups than tp ranks: the mixer's fused in_proj kept whole on every rank"
    if 1 in tuple(w.meta["val"].shape):
        return "a projection to one output (a scalar gate): nothing to split over tp"
    if w.name in latents:
        return "a low-rank latent projection kept whole (as Megatron's multi-head latent attention)"
    if w.name in routers:
        return "an MoE router (one output per expert: kept whole, as Megatron does)"
    if w.name in selectors:
        return ("a token selector's projection (a top-k over per-head scores summed over the heads: DeepSeek sparse "
                "attention's indexer) kept whole, as DeepSeek's tensor-parallel inference does")
    if w.name in streams:
        return ("a hyper-connection's mixing projection (the residual streams to the few weights that mix them) kept "
                "whole, as the streams are")
    if w.name in banks:
        return ("a bank of score-bias profiles every head mixes (relative logits) kept whole: each rank mixes it "
                "for its own heads, no collective")
    if w.name in looked_up:
        return ("a relative-position bias projection of the hidden states, buckets x heads with the buckets outer, "
                "looked up per (query, key) pair (ProphetNet's n-gram attention) kept whole: each rank takes its "
                "heads of the looked-up bias, no collective (split by columns, a rank would hold buckets, not heads)")
    return None


def check_quality(compiled) -> list[Finding]:
    """The plan's findings against Megatron's layout (empty: Megatron's layout). Only tp is checked."""
    from mcompile.sharding.mixer_hints import few_groups
    from mcompile.sharding.planner import (
        bias_bank_hints,
        gathered_bias_hints,
        kv_hints,
        kv_sliced,
        latent_hints,
        router_hints,
        selector_hints,
        stream_mix_hints,
    )

    mesh = compiled.mesh
    if "tp" not in mesh.axis_names or mesh.size("tp") <= 1:
        return []
    plan, cap = compiled.plan, compiled.captured
    sp = plan.options.sequence_parallel
    latents, routers, selectors = latent_hints(cap), router_hints(cap), frozenset(selector_hints(cap))
    banks, streams = frozenset(bias_bank_hints(cap)), frozenset(stream_mix_hints(cap))
    looked_up = frozenset(gathered_bias_hints(cap))
    exits = tp_exits(cap.gm, frozenset(latents) | frozenset(routers) | selectors | streams)
    raw: list[tuple[int, str, tuple, str]] = []  # layer, kind, what alike layers share, text
    per_layer: dict[int, list] = {}
    for spec in plan.collectives:
        if spec.axis == "tp" and spec.layer is not None and spec.forward != "none":
            per_layer.setdefault(spec.layer, []).append(spec)
    nodes = {n.name: n for n in cap.gm.graph.nodes}
    for layer, specs in sorted(per_layer.items()):
        # a norm's statistics over tp-sharded features (OLMo-2's q/k norm over all heads: a mean of [b, s, 1]
        # all-reduced) are the model's, not the layout's: any tp layout of that norm reduces them
        stats = [s for s in specs if getattr(nodes.get(s.origin), "target", None) in _STATISTICS]
        specs = [s for s in specs if s not in stats]
        bar = len(exits.get(layer, ())) * (2 if sp else 1)
        if len(specs) > bar:
            moved = ", ".join(f"{s.forward} of {s.origin}" for s in specs)
            kinds = (bar, tuple(s.forward for s in specs))
            picked = [s.origin for s in specs
                      if s.forward == "all_gather" and _indexed_along(nodes.get(s.origin), s.dim)]
            why = f"; {', '.join(picked[:3])}{' ...' if len(picked) > 3 else ''} gathered to be indexed one entry at " \
                  "a time along the split dim (select: a Python loop over heads or channels, which no tp placement " \
                  "survives; written as one op over that dim, it stays split)" if picked else ""
            raw.append((layer, "collectives", kinds, f"{len(specs)} forward tp collectives where Megatron runs {bar} "
                                              f"({len(exits.get(layer, ()))} tp region exits"
                                              f"{', sequence parallel' if sp else ''}){why}: {moved}"))
    kv = kv_hints(cap, mesh.size("tp"))
    mixers = frozenset(lin.args[1].name for lin in few_groups(cap, mesh.size("tp")))
    tp_i = mesh.axis_names.index("tp")
    sliced = kv_sliced(cap, mesh.size("tp"))
    for node in cap.gm.graph.nodes:
        # a key/value projection kept whole is Megatron's only if each rank then attends its own query heads
        if node.op == "call_function" and node.target is aten.scaled_dot_product_attention.default and \
                layer_index(node) is not None and any(a.name in sliced for a in node.all_input_nodes):
            p = (plan.activations.get(node.name) or (None,) * len(mesh.axis_names))[tp_i]
            if not is_shard(p):
                raw.append((layer_index(node), "whole attention", (), f"attention {node.name} runs whole on every "
                            "tp rank (its key/value projection is kept whole, but its query heads are not split)"))
    seen = set()
    for node in cap.gm.graph.nodes:
        w = _weight_of(node) if node.op == "call_function" else None
        layer = layer_index(node) if w is not None else None
        if layer is None:
            continue
        fqn = cap.params.get(w.name)
        if fqn is None or fqn in seen or w.meta["val"].ndim != 2 or fqn not in plan.params:
            continue
        seen.add(fqn)
        p = plan.params[fqn].placements[tp_i]
        if is_shard(p) or not isinstance(p, Replicate) or \
                _whole_reason(w, latents, routers, kv, mixers, selectors, banks, looked_up, streams):
            continue
        short = fqn.split(f".{layer}.", 1)[-1]
        shape = tuple(w.meta["val"].shape)
        raw.append((layer, "whole weight", (short,), f"{short} ({shape}) is whole on every tp rank"))
    grouped: dict[tuple, tuple[list[int], str]] = {}  # alike layers: one finding, the first layer's text
    for layer, kind, key, text in raw:
        grouped.setdefault((kind, key), ([], text))[0].append(layer)
    return [Finding(tuple(layers), kind, text) for (kind, _), (layers, text) in grouped.items()]


def _indexed_along(node, dim) -> bool:
    """Whether ``node``'s value is read by ``select`` along ``dim`` (Zamba's ``x[head]`` in a loop over heads)."""
    if node is None or dim is None or not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    nd = node.meta["val"].ndim
    return any(u.op == "call_function" and u.target is aten.select.int and u.args[0] is node and
               u.args[1] % nd == dim % nd for u in node.users)


def warn_quality(compiled, stacklevel: int = 3) -> list[Finding]:
    findings = check_quality(compiled)
    if findings:
        warnings.warn("the plan is not Megatron's tensor-parallel layout (mcompile.sharding.quality):\n  " +
                      "\n  ".join(map(str, findings)), PlanQualityWarning, stacklevel=stacklevel)
    return findings
