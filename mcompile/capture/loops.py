"""Python loops over the indices a mask selects, captured as a loop over every index (the eager MoE dispatch).

``for e in (counts > 0).nonzero(): ...`` runs its body once per index the mask selects, a number only the
values know: torch.export cannot trace it (it has to know how often the Python loop runs). Eager
mixture-of-experts code writes its dispatch this way (transformers' Mixtral-style ``expert_hit`` loop, kept
by DBRX, Switch Transformers and NLLB-MoE; hand-written MoEs), so the loop's meaning is captured instead:

* While capturing (:func:`unrolling`), ``nonzero`` (``Tensor.nonzero``, ``torch.nonzero``, one-argument
  ``torch.where``) of a 1-D mask of static size ``n`` returns its tensor as usual, marked; iterating over the
  marked tensor in Python runs the body once for *every* index ``0 .. n-1`` (each a constant tensor, shaped as
  the element of the real result would be), recording which traced nodes each iteration made.
* After the export (:func:`guard`), every value an iteration hands to the rest of the program (a node of the
  iteration with a user outside it) is selected by the mask: ``torch.where(mask[i], value, value_before)``,
  where ``value_before`` is what the iteration updated — the tensor an in-place op of it writes
  (``out.index_add_(...)``, made functional first), or the one input of its result of the same shape and dtype
  made before the iteration (``out = out + y``). An index the mask leaves out therefore changes nothing,
  forward and backward, exactly as the eager loop that never ran it; an index it selects runs as in eager.

What is refused (:class:`LoopRefused`, naming the loop's line): a loop that leaves early (``break``), an
iteration whose result has no such "before" value (a tensor appended to a Python list and concatenated after
the loop), an iteration that writes in place a tensor made before it other than through its result, and a
mask whose size depends on the batch or the sequence (the loop would run a data-dependent number of times).
"""

from __future__ import annotations

import contextlib
import linecache
import sys
import threading
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from mcompile.ir import meta as M
from mcompile.ir.patches import Patches, Refused, exception_chain

__all__ = ["LoopRefused", "exporting", "guard", "unrolling"]

aten = torch.ops.aten
MAX_INDICES = 4096  # a mask longer than this is not an index set to unroll (experts, heads: tens to hundreds)

_TAG = M.LOOP_ITERATION  # node.meta: (loop, index) of the unrolled iteration that traced the node
_MASK = M.LOOP_MASKS  # node.meta: the loops over this mask's nonzero indices
_STATE = threading.local()
_ORIG = {
    "nonzero": torch.Tensor.nonzero,
    "iter": torch.Tensor.__iter__,
    "format": torch.Tensor.__format__,
    "torch_nonzero": torch.nonzero,
    "torch_where": torch.where,
}
_FIX = ("write the loop over range(n) and select each iteration's update with the mask, e.g. "
        "`out = torch.where(mask[i], out.index_add(0, idx, y), out)`, or dispatch the experts with one grouped "
        "GEMM (a transformers model: experts_implementation='grouped_mm')")


class LoopRefused(Refused):
    """A loop that cannot be unrolled: cause, fix and its ``for`` line."""


@dataclass
class _Loop:
    where: str  # file:line: code of the ``for``
    starts: list = field(default_factory=list)  # per iteration, the last traced node before it
    names: list[list[str]] = field(default_factory=list)  # per iteration, the names of the nodes it traced
    current: int | None = None  # the index whose iteration runs
    ended: bool = False


def _tracer():
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return None if mode is None else mode.tracer


def _active() -> bool:
    return getattr(_STATE, "loops", None) is not None and _tracer() is not None


def _unrollable(mask) -> bool:
    return (isinstance(mask, torch.Tensor) and mask.ndim == 1 and isinstance(mask.shape[0], int)
            and 0 < mask.shape[0] <= MAX_INDICES)


def _mark(out, mask, scalar: bool):
    try:
        out._mc_loop_mask, out._mc_loop_scalar = mask, scalar
    except (AttributeError, RuntimeError):
        pass
    return out


def _nonzero(self, *args, **kwargs):
    out = _ORIG["nonzero"](self, *args, **kwargs)
    if _active() and not args and _unrollable(self):
        if kwargs.get("as_tuple"):
            _mark(out[0], self, True)
        elif not kwargs:
            _mark(out, self, False)
    return out


def _torch_nonzero(input, *args, **kwargs):  # noqa: A002 - torch's name
    return _nonzero(input, *args, **kwargs) if isinstance(input, torch.Tensor) and not args and \
        "out" not in kwargs else _ORIG["torch_nonzero"](input, *args, **kwargs)


