"""Joint forward + backward programs (DESIGN §5; issue 13).

A per-rank program (or a pipeline stage's) is traced once per input signature into a **joint
graph**: its forward and ``torch.autograd.grad`` of its differentiable outputs, traced together
with ``make_fx`` over fake tensors — the way AOTAutograd builds its joint graph
(``torch._functorch._aot_autograd``: forward + autograd.grad under proxy tracing). mcompile's
collective ops trace through their registered backwards, so every collective of both directions is
a node of one graph. The joint graph is then **partitioned** into

- a forward module: ``primals -> (*outputs, *saved)``;
- a backward module: ``(*saved, *primals it reads, *tangents) -> grads`` (one per primal that
  requires grad, ``None`` where there is none), which recomputes every forward value it needs that
  was not saved (activation recompute *is* the choice of the saved set: passes/remat.py).

and, for zero-bubble schedules, the backward module is split on the graph into the input-gradient
part (B) and the weight-gradient part (W), the values W needs from B handed over as a stash.

The runtime executes these modules with autograd off (:class:`JointExecutable`): it calls forward,
keeps the saved tensors, calls backward with the output gradients, and adds the weight gradients
into its flat buffers itself. Node meta of the program (layer, origin) is carried to the joint
graph through ``node.meta["custom"]`` (``torch.fx.traceback.preserve_node_meta``).
"""

from __future__ import annotations

import collections
import dataclasses
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx import traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from mcompile.ir import meta as M
from mcompile.passes.nodes import fake_args, lazy_module

__all__ = ["JointGraph", "JointProgram", "JointTraceError", "trace_joint", "partition", "split_weight",
           "forward_nodes", "saved_for_policy", "VIEW_OPS", "is_alias", "accumulate_outputs", "ACC_OUTPUT"]

aten = torch.ops.aten

# ops whose output aliases their input: recomputing them costs nothing, saving them costs their base
VIEW_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
            aten.transpose.int, aten.permute.default, aten.expand.default, aten.unsqueeze.default,
            aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims, aten.slice.Tensor, aten.select.int,
            aten.detach.default, aten.alias.default, aten.as_strided.default, aten.split.Tensor,
            aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default, aten.narrow.default,
            aten.view_as_real.default, aten.view_as_complex.default, operator.getitem}


def is_alias(n: fx.Node) -> bool:
    """A view of its first input: free to recompute, and saving it keeps that input's storage. Not so
    for ``getitem`` of a multi-output op (SDPA's (out, logsumexp, ...)): the element is a tensor of its
    own, and saving the op's whole tuple would keep every element alive."""
    if n.target not in VIEW_OPS or not n.all_input_nodes:
        return False
    if n.target is operator.getitem:
        src = n.all_input_nodes[0]
        return src.target in VIEW_OPS  # an element of split / unbind / chunk: a view
    return True


class JointTraceError(RuntimeError):
    """The program's backward cannot be traced into a graph."""


@dataclass
class JointGraph:
    """A traced joint graph and what its inputs and outputs are."""

    gm: fx.GraphModule
    num_primals: int
    num_outputs: int  # forward outputs (flattened), first in the output tuple
    diff_outputs: list[int]  # forward outputs that get a tangent (require grad)
    grad_primals: list[int]  # primals that require grad: the gradients follow the outputs, in this order
    primal_names: list[str]
    tangent_names: list[str]
    constants: list = field(default_factory=list)  # the program's get_attr tensors: the last primals, passed by
    #                                                the runner after the call's own inputs


def _flat(out) -> tuple:
    return tuple(out) if isinstance(out, tuple | list) else (out,)


def _trace_failure(program: fx.GraphModule, e: Exception) -> str:
    """What to tell the user when the joint trace failed: the op (an ``ns::name`` in the error, and
    the program's node whose backward called it), the cause, and the fallback."""
    import re

    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    named = re.findall(r"\b([A-Za-z_]\w*::\w+)", str(e))
    custom = [n for n in program.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
              and n.target.namespace not in ("aten", "prims", "mcompile", "mcompile_kernels")]
    if named:
        op = named[0]
        nodes = [n.name for n in custom if n.target.name().split(".")[0] == op]
        callers = ", ".join(sorted({str(n.target) for n in custom}))
        where = f"the op {op}" + (f" (node {nodes[0]})" if nodes else
                                  (f", reached from the backward of {callers}" if custom else ""))
    else:
        bad = _first_unsupported(program)
        where = f"the op {bad}" if bad else "an op of the program"
    return (f"mcompile could not trace this program's backward into a joint graph: {where}: {type(e).__name__}: "
            f"{text}. Give the op a fake implementation (torch.library register_fake) and trace-safe autograd "
            "formula, or run the model on the eager fallback with Config(execution='autograd'), which runs "
            "forward under autograd")


