"""The cost model's front: a model's profile (:func:`analyse` of a planned model, :class:`Workload` capturing and
planning a model once per tp through the compiler's model passes) and :func:`estimate` / :func:`step_time_expr`,
which price a layout of it with the formulas of :mod:`mcompile.cost.model`.

The layers (tests/test_layers.py): ``mcompile.cost.model`` holds what is priced and how — layouts, efficiencies, the
profile's types, collective and pipeline formulas, step terms, memory — and imports no pass, so the passes that
price a choice (cp attention, collective matmul) use it; this module plans models, so it sits above the compiler.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from functools import cached_property
from typing import Any

import sympy
import torch
import torch.fx as fx

from mcompile.cost.hardware import Hardware, get_hardware
from mcompile.cost.model import (
    BATCH,
    CP_VARIANTS,
    GLOBAL_BATCH,
    MESH_ORDER,
    RECOMPUTE_MODES,
    SEQ,
    CommOp,
    Efficiency,
    Estimate,
    Layout,
    ModelProfile,
    MoEProfile,
    OpCost,
    Recompute,
    Section,
    Sections,
    activation_budget,
    cost_settings,
    log,
    matmul_flops,
    node_category,
    op_class,
    plain_number,
    price_ranks,
    resolve_precision,
    step_terms,
    validate_layout,
)
from mcompile.ir import memory_model as MM
from mcompile.ir.annotate import layer_index, layer_path, node_cost
from mcompile.ir.meta import ATTENTION_CORE, BYTES_READ, BYTES_WRITTEN, FLOPS, OUT_BYTES
from mcompile.ir.placements import BlockShard, Partial, Shard

__all__ = ["Workload", "analyse", "estimate", "step_time_expr", "check_plan_matches", "example_seq"]


def _is_sharded(p) -> bool:
    if isinstance(p, tuple):
        return any(_is_sharded(x) for x in p)
    return isinstance(p, (Shard, BlockShard))


def _is_partial(p) -> bool:
    if isinstance(p, tuple):
        return any(_is_partial(x) for x in p)
    return isinstance(p, Partial)


def analyse(compiled, *, n_layers: int | None = None, name: str = "", heads: int | None = None,
            kv_heads: int | None = None, seq_len: int | None = None,
            layer_counts: dict[int, int] | None = None) -> ModelProfile:
    """Analyse a :class:`mcompile.api.Compiled` (captured, annotated, planned) into a ModelProfile.

    ``n_layers``: layers of the real model (the capture may hold fewer: each section is the mean of
    the captured layers, scaled by ``n_layers``). ``layer_counts``: how many real layers each captured
    layer stands for, by captured layer index (they sum to ``n_layers``; default: all alike) — a
    model whose first layers are dense and the rest MoE (DeepSeek-V3) captures one of each and
    weights them by their real counts, so the "layer" section is the real model's mean layer.

    Routed experts (``moe_ffn`` nodes, passes/ep/find_moe.py): their forward FLOPs are T·k·(one expert's FFN:
    2·Σ of its weights' sizes), k experts per token, not E (the annotation's, when it has a formula);
    the expert parameters are counted over all E experts (a plan that shards them over ``ep`` is
    multiplied back: ep is applied per layout); their all-to-all dispatch and combine are the plan's
    ``ep`` collectives, or — a plan without ep — what passes/lower.py's all-to-all dispatcher inserts:
    the E int64 counts (forward), and per direction the T·k token rows of d elements (forward and
    backward).

    The work is :class:`_Analysis`'s, in its parts: where each node belongs (sections, layer weights),
    each node's share on one tp rank, the routed experts' facts, ops, collectives, parameters and saved
    activations per section, then the profile."""
    return _Analysis(compiled, n_layers=n_layers, layer_counts=layer_counts).profile(
        name=name, heads=heads, kv_heads=kv_heads, seq_len=seq_len)


class _Analysis:
    """One :func:`analyse` of a planned model: the facts every part shares (the graph's nodes, the section
    and layer weight of each, the tp and ep axes, the routed experts, the parameters per section), gathered
    once at construction, and the parts that price a section from them (:meth:`section`) and assemble the
    profile (:meth:`profile`)."""

    def __init__(self, compiled, *, n_layers: int | None, layer_counts: dict[int, int] | None):
        cap, plan = compiled.captured, compiled.plan
        self.cap, self.plan = cap, plan
        self.tp = plan.mesh.get("tp", 1)
        self.tp_index = list(plan.mesh).index("tp") if "tp" in plan.mesh else None
        self.ep_plan = plan.mesh.get("ep", 1)
        self.ep_index = list(plan.mesh).index("ep") if "ep" in plan.mesh else None
        self.sub = {cap.symbols[k]: v for k, v in (("batch", BATCH), ("seq", SEQ)) if k in cap.symbols}
        self.params_ph = set(cap.params) | set(cap.buffers) | set(cap.constants)
        self._place_nodes(cap.gm)
        self._weigh_layers(n_layers, layer_counts)
        self.gathered = {c.origin for c in plan.collectives if c.forward == "all_gather"}
        self.by_name = {n.name: n for n in self.nodes}
        self._find_experts()
        self._count_params()
        self._find_differentiable()

    # ------------------------------------------------------------------ where each node belongs

    def _place_nodes(self, gm: fx.GraphModule) -> None:
        """Where each node belongs: a layer index, or before ("pre") / after ("post") the layers (``nodes``,
        ``layer_of``, ``section_of``, ``layer_ids``)."""
        nodes = self.nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
        layer_of = self.layer_of = {n: layer_index(n) for n in nodes}
        layered = [i for i, n in enumerate(nodes) if layer_of[n] is not None]
        if not layered:
            raise ValueError("the captured model has no numbered layers (modules like `layers.0`, `h.0`): the cost "
                             "model analyses one transformer block and scales it by the layer count")
        first = layered[0]
        section_of = self.section_of = {}
        for i, n in enumerate(nodes):
            section_of[n] = layer_of[n] if layer_of[n] is not None else ("pre" if i < first else "post")
        self.layer_ids = sorted({v for v in layer_of.values() if v is not None})

    def _weigh_layers(self, n_layers: int | None, layer_counts: dict[int, int] | None) -> None:
        """The share of the real model's mean layer each captured layer stands for (``lw``), and the real
        model's depth (``n_layers``)."""
        layer_ids = self.layer_ids
        n_cap = self.n_cap = len(layer_ids)
        n_layers = self.n_layers = n_layers or n_cap
        if layer_counts is None:
            self.lw = dict.fromkeys(layer_ids, sympy.Rational(1, n_cap))
        else:
            if set(layer_counts) != set(layer_ids) or sum(layer_counts.values()) != n_layers:
                raise ValueError(f"layer_counts={layer_counts} must give every captured layer {layer_ids} a count, "
                                 f"summing to n_layers={n_layers}")
            self.lw = {i: sympy.Rational(Fraction(c).numerator, Fraction(c).denominator) / n_layers
                       for i, c in layer_counts.items()}

    def weight_of(self, n: fx.Node):
        """The weight of node n's work in its section: its layer's share of the mean layer, or 1."""
        return self.lw[self.section_of[n]] if isinstance(self.section_of[n], int) else sympy.Integer(1)

    def is_param(self, n: fx.Node) -> bool:
        """A parameter, buffer or constant placeholder."""
        return n.op == "placeholder" and n.name in self.params_ph

    # ------------------------------------------------------------------ one tp rank's share

    def placement_of(self, n: fx.Node):
        """Node n's placement along tp (a parameter's, or an activation's), or None."""
        plan, tp_index = self.plan, self.tp_index
        if n.op == "placeholder":
            fqn = self.cap.params.get(n.name)
            if fqn is None or tp_index is None:
                return None
            return plan.params[fqn].placements[tp_index]
        placements = plan.activations.get(n.name)
        return None if placements is None or tp_index is None else placements[tp_index]

    def share(self, n: fx.Node) -> sympy.Expr:
        """The share of node n's work one tp rank does."""
        tp = self.tp
        if tp == 1:
            return sympy.Integer(1)
        out = self.placement_of(n)
        if _is_sharded(out) or _is_partial(out):
            return sympy.Rational(1, tp)
        for a in n.all_input_nodes:
            if _is_sharded(self.placement_of(a)) and a.name not in self.gathered:
                return sympy.Rational(1, tp)
        return sympy.Integer(1)

    def local_fraction(self, x: fx.Node, consumer: fx.Node):
        """The share of value x one tp rank holds (for the memory model's saved bytes)."""
        tp, gathered = self.tp, self.gathered
        if tp == 1:
            return sympy.Integer(1)
        if _is_sharded(self.placement_of(x)) and x.name not in gathered:
            return sympy.Rational(1, tp)
        if _is_sharded(self.placement_of(x)) and x.name in gathered and self.plan.options.sp_variant == "regather":
            return sympy.Rational(1, tp)
        return sympy.Integer(1)

    def local_numel(self, fqn: str) -> int:
        """A parameter's elements on one tp rank, all of them along ep (ep is applied per layout), at the
        experts' real width."""
        pp = self.plan.params[fqn]
        n = pp.local_numel
        if self.ep_index is not None and _is_sharded(pp.placements[self.ep_index]):
            n *= self.ep_plan
        return n

    # ------------------------------------------------------------------ the routed experts

    def _find_experts(self) -> None:
        """The routed experts: moe_ffn nodes (``moe_nodes``), their expert weights (``expert_fqns``), and the
        shape facts of each (``moe_facts``)."""
        from mcompile.ir.annotate import to_sympy
        from mcompile.ir.moe import ExpertForm, moe_ffn

        cap = self.cap
        self.moe_nodes = [n for n in self.nodes if n.target is moe_ffn]
        self.expert_fqns: set[str] = set()
        self.moe_facts: dict[fx.Node, dict] = {}
        for n in self.moe_nodes:
            x, idx, _w, *ws = n.args
            xv, iv = x.meta["val"], idx.meta["val"]
            wv = [w.meta["val"] for w in ws]
            form = ExpertForm.parse(n.kwargs["form"])
            E, k, d = int(wv[0].shape[0]), int(iv.shape[1]), int(xv.shape[1])
            f = int(wv[form.n_matrices - 1].shape[form.hidden_dims()[form.n_matrices - 1]])  # the down projection's
            slot = 2 * sum(math.prod(int(s) for s in v.shape[1:]) for v in wv)
            T = sympy.sympify(to_sympy(xv.shape[0])).subs(self.sub)
            fqns = [cap.params.get(w.name) for w in ws]
            self.expert_fqns.update(q for q in fqns if q)
            self.moe_facts[n] = dict(E=E, k=k, d=d, f=f, slot=slot, T=T, form=form, fqns=fqns, elt=xv.element_size(),
                                     full_params=sum(math.prod(int(s) for s in v.shape) for v in wv))

    def moe_op(self, n: fx.Node, weight) -> OpCost:
        """A moe_ffn node on one tp rank (module docstring of :func:`analyse`)."""
        m = self.moe_facts[n]
        T, k, d, elt = m["T"], m["k"], m["d"], m["elt"]
        annotated = sympy.sympify(n.meta.get(FLOPS, 0)).subs(self.sub)
        flops = annotated if annotated != 0 else T * k * m["slot"]
        sh = self.share(n)
        f_l = m["f"] * sh  # expert-TP shards each expert's hidden units
        n_first = 1 if m["form"].kind != "sep" else 2  # projections reading the gathered rows
        width = 2 * f_l if m["form"].kind != "plain" else f_l  # what the first projection(s) write
        w_bytes = sum(self.local_numel(q) for q in m["fqns"] if q) * elt
        acts = (T * k * d * 2  # gather the slots' rows: read, write
                + T * k * (n_first * d + width)  # first projection(s): read rows, write gate/up
                + T * k * (width + f_l)  # activation (× up): read, write
                + T * k * (f_l + d)  # down projection: read, write
                + T * k * d + 2 * T * d)  # weighted, added back to the tokens
        y = acts * elt + w_bytes
        return OpCost(n.name, "gemm", "moe", sympy.expand(flops * sh * weight), sympy.expand(y * weight), True,
                      sympy.expand(flops * weight), float(w_bytes * weight))

    def moe_profile(self) -> MoEProfile | None:
        """The routed experts' shape, over the real model's layers (None: no moe_ffn node)."""
        moe_nodes, moe_facts, lw, section_of = self.moe_nodes, self.moe_facts, self.lw, self.section_of
        if not moe_nodes:
            return None
        m0 = moe_facts[moe_nodes[0]]
        layers_real = float(sum(lw[section_of[n]] for n in moe_nodes if isinstance(section_of[n], int))) * self.n_layers
        full = float(sum(moe_facts[n]["full_params"] * lw[section_of[n]] for n in moe_nodes
                         if isinstance(section_of[n], int))) * self.n_layers
        return MoEProfile(experts=m0["E"], top_k=m0["k"], hidden=m0["d"], expert_hidden=m0["f"],
                          layers=round(layers_real, 6), expert_params=full, slot_flops=m0["slot"],
                          form=m0["form"].text())

    # ------------------------------------------------------------------ a section's ops and collectives

    def ops_of(self, members: list[fx.Node]) -> list[OpCost]:
        """The OpCost of each member with work, on one tp rank, weighted by its layer."""
        sub, out = self.sub, []
        for n in members:
            weight = self.weight_of(n)
            if n in self.moe_facts:
                out.append(self.moe_op(n, weight))
                continue
            f = sympy.sympify(n.meta.get(FLOPS, 0)).subs(sub)
            y = sympy.sympify(n.meta.get(BYTES_READ, 0) + n.meta.get(BYTES_WRITTEN, 0)).subs(sub)
            if f == 0 and y == 0:
                continue
            cat = node_cost(n).category if isinstance(n.target, torch._ops.OpOverload) else "other"
            k = self.share(n)
            wgrad = op_class(cat) == "gemm" and any(self.is_param(a) for a in n.all_input_nodes)
            out.append(OpCost(n.name, op_class(cat), cat, sympy.expand(f * k * weight), sympy.expand(y * k * weight),
                              wgrad, sympy.expand(f * weight)))
        return out

    def ep_comms(self) -> list[tuple]:
        """(layer, kind, bytes, phase, purpose) of every MoE collective over ep (docstring)."""
        out = []
        if self.ep_index is not None:
            for c in self.plan.collectives:
                if c.axis != "ep" or not c.purpose.startswith("moe"):
                    continue
                b = sympy.sympify(c.bytes, locals={"batch": BATCH, "seq": SEQ})
                for phase, kind in (("forward", c.forward), ("backward", c.backward)):
                    if kind in ("all_to_all", "all_gather", "reduce_scatter", "all_reduce"):
                        out.append((c.layer, kind, b, phase, c.purpose))
            return out
        for n in self.moe_nodes:
            m = self.moe_facts[n]
            layer = self.section_of[n]
            rows = m["T"] * m["k"] * m["d"] * m["elt"]
            out.append((layer, "all_to_all", sympy.Integer(8 * m["E"]), "forward", "moe: tokens per expert"))
            for purpose in ("moe: dispatch", "moe: combine"):
                for phase in ("forward", "backward"):
                    out.append((layer, "all_to_all", sympy.expand(rows), phase, purpose))
        return out

    def comms_of(self, key) -> list[CommOp]:
        """The tp collectives, then the ep ones, of section ``key`` ("layer": weighted by their layer)."""
        lw, n_cap, out = self.lw, self.n_cap, []
        for c in self.plan.collectives:
            if c.axis != "tp":
                continue
            origin = self.by_name.get(c.origin)
            where = c.layer if c.layer is not None else (self.section_of.get(origin, "post") if origin else "post")
            if (key == "layer" and not isinstance(where, int)) or (key != "layer" and where != key):
                continue
            b = sympy.sympify(c.bytes, locals={"batch": BATCH, "seq": SEQ})
            w = lw.get(where, sympy.Rational(1, n_cap)) if key == "layer" else sympy.Integer(1)
            for phase, kind in (("forward", c.forward), ("backward", c.backward)):
                kind = {"all_reduce_max": "all_reduce"}.get(kind, kind)
                if kind in ("all_reduce", "all_gather", "reduce_scatter"):
                    out.append(CommOp(kind, "tp", b, phase, c.purpose, w))
        for layer, kind, b, phase, purpose in self.ep_comms():
            if (key == "layer") != isinstance(layer, int) or (key != "layer" and layer != key):
                continue
            w = lw.get(layer, sympy.Rational(1, n_cap)) if key == "layer" else sympy.Integer(1)
            out.append(CommOp(kind, "ep", b, phase, purpose, w))
        return out

    # ------------------------------------------------------------------ parameters

    def _count_params(self) -> None:
        """Parameters per section, on one tp rank: layers by module path (the mean layer's ``layer_params``,
        ``layer_experts`` of them the routed experts'), the rest by the section that uses them (``pre_params``,
        ``post_params``; ``tied``: used both before and after the layers)."""
        cap, nodes, section_of, lw = self.cap, self.nodes, self.section_of, self.lw
        layer_paths = {i: {layer_path(n) for n in nodes if self.layer_of[n] == i} for i in self.layer_ids}
        used_by: dict[str, set] = {}
        for n in nodes:
            for a in n.all_input_nodes:
                if a.op == "placeholder" and a.name in cap.params:
                    used_by.setdefault(cap.params[a.name], set()).add("layer" if isinstance(section_of[n], int)
                                                                      else section_of[n])
        layer_sum = layer_experts_sum = sympy.Integer(0)  # exact: the mean layer's parameters
        pre_params = post_params = tied = 0
        for fqn in self.plan.params:
            n_local = self.local_numel(fqn)
            owner = next((i for i, ps in layer_paths.items() if any(p and fqn.startswith(p + ".") for p in ps)), None)
            if owner is not None:
                layer_sum += n_local * lw[owner]
                if fqn in self.expert_fqns:
                    layer_experts_sum += n_local * lw[owner]
                continue
            users = used_by.get(fqn, {"post"})
            if "pre" in users:
                pre_params += n_local
            if "post" in users or "layer" in users:
                post_params += n_local
            if "pre" in users and ("post" in users or "layer" in users):
                tied += n_local
        self.layer_params, self.layer_experts = float(layer_sum), float(layer_experts_sum)
        self.pre_params, self.post_params, self.tied = pre_params, post_params, tied

    # ------------------------------------------------------------------ saved activations, node counts

    def _find_differentiable(self) -> None:
        """The aten calls autograd records (an input is a parameter or such a node): ``differentiable``."""
        self.differentiable: set = set()
        for n in self.nodes:
            if any((a.op == "placeholder" and a.name in self.cap.params) or a in self.differentiable
                   for a in n.all_input_nodes):
                self.differentiable.add(n)

    def needs_grad(self, a: fx.Node) -> bool:
        """A value autograd records a gradient for."""
        return (a.op == "placeholder" and a.name in self.cap.params) or a in self.differentiable

    def acts(self, members: list[fx.Node], weight, mode: str) -> sympy.Expr:
        """The bytes members save for backward under recompute ``mode``, weighted."""
        sub = self.sub
        rec = ()
        if mode == "full":
            rec = members
        elif mode == "selective":
            rec = [n for n in members if op_class(node_category(n)) == "attention" or node_category(n) == "softmax"
                   or n.meta.get(ATTENTION_CORE)]
        keep = lambda x: BATCH in sympy.sympify(x.meta.get(OUT_BYTES, 0)).subs(sub).free_symbols  # noqa: E731
        e = MM.saved_for_backward(members, is_param=self.is_param, local_fraction=self.local_fraction,
                                  recomputed=rec, keep_input=keep, needs_grad=self.needs_grad)
        if mode != "full":  # what the experts keep (saved_for_backward sees the moe_ffn node as one opaque call)
            e = e + sympy.Add(*[MM.moe_saved_bytes(n, hidden_share=self.share(n))
                                for n in members if n in self.moe_facts])
        return sympy.expand(e.subs(sub) * weight)

    def node_counts(self, members: list[fx.Node]) -> tuple[float, float]:
        """The members' aten calls, and those autograd records, weighted by their layer."""
        calls = [n for n in members if isinstance(n.target, torch._ops.OpOverload)]
        return (float(sum(self.weight_of(n) for n in calls)),
                float(sum(self.weight_of(n) for n in calls if n in self.differentiable)))

    # ------------------------------------------------------------------ the profile

    def section(self, key) -> Section:
        """Section ``key`` ("layer": the real model's mean layer, "pre", "post")."""
        nodes, section_of, layer_ids = self.nodes, self.section_of, self.layer_ids
        if key == "layer":
            members = [n for n in nodes if isinstance(section_of[n], int)]
            # each layer on its own: a recomputed region is one layer (its input kept), never two
            groups = [[n for n in members if section_of[n] == i] for i in layer_ids]
            a = {m: sympy.Add(*[self.acts(g, self.lw[i], m) for i, g in zip(layer_ids, groups)])
                 for m in RECOMPUTE_MODES}
        else:
            members = [n for n in nodes if section_of[n] == key]
            a = dict.fromkeys(RECOMPUTE_MODES, self.acts(members, sympy.Integer(1), "none"))
        params = {"layer": self.layer_params, "pre": self.pre_params, "post": self.post_params}[key]
        return Section(tuple(self.ops_of(members)), tuple(self.comms_of(key)), params, a, *self.node_counts(members),
                       expert_params=self.layer_experts if key == "layer" else 0)

    def profile(self, *, name: str, heads: int | None, kv_heads: int | None, seq_len: int | None) -> ModelProfile:
        """The ModelProfile: the three sections, the routed experts, and the model's shape."""
        cap, plan, nodes = self.cap, self.plan, self.nodes
        moe = self.moe_profile()
        hidden, vocab, q_heads, k_heads = _shapes(nodes, cap, plan)
        # bytes per element of the residual stream (pipeline messages): the embedding output's dtype
        emb = next((n for n in nodes if getattr(n.target, "overloadpacket", None) is torch.ops.aten.embedding), None)
        val = emb.meta.get("val") if emb is not None else None
        act_bytes = val.element_size() if isinstance(val, torch.Tensor) else 2
        return ModelProfile(
            name=name or cap.model_name or plan.model, n_layers=self.n_layers, hidden=hidden,
            heads=heads or q_heads, kv_heads=kv_heads or k_heads or heads or q_heads, vocab=vocab, seq_len=seq_len,
            tp=self.tp, sequence_parallel=plan.options.sequence_parallel, sp_variant=str(plan.options.sp_variant),
            layer=self.section("layer"), pre=self.section("pre"), post=self.section("post"), tied_params=self.tied,
            activation_bytes=act_bytes, param_shapes={f: tuple(p.shape) for f, p in plan.params.items()}, moe=moe,
        )


