"""Collective matmul: tensor-parallel all-gather / reduce-scatter overlapped with their GEMMs by chunking.

Wang et al., ASPLOS 2023 ("Overlap Communication with Dependent Computation via Decomposition in
Large Deep Learning Models"); Megatron-LM's ``tp_comm_overlap`` does the same with userbuffers. The
pass rewrites a partitioned forward or backward module (passes/joint.py) in place:

- **all-gather -> matmul** (SP into a column-parallel linear; in backward, the gathered output
  gradient into the input-gradient GEMM): the local input is split into k chunks along a dim that is
  not gathered; all k chunk all-gathers are started at once; then per chunk: wait, shape ops, every
  row-wise matmul of the chunk. Chunk j's gather runs under the GEMMs of chunks < j.
- **matmul -> reduce-scatter** (a row-parallel linear out of the tp region; in backward, the sum of
  the input-gradient GEMMs): per chunk of rows: the GEMMs (and the adds of their partial products),
  shape ops, start the chunk's reduce-scatter; all waits just before the first reader. Chunk j's
  reduce-scatter runs under the GEMMs of chunks > j.
- **matmul -> all-reduce** (without SP: a row-parallel linear's *g*; in backward, the input gradient of
  a column-parallel block, the backward of *f*): as matmul -> reduce-scatter, each chunk's GEMMs then
  the start of its all-reduce, all waits before the first reader. An all-reduce touches no dim, so the
  chunks are contiguous row blocks at any batch (the sequence at batch 1).

**Which dim.** A chunk must be a set of the matmul's rows that is the same in every row view of
the tensor ([b, s, h] or [b*s, h]), so the pass chunks the first dim of size > 1 (every dim before it
has size 1), never the matmul's contraction dim. Under SP with batch > 1 that is the batch dim, not
the gathered / scattered one: chunk j is the j-th contiguous block of rows, and a collective over a
chunk of a non-collective dim is the chunk of the collective. At batch 1 (Megatron's usual micro-
batch) the first dim of size > 1 is the gathered / scattered sequence itself; then chunk j is
*rank-strided*: the j-th of k blocks of every rank's sequence shard (rows ``r * s/n + j * s/(n k) +
i``, i < s/(n k), for every rank r). All-gathering the j-th block of each rank's local shard yields
exactly those rows, rank-major (the GEMM outputs of the k chunks are interleaved back: view
``[n, s/(n k), ..]``, concatenate on the second dim); for a reduce-scatter, the chunk's rows of the
matmul input are copied out (one copy of the input in all), and the reduce-scatter of chunk j hands
rank r its rows ``r * s/n + j * s/(n k) + i`` — its own shard's j-th block, concatenated in order.
The layout is that of TransformerEngine's / Megatron's userbuffers overlap under sequence parallelism,
where each rank's shard is the unit (Wang et al. decompose the same way). Every value is computed with
the same reductions as before: a row block of a GEMM is the GEMM of the row block, an add of row
blocks is the row block of the add, and each chunk's collective moves or sums the same rows.

**When** (``tp_overlap``): ``"off"``, an int k >= 2 (every eligible op, k clamped down to a divisor
of every chunked size), or ``"auto"``: per op, with comm from :func:`mcompile.cost.model.collective_time`
over the tp link and each GEMM on the roofline ``max(flops / (peak * eff), bytes / (hbm * eff))``::

    t(1) = comm + gemm                                       (the GEMM waits for the whole collective)
    t(k) = comm/k + (k - 1) * max(gemm/k, comm/k) + gemm/k + copies
           (comm/k, gemm/k: one chunk's time — comm/k pays the α of every ring step once per chunk,
            gemm/k re-reads the weight once per chunk; copies: the concatenations the rewrite adds)

on hardware that cannot overlap (``Hardware.comm_overlaps_compute`` False) ``t(k) = k (comm/k +
gemm/k) + copies``. The best k in {2, 4} is taken when it beats t(1); else the op is skipped and the
:class:`Decision` says by how much it lost. ``"symm_mem"`` asks for torch's fused async-TP ops
(``torch.ops.symm_mem.fused_all_gather_matmul``); mcompile does not emit them yet, so it warns and
takes the chunked decomposition chosen as under ``"auto"``.

Requires: aten-level module with ``meta["val"]`` on its nodes. Ensures: :func:`check_waits`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from mcompile.ir import ops
from mcompile.passes.dp.overlap import _perm_from_front, _perm_to_front, check_waits, is_start, is_wait

__all__ = ["Decision", "rewrite", "symm_mem_available", "AG_MM", "MM_RS", "MM_AR"]

aten = torch.ops.aten
_AG, _RS, _AR = ops.OPS["all_gather"], ops.OPS["reduce_scatter"], ops.OPS["all_reduce"]
_ROW_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_MM = {aten.mm.default: 0, aten.addmm.default: 1}  # matmul -> position of its row operand
AG_MM, MM_RS, MM_AR = "all_gather->matmul", "matmul->reduce_scatter", "matmul->all_reduce"
_PATTERN = {_AG: AG_MM, _RS: MM_RS, _AR: MM_AR}


def _axis(node: fx.Node) -> str:
    return node.args[1] if node.target is _AR else node.args[2]  # all_reduce(x, axis, n); the others (x, dim, axis, n)


@dataclass(frozen=True)
class Decision:
    """What the pass did with one tp collective: ``chunks`` 1 means left as it was (``reason`` says
    why); ``saved_s`` is the predicted time saved (cost model; negative: chunking would lose)."""

    op: str
    pattern: str
    chunks: int
    saved_s: float | None = None
    reason: str = ""
    where: str = "forward"

    def __str__(self) -> str:
        gain = f", predicted {self.saved_s * 1e6:+.2f} us saved" if self.saved_s is not None else ""
        what = f"{self.chunks} chunks" if self.chunks > 1 else "skipped"
        return f"{self.where} {self.op} ({self.pattern}): {what}{gain}" + (f" — {self.reason}" if self.reason else "")


def symm_mem_available() -> tuple[bool, str]:
    """Whether mcompile can use torch's symmetric-memory async-TP ops here, and why not."""
    if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
        return False, "no CUDA/NCCL here (the CPU runtime uses gloo)"
    if not hasattr(getattr(torch.ops, "symm_mem", None), "fused_all_gather_matmul"):
        return False, f"torch {torch.__version__} lacks torch.ops.symm_mem.fused_all_gather_matmul"
    return False, "mcompile does not emit the fused symm_mem ops yet"


