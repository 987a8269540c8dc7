"""The joint graph of a program with repeated layers, traced once per distinct layer (issue 40).

Tracing a joint graph (passes/joint.py ``trace_joint``: ``make_fx`` of forward + ``autograd.grad`` over fake
tensors) costs the same for every op of the program, so a stage of 16 transformer layers took 16 layers' worth of
fake-tensor dispatch, and time to the first step grew with depth. Most of those layers are the same code on other
parameters. This pass traces each distinct layer once and copies its joint graph for the others:

1. **Runs.** The program's ``call_function`` nodes in maximal contiguous runs of one layer (``M.LAYER``, set by
   capture from the module path); a layer split over several runs is left inline. Each run's interface: the values
   it reads from outside (inputs, in order of first use) and those read outside it (outputs). Two runs are alike
   when their nodes have the same targets and literal arguments with the node references renumbered by position
   (inputs by their index, run nodes by theirs), except the key of a dropout or random op (``node_key`` of the
   node's name, different for every layer) and where the inputs come from. Runs with no alike run stay inline.
2. **One trace per variant.** A fake forward of the *outer* program (the program with each repeated run replaced
   by a call of it) gives each run's inputs: their shape, stride, dtype, device, whether they require grad, and
   the value of a non-tensor input (a ``sym_size``). The first run of a variant (its structure and those input
   metadata) is traced on its own, as a program whose placeholders are its tensor inputs (non-tensor ones are
   constants of that trace); every later run of the variant gets outputs of the traced forward's metadata.
3. **The outer trace.** The outer program's joint graph, traced as any program, with each run one
   ``autograd.Function`` whose forward and backward are single opaque ops (``mcompile::joint_block``,
   ``mcompile::joint_block_grad``): autograd sums the gradients of values read by several runs and by the outer
   program, and orders the runs' backwards, exactly as in a full trace.
4. **Substitution.** Each ``joint_block`` node is replaced by a copy of its variant's forward nodes (those traced
   before the first output gradient, not only the outputs' ancestors: the values autograd saves are computed
   there), each ``joint_block_grad`` node by the rest, reading the copied forward values, the output gradients the
   outer graph computed, and giving the input gradients. A copied node takes the meta of the node it implements
   in *its* run (``custom``: layer, origin, program node), so recompute policies, ZeRO-3's prefetch by layer and
   ``show`` see the same graph a full trace gives; a dropout node takes its run's key.

The result is the full trace's graph up to node names and the order of independent nodes (the same ops, the same
collectives in the same order). Programs with no repeated run are traced whole. The idea is that of regional
compilation (``torch.compile``'s compilation of one repeated block reused for all its instances); here at the
level of the joint graph, so the rest of the compiler (partition, recompute, zero-bubble split, bucketing) sees
one flat graph.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from mcompile.ir import meta as M
from mcompile.passes.nodes import fake_args, lazy_module

__all__ = ["compose", "fake_forward", "layer_runs"]

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------
# 1. runs and their structure
# ---------------------------------------------------------------------------------------------
@dataclass
class Run:
    layer: object
    nodes: list[fx.Node]
    inputs: list[fx.Node] = field(default_factory=list)  # read from outside, in order of first use
    outputs: list[fx.Node] = field(default_factory=list)  # read outside
    structure: str = ""
    keys: list[int] = field(default_factory=list)  # the dropout / random keys, in node order


def _random_ops() -> set:
    return {torch.ops.mcompile.dropout.default, torch.ops.mcompile.random_like.default}


_SIZES = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int}


def _reached(program: fx.GraphModule) -> dict[fx.Node, frozenset]:
    """For each node of no layer: the layers of the first layered nodes its users reach through nodes of no
    layer (``"out"`` for the program's output)."""
    out: dict[fx.Node, frozenset] = {}
    for n in reversed(program.graph.nodes):
        if n.op == "call_function" and n.meta.get(M.LAYER) is None:
            acc: set = set()
            for u in n.users:
                if u.op == "call_function" and u.meta.get(M.LAYER) is not None:
                    acc.add(u.meta[M.LAYER])
                else:
                    acc |= out.get(u, {"out"})
            out[n] = frozenset(acc)
    return out


def _inside(n: fx.Node, layer, members: set[fx.Node], reached: dict) -> str | None:
    """What a node of no layer inside the span of ``layer``'s open run is to the run: ``"member"`` when only the
    run reads it, directly or through other such nodes (a dropout's index ``arange`` and its ``narrow``: copied
    in place, as a whole trace has them), ``"outside"`` when it is a size read from what came before the run (a
    ``sym_size`` of an input that several layers read: an int, which leaves no node in a joint graph, so
    computing it before the run's call changes nothing), else None (the run ends there)."""
    if n.op != "call_function":
        return None
    if n.users and reached.get(n) == frozenset({layer}):
        return "member"
    sizes = n.target in _SIZES or (getattr(n.target, "__module__", None) == "_operator"  # int arithmetic on sizes;
                                   and n.target is not operator.getitem)  # not an element of a tuple of tensors
    if sizes and not any(a in members for a in n.all_input_nodes):
        return "outside"
    return None


def layer_runs(program: fx.GraphModule) -> list[Run]:
    """The maximal contiguous runs of ``call_function`` nodes of one layer (get_attr nodes inside a run's span are
    outside it, and nodes of no layer there as :func:`_inside` says); a layer that appears in more than one run is
    in none."""
    runs: list[Run] = []
    cur: Run | None = None
    members: set[fx.Node] = set()
    reached = _reached(program)
    for n in program.graph.nodes:
        if n.op == "get_attr":
            continue
        layer = n.meta.get(M.LAYER) if n.op == "call_function" else None
        if layer is None:
            where = _inside(n, cur.layer, members, reached) if cur is not None else None
            if where == "member":
                cur.nodes.append(n)
                members.add(n)
            elif where is None:
                cur = None
            continue
        if cur is None or cur.layer != layer:
            cur = Run(layer, [])
            members = set()
            runs.append(cur)
        cur.nodes.append(n)
        members.add(n)
    count: dict = {}
    for r in runs:
        count[r.layer] = count.get(r.layer, 0) + 1
    runs = [r for r in runs if count[r.layer] == 1]
    random_ops = _random_ops()
    for r in runs:
        inside = {n: i for i, n in enumerate(r.nodes)}
        ins: dict[fx.Node, int] = {}

        def ref(a: fx.Node, inside=inside, ins=ins):
            if a in inside:
                return ("n", inside[a])
            if a not in ins:
                ins[a] = len(ins)
            return ("i", ins[a])

        parts = []
        for n in r.nodes:
            args = n.args
            if n.target in random_ops:
                r.keys.append(args[3])
                args = (*args[:3], "key", *args[4:])
            parts.append((str(n.target), fx.node.map_arg(args, ref), fx.node.map_arg(n.kwargs, ref)))
        r.inputs = list(ins)
        r.outputs = [n for n in r.nodes if any(u not in inside for u in n.users)]
        parts.append(tuple(inside[o] for o in r.outputs))
        r.structure = repr(parts)
    return runs


# ---------------------------------------------------------------------------------------------
# the opaque ops the outer program is traced with
# ---------------------------------------------------------------------------------------------
@dataclass
class _Variant:
    """One traced run: its joint graph and what the outer trace needs of it."""

    jg: object  # passes/joint.py JointGraph of the run's program (its non-tensor inputs baked in: they are part of
    #             the variant's key, so every instance of it has the same)
    rep: Run
    tensor_pos: list[int]  # positions of the tensor inputs among the run's inputs
    out_meta: list[tuple]  # (size, stride, dtype, device) of each output
    diff: list[int]  # outputs that require grad
    grad_of: list[int]  # the tensor inputs (their positions among tensor inputs) whose gradient the trace gives
    primals: list[fx.Node]  # the joint's input placeholders
    tangents: list[fx.Node]  # its output-gradient placeholders
    results: list  # the joint's forward outputs (nodes)
    grads: list[fx.Node]  # the gradients it gives (of the inputs in grad_of)
    forward: list[fx.Node]  # the joint's nodes traced in forward, in order
    backward: list[fx.Node]  # the others


@dataclass
class _Instance:
    run: Run
    variant: _Variant | None = None


_INSTANCES: dict[int, _Instance] = {}
_COUNTER = itertools.count()


@torch.library.custom_op("mcompile::joint_block", mutates_args=())
def _block_op(inst: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Stands for a repeated run of the program while its outer joint graph is traced; replaced by the run's
    traced forward (module docstring, 4), never executed."""
    raise RuntimeError("mcompile::joint_block is replaced in the joint graph and never runs")


@_block_op.register_fake
def _(inst, inputs):
    return [torch.empty_strided(s, st, dtype=d, device=dev) for s, st, d, dev in _INSTANCES[inst].variant.out_meta]


@torch.library.custom_op("mcompile::joint_block_grad", mutates_args=())
def _block_grad_op(inst: int, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Stands for a repeated run's backward (its input gradients from its output gradients); replaced by the
    run's traced backward, never executed."""
    raise RuntimeError("mcompile::joint_block_grad is replaced in the joint graph and never runs")


@_block_grad_op.register_fake
def _(inst, grads):
    v = _INSTANCES[inst].variant
    vals = [v.primals[j].meta["val"] for j in v.grad_of]
    return [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device) for x in vals]


class _BlockFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inst, *inputs):
        ctx.inst = inst
        v = _INSTANCES[inst].variant
        outs = _block_op(inst, list(inputs))
        ctx.mark_non_differentiable(*[o for i, o in enumerate(outs) if i not in v.diff])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        v = _INSTANCES[ctx.inst].variant
        got = _block_grad_op(ctx.inst, [grads[i] for i in v.diff])
        res: list = [None] * len(v.tensor_pos)
        for j, g in zip(v.grad_of, got):
            res[j] = g
        return (None, *res)