def _shapes(nodes, cap, plan) -> tuple[int, int | None, int | None, int | None]:
    """hidden (embedding width), vocabulary (embedding rows), query and key heads (first SDPA)."""
    hidden = vocab = qh = kh = None
    for n in nodes:
        pk = getattr(n.target, "overloadpacket", None)
        if pk is torch.ops.aten.embedding and vocab is None:
            w = n.args[0]
            fqn = cap.params.get(w.name) if isinstance(w, fx.Node) else None
            if fqn is not None:
                shape = plan.params[fqn].shape
                if vocab is None or shape[0] > vocab:
                    vocab, hidden = shape[0], shape[1]
        if pk is torch.ops.aten.scaled_dot_product_attention and qh is None:
            q, k = n.args[0].meta["val"], n.args[1].meta["val"]
            qh, kh = int(q.shape[-3]), int(k.shape[-3])
    if hidden is None:
        raise ValueError("could not find the model's hidden size (no embedding of a parameter table)")
    return hidden, vocab, qh, kh


class Workload:
    """A model for the cost model: captured on the meta device ONCE (canonicalised and annotated), planned and
    lowered per (tp, sequence parallel) on that one graph, analysed (:func:`analyse`), cached. The search's
    workload (:class:`mcompile.search.SearchWorkload`) is one, so the search and :func:`estimate` price from the
    same profiles.

    ``Workload.from_preset("llama3-70b")`` captures a 2-layer version of the preset and scales by
    its layer count. ``Workload(model, example_inputs, n_layers=...)`` takes any model whose
    forward returns the loss; ``n_layers`` defaults to the captured layers; ``Workload.of(module, inputs)``
    captures a 2-block copy of a deep module. Build one Workload and reuse it: each new (tp, sp) costs one
    plan (well under a second)."""

    def __init__(self, model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict | None = None, *,
                 n_layers: int | None = None, name: str = "", heads: int | None = None, kv_heads: int | None = None,
                 seq_len: int | None = None, dtype: torch.dtype = torch.bfloat16,
                 layer_counts: dict[int, Fraction] | None = None):
        self.model, self.example_inputs, self.example_kwargs = model, example_inputs, example_kwargs
        self.n_layers, self.name, self.heads, self.kv_heads = n_layers, name, heads, kv_heads
        self.seq_len, self.dtype = seq_len, dtype
        self.layer_counts = layer_counts  # real layers per captured layer (analyse's layer_counts); None: alike
        self._profiles: dict[tuple[int, bool], ModelProfile] = {}
        self._compiled: dict[tuple[int, bool], object] = {}  # (tp, sp) -> the planned
                                                             # mcompile.sharding.compiled.Compiled

    @classmethod
    def from_preset(cls, preset, *, capture_layers: int = 2, dtype: torch.dtype = torch.bfloat16) -> Workload:
        """A preset (name or :class:`mcompile.models.presets.Preset`) captured with ``capture_layers``
        layers on the meta device and scaled to its real depth.

        A model whose first ``first_dense_layers`` layers are dense and the rest MoE (DeepSeek-V3: 3 of
        61) is captured with both kinds — ``min(first_dense_layers, capture_layers - 1)`` dense layers
        (at least 1) and the rest MoE (at least 1) — and each captured layer stands for its kind's real
        count (:func:`analyse`'s ``layer_counts``): DeepSeek-V3 at the default 2 captures 1 dense layer
        (weight 3) and 1 MoE layer (weight 58)."""
        from mcompile.models.gpt import GPTConfig
        from mcompile.models.presets import Preset, get_preset

        p: Preset = get_preset(preset) if isinstance(preset, str) else preset
        cfg = p.config
        counts = None
        if isinstance(cfg, GPTConfig):
            depth, heads, kv = cfg.n_layer, cfg.n_head, cfg.n_head
            small = dataclasses.replace(p, config=dataclasses.replace(cfg, n_layer=min(capture_layers, depth)))
        else:
            depth, heads, kv = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads
            fields = {"n_layers": min(capture_layers, depth)}
            dense = getattr(cfg, "first_dense_layers", 0)
            if 0 < dense < depth:  # dense layers, then MoE ones: capture both kinds, weighted by their real counts
                dense_cap = max(1, min(dense, capture_layers - 1))
                n_cap = max(fields["n_layers"], dense_cap + 1)
                fields = {"n_layers": n_cap, "first_dense_layers": dense_cap}
                counts = {i: Fraction(dense, dense_cap) if i < dense_cap else Fraction(depth - dense, n_cap - dense_cap)
                          for i in range(n_cap)}
            small = dataclasses.replace(p, config=dataclasses.replace(cfg, **fields))
        model = small.build("meta", dtype)
        inputs = small.example_inputs(batch=2, seq=min(16, p.max_seq_len), device="meta")
        return cls(model, inputs, n_layers=depth, name=p.name, heads=heads, kv_heads=kv, seq_len=p.max_seq_len,
                   dtype=dtype, layer_counts=counts)

    @classmethod
    def from_compiled(cls, compiled, *, n_layers: int | None = None, name: str = "") -> Workload:
        """The Workload of an already planned model: its own (tp, sp) only."""
        w = cls(None, (), n_layers=n_layers, name=name)
        prof = analyse(compiled, n_layers=n_layers, name=name)
        w._profiles[(prof.tp, prof.sequence_parallel)] = prof
        return w

    @cached_property
    def captured(self):
        """The model captured ONCE on the meta device, canonicalised (attention too: a causal mask made from sizes
        becomes ``is_causal``) and annotated: the model passes up to ``annotate`` (mcompile.compiler.plan_model,
        no block repetition, no checks); each (tp, sp) re-plans this graph."""
        from mcompile.compiler import ModelState, PlanRequest, plan_model
        from mcompile.ir.mesh import Mesh

        request = PlanRequest(meta_dtype=self.dtype, repeat_blocks=False, checks=False)
        self._state = plan_model(ModelState(self.model, Mesh.fake(tp=1), tuple(self.example_inputs),
                                            self.example_kwargs, request), upto="annotate")
        return self._state.cap

    def compiled(self, tp: int, sequence_parallel: bool = False):
        """The planner's plan of the captured graph at this tp (a :class:`mcompile.sharding.compiled.Compiled`): the
        model
        passes from ``plan_axes`` to ``record_collectives`` on the shared graph."""
        key = (tp, bool(sequence_parallel and tp > 1))
        if key not in self._compiled:
            from mcompile.compiler import plan_model
            from mcompile.ir.mesh import Mesh

            self.captured  # noqa: B018  (captured once)
            st = self._state.replan(Mesh.fake(tp=tp), sequence_parallel=key[1])
            self._compiled[key] = plan_model(st, start="plan_axes", upto="record_collectives").compiled
        return self._compiled[key]

    def profile(self, tp: int = 1, sequence_parallel: bool = False) -> ModelProfile:
        key = (tp, bool(sequence_parallel and tp > 1))
        if key not in self._profiles:
            if self.model is None:
                have = ", ".join(f"tp={t}{' sp' if s else ''}" for t, s in self._profiles)
                raise ValueError(f"this Workload was made from one compiled plan ({have}); to price tp={tp} "
                                 f"sp={key[1]}, build it from the model: Workload(model, example_inputs)")
            self._profiles[key] = analyse(self.compiled(*key), n_layers=self.n_layers, name=self.name,
                                          heads=self.heads, kv_heads=self.kv_heads, seq_len=self.seq_len,
                                          layer_counts=self.layer_counts)
        return self._profiles[key]

    @classmethod
    def of(cls, model, example_inputs=(), example_kwargs=None, *, dtype=torch.bfloat16,
           capture_layers: int = 2) -> Workload:
        """From a preset name or Preset, a Workload, or a module with its example inputs (a deep module: a copy
        of ``capture_layers`` of its blocks captured, scaled to its depth)."""
        from mcompile.models.presets import Preset

        if isinstance(model, cls):
            return model
        if isinstance(model, (str, Preset)):
            return cls.from_preset(model, capture_layers=capture_layers, dtype=dtype)
        if isinstance(model, Workload):
            if model.model is None:
                raise ValueError("this Workload was made from one compiled plan: pricing other layouts needs the "
                                 "model (Workload(model, example_inputs) or a preset)")
            w = cls(model.model, model.example_inputs, model.example_kwargs, n_layers=model.n_layers,
                    name=model.name, heads=model.heads, kv_heads=model.kv_heads, seq_len=model.seq_len,
                    dtype=model.dtype, layer_counts=model.layer_counts)
            w._profiles.update(model._profiles)
            return w
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"a Workload is made of a module, a preset name, a Preset or a Workload, not "
                            f"{type(model).__name__}")
        if not example_inputs and not example_kwargs:
            raise ValueError("a Workload of a module needs example_inputs=(...) (a template: shapes and dtypes)")
        from mcompile.capture.export import CaptureError
        from mcompile.sharding.blocks import analyse as blocks_of

        short, depth = _truncated(model, capture_layers)
        if depth is not None:
            w = cls(short, tuple(example_inputs), example_kwargs, n_layers=depth, dtype=dtype)
            try:  # capture now: the whole model when the cut one fails
                if blocks_of(w.captured.gm, w.captured.params).num_layers == capture_layers:
                    return w
            except (CaptureError, RuntimeError, ValueError, TypeError, IndexError) as e:
                log.info("capturing %d of %d blocks failed (%s): capturing the whole model", capture_layers, depth, e)
        return cls(model, tuple(example_inputs), example_kwargs, dtype=dtype)


