"""The sharding rule of a user's ``torch.autograd.Function`` (an ``mcompile_fn`` op,
:mod:`mcompile.capture.autograd_fn`):
:func:`pointwise_rule`, inferred only where it can be proven. The Function's forward and
backward are traced together with ``make_fx`` on small example tensors that repeat the node's
broadcasting pattern (a distinct size per output dim, 1 where an input broadcasts); when every op of
that trace is pointwise (``torch.Tag.pointwise``, or a copy / cast / detach) over tensors that
broadcast to the output, the Function is elementwise forward AND backward, so it gets the pointwise
rule (a dim of the output may be split wherever every input has it or broadcasts along it; no
Partial: its code need not be linear). A Function whose tensors share every dim but the last and that is
proven, by perturbing rows of its inputs and of its outputs' gradients, to work row by row (a router's
per-token multiplier: Phi-MoE's) may be split along those leading dims (:func:`_rowwise`).
Otherwise — a reduction, a view, a matmul, or a backward that
normalises by the gradient's norm, coupling every element — the rule offers nothing and the op runs
replicated, reported by a ``FallbackWarning`` with the op that stopped the proof. Under dp it runs on
each rank's batch, as every op does (data parallelism's assumption that samples are independent holds
for it only if its code keeps them so).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mcompile.sharding.rules.base import R, Shard, Strategy, same
from mcompile.sharding.rules.pointwise import pointwise_shard_strategies

__all__ = ["pointwise_rule"]

# ops that copy, cast or detach a tensor: elementwise although not tagged pointwise
_ELEMENTWISE = {"aten::detach", "aten::alias", "aten::clone", "aten::_to_copy", "aten::to", "aten::lift_fresh_copy",
                "aten::zeros_like", "aten::ones_like", "aten::full_like", "aten::empty_like", "aten::scalar_tensor",
                "aten::_assert_tensor_metadata"}
_VERDICTS: dict = {}  # (op, broadcast pattern, dtypes, other arguments) -> None (pointwise) or why not


def pointwise_rule(info):
    """The rule of an ``mcompile_fn`` op (mcompile.sharding.rules.get_rule): the pointwise strategies when the
    Function is proven elementwise forward and backward for these inputs (module docstring), else none
    (``info.notes`` says why; the op runs replicated and is reported)."""
    why = _not_pointwise(info)
    if why is not None:
        lead = _rowwise(info)
        if isinstance(lead, int):
            k = len(info.outputs)
            cur = info.current[0] if info.current else R
            out = [Strategy(tuple(Shard(d) for _ in info.inputs), (Shard(d),) * k, name="rows") for d in range(lead)]
            out.sort(key=lambda s: s.inputs[0] != cur)
            return out + [Strategy(tuple(R for _ in info.inputs), (R,) * k, name="replicate")]
        info.notes.append(f"{info.op}: no split inferred: {why}; nor row by row: {lead}")
        return []
    k = len(info.outputs)
    out = pointwise_shard_strategies(info) + [Strategy(tuple(R for _ in info.inputs), (R,), name="replicate")]
    return [replace(s, outputs=s.outputs * k) for s in out] if k > 1 else out


def _rowwise(info) -> int | str:
    """The number of leading dims along which the Function works row by row, proven by evaluation, else why not.

    Every tensor input and output must share its shape but the last dim (a router's per-token scores [T, E],
    choices [T, k] and weights: Phi-MoE's ``PhimoeMultiplier``). Example tensors with distinct leading sizes
    are run forward and backward (random outputs' gradients); then the float inputs and the outputs' gradients
    are perturbed in every row but the first, and again in the first row only: the unperturbed rows of every
    output and every
    input gradient must not move (bit for bit), and a rerun of the same inputs must repeat itself (nothing
    random). Integer inputs are zeros (valid as any index), booleans drawn. Such a Function may be split along
    any leading dim, each rank running it on its rows."""
    if len(info.outputs) != 1 and any(t.ndim != info.outputs[0].ndim for t in info.outputs):
        return "its outputs differ in rank"
    tensors = [*info.inputs, *info.outputs]
    nd = info.outputs[0].ndim
    if nd < 2 or any(t.ndim != nd for t in tensors):
        return "its tensors are not all of one rank >= 2"
    lead_shape = info.outputs[0].shape[:-1]
    if any(not all(same(a, b) for a, b in zip(t.shape[:-1], lead_shape)) for t in tensors):
        return "its tensors do not share their leading dims"
    if any(not isinstance(t.shape[-1], int) for t in tensors):
        return "a last dim whose size is symbolic"
    lead = tuple(d + 3 for d in range(nd - 1))
    gen = torch.Generator().manual_seed(0)

    def example(t):
        shp = (*lead, t.shape[-1])
        if t.dtype.is_floating_point:
            return torch.rand(shp, generator=gen, dtype=torch.float64).add(0.5).to(t.dtype)
        if t.dtype == torch.bool:
            return torch.rand(shp, generator=gen) > 0.5
        return torch.zeros(shp, dtype=t.dtype)


    def run(tensors_in, cots):
        outs, grads = _forward_backward(info, [t.detach().clone() for t in tensors_in],
                                        lambda diff: [c.to(o.dtype) for c, o in zip(cots, diff)])
        return [o.detach().reshape(-1, o.shape[-1]) for o in outs] + \
            [g.reshape(-1, g.shape[-1]) for g in grads if g is not None]

    base = [example(t) for t in info.inputs]
    cots = [torch.rand((*lead, o.shape[-1]), generator=gen, dtype=torch.float64).add(0.5) for o in info.outputs]
    try:
        ref = run(base, cots)
        if any(not torch.equal(a, b) for a, b in zip(ref, run(base, cots))):
            return "two runs on the same inputs differ (random)"
        rows = int(torch.tensor(lead).prod())
        for first in (False, True):  # perturb every row but the first, then the first only (outputs' gradients too)
            sel = slice(0, 1) if first else slice(1, None)
            moved = []
            for t in [*base, *cots]:
                t2 = t.clone().reshape(rows, -1)
                if t.is_floating_point():
                    t2[sel] = torch.rand(t2[sel].shape, generator=gen, dtype=torch.float64).add(0.5).to(t.dtype)
                moved.append(t2.reshape(t.shape))
            got = run(moved[:len(base)], moved[len(base):])
            keep = slice(1, None) if first else slice(0, 1)
            if len(got) != len(ref) or any(not torch.equal(a[keep], b[keep]) for a, b in zip(got, ref)):
                return "a row's outputs or gradients depend on other rows"
    except Exception as e:  # noqa: BLE001 - a Function that does not run on the examples is not proven
        return f"it does not run on example rows ({type(e).__name__}: {e})"
    return nd - 1


def _example_shapes(info) -> tuple[list[tuple[int, ...]], tuple[int, ...]] | str:
    """Each tensor input's example shape and the output's: output dim d has size d + 2 (distinct, so a
    broadcast is never mistaken for a match), 1 where the output or the input has 1; a reason string where
    the inputs do not broadcast to the output, or the outputs differ in shape."""
    o = info.outputs[0]
    if any(len(t.shape) != o.ndim or not all(same(a, b) for a, b in zip(t.shape, o.shape)) for t in info.outputs):
        return "its outputs differ in shape"
    out_shape = tuple(1 if same(size, 1) else d + 2 for d, size in enumerate(o.shape))
    shapes = []
    for t in info.inputs:
        off = o.ndim - t.ndim
        if off < 0:
            return f"an input of {t.ndim} dims, more than its output's {o.ndim}"
        shp = []
        for k, size in enumerate(t.shape):
            if not same(size, 1) and not same(size, o.shape[k + off]):
                return f"an input of shape {tuple(t.shape)} that does not broadcast to the output {tuple(o.shape)}"
            shp.append(1 if same(size, 1) else out_shape[k + off])
        shapes.append(tuple(shp))
    return shapes, out_shape


def _is_tensor(a) -> bool:
    """A tensor argument: an fx node of one in a graph, or the tensor itself (a rule asked outside a graph)."""
    import torch.fx as fx

    return isinstance(a, torch.Tensor) or isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def _not_pointwise(info) -> str | None:
    import torch.fx as fx

    found = _example_shapes(info)
    if isinstance(found, str):
        return found
    others = []
    fx.node.map_aggregate((info.args, info.kwargs), lambda a: a if _is_tensor(a) else others.append(a))
    if any(isinstance(a, fx.Node) for a in others):
        return "an argument known only at run time (a size read from a tensor)"
    key = (info.op, tuple(found[0]), tuple(t.dtype for t in info.inputs), repr(others))
    if key not in _VERDICTS:
        _VERDICTS[key] = _trace_verdict(info, *found)
    return _VERDICTS[key]


def _trace_verdict(info, shapes, out_shape) -> str | None:
    from torch.fx.experimental.proxy_tensor import make_fx

    gen = torch.Generator().manual_seed(0)
    examples = [torch.rand(shp, generator=gen, dtype=torch.float64).add(0.5).to(t.dtype) if t.dtype.is_floating_point
                else torch.ones(shp, dtype=t.dtype) for shp, t in zip(shapes, info.inputs)]

    def joint(*tensors):
        outs, grads = _forward_backward(info, [t.detach() for t in tensors],
                                        lambda diff: [torch.ones_like(o) for o in diff])
        return outs, [g for g in grads if g is not None]

    try:
        gm = make_fx(joint)(*examples)
    except Exception as e:  # noqa: BLE001 - a Function that does not trace on examples is not proven pointwise
        return f"its forward and backward do not trace on example tensors ({type(e).__name__}: {e})"
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        tags = getattr(n.target, "tags", ())
        name = getattr(getattr(n.target, "_schema", None), "name", str(n.target))
        if torch.Tag.nondeterministic_seeded in tags:
            return f"its forward or backward draws random numbers ({n.target}): each rank would draw its own"
        if torch.Tag.pointwise not in tags and name not in _ELEMENTWISE:
            return f"its forward or backward runs {n.target}, which is not pointwise"
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and (val.ndim > len(out_shape) or any(
                s not in (1, o) for s, o in zip(val.shape[::-1], out_shape[::-1]))):
            return f"its forward or backward makes a tensor of shape {tuple(val.shape)} ({n.target}) that does " \
                "not broadcast to the output"
    return None


def _forward_backward(info, tensors: list, cotangents) -> tuple[list, list]:
    """The captured Function ``info.op`` on ``tensors`` (in place of its tensor arguments; floating ones require
    grad): its outputs and the gradients of its differentiable outputs, weighted by ``cotangents(diff)``, with
    respect to the floating inputs (None where unused)."""
    import torch.fx as fx

    ins = [t.requires_grad_(t.is_floating_point()) for t in tensors]
    it = iter(ins)
    args, kwargs = fx.node.map_aggregate((info.args, info.kwargs), lambda a: next(it) if _is_tensor(a) else a)
    outs = info.op(*args, **kwargs)
    outs = [outs] if isinstance(outs, torch.Tensor) else list(outs)
    diff = [o for o in outs if o.requires_grad]
    wrt = [x for x in ins if x.requires_grad]
    grads = torch.autograd.grad(diff, wrt, cotangents(diff), allow_unused=True) if diff and wrt else []
    return outs, list(grads)