def _block(inst: int, inputs: list):
    """The outer program's call of repeated run ``inst`` (traced: one opaque op each way)."""
    v = _INSTANCES[inst].variant
    tensors = [inputs[p] for p in v.tensor_pos]
    return list(_BlockFn.apply(inst, *tensors))


# ---------------------------------------------------------------------------------------------
# 2. the outer program
# ---------------------------------------------------------------------------------------------
def _outer_program(program: fx.GraphModule, runs: list[Run]) -> tuple[fx.GraphModule, dict[int, Run]]:
    """``program`` with each of ``runs`` replaced by ``_block(inst, [inputs])`` and a getitem per output, at
    the place of the run's last node. Returns the program and the instance ids."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    member = {n: r for r in runs for n in r.nodes}
    last = {r.nodes[-1]: r for r in runs}
    insts: dict[int, Run] = {}
    for n in program.graph.nodes:
        if n in member:
            if n in last:
                r = last[n]
                inst = next(_COUNTER)
                insts[inst] = r
                call = g.call_function(_block, (inst, [env[a] for a in r.inputs]))
                call.meta = {M.LAYER: r.layer}
                for i, o in enumerate(r.outputs):
                    env[o] = g.call_function(operator.getitem, (call, i))
                    env[o].meta = dict(o.meta)
            continue
        env[n] = g.node_copy(n, lambda a: env[a])
    g._codegen = program.graph._codegen
    gm = lazy_module(program, g)  # interpreted, never called: no code generated
    return gm, insts


def _run_program(run: Run, consts: dict[int, object]) -> fx.GraphModule:
    """The run as a program of its own: its tensor inputs placeholders, its non-tensor ones ``consts`` (by input
    position), its outputs returned as a tuple."""
    g = fx.Graph()
    env: dict[fx.Node, object] = {}
    for i, a in enumerate(run.inputs):
        if i in consts:
            env[a] = consts[i]
        else:
            p = g.placeholder(a.name)
            p.meta = dict(a.meta)
            env[a] = p
    for n in run.nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[o] for o in run.outputs))
    return lazy_module(torch.nn.Module(), g)


def _meta_key(x) -> tuple:
    if isinstance(x, torch.Tensor):
        return ("t", tuple(x.shape), tuple(x.stride()), x.dtype, x.device, x.requires_grad)
    return ("v", type(x).__name__, repr(x))


class _Unsupported(Exception):
    """A run this pass does not compose (a non-tensor output): the program is traced whole."""


class _Outer(fx.Interpreter):
    """Runs an outer program on fake tensors: a repeated run's call is answered by ``first(run, inputs)`` the first
    time its variant (structure and input metadata) is met — ``(variant, metas, outputs or None)``, ``metas`` the
    outputs' (size, stride, dtype, device, requires_grad) — and by fresh tensors of those metadata after; each
    instance's variant is handed to ``seen(inst, run, variant)``."""

    def __init__(self, gm: fx.GraphModule, insts: dict[int, Run], first, seen=None):
        super().__init__(gm)
        self.insts, self.first, self.seen, self.known = insts, first, seen, {}

    def call_function(self, target, a, kw):
        if target is not _block:
            return super().call_function(target, a, kw)
        inst, inputs = a
        run = self.insts[inst]
        key = (run.structure, tuple(_meta_key(x) for x in inputs))
        got = self.known.get(key)
        outs = None
        if got is None:
            variant, metas, outs = self.first(run, inputs)
            got = self.known[key] = (variant, metas)
        if self.seen is not None:
            self.seen(inst, run, got[0])
        if outs is not None:
            return outs
        return [torch.empty_strided(s, st, dtype=d, device=dev).requires_grad_(rg) for s, st, d, dev, rg in got[1]]