def _truncated(model: torch.nn.Module, keep: int = 2) -> tuple[torch.nn.Module, int | None]:
    """A shallow copy of ``model`` keeping ``keep`` blocks of its longest list of same-type blocks
    (:func:`mcompile.sharding.repeat.truncate`) and the original block count; the model itself and None when
    it has no such list."""
    from mcompile.sharding.repeat import truncate

    short = truncate(model, keep)
    return (model, None) if short is None else (short[0], short[2])


def _layout_of(plan_or_layout, model, overrides: dict) -> tuple[Layout, Any, Any]:
    """(layout, model, the Plan or None) of estimate()'s first two arguments."""
    from mcompile.ir.plan import Plan

    if isinstance(plan_or_layout, Layout):
        return (dataclasses.replace(plan_or_layout, **overrides) if overrides else plan_or_layout), model, None
    compiled = None
    if hasattr(plan_or_layout, "captured") and hasattr(plan_or_layout, "plan"):  # an api.Compiled
        compiled, plan = plan_or_layout, plan_or_layout.plan
    elif isinstance(plan_or_layout, Plan):
        plan = plan_or_layout
    else:
        raise TypeError(f"estimate() takes a Layout, a Plan or a compiled plan, not {type(plan_or_layout).__name__}")
    fields = {a: plan.mesh.get(a, 1) for a in MESH_ORDER}
    fields["sequence_parallel"] = plan.options.sequence_parallel
    if fields["cp"] > 1 and getattr(plan.options, "cp_attention", None) in CP_VARIANTS:  # the variant planned
        fields["cp_attention"] = plan.options.cp_attention
    if plan.schedule:
        fields["schedule"] = plan.schedule
    if getattr(plan, "pipeline", None) and plan.pipeline.get("virtual"):  # the partitioner's stage table
        fields["virtual"] = int(plan.pipeline["virtual"])
    fields.update(overrides)
    layout = Layout(**fields)
    if model is None and compiled is not None:
        model = Workload.from_compiled(compiled)
    return layout, model, plan


