"""Overlap passes: collectives started as early as their input allows, waited as late as their first use.

They rewrite the forward and backward modules of a joint program (passes/joint.py) *after* the
partition, so each sees the order the runtime will execute and needs no backward of its own. Each
states its ordering rule; :func:`check_waits` proves every started collective is waited exactly
once, after its start and before any other use of its buffer, and that every rank issues its
collectives in one order (the graph order is the issue order on every rank: the passes are
deterministic functions of the program, which is the same on every rank of a group).

The asynchronous ops (mcompile.ir.ops ``start_*`` / ``wait``) work on dim 0; a collective on another
dim is wrapped in ``permute`` + ``contiguous`` on both sides (:func:`make_async`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from mcompile.ir import ops
from mcompile.ir.meta import ACC_OUTPUT
from mcompile.ir.ops import grad_sink, grads_ready  # noqa: F401  (the op launch_buckets places, kept in the IR)

__all__ = ["check_waits", "make_async", "OverlapError", "is_start", "is_wait",
           "launch_buckets", "grad_sink", "BucketLaunch", "inplace_all_reduces"]

_SYNC = {ops.OPS["all_gather"]: "all_gather", ops.OPS["reduce_scatter"]: "reduce_scatter",
         ops.OPS["all_reduce"]: "all_reduce"}


class OverlapError(RuntimeError):
    pass


def is_start(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in ops.STARTS.values()


def is_wait(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is ops.WAIT


def check_waits(gm: fx.GraphModule, where: str = "") -> None:
    """Every ``start_*`` node has exactly one ``wait`` on it, placed after it, which also takes the
    start's input (so a compiler keeps that input's memory unwritten until the wait: mcompile.ir.ops);
    every other user of the started buffer comes after that wait. Raises :class:`OverlapError`
    naming the node."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    at = f" in {where}" if where else ""
    for n in gm.graph.nodes:
        if not is_start(n):
            continue
        waits = [u for u in n.users if is_wait(u)]
        if len(waits) != 1:
            raise OverlapError(f"{n.name}{at}: started collective has {len(waits)} waits (needs exactly one)")
        w = waits[0]
        if order[w] < order[n]:
            raise OverlapError(f"{n.name}{at}: waited at {w.name} before it starts")
        if len(w.args) < 2 or w.args[1] is not n.args[0]:
            raise OverlapError(
                f"{n.name}{at}: its wait {w.name} does not take the start's input {n.args[0]} "
                f"(write wait({n.name}, {n.args[0]}): the input must stay live until the collective is waited)")
        early = [u.name for u in n.users if u is not w and order[u] < order[w]]
        if early:
            raise OverlapError(f"{n.name}{at}: read by {', '.join(early)} before its wait {w.name}")
    for n in gm.graph.nodes:
        if is_wait(n) and not is_start(n.args[0]):
            raise OverlapError(f"{n.name}{at}: waits on {n.args[0]}, which no collective was started into")


def _fresh_and_dead(x, reader: fx.Node) -> bool:
    """``x`` is a tensor an aten op of this module made (not an input, not a view of one, not a buffer a
    custom op may hold on to), read by ``reader`` alone — through views that ``reader`` alone reads —
    so ``reader`` may overwrite it."""
    while True:
        if not isinstance(x, fx.Node) or x.op != "call_function" or list(x.users) != [reader]:
            return False
        t = x.target
        if not isinstance(t, torch._ops.OpOverload) or t.namespace != "aten" or t._schema.is_mutable or \
                torch._C._dispatch_has_kernel_for_dispatch_key(t.name(), "CompositeImplicitAutograd"):
            return False  # (a composite: reshape, contiguous, to ... may return its input or a view of it)
        if not t.is_view and t is not torch.ops.aten._unsafe_view.default:  # (a view without alias annotation)
            return not any(r.alias_info is not None for r in t._schema.returns)
        reader, x = x, x.args[0]  # a view: its base must be as fresh and read by this view alone