def _torch_where(*args, **kwargs):
    out = _ORIG["torch_where"](*args, **kwargs)
    if len(args) == 1 and not kwargs and _active() and _unrollable(args[0]):
        _mark(out[0], args[0], True)
    return out


def _iter(self):
    mask = getattr(self, "_mc_loop_mask", None)
    if mask is None or not _active():
        return _ORIG["iter"](self)
    tracer = _tracer()
    from torch.fx.experimental.proxy_tensor import get_proxy_slot

    try:
        mask_node = get_proxy_slot(mask, tracer).proxy.node
    except Exception:  # noqa: BLE001 - a mask that is not traced (a constant): export's own error follows
        return _ORIG["iter"](self)
    f = sys._getframe(1)
    line = linecache.getline(f.f_code.co_filename, f.f_lineno).strip()
    loop = _Loop(f"{f.f_code.co_filename}:{f.f_lineno}: {line}")
    mask_node.meta[_MASK] = (*mask_node.meta.get(_MASK, ()), id(loop))
    _STATE.loops.append(loop)
    scalar = self._mc_loop_scalar
    graph = tracer.graph

    def run():
        for i in range(mask.shape[0]):
            if (loop.where, i) in _STATE.skip:
                continue
            loop.starts.append(_last(graph))
            loop.current = i
            yield _index(i, scalar)
        loop.starts.append(_last(graph))
        loop.current, loop.ended = None, True
        for i, (a, b) in enumerate(zip(loop.starts, loop.starts[1:])):
            names, n = [], a.next
            while n is not b.next and n.op != "root":
                names.append(n.name)
                n.meta[_TAG] = (id(loop), i)
                n = n.next
            loop.names.append(names)

    return run()


def _index(i: int, scalar: bool) -> torch.Tensor:
    """The index as a constant tensor shaped as the element of the nonzero result would be: code that reads its
    value (``experts[e[0]]``, ``self[f"expert_{e[0]}"]``: :func:`_format`) reads ``i``; in an op, a constant."""
    return torch.tensor(i) if scalar else torch.tensor([i])


def _format(self, spec):
    """``Tensor.__format__`` of a fake 0-d tensor that holds a constant (an unrolled index): its value, as eager
    formats a 0-d tensor (torch formats only a plain Tensor by value, a FakeTensor by its repr)."""
    if self.ndim == 0 and getattr(self, "constant", None) is not None and _active():
        return self.item().__format__(spec)
    return _ORIG["format"](self, spec)


# Tensor.nonzero / __iter__ / __format__, torch.nonzero / torch.where while any capture runs
_PATCHES = Patches((torch.Tensor, "nonzero", _nonzero), (torch.Tensor, "__iter__", _iter),
                   (torch.Tensor, "__format__", _format), (torch, "nonzero", _torch_nonzero),
                   (torch, "where", _torch_where))


def _last(graph: fx.Graph) -> fx.Node:
    return graph._root.prev


@contextlib.contextmanager
def unrolling():
    """While capturing (this thread): Python loops over ``nonzero`` of a static 1-D mask run every index;
    yields the list of the loops traced (:func:`guard` completes them on the exported program)."""
    saved = getattr(_STATE, "loops", None), getattr(_STATE, "skip", None)
    with _PATCHES.held():
        _STATE.loops, _STATE.skip = loops, _ = [], set()
        try:
            yield loops
        finally:
            _STATE.loops, _STATE.skip = saved


def exporting(loops: list[_Loop], model, args, kwargs, dynamic_shapes):
    """``torch.export.export`` (non-strict) under :func:`unrolling`. An index whose iteration cannot be traced
    because the body indexes a tensor out of its range with it (DBRX's dispatch mask has a column per expert
    plus one that top-k never selects, and the body reads that expert's weights) is an iteration eager mode can
    never run either (it would raise IndexError): the export is retried without it."""
    for _ in range(MAX_INDICES):
        loops.clear()
        try:
            return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
        except Exception as e:
            running = [lp for lp in loops if not lp.ended and lp.current is not None]
            if not running or not any(isinstance(x, IndexError) for x in exception_chain(e)):
                raise
            _STATE.skip.add((running[-1].where, running[-1].current))
    raise AssertionError("unreachable: every index of every loop skipped")


# -- after the export: each iteration's updates selected by the mask --------------------------------------------


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _same(a, b) -> bool:
    va, vb = _val(a), _val(b)
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype
            and tuple(va.shape) == tuple(vb.shape))


