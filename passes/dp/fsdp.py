"""ZeRO-3 / FSDP as passes: parameters sharded over dp, gathered per layer just before use.

Rajbhandari et al. 2020 (ZeRO stage 3) and PyTorch FSDP (Zhao et al. 2023): each dp rank keeps
1/dp of every parameter (and of its gradient and optimizer state); a layer's parameters are
all-gathered just before the layer runs, freed after, gathered again for its backward, and their
gradients reduce-scattered. Here that is three small graph passes, not a wrapper module:

1. :func:`shard_specs` (model scope): which parameters are sharded over dp and how. A parameter is
   sharded on dim 0 of its tensor-parallel piece, so the dp piece of a rank is a plain chunk of
   what the program computes with. Its DTensor placement over dp is ``Shard(0)`` when tp does not
   shard dim 0, and ``BlockShard(0, tp)`` (torch's ``_StridedShard``, as FSDP2 over TP) when it
   does. Left replicated, with the reason: a dim 0 that dp does not divide, a padded vocabulary,
   a fused block layout on dim 0.
2. :func:`insert_gathers` (rank scope, per program or pipeline stage): each sharded parameter's
   placeholder now receives the dp piece, and ``all_gather(piece, 0, "dp", grad="reduce_scatter")``
   is placed right before its first use. Traced into the joint graph, the gather's backward is the
   reduce-scatter of the parameter's gradient: the gradient of the piece, already summed over dp.
3. :func:`gathered_values` (signature scope, before the partition): the gathers and every value
   computed from gathered parameters alone (views, transposes, casts) are never saved for
   backward, so the partition re-gathers them in backward just before the layer's backward needs
   them (the lazy recompute order of passes/joint.py), and a layer's full parameters live only
   while the layer runs.

With ``Config(overlap=True)`` :func:`prefetch` then makes the gathers asynchronous on the forward
and backward modules. Ordering rule: the gathers of the k-th layer (in order of use) start right
after the (k-1)-th layer's gathers are waited, i.e. while layer k-1 computes (one layer ahead), and
are waited right before their first use; a parameter gradient's reduce-scatter starts as soon as
the gradient exists and is waited (with the accumulation that reads it) right before the next one
starts: one reduce-scatter in flight behind the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from mcompile.ir import meta as M
from mcompile.ir import ops
from mcompile.ir.placements import BlockShard, Shard, ShardSpec, dp_placements, local_piece  # noqa: F401  (re-exported)

__all__ = ["ShardSpec", "shard_specs", "insert_gathers", "gathered_values", "prefetch", "is_param_gather",
           "PrefetchReport", "gathered_in_flight"]


def shard_specs(plan, mesh) -> dict[str, ShardSpec]:
    """fqn -> how ZeRO-3 keeps it over dp (module docstring, 1)."""
    dp = mesh.size("dp")
    names = list(mesh.axis_names)
    out = {}
    for fqn, pp in plan.params.items():
        pl = dict(zip(names, pp.placements))
        local = pp.local_shape
        reason = ""
        if not getattr(torch, pp.dtype.removeprefix("torch."), torch.int64).is_floating_point:
            reason = "not a floating-point parameter"
        elif not local or local[0] % dp:
            reason = f"dim 0 of its local piece ({local[0] if local else 'a scalar'}) does not divide by dp={dp}"
        elif pp.padded_shape is not None:
            reason = "a padded vocabulary"
        elif any(isinstance(p, BlockShard) and p.dim % len(local) == 0 for p in pp.placements):
            reason = "a fused block layout (BlockShard) on dim 0 over another axis"
        if reason:
            out[fqn] = ShardSpec(fqn, None, reason)
            continue
        on_dim0 = [a for a, p in pl.items() if a != "dp" and isinstance(p, Shard) and p.dim % len(local) == 0
                   and mesh.size(a) > 1]
        if len(on_dim0) > 1:
            out[fqn] = ShardSpec(fqn, None, f"dim 0 already sharded over {', '.join(on_dim0)}")
            continue
        blocks = mesh.size(on_dim0[0]) if on_dim0 else 1
        out[fqn] = ShardSpec(fqn, BlockShard(0, blocks) if blocks > 1 else Shard(0))
    return out


def insert_gathers(gm: fx.GraphModule, placeholders: set[str], dp: int) -> list[fx.Node]:
    """Module docstring, 2: a gather before the first use of each placeholder in ``placeholders``.
    Returns the gather nodes. Recompiles."""
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    gathers = []
    for ph in [n for n in g.nodes if n.op == "placeholder" and n.name in placeholders and n.users]:
        first = min(ph.users, key=order.__getitem__)
        with g.inserting_before(first):
            ag = g.call_function(ops.OPS["all_gather"], (ph, 0, "dp", dp, "reduce_scatter"))
        for k in (M.LAYER, "nn_module_stack", "stack_trace"):
            if k in first.meta:
                ag.meta[k] = first.meta[k]
        ag.meta[M.ORIGIN] = f"zero3 gather {ph.name}"
        ph.replace_all_uses_with(ag, delete_user_cb=lambda u, ag=ag: u is not ag)
        gathers.append(ag)
    g.lint()
    gm.recompile()
    return gathers


def is_param_gather(n: fx.Node) -> bool:
    """A ZeRO-3 gather in a traced module: an all-gather over dp of a module input (a parameter piece)."""
    return (n.op == "call_function" and n.target is ops.OPS["all_gather"] and n.args[2] == "dp"
            and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder")


def gathered_values(gm: fx.GraphModule, forward: set[str] | None = None) -> set[str]:
    """Module docstring, 3: names of the param gathers of a joint graph and of every forward value
    computed from them alone (constants aside)."""
    out: set[str] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or (forward is not None and n.name not in forward):
            continue
        if is_param_gather(n):
            out.add(n.name)
            continue
        ins = n.all_input_nodes
        if ins and all(a.name in out for a in ins):
            out.add(n.name)
    return out


@dataclass(frozen=True)
class PrefetchReport:
    gathers: int  # made asynchronous
    groups: int  # layers (groups of gathers started together)
    reduce_scatters: int  # gradient reduce-scatters made asynchronous
    max_in_flight: int  # most gathers started and not yet waited at one point


def _layer(n: fx.Node):
    c = n.meta.get("custom", {})
    return c.get(M.LAYER, n.meta.get(M.LAYER))


def prefetch(gm: fx.GraphModule, where: str = "") -> PrefetchReport:
    """Module docstring, ordering rule: the param gathers and gradient reduce-scatters over dp of a
    forward or backward module made asynchronous. Recompiles; checks the waits."""
    from mcompile.passes.dp.overlap import check_waits, make_async

    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    gathers = sorted([n for n in g.nodes if is_param_gather(n)],
                     key=lambda n: order[min(n.users, key=order.__getitem__)] if n.users else order[n])
    groups: list[list[fx.Node]] = []
    for n in gathers:
        if groups and _layer(groups[-1][0]) == _layer(n):  # (None: outside the layers, e.g. final norm + head)
            groups[-1].append(n)
        else:
            groups.append([n])
    prev_wait = None
    for grp in groups:
        waits = []
        for n in grp:
            _, w, _ = make_async(gm, n, start_after=prev_wait)
            waits.append(w)
        order = {n: i for i, n in enumerate(g.nodes)}
        prev_wait = min(waits, key=order.__getitem__)  # the layer starts computing: the next one's gathers start
    # gradient reduce-scatters: each starts as soon as its gradient exists; what reads it (the
    # accumulation into the main gradient) moves to just after the next gradient is computed, where
    # the wait goes: one reduce-scatter in flight behind the backward, the next starts after it is waited
    rs = [n for n in g.nodes if n.op == "call_function" and n.target is ops.OPS["reduce_scatter"]
          and n.args[2] == "dp"]
    out_node = next(n for n in g.nodes if n.op == "output")
    prev_tail = None
    for i, n in enumerate(rs):
        order = {m: k for k, m in enumerate(g.nodes)}
        x = n.args[0]
        start_after = x if prev_tail is None or order[x] > order[prev_tail] else prev_tail
        nxt = rs[i + 1].args[0] if i + 1 < len(rs) else None
        anchor = out_node if nxt is None else nxt.next
        moving, seen = [], {n}
        if order[anchor] > order[n]:
            for m in list(g.nodes)[order[n] + 1:order[anchor]]:
                if any(a in seen for a in m.all_input_nodes):
                    moving.append(m)
                    seen.add(m)
            if nxt is not None and nxt in seen:  # the next gradient reads this one: no move
                moving = []
        for m in moving:
            anchor.prepend(m)
        _, w, _ = make_async(gm, n, start_after=start_after, wait_before=moving[0] if moving else None)
        prev_tail = moving[-1] if moving else w
    g.lint()
    gm.recompile()
    check_waits(gm, where)
    in_flight, most = 0, 0
    for n in g.nodes:
        if n.op == "call_function" and n.target is ops.STARTS["all_gather"]:
            in_flight += 1
            most = max(most, in_flight)
        elif n.op == "call_function" and n.target is ops.WAIT and n.args[0].target is ops.STARTS["all_gather"]:
            in_flight -= 1
    return PrefetchReport(len(gathers), len(groups), len(rs), most)


def replicated_reasons(specs: dict[str, ShardSpec]) -> list[str]:
    return [f"{s.fqn}: {s.reason}" for s in specs.values() if not s.sharded]



def gathered_in_flight(gm: fx.GraphModule) -> tuple[int, list[int]]:
    """Bytes of gathered (full) parameters live at once in a forward or backward module, at most, and
    the bytes of each layer group of gathers in order of use: a gathered buffer is live from its
    gather (or start) to the last reader of it or of a view of it (fx frees a value after its last
    use). ZeRO-3's promise: at most the layer being computed and the one prefetched."""
    from mcompile.passes.joint import is_alias

    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    roots = [n for n in nodes if is_param_gather(n) or
             (n.op == "call_function" and n.target is ops.STARTS["all_gather"] and n.args[1] == "dp"
              and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder")]
    spans, groups = [], []
    for r in roots:
        val = r.meta.get("val")
        nbytes = val.numel() * val.element_size() if val is not None else 0
        last, todo = order[r], [r]
        while todo:
            x = todo.pop()
            for u in x.users:
                last = max(last, order[u])
                if is_alias(u):
                    todo.append(u)
        spans.append((order[r], last, nbytes))
        lay = _layer(r)
        if groups and groups[-1][0] == lay:
            groups[-1][1] += nbytes
        else:
            groups.append([lay, nbytes])
    most = max((sum(b for s0, e, b in spans if s0 <= i <= e) for i in range(len(nodes))), default=0)
    return most, [b for _, b in groups]