def example_seq(plan_or_compiled) -> int | None:
    """The sequence length of the example inputs a plan (or compiled plan) was made with: the plan's
    record (:attr:`mcompile.ir.plan.Plan.inputs`), else the capture's size hint of its sequence symbol."""
    plan = getattr(plan_or_compiled, "plan", plan_or_compiled)
    seq = plan.example_batch_seq[1] if getattr(plan, "inputs", None) else None
    cap = getattr(plan_or_compiled, "captured", None)
    if seq is None and cap is not None and "seq" in cap.symbols:
        for name in cap.user_inputs:
            val = cap.placeholder(name).meta.get("val")
            if isinstance(val, torch.Tensor) and val.ndim > 1 and isinstance(val.shape[1], torch.SymInt):
                hint = val.shape[1].node.hint
                if hint is not None:
                    return int(hint)
    return seq


def _workload(model, plan=None) -> Workload:
    if isinstance(model, Workload):
        return model
    if model is None:
        if plan is not None:
            raise ValueError(
                "estimate(plan) needs the model the plan was made from: estimate(plan, model) with the nn.Module "
                "(the plan records its example inputs), a preset name, or a Workload; or price "
                "mc.compile_plan(...), which carries its model")
        raise ValueError("estimate() needs the model: model=Workload(...), a preset name, or pass a compiled plan")
    from mcompile.models.presets import Preset

    if isinstance(model, (str, Preset)):
        return Workload.from_preset(model)
    if isinstance(model, torch.nn.Module):
        if plan is None:
            raise TypeError("estimate(layout, module) needs the example inputs: pass Workload(module, example_inputs)")
        if not plan.inputs:
            raise ValueError("this plan records no example inputs (saved before plans did): pass "
                             "Workload(model, example_inputs) to estimate it")
        # a template of the recorded shapes and dtypes on meta (capture reads no values), captured in bf16
        # as Workload.from_preset does: the same numbers as pricing the plan with its preset's name; a deep model
        # as a 2-block copy, captured once
        template = tuple(torch.zeros(i.shape, dtype=getattr(torch, i.dtype), device="meta") for i in plan.inputs)
        return Workload.of(model, template)
    raise TypeError(f"model={type(model).__name__}: pass a Workload, a preset name, a Preset or an nn.Module")