def _phase1(outer: fx.GraphModule, insts: dict[int, Run], mode, fake: list, trace) -> None:
    """A fake forward of the outer program (module docstring, 2): the variant of every instance, each traced
    by ``trace(program, args) -> JointGraph`` when first met."""
    def first(run, inputs):
        v = _trace_variant(run, inputs, trace)
        return v, [(*m, i in v.diff) for i, m in enumerate(v.out_meta)], None

    def seen(inst, run, v):
        _INSTANCES[inst] = _Instance(run, v)

    with mode, torch.enable_grad():
        _Outer(outer, insts, first, seen).run(*fake)


def _trace_variant(run: Run, inputs: list, trace) -> _Variant:
    consts = {i: x for i, x in enumerate(inputs) if not isinstance(x, torch.Tensor)}
    tensor_pos = [i for i in range(len(inputs)) if i not in consts]
    sub = _run_program(run, consts)
    fresh = [inputs[i].detach().requires_grad_(inputs[i].requires_grad) for i in tensor_pos]
    jg = trace(sub, fresh)  # the run's program reads no get_attr (its constants are inputs): nothing lifted
    out_node = next(n for n in jg.gm.graph.nodes if n.op == "output")
    outs = list(out_node.args[0])[:jg.num_outputs]
    out_meta = []
    for o in outs:
        val = o.meta.get("val") if isinstance(o, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            raise _Unsupported("a run whose output is not a tensor")
        out_meta.append((tuple(val.shape), tuple(val.stride()), val.dtype, val.device))
    grads = list(out_node.args[0])[jg.num_outputs:]
    grad_of = [jg.grad_primals[k] for k, gr in enumerate(grads) if isinstance(gr, fx.Node)]
    phs = [n for n in jg.gm.graph.nodes if n.op == "placeholder"]
    fwd_names = jg.gm.meta.get(M.JOINT_FORWARD_NODES, frozenset())
    body = [n for n in jg.gm.graph.nodes if n.op in ("call_function", "get_attr")]
    return _Variant(jg, run, tensor_pos, out_meta, list(jg.diff_outputs), grad_of, phs[:jg.num_primals],
                    [p for p in phs if p.name in jg.tangent_names], outs,
                    [gr for gr in grads if isinstance(gr, fx.Node)],
                    [n for n in body if n.name in fwd_names or n.op == "get_attr"],
                    [n for n in body if n.name not in fwd_names and n.op != "get_attr"])


# ---------------------------------------------------------------------------------------------
# 4. substitution
# ---------------------------------------------------------------------------------------------
def _substitute(gm: fx.GraphModule) -> None:
    """Module docstring, 4: every joint_block / joint_block_grad node of the traced outer joint graph replaced
    by its variant's forward / backward nodes."""
    g = gm.graph
    fwd_op, bwd_op = torch.ops.mcompile.joint_block.default, torch.ops.mcompile.joint_block_grad.default
    envs: dict[int, dict] = {}
    consts: dict[tuple[int, str], fx.Node] = {}  # (variant id, attribute) -> the outer graph's get_attr
    random_ops = _random_ops()
    last_input = [n for n in g.nodes if n.op == "placeholder"][-1]  # a variant's constants are read after it
    forward = set(gm.meta.get(M.JOINT_FORWARD_NODES, ()))
    for node in list(g.nodes):
        if node.op != "call_function" or node.target not in (fwd_op, bwd_op):
            continue
        inst = node.args[0]
        instance = _INSTANCES[inst]
        v, run = instance.variant, instance.run
        jg = v.jg
        if node.target is fwd_op:
            env = envs[inst] = dict(zip(v.primals, node.args[1]))
            todo, results = v.forward, v.results
        else:
            env = envs[inst]
            env.update(zip(v.tangents, node.args[1]))
            todo, results = v.backward, v.grads
        # the node each of the variant's program nodes stands for in this run
        here = {r.name: n for r, n in zip(v.rep.nodes, run.nodes)}
        keys = dict(zip(v.rep.keys, run.keys))
        for jn in todo:
            if jn.op == "get_attr":
                ck = (id(v), jn.target)
                if ck not in consts:
                    name = f"_mc_block_const_{len(consts)}"
                    t = jg.gm
                    for part in jn.target.split("."):
                        t = getattr(t, part)
                    gm.register_buffer(name, t) if isinstance(t, torch.Tensor) else setattr(gm, name, t)
                    with g.inserting_after(last_input):
                        consts[ck] = g.get_attr(name)
                    consts[ck].meta = dict(jn.meta)
                env[jn] = consts[ck]
                continue
            with g.inserting_before(node):
                new = g.node_copy(jn, lambda a, env=env: env[a])
            if jn.target in random_ops and new.args[3] in keys:
                new.args = (*new.args[:3], keys[new.args[3]], *new.args[4:])
            custom = jn.meta.get("custom")
            if custom is not None:
                src = here.get(custom.get(M.PROGRAM_NODE))
                if src is not None:
                    new.meta["custom"] = src.meta.get("custom", custom)
                    for k in ("nn_module_stack", "stack_trace"):
                        if k in src.meta:
                            new.meta[k] = src.meta[k]
            env[jn] = new
            if node.target is fwd_op:
                forward.add(new.name)
        for u in list(node.users):
            if u.op == "call_function" and u.target is operator.getitem:
                r = results[u.args[1]]
                u.replace_all_uses_with(env[r] if isinstance(r, fx.Node) else r)
                g.erase_node(u)
            else:
                raise AssertionError(f"{node.name} is read by {u.name} ({u.target}), not by getitem")
        g.erase_node(node)
    gm.meta[M.JOINT_FORWARD_NODES] = frozenset(forward)


def _repeated(program: fx.GraphModule) -> list[Run]:
    """The program's runs that have an alike run (the same structure)."""
    runs = layer_runs(program)
    count: dict[str, int] = {}
    for r in runs:
        count[r.structure] = count.get(r.structure, 0) + 1
    return [r for r in runs if count[r.structure] > 1]


def compose(program: fx.GraphModule, args: list, trace) -> object | None:
    """The joint graph of ``program`` on ``args`` composed from one trace per distinct repeated run (module
    docstring), or None when it has no run with an alike one (the caller traces it whole). ``trace(program,
    args, before_dce=None)`` traces a program whole (passes/joint.py ``_trace``), calling ``before_dce(gm)`` on
    its graph before removing dead code. Every trace here is made in the fake mode of ``args`` (one made for
    them if they are real), never taken from a cache: a joint graph traced elsewhere (another thread's rank of
    the simulator) carries values of its own mode, which later passes cannot combine with this graph's."""
    repeated = _repeated(program)
    if not repeated:
        return None
    outer, insts = _outer_program(program, repeated)
    try:
        mode, fake = fake_args(args)  # one mode for the runs' and the outer trace: passes after combine their values
        try:
            _phase1(outer, insts, mode, fake, trace)
        except _Unsupported:
            return None
        return trace(outer, fake, _substitute)
    finally:
        for inst in insts:
            _INSTANCES.pop(inst, None)


def fake_forward(program: fx.GraphModule, args: list):
    """``program(*args)`` on fake tensors (``args`` fake, their mode entered by the caller) running each distinct
    repeated run once: a later run alike in structure and in its inputs' metadata gets outputs of the first's
    metadata without running (the pipeline's message shapes: runtime/pipeline.py ``_trace_stages``). Costs the
    outer program's nodes and one run per variant, not the program's depth."""
    repeated = _repeated(program)
    if not repeated:
        return program(*args)
    outer, insts = _outer_program(program, repeated)

    def first(run, inputs):
        env = dict(zip(run.inputs, inputs))
        for n in run.nodes:
            n_args, n_kw = fx.node.map_arg((n.args, n.kwargs), lambda x: env[x])
            env[n] = n.target(*n_args, **n_kw)
        outs = [env[o] for o in run.outputs]
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise _Unsupported("a run whose output is not a tensor")
        return None, [(tuple(o.shape), tuple(o.stride()), o.dtype, o.device, o.requires_grad) for o in outs], outs

    try:
        return _Outer(outer, insts, first).run(*args)
    except _Unsupported:
        return program(*args)