def rewrite(gm: fx.GraphModule, *, tp_overlap="auto", hardware=None, where: str = "forward",
            axes: tuple[str, ...] = ("tp",)) -> list[Decision]:
    """Chunk every eligible tp all-gather -> matmul and matmul -> reduce-scatter of ``gm`` in place
    and matmul -> all-reduce (module docstring); returns one :class:`Decision` per tp all-gather / reduce-scatter /
    all-reduce (none when
    ``tp_overlap="off"``). ``hardware``: a profile or its name (default H100) for ``"auto"``."""
    if tp_overlap == "off":
        return []
    if tp_overlap == "symm_mem":
        _, why = symm_mem_available()
        warnings.warn(f"tp_overlap='symm_mem': torch's symmetric-memory async-TP ops cannot be used ({why}); "
                      "falling back to the chunked decomposition (collective matmul, chunks chosen as under "
                      "tp_overlap='auto')", stacklevel=2)
        tp_overlap = "auto"
    if not (tp_overlap == "auto" or (isinstance(tp_overlap, int) and not isinstance(tp_overlap, bool)
                                     and tp_overlap >= 2)):
        raise ValueError(f"tp_overlap={tp_overlap!r}: use 'auto', 'off', 'symm_mem' or a number of chunks >= 2")
    from mcompile.cost.hardware import get_hardware

    hw = get_hardware(hardware if hardware is not None else "h100")
    decisions = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _PATTERN or _axis(node) not in axes:
            continue
        match = _match_gather(node) if node.target is _AG else _match_scatter(node)
        pattern = _PATTERN[node.target]
        if isinstance(match, str):
            decisions.append(Decision(node.name, pattern, 1, None, match, where))
            continue
        st = match.stride
        valid = [k for k in range(2, min(match.rows // st, 64) + 1) if all(s % (k * st) == 0 for s in match.sizes)]
        if not valid:
            what = "the chunked sizes" if st == 1 else f"each rank's share (1/{st}, batch 1: rank-strided) of the sizes"
            decisions.append(Decision(node.name, pattern, 1, None, f"no k >= 2 divides {what} "
                                      f"{sorted(set(match.sizes))}", where))
            continue
        if tp_overlap == "auto":
            times = {k: _time(match, k, hw, where) for k in (1, 2, 4) if k == 1 or k in valid}
            k = min((c for c in times if c > 1), key=times.__getitem__, default=None)
            if k is None:
                decisions.append(Decision(node.name, pattern, 1, None, f"'auto' tries 2 or 4 chunks; neither divides "
                                          f"the chunked sizes {sorted(set(match.sizes))}", where))
                continue
            saved = times[1] - times[k]
            if saved <= 0:
                decisions.append(Decision(node.name, pattern, 1, saved, f"chunking predicted slower on {hw.name}: "
                                          + ", ".join(f"t({c})={t * 1e6:.3g} us" for c, t in times.items()), where))
                continue
            reason = f"cost model on {hw.name}: t(1)={times[1] * 1e6:.3g} us, t({k})={times[k] * 1e6:.3g} us"
        else:
            if min(valid) > tp_overlap:
                decisions.append(Decision(node.name, pattern, 1, None, f"no k in 2..{tp_overlap} divides the chunked "
                                          f"sizes {sorted(set(match.sizes))}", where))
                continue
            k = max(v for v in valid if v <= tp_overlap)
            saved = _time(match, 1, hw, where) - _time(match, k, hw, where)
            reason = f"tp_overlap={tp_overlap}" + (f", clamped to {k}" if k != tp_overlap else "")
        err = _late_operands(match) if node.target is _AG else _early_readers(match)
        if err:
            decisions.append(Decision(node.name, pattern, 1, saved, err, where))
            continue
        (_rewrite_gather if node.target is _AG else _rewrite_scatter)(gm, match, k)  # (reduce-scatter or all-reduce)
        decisions.append(Decision(node.name, pattern, k, saved, reason, where))
    check_waits(gm, where)
    gm.graph.lint()
    gm.recompile()
    return decisions


# ---- matching ------------------------------------------------------------------------------------
@dataclass
class _Match:
    coll: fx.Node  # the synchronous collective
    cdim: int  # the chunked dim of the collective's (full) tensor
    tree: list[fx.Node]  # row views / adds between the collective and the matmuls, graph order
    mms: list[fx.Node]  # the row-wise matmuls
    sizes: list[int]  # every chunked size: k must divide each
    rows: int  # size of the chunked dim
    stride: int = 1  # 1: contiguous row blocks; n (batch 1, the chunked dim is the collective's): rank-strided
    late: list[fx.Node] = field(default_factory=list)  # operands of the matmuls to move up (all-gather)


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _chunk_dim(shape) -> int | None:
    return next((i for i, s in enumerate(shape) if s > 1), None)


def _rowwise_mm(m: fx.Node, v: fx.Node) -> bool:
    """``m`` multiplies the rows of 2-d ``v`` by operands that are not ``v`` (a bias broadcast on rows)."""
    pos = _MM.get(m.target)
    if pos is None or m.args[pos] is not v or _val(v) is None or _val(v).ndim != 2 or _val(v).shape[0] < 2:
        return False
    others = [a for i, a in enumerate(m.args) if i != pos]
    if v in others or (m.target is aten.addmm.default and (_val(m.args[0]) is None or _val(m.args[0]).ndim != 1)):
        return False
    return True


def _match_gather(ag: fx.Node) -> _Match | str:
    y, g = _val(ag), ag.args[1]
    if y is None:
        return "no shape metadata"
    g %= y.ndim
    cd = _chunk_dim(y.shape)
    if cd is None:
        return "no dim to chunk: the gathered tensor has one row"
    stride = ag.args[3] if cd == g else 1  # batch 1: rank-strided chunks of the gathered dim (module docstring)
    tree, mms, sizes, todo = [], [], [y.shape[cd]], [ag]
    while todo:
        v = todo.pop()
        for u in v.users:
            if u.target in _ROW_VIEWS and _val(u) is not None and _chunk_dim(_val(u).shape) is not None \
                    and _chunk_dim(_val(u).shape) < _val(u).ndim - 1:
                tree.append(u)
                sizes.append(_val(u).shape[_chunk_dim(_val(u).shape)])
                todo.append(u)
            elif _rowwise_mm(u, v) and u not in mms:
                mms.append(u)
                sizes.append(_val(v).shape[0])
    if not mms:
        return "no matmul reads the gathered rows (users: " + ", ".join(u.name for u in ag.users) + ")"
    order = {n: i for i, n in enumerate(ag.graph.nodes)}
    return _Match(ag, cd, sorted(tree, key=order.__getitem__), sorted(mms, key=order.__getitem__), sizes, y.shape[cd],
                  stride)


def _match_scatter(rs: fx.Node) -> _Match | str:
    """matmul -> reduce-scatter, or matmul -> all-reduce (no collective dim: contiguous row blocks)."""
    z = _val(rs.args[0])
    if z is None:
        return "no shape metadata"
    g = None if rs.target is _AR else rs.args[1] % z.ndim
    cd = _chunk_dim(z.shape)
    if cd is None:
        return f"no dim to chunk: the {'all-reduced' if g is None else 'reduce-scattered'} tensor has one row"
    stride = rs.args[3] if cd == g else 1  # batch 1: rank-strided chunks of the scattered dim (module docstring)
    tree, mms, sizes, todo = [], [], [z.shape[cd]], [rs.args[0]]
    while todo:
        v = todo.pop()
        val = _val(v)
        if not isinstance(v, fx.Node) or val is None:
            return "the collective's input is not computed by matmuls"
        if v.target in _MM and _rowwise_mm(v, v.args[_MM[v.target]]):
            if stride > 1 and not _val(v.args[_MM[v.target]]).is_contiguous():
                return f"batch 1: the rows of {v.name}'s input are not contiguous, so its chunks cannot be viewed out"
            mms.append(v)
            sizes.append(val.shape[0])
        elif v.target in _ROW_VIEWS and _chunk_dim(val.shape) is not None:
            tree.append(v)
            sizes.append(val.shape[_chunk_dim(val.shape)])
            todo.append(v.args[0])
        elif v.target is aten.add.Tensor and len(v.args) == 2 and not v.kwargs and \
                all(_val(a) is not None and _val(a).shape == val.shape for a in v.args):
            tree.append(v)
            sizes.append(val.shape[_chunk_dim(val.shape)] if _chunk_dim(val.shape) is not None else 1)
            todo.extend(v.args)
        else:
            return f"the collective's input is not computed by matmuls ({v.name}: {v.target})"
    order = {n: i for i, n in enumerate(rs.graph.nodes)}
    return _Match(rs, cd, sorted(set(tree), key=order.__getitem__), sorted(set(mms), key=order.__getitem__), sizes,
                  z.shape[cd], stride)


def _late_operands(m: _Match) -> str:
    """The matmuls' other operands are computed before the first reader of the gathered tensor, or can
    be moved there (a weight's ``t``); '' when so, else the reason."""
    order = {n: i for i, n in enumerate(m.coll.graph.nodes)}
    first = min(order[u] for u in m.coll.users)
    late, todo = set(), [a for mm in m.mms for a in mm.all_input_nodes if a not in m.tree and a is not m.coll]
    while todo:
        a = todo.pop()
        if order[a] >= first and a not in late:
            late.add(a)
            todo.extend(a.all_input_nodes)
            # an operand read from a started collective (a ZeRO-3 weight gather, passes/dp/fsdp.py): its wait
            # moves up with it, so the buffer is still waited before it is read
            todo.extend(w for b in a.all_input_nodes if is_start(b) for w in b.users if is_wait(w))
    tainted = _descendants(m.coll)
    bad = [a.name for a in late if a in tainted]
    if bad:
        return f"a matmul operand ({', '.join(sorted(bad))}) depends on the gathered tensor"
    m.late = sorted(late, key=order.__getitem__)
    return ""


def _early_readers(m: _Match) -> str:
    order = {n: i for i, n in enumerate(m.coll.graph.nodes)}
    inside = set(m.tree) | set(m.mms) | {m.coll}
    early = [u.name for n in m.tree + m.mms for u in n.users if u not in inside and order[u] < order[m.coll]]
    return f"a partial product is read before the collective ({', '.join(early)})" if early else ""


def _descendants(root: fx.Node) -> set[fx.Node]:
    out, todo = set(), [root]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in out:
                out.add(u)
                todo.append(u)
    return out


# ---- cost ----------------------------------------------------------------------------------------
def _time(m: _Match, k: int, hw, where: str) -> float:
    """Predicted seconds of the collective and its GEMMs in k chunks (module docstring)."""
    from mcompile.cost.model import DEFAULT_EFFICIENCY, collective_time

    eff = DEFAULT_EFFICIENCY.for_hardware(hw)
    coll = m.coll
    full = _val(coll) if coll.target is _AG else _val(coll.args[0])
    size = full.element_size()
    n = coll.args[2] if coll.target is _AR else coll.args[3]
    beta, alpha = ((hw.intra_node_bandwidth * eff.intra_node, hw.intra_node_latency) if n <= hw.gpus_per_node
                   else (hw.inter_node_bandwidth * eff.inter_node, hw.inter_node_latency))
    kind = {_AG: "all_gather", _RS: "reduce_scatter", _AR: "all_reduce"}[coll.target]
    comm = float(collective_time(kind, full.numel() * size / k, n, beta, alpha, hw.collective_call_latency))
    hbm = hw.hbm_bandwidth * eff.memory
    gemm = 0.0
    for mm in m.mms:
        a, w, out = (_val(x) for x in (mm.args[_MM[mm.target]], mm.args[_MM[mm.target] + 1], mm))
        rows, kk, cols = a.shape[0] / k, a.shape[1], out.shape[1]
        flops = 2 * rows * kk * cols
        nbytes = (rows * kk + kk * cols + rows * cols) * out.element_size()  # the weight read once per chunk
        gemm += max(flops / (_peak(hw, out.dtype) * eff.gemm), nbytes / hbm)
    gemm += sum(3 * _val(a).numel() * size / k for a in m.tree if a.target is aten.add.Tensor) / hbm
    if k == 1:
        return comm + gemm
    # concatenations the rewrite adds (read + write): the matmuls' outputs, or the reduce-scatter's
    copies = 2 * size * (sum(_val(mm).numel() for mm in m.mms) if coll.target is _AG else _val(coll).numel()) / hbm
    if m.stride > 1 and coll.target is _RS:  # batch 1: each chunk's rows of the matmul inputs are copied out
        copies += 2 * size * sum(_val(a).numel() for a in {mm.args[_MM[mm.target]] for mm in m.mms}) / hbm
    nodes = k * (len(m.tree) + len(m.mms) + 3) * (hw.op_overhead_forward if where == "forward"
                                                  else hw.op_overhead_backward)
    if not hw.comm_overlaps_compute:
        return k * (comm + gemm) + copies + nodes
    return comm + (k - 1) * max(comm, gemm) + gemm + copies + nodes


def _peak(hw, dtype: torch.dtype) -> float:
    try:
        return hw.peak_flops(str(dtype).replace("torch.", ""))
    except ValueError:  # float64 and other dtypes without a tensor-core rate: the fp32 one (an optimistic bound)
        return hw.fp32_flops


# ---- rewriting -----------------------------------------------------------------------------------
def _call(g: fx.Graph, target, args, kwargs=None, like: fx.Node | None = None) -> fx.Node:
    """A new node with its ``meta['val']`` (run on the fake values of its inputs) and ``like``'s meta."""
    node = g.call_function(target, tuple(args), kwargs or {})
    vals = [_val(a) for a in node.all_input_nodes]
    if target is not ops.WAIT and vals and all(isinstance(v, torch.Tensor) for v in vals):
        from torch._guards import detect_fake_mode

        mode = detect_fake_mode(vals)
        if mode is not None:
            with mode:
                node.meta["val"] = target(*fx.node.map_arg(node.args, _val), **fx.node.map_arg(node.kwargs, _val))
    if like is not None:
        for key in ("custom", "stack_trace", "nn_module_stack"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
    return node


def _chunk_shape(shape, k: int) -> list[int]:
    cd = _chunk_dim(shape)
    return [s // k if i == cd else s for i, s in enumerate(shape)]


def _cat(g: fx.Graph, parts: list[fx.Node], dim: int, stride: int, like: fx.Node) -> fx.Node:
    """The whole tensor from its k chunks along ``dim``: concatenated (``stride`` 1), or, rank-strided chunks
    (``stride`` n: each chunk holds n rank-major blocks), interleaved back — each chunk viewed
    ``[.., n, rows/n, ..]``, concatenated on the dim after ``dim``, viewed whole."""
    if stride == 1:
        return _call(g, aten.cat.default, (parts, dim), like=like)
    shape = list(_val(parts[0]).shape)
    split = shape[:dim] + [stride, shape[dim] // stride] + shape[dim + 1:]
    views = [_call(g, aten.view.default, (p, split), like=like) for p in parts]
    cat = _call(g, aten.cat.default, (views, dim + 1), like=like)
    whole = shape[:dim] + [shape[dim] * len(parts)] + shape[dim + 1:]
    return _call(g, aten.view.default, (cat, whole), like=like)


def _erase_dead(g: fx.Graph, nodes) -> None:
    for n in sorted(nodes, key={m: i for i, m in enumerate(g.nodes)}.__getitem__, reverse=True):
        if not n.users:
            g.erase_node(n)


def _rewrite_gather(gm: fx.GraphModule, m: _Match, k: int) -> None:
    g, ag = gm.graph, m.coll
    x, gdim, axis, n = ag.args[0], ag.args[1] % _val(ag).ndim, ag.args[2], ag.args[3]
    ndim, step = _val(ag).ndim, _val(ag).shape[m.cdim] // (k * m.stride)  # rows of the local input per chunk
    order = {nd: i for i, nd in enumerate(g.nodes)}
    first = min(ag.users, key=order.__getitem__)
    for a in m.late:  # the weights' t() etc. move up before the first chunk's GEMM
        first.prepend(a)
    anchor = x if x.op != "placeholder" else [p for p in g.nodes if p.op == "placeholder"][-1]
    starts = []
    for j in range(k):  # every chunk's gather starts as soon as the local input exists
        with g.inserting_after(anchor):
            xj = _call(g, aten.slice.Tensor, (x, m.cdim, j * step, (j + 1) * step), like=ag)
        anchor = xj
        if gdim != 0:
            with g.inserting_after(anchor):
                anchor = _call(g, aten.permute.default, (xj, _perm_to_front(ndim, gdim)), like=ag)
        with g.inserting_after(anchor):
            anchor = _call(g, ops.STARTS["all_gather"], (anchor, axis, n), like=ag)
        starts.append(anchor)
    outs: dict[fx.Node, list[fx.Node]] = {mm: [] for mm in m.mms}
    chunks = []
    with g.inserting_before(first):
        for s in starts:  # chunk j: wait, shape ops, its GEMMs (under chunk j+1's gather)
            _call(g, ops.WAIT, (s, s.args[0]), like=ag)  # the start's input live until its wait (mcompile.ir.ops)
            yj = s
            if gdim != 0:
                yj = _call(g, aten.permute.default, (s, _perm_from_front(ndim, gdim)), like=ag)
                if not _val(yj).is_contiguous():  # at batch 1 the permutes only move a dim of size 1: no copy
                    yj = _call(g, aten.clone.default, (yj,), {"memory_format": torch.contiguous_format}, like=ag)
            chunks.append(yj)
            env = {ag: yj}
            for v in m.tree:
                env[v] = _call(g, v.target, (env[v.args[0]], _chunk_shape(_val(v).shape, k)), like=v)
            for mm in m.mms:
                args = [env.get(a, a) if i == _MM[mm.target] else a for i, a in enumerate(mm.args)]
                outs[mm].append(_call(g, mm.target, args, mm.kwargs, like=mm))
        cats = {mm: _cat(g, outs[mm], 0, m.stride, mm) for mm in m.mms}
        whole = _cat(g, chunks, m.cdim, m.stride, ag)
    for mm in m.mms:
        mm.replace_all_uses_with(cats[mm])
        g.erase_node(mm)
    _erase_dead(g, m.tree)
    ag.replace_all_uses_with(whole)  # other readers (the saved activation, a weight gradient): the whole tensor
    g.erase_node(ag)
    _erase_dead(g, [whole])


def _rewrite_scatter(gm: fx.GraphModule, m: _Match, k: int) -> None:
    g, rs = gm.graph, m.coll
    z, ndim = rs.args[0], _val(rs.args[0]).ndim
    if rs.target is _AR:  # no collective dim: started as it is (dim 0 of the chunk is as good as any)
        sdim, (axis, n), kind = 0, rs.args[1:3], "all_reduce"
    else:
        sdim, axis, n, kind = rs.args[1] % ndim, rs.args[2], rs.args[3], "reduce_scatter"
    order = {nd: i for i, nd in enumerate(g.nodes)}
    envs, starts, st = [], [], m.stride
    with g.inserting_before(rs):
        for j in range(k):  # chunk j: its GEMMs, shape ops, start its reduce-scatter (under chunk j+1's GEMMs)
            env, rows = {}, {}
            for v in sorted(m.mms + m.tree, key=order.__getitem__):
                if v in m.mms:
                    pos = _MM[v.target]
                    a = v.args[pos]
                    step = _val(a).shape[0] // (k * st)
                    if st == 1:
                        aj = _call(g, aten.slice.Tensor, (a, 0, j * step, (j + 1) * step), like=v)
                    elif a in rows:  # another matmul of the same rows: one copy
                        aj = rows[a]
                    else:  # rank-strided: block j of each rank's rows, copied out once
                        rest = list(_val(a).shape[1:])
                        av = _call(g, aten.view.default, (a, [st, step * k, *rest]), like=v)
                        sl = _call(g, aten.slice.Tensor, (av, 1, j * step, (j + 1) * step), like=v)
                        cp = _call(g, aten.clone.default, (sl,), {"memory_format": torch.contiguous_format}, like=v)
                        aj = rows[a] = _call(g, aten.view.default, (cp, [st * step, *rest]), like=v)
                    env[v] = _call(g, v.target, [aj if i == pos else x for i, x in enumerate(v.args)], v.kwargs,
                                   like=v)
                elif v.target is aten.add.Tensor:
                    env[v] = _call(g, v.target, (env[v.args[0]], env[v.args[1]]), like=v)
                else:
                    env[v] = _call(g, v.target, (env[v.args[0]], _chunk_shape(_val(v).shape, k)), like=v)
            src = env[z]
            if sdim != 0:
                src = _call(g, aten.permute.default, (src, _perm_to_front(ndim, sdim)), like=rs)
            starts.append(_call(g, ops.STARTS[kind], (src, axis, n), like=rs))
            envs.append(env)
        for v in m.mms + m.tree:  # a partial product read elsewhere (after the reduce-scatter): whole
            if any(u not in m.tree and u is not rs for u in v.users):
                cd = _chunk_dim(_val(v).shape)
                whole = _cat(g, [e[v] for e in envs], cd, st, v)
                v.replace_all_uses_with(whole, delete_user_cb=lambda u: u not in m.tree and u is not rs)
    first = min(rs.users, key=order.__getitem__) if rs.users else next(nd for nd in g.nodes if nd.op == "output")
    with g.inserting_before(first):  # every wait just before the first reader
        parts = []
        for s in starts:
            _call(g, ops.WAIT, (s, s.args[0]), like=rs)
            parts.append(_call(g, aten.permute.default, (s, _perm_from_front(ndim, sdim)), like=rs) if sdim else s)
        rs.replace_all_uses_with(_call(g, aten.cat.default, (parts, m.cdim), like=rs))
    g.erase_node(rs)
    _erase_dead(g, m.tree + m.mms)