def _layer_counts(shapes: dict) -> tuple[dict, int]:
    """{fqn with its first index written '#': shape} and the number of layers (the most indices seen
    under one prefix: ``layers.0`` .. ``layers.31`` -> 32)."""
    import re

    folded, indices = {}, {}
    for fqn, shape in shapes.items():
        m = re.search(r"(^|\.)(\d+)(\.|$)", fqn)
        if m is None:
            folded[fqn] = tuple(shape)
            continue
        key = fqn[:m.start(2)] + "#" + fqn[m.end(2):]
        folded.setdefault(key, tuple(shape))
        if folded[key] != tuple(shape):  # layers of different shapes: keep each apart
            folded[fqn] = tuple(shape)
        indices.setdefault(fqn[:m.start(2)], set()).add(int(m.group(2)))
    return folded, max((len(v) for v in indices.values()), default=0)


def check_plan_matches(plan, prof: ModelProfile) -> None:
    """Raise ValueError when ``plan``'s parameters (names and full shapes, layers folded) or depth are
    not those of the model ``prof`` was analysed from: pricing one model's plan with another's
    numbers would be silently wrong."""
    if not prof.param_shapes:
        return
    mine, depth = _layer_counts({f: p.shape for f, p in plan.params.items()})
    theirs, _ = _layer_counts(prof.param_shapes)
    what = (f"the plan ({plan.model or 'a model'}, {len(plan.params)} parameters) and the model given "
            f"({prof.name or 'a model'})")
    missing = sorted(set(mine) - set(theirs))
    extra = sorted(set(theirs) - set(mine))
    differ = sorted(k for k in set(mine) & set(theirs) if mine[k] != theirs[k])
    if missing or extra:
        raise ValueError(f"{what} have different parameters: the plan's {missing[:3]} are not in the model, the "
                         f"model's {extra[:3]} are not in the plan; price a plan with the model it was made from")
    if differ:
        k = differ[0]
        raise ValueError(f"{what} differ in shape: {k} is {list(mine[k])} in the plan and {list(theirs[k])} in the "
                         f"model ({len(differ)} such); price a plan with the model it was made from")
    if depth and prof.n_layers and depth != prof.n_layers:
        raise ValueError(f"{what} differ in depth: the plan has {depth} layers, the model {prof.n_layers}; price a "
                         "plan with the model it was made from")