def _first_unsupported(program: fx.GraphModule) -> str | None:
    """An op of the program that has no fake (meta) implementation, for the error message."""
    for n in program.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            try:
                if not torch._C._dispatch_has_kernel_for_dispatch_key(n.target.name(), "Meta") and \
                        not torch._C._dispatch_has_kernel_for_dispatch_key(n.target.name(),
                                                                           "CompositeImplicitAutograd") and \
                        n.target.namespace not in ("aten", "prims", "mcompile"):
                    return f"{n.target} (node {n.name})"
            except RuntimeError:
                continue
        elif n.op == "call_function" and not isinstance(n.target, torch._ops.OpOverload | torch._ops.OpOverloadPacket) \
                and n.target is not operator.getitem and getattr(n.target, "__module__", "").find("torch") < 0:
            return f"{getattr(n.target, '__qualname__', n.target)} (node {n.name})"
    return None


_SCATTER_OF_VIEW = {torch.ops.aten.slice.Tensor: torch.ops.aten.slice_scatter.default,
                    torch.ops.aten.select.int: torch.ops.aten.select_scatter.default}


def functional_writes(program: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``program`` whose in-place writes into tensors it made itself are functional ops, as
    AOTAutograd's functionalisation makes them: ``x.masked_fill_(m, v)`` becomes ``x2 = masked_fill(x, m, v)``
    and a write into a slice or select of x (HF T5's decoder ids: zeros, then ``ids[..., 1:] = labels[...,
    :-1]``) becomes the functional op on the view scattered back (``slice_scatter``); what reads x after
    the write reads the new value. Traced as is, such a write returns a value nobody reads and the graph
    built from what the outputs need loses it (a silently wrong loss). Writes into inputs and constants (an
    FP8 amax history) stay writes. A write this cannot express raises :class:`JointTraceError`."""
    import copy

    def writes(gm):
        return [n for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "_schema", None)
                is not None and n.target._schema.is_mutable and n.args and isinstance(n.args[0], fx.Node)
                and _base_of(n.args[0]).op not in ("placeholder", "get_attr")]

    if not writes(program):
        return program
    gm = copy.deepcopy(program)
    g = gm.graph
    for n in writes(gm):
        order = {m: i for i, m in enumerate(g.nodes)}
        dst = n.args[0]
        view = dst if dst.op == "call_function" and dst.target in _SCATTER_OF_VIEW else None
        base = view.args[0] if view is not None else dst
        packet, overload = n.target._schema.name.split("::")[1], n.target._overloadname
        functional = getattr(getattr(torch.ops.aten, packet.rstrip("_"), None), overload, None)
        stale = [u for u in base.users if u is not n and u is not view and order[u] < order[n]
                 and any(order[w] > order[n] for w in u.users)]
        if (view is not None and view.args[0].op == "call_function" and view.args[0].target in _SCATTER_OF_VIEW) \
                or (view is None and dst is not base) or functional is None or not packet.endswith("_") or stale:
            raise JointTraceError(
                f"{n.name} ({n.target}) writes in place into a tensor the model made, in a way mcompile's joint "
                "graph cannot rewrite functionally (a view of a view, or a view read after the write): write it "
                "out of place (x = x.masked_fill(...), torch.where, torch.cat) or run with "
                "Config(execution='autograd')")
        value = _functional_value(g, n, functional)
        new = value
        if view is not None:
            with g.inserting_after(value):
                new = g.call_function(_SCATTER_OF_VIEW[view.target], (base, value, *view.args[1:]), dict(view.kwargs))
                new.meta = dict(base.meta)
        later = order[n]
        for u in list(base.users):
            if u not in (n, value, new) and order.get(u, -1) > later:
                u.replace_input_with(base, new)
        if view is not None:
            for u in list(view.users):
                if u not in (n, value, new) and order.get(u, -1) > later:
                    u.replace_input_with(view, value)
        n.replace_all_uses_with(value)
        g.erase_node(n)
    g.eliminate_dead_code()
    gm.recompile()
    return gm


def _functional_value(g: fx.Graph, n: fx.Node, functional) -> fx.Node:
    """The value the in-place write ``n`` leaves in its destination, computed out of place by nodes inserted
    after ``n``: the write's functional op (``masked_fill_`` -> ``masked_fill``), except for ``dst.copy_(src)``.
    Its functional twin ``aten.copy`` has no derivative in autograd (AOTAutograd's functionalisation emits
    it only after autograd has run), so a joint trace through it fails whenever ``src`` requires grad (Hugging
    Face DeepSeek-V3's attention builds its keys by ``copy_`` of two projections into slices of ``new_empty``).
    What a copy leaves is ``src`` cast to the destination's dtype and device and broadcast to its shape, which
    autograd differentiates (the destination's old value gets no gradient: it is overwritten); cloned, so the
    value is a tensor of its own as the destination was (no later write into an input that ``src`` views
    reaches it)."""
    def after(prev: fx.Node, target, args, kwargs=None) -> fx.Node:
        with g.inserting_after(prev):
            node = g.call_function(target, args, kwargs or {})
        node.meta = dict(n.meta)
        return node

    if n.target is not aten.copy_.default:
        return after(n, functional, tuple(n.args), dict(n.kwargs))
    dst, src = n.args[0], n.args[1]
    cast = after(n, aten.type_as.default, (src, dst))
    wide = after(cast, aten.expand_as.default, (cast, dst))
    return after(wide, aten.clone.default, (wide,))


def _base_of(x: fx.Node) -> fx.Node:
    while x.op == "call_function" and x.target in _SCATTER_OF_VIEW:
        x = x.args[0]
    return x


def trace_joint(program: fx.GraphModule, args: list) -> JointGraph:
    """Trace ``program(*args)`` and the gradients of its differentiable outputs with respect to the
    arguments that require grad into one graph. ``args`` are the real (or fake) inputs of one call:
    only their metadata is used. Raises :class:`JointTraceError` naming the op when the program's
    backward cannot be traced (then ``Config(execution="autograd")`` runs it eagerly)."""
    program = functional_writes(program)
    _mark_program_nodes(program)
    # module constants (an FP8 amax history, a fused op's table) become inputs of the trace: one that is
    # changed in place is then changed on the tensor the runtime passes, not on a copy baked into the graph
    consts = lifted_constants(program)
    key = _trace_key(program, list(args), consts)
    if key in _TRACED:  # the same program and signature traced before in this process
        _TRACED.move_to_end(key)
        return _copy_joint(_TRACED[key], [t for _, t in consts])
    from mcompile.passes.joint_blocks import compose

    # repeated layers traced once each (passes/joint_blocks.py), else the whole program
    jg = compose(program, list(args), _trace) if BLOCKS else None
    if jg is None:
        jg = _trace(program, list(args))
    # the memo shares the graph: no pass rewrites a joint graph after its trace (partition and the passes after it
    # make modules of their own), and a later hit gets a copy
    _TRACED[key] = dataclasses.replace(jg, constants=[])
    while len(_TRACED) > _TRACED_MAX:
        _TRACED.popitem(last=False)
    return jg


# Whether trace_joint composes repeated layers from one trace each (passes/joint_blocks.py); off only to compare
# with the whole trace (tests/test_joint_blocks.py)
BLOCKS = True


def _mark_program_nodes(program: fx.GraphModule) -> None:
    for n in program.graph.nodes:  # our meta, carried onto the traced nodes (module docstring)
        if n.op == "call_function":
            n.meta["custom"] = {**n.meta.get("custom", {}), M.LAYER: n.meta.get(M.LAYER),
                                M.ORIGIN: n.meta.get(M.ORIGIN, n.name), M.PROGRAM_NODE: n.name}


def _trace(program: fx.GraphModule, args: list, before_dce=None) -> JointGraph:
    """make_fx of ``program``'s forward and gradients on ``args`` (trace_joint without its cache);
    ``before_dce(gm)`` runs on the traced graph before dead code is removed."""
    _mark_program_nodes(program)
    consts = lifted_constants(program)
    shapes: dict = {}
    n_args = len(args)
    args = list(args) + [t for _, t in consts]

    class _Lifted(fx.Interpreter):
        def get_attr(self, target, a, kw):
            return self._consts[target] if target in self._consts else super().get_attr(target, a, kw)

    def forward(*primals):
        it = _Lifted(program)
        it._consts = {name: primals[n_args + i] for i, (name, _) in enumerate(consts)}
        with fx_traceback.preserve_node_meta():
            return _flat(it.run(*primals[:n_args]))

    def joint(primals):
        outs = forward(*primals)
        diff_idx = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        # the output gradients: a marker node each, made placeholders after the trace (below), so the forward
        # runs once — not once more beforehand only to learn the outputs' shapes (~10% of a program's trace)
        tangents = [_tangent(outs[i]) for i in diff_idx]
        shapes["n_out"], shapes["diff"] = len(outs), diff_idx
        diff = [outs[i] for i in diff_idx]
        req = [p for p in primals if isinstance(p, torch.Tensor) and p.requires_grad]
        grads = torch.autograd.grad(diff, req, tangents, allow_unused=True) if diff and req else [None] * len(req)
        return (*outs, *grads)

    try:
        mode, fake = fake_args(args)  # already fake (a pipeline's shape probe): traced in that mode
        with mode, torch.enable_grad():
            gm = make_fx(joint, tracing_mode="real")(fake)
        _tangents_to_placeholders(gm, fake)
    except Exception as e:  # noqa: BLE001 - re-raised with what to do
        raise JointTraceError(_trace_failure(program, e)) from e
    diff_idx = shapes["diff"]
    if before_dce is not None:
        before_dce(gm)
    gm.graph.eliminate_dead_code()
    meta = dict(gm.meta)
    gm = lazy_module(gm, gm.graph)
    gm.meta.update(meta)
    gm.meta[M.NUM_FWD_OUTPUTS] = shapes["n_out"]
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    primal_names = [n.name for n in phs if n.name.startswith("primals")]
    tangent_names = [n.name for n in phs if n.name.startswith("tangents")]
    grad_primals = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    return JointGraph(gm, len(primal_names), shapes["n_out"], diff_idx, grad_primals, primal_names, tangent_names,
                      [t for _, t in consts])


# Joint graphs traced in this process, by program and input signature (:func:`_trace_key`). A program is traced
# once per signature by its runner (runtime/joint_runner.py); a later ``parallelize`` of the same model and layout in
# the same process (a resumed run, a checkpoint loaded into a fresh module, the probe of another rank's stage)
# builds new runners over equal programs, and tracing is the largest part of their first step (~2 s for a tiny
# two-layer model). Kept as the first caller's graph (no pass rewrites a joint graph after its trace: partition and the
# passes after it build modules of their own; tests/test_joint_blocks.py checks), handed out as copies.
_TRACED: collections.OrderedDict = collections.OrderedDict()
_TRACED_MAX = 64


def _trace_key(program: fx.GraphModule, args: list, consts: list) -> str:
    """What the joint trace of ``program`` on ``args`` depends on: the program's code (every node, target and
    literal argument), the meta the trace carries onto its nodes (layer, origin), and the metadata of the inputs
    and lifted constants (shape, stride, dtype, device, requires_grad; not their values: the trace is on fake
    tensors). Non-tensor arguments by value."""
    import hashlib

    def sig(a):
        if isinstance(a, torch.Tensor):
            return ("t", tuple(a.shape), tuple(a.stride()), str(a.dtype), a.device.type, a.requires_grad)
        return ("v", repr(a))

    h = hashlib.sha256(program.graph.python_code(root_module="self").src.encode())  # the graph, recompiled or not
    h.update(repr([(n.name, sorted(n.meta.get("custom", {}).items(), key=lambda kv: kv[0]))
                   for n in program.graph.nodes if n.op == "call_function"]).encode())
    h.update(repr([sig(a) for a in args]).encode())
    h.update(repr([(name, sig(t)) for name, t in consts]).encode())
    return h.hexdigest()


def _copy_joint(jg: JointGraph, constants: list) -> JointGraph:
    """``jg`` over a copy of its graph (new nodes; their meta dicts copied, the values in them shared, as
    ``copy.deepcopy(graph)`` does) with ``constants`` as the lifted constants."""
    import copy

    gm = lazy_module(jg.gm, copy.deepcopy(jg.gm.graph))
    gm.meta.update(jg.gm.meta)
    return JointGraph(gm, jg.num_primals, jg.num_outputs, list(jg.diff_outputs), list(jg.grad_primals),
                      list(jg.primal_names), list(jg.tangent_names), list(constants))


@torch.library.custom_op("mcompile::joint_tangent", mutates_args=())
def _tangent_op(size: list[int], stride: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Stands for the gradient of an output of this size, stride and dtype while the joint graph is traced:
    each such node becomes a ``tangents_<k>`` placeholder of the joint graph (:func:`_tangents_to_placeholders`).
    Made from the output's metadata, not from the output, so the trace gains no node that reads it."""
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


@_tangent_op.register_fake
def _(size, stride, dtype, device):
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


def _tangent(out: torch.Tensor) -> torch.Tensor:
    return _tangent_op(list(out.shape), list(out.stride()), out.dtype, out.device)


def _tangents_to_placeholders(gm: fx.GraphModule, primals: list) -> None:
    """The traced ``joint(primals)`` as if traced as ``joint(primals, tangents)``: each tangent marker node
    (in order) replaced by a placeholder ``tangents_<k>`` after the primals, and the module's calling
    convention (its pytree codegen) taking the two lists."""
    import torch.utils._pytree as pytree

    g = gm.graph
    marks = [n for n in g.nodes if n.op == "call_function" and n.target is torch.ops.mcompile.joint_tangent.default]
    forward = []  # what was traced before the first output gradient (passes/joint_blocks.py copies it apart)
    for n in g.nodes:
        if marks and n is marks[0]:
            break
        if n.op in ("call_function", "get_attr"):
            forward.append(n.name)
    gm.meta[M.JOINT_FORWARD_NODES] = frozenset(forward)
    last = [n for n in g.nodes if n.op == "placeholder"][-1]
    tangents = []
    for k, mark in enumerate(marks):
        with g.inserting_after(last):
            ph = g.placeholder(f"tangents_{k + 1}")
        ph.meta = {key: v for key, v in mark.meta.items() if key in ("val", "tensor_meta")}
        assert ph.name == f"tangents_{k + 1}", ph.name
        mark.replace_all_uses_with(ph)
        g.erase_node(mark)
        last = ph
        tangents.append(ph.meta.get("val"))
    codegen = g._codegen
    if isinstance(codegen, fx.graph._PyTreeCodeGen):
        info = codegen.pytree_info
        in_spec = pytree.tree_flatten((list(primals), tangents))[1]
        g._codegen = fx.graph._PyTreeCodeGen(fx.graph._PyTreeInfo(["primals", "tangents"], in_spec, info.out_spec))


def lifted_constants(program: fx.GraphModule) -> list[tuple[str, torch.Tensor]]:
    """The tensors the program reads with ``get_attr``, in graph order (passed as trailing inputs of
    the joint modules)."""
    out, seen = [], set()
    for n in program.graph.nodes:
        if n.op == "get_attr" and n.target not in seen:
            t = program
            for part in n.target.split("."):
                t = getattr(t, part)
            if isinstance(t, torch.Tensor):
                out.append((n.target, t))
                seen.add(n.target)
    return out


# ---------------------------------------------------------------------------------------------
# classification and the saved set
# ---------------------------------------------------------------------------------------------
def forward_nodes(jg: JointGraph) -> tuple[set[str], set[str]]:
    """(forward, backward) call_function node names: forward ones are the ancestors of the forward
    outputs, everything else is backward work (passes/remat.py ``classify``)."""
    from mcompile.passes.remat import classify

    return classify(jg.gm)


def _output_args(jg: JointGraph) -> list:
    out = next(n for n in jg.gm.graph.nodes if n.op == "output")
    return list(out.args[0])


def needed_by_backward(jg: JointGraph) -> list[str]:
    """Forward nodes a backward node (or a gradient output) reads directly, in graph order."""
    fwd, bwd = forward_nodes(jg)
    needed = set()
    for n in jg.gm.graph.nodes:
        if n.name in bwd:
            needed.update(a.name for a in n.all_input_nodes if a.name in fwd)
    for a in _output_args(jg)[jg.num_outputs:]:  # a gradient that is a forward value (rare)
        if isinstance(a, fx.Node) and a.name in fwd:
            needed.add(a.name)
    return [n.name for n in jg.gm.graph.nodes if n.name in needed]


def _pinned(jg: JointGraph) -> set[str]:
    """Forward nodes that must be saved, never recomputed: random ops (they would draw other numbers),
    in-place ops, the values they write (an FP8 amax history advanced in forward) and what read those
    values before the write."""
    from mcompile.passes.remat import _is_random, _mutated

    out = set()
    order = {n: i for i, n in enumerate(jg.gm.graph.nodes)}
    for n in jg.gm.graph.nodes:
        if n.op != "call_function":
            continue
        if _is_random(n) or _mutated(n):
            out.add(n.name)
        for m in _mutated(n):
            out.add(m.name)
            # what read the value before it was overwritten (``v /= v.sum()``: the sum): recomputed in
            # backward it would read the new value, so it is saved
            out.update(u.name for u in m.users if order[u] < order[n] and u.op == "call_function")
    return out


def saved_for_policy(jg: JointGraph, policy: str, method: str = "uniform", num_layers: int = 1) -> list[str]:
    """The saved set of a named policy (``none``, ``full``, ``selective``), as node names.

    - ``none``: every forward value the backward reads, except views, recomputed from their input
      when that input is available anyway (a primal or itself saved) — a view costs no FLOPs and
      saving it would keep a second name for the same storage;
    - ``full`` (Megatron's full recompute): per group of ``num_layers`` layers (``uniform``) only the
      values entering the group from outside it; ``block``: the first ``num_layers`` layers that way,
      the others as ``none``;
    - ``selective`` (Korthikanti et al. 2022): as ``none``, but the attention core's outputs are
      recomputed from its inputs (which are saved).
    Random ops are always saved: recomputing them would draw other numbers.
    """
    nodes = {n.name: n for n in jg.gm.graph.nodes}
    fwd, _ = forward_nodes(jg)
    needed = needed_by_backward(jg)
    primals = set(jg.primal_names)
    pinned = _pinned(jg)

    def layer(n: fx.Node):
        return n.meta.get("custom", {}).get(M.LAYER)

    if policy in ("none", "selective"):
        recompute = set()
        if policy == "selective":
            recompute = {n for n in fwd if _is_attention(nodes[n]) or
                         (nodes[n].target is operator.getitem and _is_attention(nodes[n].args[0]))}
        return _close_over_views(jg, needed, recompute, fwd, primals, pinned)
    if policy != "full":
        raise ValueError(f"recompute {policy!r}: use 'none', 'full', 'selective' or 'auto'")
    layers = sorted({layer(nodes[n]) for n in fwd if layer(nodes[n]) is not None})

    def group(name: str):
        lay = layer(nodes[name])
        if lay is None:
            return None
        pos = layers.index(lay)
        if method == "uniform":
            return pos // num_layers
        if method == "block":
            return pos if pos < num_layers else None
        raise ValueError(f"recompute method {method!r}: use 'uniform' or 'block'")

    saved: list[str] = []
    recomputed = {n for n in fwd if group(n) is not None and n not in pinned}
    for name in needed:  # outside any recomputed group: saved as under 'none'
        if name not in recomputed:
            saved.append(name)
    for name in recomputed:  # what a recomputed group reads from outside it (its input) is saved
        for a in nodes[name].all_input_nodes:
            if a.name in fwd and (a.name not in recomputed or group(a.name) != group(name)):
                saved.append(a.name)
    seen = set(saved)
    out = [n.name for n in jg.gm.graph.nodes if n.name in seen]
    return _close_over_views(jg, out, set(), fwd, primals, pinned)


def _is_attention(n) -> bool:
    return isinstance(n, fx.Node) and isinstance(n.target, torch._ops.OpOverload) and \
        "scaled_dot_product" in n.target.name()


def _close_over_views(jg, wanted: list[str], recompute: set[str], fwd: set[str], primals: set[str],
                      pinned: set[str]) -> list[str]:
    """Resolve ``wanted`` (values the backward reads) into a saved list: nodes in ``recompute`` and
    views of available values are recomputed, their forward inputs wanted in turn."""
    nodes = {n.name: n for n in jg.gm.graph.nodes}
    saved: set[str] = set()
    todo = list(wanted)
    done: set[str] = set()
    while todo:
        name = todo.pop()
        if name in done or name in primals:
            continue
        done.add(name)
        n = nodes[name]
        ins = [a.name for a in n.all_input_nodes if a.name in fwd or a.name in primals]
        if (name in recompute or is_alias(n)) and name not in pinned:
            # recomputed; a view always is (no FLOPs): its base is saved instead — one storage, and the
            # saved bytes are what the storage holds (none for a view of a primal)
            todo.extend(a for a in ins if a not in primals)
            continue
        saved.add(name)
    return [n.name for n in jg.gm.graph.nodes if n.name in saved]


# ---------------------------------------------------------------------------------------------
# partition
# ---------------------------------------------------------------------------------------------
@dataclass
class JointProgram:
    """A partitioned joint graph: the modules a rank runs and what flows between them."""

    joint: JointGraph
    forward: fx.GraphModule  # primals -> (*outputs, *saved)
    backward: fx.GraphModule  # (*saved, *bwd_primals, *tangents) -> grads of grad_primals
    saved: list[str]  # joint-graph node names returned by forward for backward
    bwd_primals: list[int]  # primal indices the backward reads directly
    recomputed: list[str]  # forward nodes the backward recomputes
    saved_bytes: int = 0
    recompute_flops: float = 0.0
    recomputed_ops: int = 0  # of those, the ops: not views (free) nor ZeRO-3's parameter gathers (repeated anyway)
    # zero-bubble split of backward (split_weight): B -> (*input grads, *stash); W(*stash) -> weight grads
    backward_input: fx.GraphModule | None = None
    backward_weight: fx.GraphModule | None = None
    input_grads: list[int] = field(default_factory=list)  # positions in grad_primals computed by B
    weight_grads: list[int] = field(default_factory=list)  # positions computed by W
    acc_full: list[int] = field(default_factory=list)  # primal indices backward adds into buffers (in order)
    acc_positions: list[int] = field(default_factory=list)  # the same for W
    # overlap (passes/dp/overlap.py launch_buckets): dp buckets launched inside backward / W, and the primal
    # indices whose bucket readiness those launches count
    launches: list = field(default_factory=list)
    ready_positions: set = field(default_factory=set)
    launches_w: list = field(default_factory=list)
    ready_positions_w: set = field(default_factory=set)
    prefetch: dict = field(default_factory=dict)  # module -> passes/dp/fsdp.py PrefetchReport (ZeRO-3, overlap)
    tp_overlap: list = field(default_factory=list)  # passes/tp/collective_matmul.py Decisions (one per tp collective)


def _copy_nodes(src_nodes: list[fx.Node], inputs: list[fx.Node], outputs: list, gm_src: fx.GraphModule,
                placeholder_names: list[str] | None = None) -> fx.GraphModule:
    """A new GraphModule: ``inputs`` become placeholders (in order), ``src_nodes`` are copied in
    order, ``outputs`` (nodes or None) returned as a tuple."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, n in enumerate(inputs):
        p = g.placeholder(placeholder_names[i] if placeholder_names else n.name)
        p.meta = dict(n.meta)
        env[n] = p

    def arg(a: fx.Node) -> fx.Node:
        if a not in env and a.op == "get_attr":  # a module constant (an FP8 amax history): the same tensor
            env[a] = g.node_copy(a)
        return env[a]

    for n in src_nodes:
        if n in env:
            continue
        env[n] = g.node_copy(n, arg)
    g.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    g.eliminate_dead_code()
    return lazy_module(gm_src, g)



def _ancestors(roots: list[fx.Node], stop: set[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [r for r in roots if isinstance(r, fx.Node)]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in stop:
            continue
        todo.extend(n.all_input_nodes)
    return seen


def _bytes(vals) -> int:
    if isinstance(vals, torch.Tensor):
        return vals.numel() * vals.element_size()
    if isinstance(vals, tuple | list):
        return sum(_bytes(v) for v in vals)
    return 0


def partition(jg: JointGraph, saved: list[str]) -> JointProgram:
    """Forward and backward modules of ``jg`` for the saved set ``saved`` (joint node names): the
    backward recomputes every forward value it reads that is neither saved nor a primal."""
    gm = jg.gm
    nodes = {n.name: n for n in gm.graph.nodes}
    order = [n for n in gm.graph.nodes if n.op == "call_function"]
    outs = _output_args(jg)
    fwd_outs, grads = outs[:jg.num_outputs], outs[jg.num_outputs:]
    primals = [nodes[p] for p in jg.primal_names]
    tangents = [nodes[t] for t in jg.tangent_names]
    saved_nodes = [nodes[s] for s in saved]
    fwd_names, _ = forward_nodes(jg)

    # in-place ops (an FP8 history advanced by backward) are roots of their side: nothing reads them
    effects = [n for n in order if _mutates(n)]
    fwd_effects = [n for n in effects if n.name in fwd_names]
    need_f = _ancestors([o for o in fwd_outs + saved_nodes + fwd_effects if isinstance(o, fx.Node)], set(primals))
    forward = _copy_nodes([n for n in order if n in need_f], primals, fwd_outs + saved_nodes, gm)

    stop = set(saved_nodes) | set(primals) | set(tangents)
    need_b = _ancestors([g for g in grads if isinstance(g, fx.Node)] +
                        [n for n in effects if n.name not in fwd_names], stop)
    bwd_primals = [i for i, p in enumerate(primals) if p in need_b]
    b_inputs = saved_nodes + [primals[i] for i in bwd_primals] + tangents
    tangent_dep = _dependents(tangents)
    backward = _copy_nodes(_lazy_order(order, need_b - stop, tangent_dep), b_inputs, grads, gm)
    recomputed = [n.name for n in order if n in need_b and n.name in fwd_names and n not in stop]
    try:
        from mcompile.passes import remat
        flops = sum(remat.node_cost(nodes[r])[0] for r in recomputed)
    except ImportError:
        flops = 0.0
    sbytes = _saved_bytes(saved_nodes)
    return JointProgram(jg, forward, backward, list(saved), bwd_primals, recomputed, sbytes, flops)


def _mutates(n: fx.Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return n.op == "call_function" and schema is not None and schema.is_mutable


def _dependents(roots: list[fx.Node]) -> set[fx.Node]:
    """Every node that depends on one of ``roots`` (graph order makes one pass enough)."""
    dep = set(roots)
    for n in (roots[0].graph.nodes if roots else ()):
        if n not in dep and any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    return dep


def _lazy_order(order: list[fx.Node], keep: set[fx.Node], tangent_dep: set[fx.Node]) -> list[fx.Node]:
    """The backward's nodes: those that depend on a tangent in the joint graph's order, every other
    one (a recomputed forward node, or tangent-free backward work such as the ``detach`` autograd
    records when it saves a value) moved to just before its first user, with what it needs before
    it. A layer's forward is thus re-run when its backward is reached, as checkpointing does, not all
    at the start — which would hold every recomputed activation at once."""
    out: list[fx.Node] = []
    done: set[fx.Node] = set()
    roots = [n for n in order if n in keep and n in tangent_dep]
    roots += [n for n in order if n in keep and n not in tangent_dep]  # read by no tangent-dependent node
    for root in roots:
        if root in done:
            continue
        stack = [(root, False)]
        while stack:  # iterative post-order over the not-yet-emitted inputs
            n, expanded = stack.pop()
            if n in done:
                continue
            if expanded:
                done.add(n)
                out.append(n)
                continue
            stack.append((n, True))
            stack.extend((a, False) for a in reversed(n.all_input_nodes) if a in keep and a not in done
                         and a.op == "call_function")
    return out


def _saved_bytes(saved_nodes: list[fx.Node]) -> int:
    """Bytes of the distinct storages the saved values hold (a view of a saved value is free)."""
    total, seen = 0, set()
    for n in saved_nodes:
        base = n
        while is_alias(base):
            base = base.all_input_nodes[0]
        if base in seen or base.op == "placeholder":  # a view of an input holds no new storage
            continue
        seen.add(base)
        total += _bytes(n.meta.get("val")) if base is n else _bytes(base.meta.get("val"))
    return total


def split_weight(jp: JointProgram, input_positions: list[int]) -> None:
    """Split ``jp.backward`` into B (the gradients at ``input_positions`` of grad_primals: the
    received activations) and W (every other gradient: the weights), on the graph: B runs the
    ancestors of its gradients; W the rest of backward, reading what it needs of B's values (the
    stash B returns after its gradients) and of backward's inputs."""
    bw = jp.backward
    phs = [n for n in bw.graph.nodes if n.op == "placeholder"]
    out = next(n for n in bw.graph.nodes if n.op == "output")
    grads = list(out.args[0])
    order = [n for n in bw.graph.nodes if n.op == "call_function"]
    weight_pos = [i for i in range(len(grads)) if i not in input_positions]
    effects = [n for n in order if _mutates(n)]  # in B: once per backward, before W reads what they left
    roots = [grads[i] for i in input_positions if isinstance(grads[i], fx.Node)]
    b_nodes = _ancestors(roots + effects, set(phs))
    w_nodes = _ancestors([grads[i] for i in weight_pos if isinstance(grads[i], fx.Node)], set(phs) | b_nodes)
    stash = [n for n in order if n in b_nodes and n in w_nodes]  # computed by B, read by W
    w_phs = [p for p in phs if p in w_nodes]
    b_out = [grads[i] for i in input_positions] + stash
    jp.backward_input = _copy_nodes([n for n in order if n in b_nodes], phs, b_out, bw)
    w_inputs = stash + w_phs
    jp.backward_weight = _copy_nodes([n for n in order if n in w_nodes and n not in b_nodes], w_inputs,
                                     [grads[i] for i in weight_pos], bw)
    jp.backward_weight.meta[M.W_INPUTS] = [phs.index(p) for p in w_phs]
    jp.input_grads, jp.weight_grads = list(input_positions), weight_pos


ACC_OUTPUT = M.ACC_OUTPUT  # node.meta key on an accumulation: the output position it replaced


def accumulate_outputs(gm: fx.GraphModule, positions: list[int]) -> list[int]:
    """Rewrite ``gm`` so that each output at ``positions`` is added in place into a buffer passed as a
    new trailing input (in the order returned), right after the value is computed, and returned as
    None: the gradient is freed at once instead of living until the module returns."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    vals = list(out.args[0])
    last_ph = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    done = []
    for j in positions:
        g = vals[j]
        if not isinstance(g, fx.Node) or g.op == "placeholder":
            continue
        with gm.graph.inserting_after(last_ph):
            buf = gm.graph.placeholder(f"acc_{j}")
        last_ph = buf
        with gm.graph.inserting_after(g):
            add = gm.graph.call_function(torch.ops.aten.add_.Tensor, (buf, g))
        add.meta[ACC_OUTPUT] = j  # the passes after this one find each gradient's accumulation by it
        vals[j] = None
        done.append(j)
    out.args = (tuple(vals),)
    gm.graph.lint()
    gm.recompile()
    return done