def inplace_all_reduces(gm: fx.GraphModule) -> int:
    """Each synchronous ``all_reduce`` whose input is fresh and read by nothing else
    (:func:`_fresh_and_dead`) becomes ``all_reduce_inplace`` on that input (no copy of it: the runtime's
    all-reduce otherwise clones its input, which the program may still read); its readers read the input.
    Returns how many. For eager modules only: inductor decides its own buffer reuse."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not ops.OPS["all_reduce"]:
            continue
        x = node.args[0]
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if not isinstance(val, torch.Tensor) or not val.is_contiguous() or not _fresh_and_dead(x, node):
            continue
        with gm.graph.inserting_before(node):
            red = gm.graph.call_function(ops.ALL_REDUCE_INPLACE, (x, *node.args[1:]))
        red.meta.update({k: node.meta[k] for k in ("custom", "stack_trace", "nn_module_stack") if k in node.meta})
        node.replace_all_uses_with(x, delete_user_cb=lambda u, red=red: u is not red)
        gm.graph.erase_node(node)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _perm_to_front(ndim: int, dim: int) -> list[int]:
    return [dim] + [d for d in range(ndim) if d != dim]


def _perm_from_front(ndim: int, dim: int) -> list[int]:
    fwd = _perm_to_front(ndim, dim)
    return [fwd.index(d) for d in range(ndim)]


def make_async(gm: fx.GraphModule, node: fx.Node, *, start_after: fx.Node | None = None,
               wait_before: fx.Node | None = None) -> tuple[fx.Node, fx.Node, fx.Node]:
    """Replace the synchronous collective ``node`` (mcompile.all_gather / reduce_scatter /
    all_reduce) by a start and a wait. The start goes right after ``start_after`` (default: right
    after its input is computed — as early as its input allows), the wait right before
    ``wait_before`` (default: the first user of ``node`` — as late as its first use). Returns
    (start, wait, result): ``result`` is what the users of ``node`` now read. Does not recompile."""
    kind = _SYNC[node.target]
    x = node.args[0]
    if kind == "all_reduce":
        dim, axis, n = 0, node.args[1], node.args[2]
    else:
        dim, axis, n = node.args[1], node.args[2], node.args[3]
    val = node.meta.get("val")
    xval = x.meta.get("val") if isinstance(x, fx.Node) else None
    ndim = xval.ndim if xval is not None else (val.ndim if val is not None else None)
    if ndim is None and dim != 0:
        raise OverlapError(f"{node.name}: a collective on dim {dim} needs shape metadata to be made asynchronous")
    dim = dim % ndim if ndim else dim
    order = {m: i for i, m in enumerate(gm.graph.nodes)}
    users = sorted(node.users, key=order.__getitem__)
    if start_after is None:
        start_after = x if isinstance(x, fx.Node) else next(iter(gm.graph.nodes))
    if wait_before is None:
        wait_before = users[0] if users else node
    if order[start_after] >= order[wait_before]:
        raise OverlapError(f"{node.name}: its start ({start_after.name}) is not before its first use "
                           f"({wait_before.name})")
    g = gm.graph
    with g.inserting_after(start_after):
        src = x
        if dim != 0:
            src = g.call_function(torch.ops.aten.permute.default, (x, _perm_to_front(ndim, dim)))
        start = g.call_function(ops.STARTS[kind], (src, axis, n))
    if src is not x:
        start.prepend(src)  # permute right before its start
    with g.inserting_before(wait_before):
        w = g.call_function(ops.WAIT, (start, src))  # src read at the wait: live until then (mcompile.ir.ops)
        res = start
        if dim != 0:
            back = g.call_function(torch.ops.aten.permute.default, (start, _perm_from_front(ndim, dim)))
            res = g.call_function(torch.ops.aten.clone.default, (back,),
                                  {"memory_format": torch.contiguous_format})
    for k in ("val", "tensor_meta"):
        if k in node.meta:
            res.meta[k] = node.meta[k]
    for k in ("custom", "stack_trace", "nn_module_stack"):
        if k in node.meta:
            start.meta[k] = w.meta[k] = node.meta[k]
    node.replace_all_uses_with(res)
    g.erase_node(node)
    return start, w, res


# ---------------------------------------------------------------------------------------------
# dp gradient buckets launched inside the backward
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BucketLaunch:
    bucket: int
    after: str  # the accumulation after which the bucket is launched
    grads: int  # how many of the bucket's gradients this module adds
    nodes_after: int  # compute nodes of the module that run after the launch (what it overlaps with)


def launch_buckets(gm: fx.GraphModule, bucket_of: dict[int, int]) -> list[BucketLaunch]:
    """Ordering rule: a dp gradient bucket is launched right after the last of its gradients that this
    module computes is added into its buffer (as early as its input allows); it is waited at the end
    of the step (``Leaves.finish``: on NCCL a wait orders the compute stream behind the reduction, so
    waiting inside a pipeline stage's backward would hold back the stages after it).

    ``bucket_of``: output position of the module (the gradient's position, ``ACC_OUTPUT`` of its
    accumulation node) -> bucket index, for the gradients whose bucket is reduced over dp. Inserts
    one ``mcompile.grads_ready`` per bucket; returns what it placed. Recompiles."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    by_bucket: dict[int, list[fx.Node]] = {}
    for n in nodes:
        j = n.meta.get(ACC_OUTPUT)
        if j is not None and j in bucket_of:
            by_bucket.setdefault(bucket_of[j], []).append(n)
    out = []
    compute = [n for n in nodes if n.op == "call_function"]
    for b, adds in sorted(by_bucket.items(), key=lambda kv: order[kv[1][-1]]):
        last = max(adds, key=order.__getitem__)
        with gm.graph.inserting_after(last):
            gm.graph.call_function(torch.ops.mcompile.grads_ready.default, (list(adds), b))
        out.append(BucketLaunch(b, last.name, len(adds), sum(order[c] > order[last] for c in compute)))
    gm.graph.lint()
    gm.recompile()
    return out