def estimate(plan_or_layout, model=None, *, hardware: str | Hardware = "h100", global_batch: int,
             seq: int | None = None, precision: str | None = None, param_dtype: str = "bf16", grad_dtype: str = "fp32",
             activations: str = "graph", attention_kernel: str = "flash", efficiency: Efficiency | None = None,
             memory_limit: float | None = None, moe_imbalance: float = 1.0, **layout_fields) -> Estimate:
    """Price a layout: step time, memory of the largest rank, throughput.

    ``plan_or_layout``: a :class:`Layout`; a :class:`mcompile.ir.plan.Plan` (dp/tp/pp from its mesh,
    sequence parallelism from its options; other Layout fields as keywords); or a compiled plan
    (``mc.compile_plan(...)``: also gives the model). ``model``: a :class:`Workload` (reuse it), a
    preset name or Preset. ``seq`` defaults to the model's maximum sequence length.
    ``activations``: "graph" (saved tensors of the captured graph) or "formula" (Korthikanti et al.).
    ``attention_kernel``: "flash" (fused SDPA) or "unfused" (Megatron 2021's bmm-softmax-dropout-bmm).
    ``precision``: matmul precision ("bf16", "fp8" for GEMMs, "fp32"; default: the layout's, else "bf16");
    ``param_dtype``/``grad_dtype``:
    storage of parameters and of the gradients the data-parallel reduction moves.
    ``memory_limit``: bytes per GPU (default: the hardware's HBM): what ``fits`` compares against, and
    the limit under which ``recompute="auto"`` takes its activation budget (:func:`auto_mix`).
    ``moe_imbalance``: expert parallelism's load imbalance, the busiest ep rank's routed slots over the
    mean (1: uniform routing; at most ep): it scales that rank's expert compute and the token bytes of
    its all-to-alls (:func:`section_times`).
    """
    layout, model, plan = _layout_of(plan_or_layout, model, layout_fields)
    layout = resolve_precision(layout, precision)
    precision = layout.precision
    work = _workload(model, plan)
    hw = get_hardware(hardware)
    prof = work.profile(layout.tp, layout.sequence_parallel)
    if plan is not None:
        check_plan_matches(plan, prof)
    # a plan's own example inputs, before a preset's maximum: the sequence it was planned at
    seq = seq or (example_seq(plan_or_layout) if plan is not None else None) or prof.seq_len
    if seq is None:
        raise ValueError("estimate() needs seq= (the model states no maximum sequence length, and no example "
                         "inputs say it)")
    validate_layout(layout, prof, global_batch, seq)
    st = cost_settings(hw, global_batch, seq, precision, param_dtype, grad_dtype, attention_kernel, efficiency,
                       memory_limit, moe_imbalance, activations)
    sec = Sections(prof, layout.microbatch_size, st, ep=layout.ep, cp=layout.cp)
    priced = price_ranks(layout, prof, sec, (math.ceil(prof.n_layers / layout.pp),) * layout.pp, st)
    terms, details, auto = priced.terms, priced.details, priced.auto
    step = sum(terms.values())
    mem = priced.memory_bytes
    mem_d = dict(priced.memory_breakdown)
    stage_info = {"stage": mem_d.pop("stage"), "inflight_microbatches": mem_d.pop("inflight_microbatches")}
    mem_d = {k: float(v) for k, v in mem_d.items()}
    # matmul-class FLOPs per step (all GPUs); recompute="auto": the slowest stage's mix on every layer (as the
    # step time)
    mix = auto[details["slow_stage"]]["mix"] if auto is not None else None
    model_flops, hardware_flops = matmul_flops(layout, prof, global_batch, seq, mix)
    details = {k: float(plain_number(v)) if not isinstance(v, int) else v for k, v in details.items()}
    details.update(stage_info, peak_flops=hw.peak_flops(precision), efficiency=st.eff, activations=activations,
                   memory_limit=st.limit, precision=precision)
    if auto is not None:
        details.update(auto_mix={i: a["mix"] for i, a in auto.items()}, activation_budget=activation_budget(auto))
    return Estimate(layout=layout, hardware=hw, global_batch=global_batch, seq=seq, step_time_s=step,
                    breakdown=terms, memory_bytes=mem, memory_breakdown=mem_d, fits=mem <= st.limit,
                    hardware_flops=hardware_flops, model_flops=model_flops, tokens_per_s=global_batch * seq / step,
                    details=details)