def _writes(n: fx.Node) -> fx.Node | None:
    """The tensor an in-place aten op (``x.add_``, ``x.index_add_``) writes: its first argument."""
    schema = getattr(n.target, "_schema", None)
    if n.op != "call_function" or schema is None or not schema.arguments:
        return None
    first = schema.arguments[0]
    if first.alias_info is not None and first.alias_info.is_write and isinstance(n.args[0], fx.Node):
        return n.args[0]
    return None


def _functional(n: fx.Node):
    """``aten.index_add_.default`` -> ``aten.index_add.default`` (None if aten has none)."""
    packet = n.target.overloadpacket
    name = packet.__name__
    if not name.endswith("_"):
        return None
    other = getattr(aten, name[:-1], None)
    return getattr(other, n.target._overloadname, None) if other is not None else None


def _fake_run(target, args, kwargs):
    from torch._guards import detect_fake_mode

    vals = fx.node.map_arg((args, kwargs), lambda x: x.meta.get("val"))
    mode = detect_fake_mode([v for v in _leaves(vals) if isinstance(v, torch.Tensor)])
    with mode if mode is not None else contextlib.nullcontext():
        return target(*vals[0], **vals[1])


def _leaves(x):
    if isinstance(x, list | tuple):
        for y in x:
            yield from _leaves(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _leaves(y)
    else:
        yield x


def _add(graph: fx.Graph, before: fx.Node, target, args, like: fx.Node | None, kwargs=None) -> fx.Node:
    with graph.inserting_before(before):
        n = graph.call_function(target, tuple(args), kwargs or {})
    if like is not None:
        n.meta.update({k: v for k, v in like.meta.items() if k != "val"})
    n.meta["val"] = _fake_run(target, n.args, n.kwargs)
    return n


def guard(ep, loops: list[_Loop]) -> None:
    """Select each unrolled iteration's updates by its mask entry (module docstring), in ``ep``'s graph."""
    if not loops:
        return
    from mcompile.capture.grad_regions import inline_grad_regions

    # the dispatch's masks and token selections are often computed under torch.no_grad() (DBRX): export keeps
    # such a region as a subgraph, which is inlined first (as canonicalisation would), so that the masks and
    # every iteration's nodes are nodes of the program itself
    inline_grad_regions(ep.graph_module)
    graph = ep.graph_module.graph
    masks = {}
    constants = {s.arg.name: ep.constants.get(s.target) for s in ep.graph_signature.input_specs
                 if s.kind.name == "CONSTANT_TENSOR"}
    out_node = graph.output_node()
    for n in graph.nodes:
        for lp in n.meta.get(_MASK, ()):
            masks[lp] = n
    for loop in loops:
        if not loop.ended:
            raise LoopRefused("a Python loop over the indices a mask selects (nonzero) leaves early (break or "
                              "return inside it): mcompile captures such a loop as one over every index, each "
                              "iteration's update selected by its mask entry, which needs the whole loop", _FIX,
                              loop.where)
        mask = masks.get(id(loop))
        if mask is None:
            raise LoopRefused("the mask of a Python loop over nonzero indices is not in the captured graph",
                              _FIX, loop.where)
        for i in range(len(loop.names)):
            nodes = list(graph.nodes)  # (the iterations before added nodes)
            order = {n: k for k, n in enumerate(nodes)}
            # the nodes the iteration traced (tagged as it ended), with what export inserted among them (the
            # runtime assertions on its data-dependent sizes)
            at = [order[n] for n in nodes if n.meta.get(_TAG) == (id(loop), i) and n.op == "call_function"]
            region = {n for n in nodes[min(at):max(at) + 1] if n.meta.get(_TAG, (id(loop), i)) == (id(loop), i)
                      and n.op == "call_function"} if at else set()
            _guard_iteration(graph, mask, i, region, out_node, order, loop.where, constants)
    ep.graph_module.recompile()


_PASS = (aten.detach_.default, aten.detach.default, aten.lift_fresh_copy.default, aten.clone.default)


def _constant(n, constants: dict):
    """The value of a lifted tensor constant (an unrolled index) ``n`` reads, through copies and detaches."""
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in _PASS:
        n = n.args[0]
    return constants.get(n.name) if isinstance(n, fx.Node) and n.op == "placeholder" else None


def _out_of_range(region, constants: dict) -> bool:
    """Whether the iteration indexes a tensor out of its range with a constant (its unrolled index): eager mode
    could never run it (it would raise IndexError), and the program must not run it either (a gather out of
    range fails at run time, whatever its result is multiplied by)."""
    for n in region:
        if n.target is not aten.index.Tensor:
            continue
        base = _val(n.args[0])
        for d, idx in enumerate(n.args[1]):
            c = _constant(idx, constants)
            if c is not None and isinstance(base.shape[d], int) and c.numel() and \
                    bool(((c >= base.shape[d]) | (c < -base.shape[d])).any()):
                return True
    return False


def _drop(graph, region, order, where) -> None:
    """An iteration eager mode can never run (:func:`_out_of_range`): its updates are its "before" values,
    and its nodes are removed."""
    for x in [n for n in region if any(u not in region for u in n.users)]:
        if not isinstance(_val(x), torch.Tensor):
            continue
        written = _writes(x)
        before = [written] if written is not None and written not in region else \
            [a for a in x.all_input_nodes if a not in region and _same(a, x)]
        if len(before) != 1:
            raise LoopRefused(f"an iteration of a Python loop over nonzero indices hands {x.name} to the code after "
                              "it, which is not an update of one tensor made before the iteration", _FIX, where)
        for u in [u for u in x.users if u not in region]:
            u.replace_input_with(x, before[0])
    for n in sorted(region, key=order.get, reverse=True):
        graph.erase_node(n)


def _guard_iteration(graph, mask, i, region, out_node, order, where, constants) -> None:
    if _out_of_range(region, constants):
        _drop(graph, region, order, where)
        return
    exits = [n for n in region if any(u not in region for u in n.users)]
    if not exits:
        return
    selected = None

    def sel(at):
        nonlocal selected
        if selected is None:
            s = _add(graph, at, aten.select.int, (mask, 0, i), None)
            if _val(mask).dtype != torch.bool:
                s = _add(graph, at, aten.ne.Scalar, (s, 0), None)
            selected = s
        return selected

    for x in sorted(exits, key=order.get):
        vx = _val(x)
        if not isinstance(vx, torch.Tensor):
            if all(not isinstance(_val(u), torch.Tensor) for u in x.users if u not in region and u is not out_node):
                continue  # a size, read by the runtime assertions on it
            raise LoopRefused(f"an iteration of a Python loop over nonzero indices hands {x.name} (not a tensor) "
                              "to the code after it", _FIX, where)
        if out_node in x.users:
            raise LoopRefused("an iteration of a Python loop over nonzero indices returns a value of forward "
                              "directly", _FIX, where)
        written = _writes(x)
        if written is not None and written not in region:
            fn = _functional(x)
            if fn is None:
                raise LoopRefused(f"an iteration of a Python loop over nonzero indices updates a tensor in place "
                                  f"with {x.target}, which has no functional form", _FIX, where)
            others = [n for n in region if n is not x and _writes(n) is written]
            if others:
                raise LoopRefused("an iteration of a Python loop over nonzero indices writes one tensor made "
                                  "before it in place twice", _FIX, where)
            after = x.next
            s = sel(after)
            if fn is aten.index_add.default and len(x.args) >= 4:
                # rows added into the tensor: the mask selects what is added (zeros when the index is left out)
                # rather than which whole tensor goes on, so the running sum stays one chain of index_adds
                # (each expert's partial sum joins it as it comes: one tp reduction after the loop)
                src = _add(graph, after, aten.where.ScalarOther, (s, x.args[3], 0.0), x.args[3])
                g = _add(graph, after, fn, (*x.args[:3], src, *x.args[4:]), x, x.kwargs)
                f = None
            else:
                f = _add(graph, after, fn, x.args, x, x.kwargs)
                g = _add(graph, after, aten.where.self, (s, f, written), x)
            later = [u for u in written.users if u not in (x, f, g) and order.get(u, -1) > order[x]]
            x.replace_all_uses_with(g)
            for u in later:
                u.replace_input_with(written, g)
            graph.erase_node(x)
            continue
        if any(_writes(n) is not None and _writes(n) not in region for n in region):
            raise LoopRefused("an iteration of a Python loop over nonzero indices writes in place a tensor made "
                              "before it, apart from its result", _FIX, where)
        before = [a for a in x.all_input_nodes if a not in region and _same(a, x)]
        if len(before) != 1:
            raise LoopRefused(
                f"an iteration of a Python loop over nonzero indices hands {x.name} to the code after it, which is "
                "not an update of one tensor made before the iteration (e.g. a tensor appended to a list): an "
                "index the mask leaves out would add to it", _FIX, where)
        users = [u for u in x.users if u not in region]
        g = _add(graph, x.next, aten.where.self, (sel(x.next), x, before[0]), x)
        for u in users:
            u.replace_input_with(x, g)