def step_time_expr(layout: Layout, model, *, hardware: str | Hardware = "h100", precision: str | None = None,
                   param_dtype: str = "bf16", grad_dtype: str = "fp32", attention_kernel: str = "flash",
                   efficiency: Efficiency | None = None, moe_imbalance: float = 1.0) -> dict[str, sympy.Expr]:
    """The step-time terms as sympy expressions in ``global_batch`` and ``seq`` (``GLOBAL_BATCH``,
    ``SEQ``), plus their sum under "step_time"."""
    layout = resolve_precision(layout, precision)
    precision = layout.precision
    work = _workload(model)
    hw = get_hardware(hardware)
    prof = work.profile(layout.tp, layout.sequence_parallel)
    if layout.recompute == Recompute.AUTO:
        raise ValueError("recompute='auto' takes its budget from the memory left at given sizes: price it with "
                         "estimate(), not symbolically")
    validate_layout(layout, prof, GLOBAL_BATCH, SEQ)
    st = cost_settings(hw, GLOBAL_BATCH, SEQ, precision, param_dtype, grad_dtype, attention_kernel, efficiency,
                       moe_imbalance=moe_imbalance)
    sec = Sections(prof, layout.microbatch_size, st, ep=layout.ep, cp=layout.cp)
    terms, _ = step_terms(layout, prof, sec, (math.ceil(prof.n_layers / layout.pp),) * layout.pp, st)
    terms = {k: sympy.sympify(v) for k, v in terms.items()}
    terms["step_time"] = sympy.Add(*terms.values())
    return terms
