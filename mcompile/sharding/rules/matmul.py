"""Contractions: linear, mm, addmm, bmm, embedding, attention, cross-entropy.

Megatron's layouts are strategies here (Shoeybi et al. 2019, "Megatron-LM", §3):
- column-parallel linear: x R, W S(0) (out features), b S(0) -> y S(-1);
- row-parallel linear:    x S(-1), W S(1) (in features), no bias -> y Partial (bias goes after the
  reduction; the canonicalisation pass splits biases off linears for that reason);
- vocab-parallel embedding: W S(0) (vocab rows), ids R -> Partial (rows outside the rank's range
  contribute zeros), lowering ``vocab_parallel_embedding``;
- vocab-parallel cross-entropy: logits S(class dim), target R -> R, lowering
  ``vocab_parallel_cross_entropy`` (the logits are never gathered);
- attention: heads (dim 1 of q, k, v) or batch sharded;
- einsum: by the equation's letters (a letter the output keeps: every operand holding it sharded along it ->
  the output sharded along it; a letter summed away: -> Partial(sum)).
"""

from __future__ import annotations

import torch

from mcompile.ir.placements import BlockShard, Partial, Shard
from mcompile.sharding.rules.base import OpInfo, R, Strategy, divisible, rule, same

aten = torch.ops.aten
P = Partial()


def _leading(info: OpInfo, x_nd: int, n_rest: int, out_nd: int) -> list[Strategy]:
    """Shard a leading (batch-like) dim of the first input; the other inputs replicated."""
    return [
        Strategy((Shard(d),) + (R,) * n_rest, (Shard(d - x_nd + out_nd),), name=f"batch_S{d}")
        for d in range(x_nd - 1)
    ]


@rule(aten.linear.default)
def linear(info: OpInfo) -> list[Strategy]:
    x, w = info.inputs[0], info.inputs[1]
    has_bias = len(info.inputs) == 3
    out_nd = info.outputs[0].ndim
    s = []
    wcur = info.current[1] if len(info.current) > 1 else R
    if isinstance(wcur, BlockShard) and wcur.dim % 2 == 0 and (not isinstance(w.shape[0], int)
                                                               or wcur.divides(w.shape[0], info.n)):
        blk = BlockShard(0, wcur.blocks)
        s.append(Strategy((R, blk) + ((blk,) if has_bias else ()), (BlockShard(out_nd - 1, wcur.blocks),),
                          name="column_blocks"))
    if divisible(w.shape[0], info.n):
        s.append(Strategy((R, Shard(0)) + ((Shard(0),) if has_bias else ()), (Shard(out_nd - 1),), name="column"))
    else:
        info.notes.append(f"indivisible: {w.shape[0]} output features do not divide by {info.n}")
    if not has_bias and divisible(w.shape[1], info.n):
        s.append(Strategy((Shard(x.ndim - 1), Shard(1)), (P,), name="row"))
    s += _leading(info, x.ndim, 2 if has_bias else 1, out_nd)
    if not has_bias:
        s += [Strategy((P, R), (P,), name="partial"), Strategy((R, P), (P,), name="partial")]
    return s + [Strategy((R,) * len(info.inputs), (R,), name="replicate")]


@rule(aten.mm.default)
def mm(info: OpInfo) -> list[Strategy]:
    return [
        Strategy((R, Shard(1)), (Shard(1),), name="column"),
        Strategy((Shard(1), Shard(0)), (P,), name="row"),
        Strategy((Shard(0), R), (Shard(0),), name="batch_S0"),
        Strategy((P, R), (P,), name="partial"),
        Strategy((R, P), (P,), name="partial"),
        Strategy((R, R), (R,), name="replicate"),
    ]


@rule(aten.addmm.default)
def addmm(info: OpInfo) -> list[Strategy]:
    bias = info.inputs[0]
    b_col = Shard(bias.ndim - 1)
    b_row = Shard(0) if bias.ndim == 2 and not same(bias.shape[0], 1) else R
    return [
        Strategy((b_col, R, Shard(1)), (Shard(1),), name="column"),
        Strategy((b_row, Shard(0), R), (Shard(0),), name="batch_S0"),
        Strategy((R, R, R), (R,), name="replicate"),
    ]


@rule(aten.bmm.default)
def bmm(info: OpInfo) -> list[Strategy]:
    bcur = info.current[1] if len(info.current) > 1 else R
    # experts' fused gate and up projections [E, H, 2I], chunked after (Llama-4): each rank its part of both
    blocks = [Strategy((R, bcur), (BlockShard(2, bcur.blocks),), name="column_blocks")] \
        if isinstance(bcur, BlockShard) and bcur.dim % 3 == 2 else []
    return blocks + [
        Strategy((Shard(0), Shard(0)), (Shard(0),), name="batch_S0"),
        Strategy((R, Shard(2)), (Shard(2),), name="column"),
        Strategy((Shard(1), R), (Shard(1),), name="rows"),
        Strategy((Shard(2), Shard(1)), (P,), name="row"),
        Strategy((P, R), (P,), name="partial"),
        Strategy((R, P), (P,), name="partial"),
        Strategy((R, R), (R,), name="replicate"),
    ]


@rule("transformers.grouped_mm_fallback.default")
def grouped_mm(info: OpInfo) -> list[Strategy]:
    """Transformers' grouped GEMM of experts (its loop of per-expert ``mm`` where ``torch._grouped_mm`` does not
    run): ``input`` [S, K] sorted by expert, ``weight`` [E, K, N], ``offs`` [E] the running token counts. Each
    expert's projection is a linear: column (N split: each rank its features of every expert) and row (K split:
    a Partial sum), Megatron's expert tensor parallelism; linear in either operand alone. The tokens stay whole
    (``offs`` counts them all)."""
    wcur = info.current[1] if len(info.current) > 1 else R
    s = []
    if isinstance(wcur, BlockShard) and wcur.dim % 3 == 2:  # fused gate/up [E, K, 2I]: each rank its part of both
        s.append(Strategy((R, wcur, R), (BlockShard(1, wcur.blocks),), name="column_blocks"))
    return s + [
        Strategy((R, Shard(2), R), (Shard(1),), name="column"),
        Strategy((Shard(1), Shard(1), R), (P,), name="row"),
        Strategy((P, R, R), (P,), name="partial"),
        Strategy((R, P, R), (P,), name="partial"),
        Strategy((R, R, R), (R,), name="replicate"),
    ]


@rule(aten.matmul.default)
def matmul(info: OpInfo) -> list[Strategy]:
    a, b = info.inputs
    o = info.outputs[0]
    if a.ndim < 2 or b.ndim < 2:
        return [Strategy((R, R), (R,), name="replicate")]
    s = []
    bcur = info.current[1] if len(info.current) > 1 else R
    if isinstance(bcur, BlockShard) and bcur.dim % b.ndim == b.ndim - 1:
        s.append(Strategy((R, bcur), (BlockShard(o.ndim - 1, bcur.blocks),), name="column_blocks"))
    s += [
        Strategy((R, Shard(b.ndim - 1)), (Shard(o.ndim - 1),), name="column"),
        Strategy((Shard(a.ndim - 1), Shard(b.ndim - 2)), (P,), name="row"),
        Strategy((Shard(a.ndim - 2), R), (Shard(o.ndim - 2),), name="rows"),
    ]
    if a.ndim == b.ndim:
        s += [Strategy((Shard(d), Shard(d)), (Shard(d),), name=f"batch_S{d}") for d in range(a.ndim - 2)]
    elif b.ndim == 2:  # [..., m, k] @ [k, n]: any leading dim of a, the weight whole
        s += [Strategy((Shard(d), R), (Shard(d),), name=f"batch_S{d}") for d in range(a.ndim - 2)]
    return s + [Strategy((P, R), (P,), name="partial"), Strategy((R, P), (P,), name="partial"),
                Strategy((R, R), (R,), name="replicate")]


def embedding_args(node_or_info) -> tuple[int, bool]:
    """``aten.embedding``'s (padding_idx, scale_grad_by_freq), from a node or an OpInfo."""
    args, kwargs = node_or_info.args, node_or_info.kwargs
    padding_idx = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
    freq = args[3] if len(args) > 3 else kwargs.get("scale_grad_by_freq", False)
    return int(padding_idx), bool(freq)


@rule(aten.embedding.default)
def embedding(info: OpInfo) -> list[Strategy]:
    ids = info.inputs[1]
    o = info.outputs[0]
    hidden = Strategy((Shard(1), R), (Shard(o.ndim - 1),), name="hidden_parallel")
    if embedding_args(info)[1]:
        # scale_grad_by_freq counts each id over all the ids the op sees: only strategies that keep the
        # ids whole (the vocab-parallel lowering looks out-of-range ids up as row 0, which would count)
        info.notes.append("scale_grad_by_freq: the ids stay whole (no vocab-parallel or id-sharded lookup)")
        return [hidden, Strategy((R, R), (R,), name="replicate")]
    s = [Strategy((Shard(0), R), (P,), lowering="vocab_parallel_embedding", name="vocab_parallel"), hidden]
    s += [Strategy((R, Shard(d)), (Shard(d),), name=f"ids_S{d}") for d in range(ids.ndim)]
    return s + [Strategy((R, R), (R,), name="replicate")]


@rule(aten.scaled_dot_product_attention.default)
def sdpa(info: OpInfo) -> list[Strategy]:
    q, k = info.inputs[0], info.inputs[1]
    has_mask = len(info.inputs) == 4
    s = []
    for d, name in ((1, "heads"), (0, "batch")):
        mask_p = ()
        if has_mask:
            m = info.inputs[3]
            md = d - (q.ndim - m.ndim)
            mask_p = (R if md < 0 or same(m.shape[md], 1) else Shard(md),)
        if d == 1 and not (divisible(q.shape[1], info.n) and divisible(k.shape[1], info.n)):
            info.notes.append(f"indivisible: {q.shape[1]} query heads / {k.shape[1]} kv heads over {info.n}")
            continue
        s.append(Strategy((Shard(d), Shard(d), Shard(d)) + mask_p, (Shard(d),), name=name))
    cur = info.current[0] if info.current else None
    if isinstance(cur, BlockShard) and cur.dim % q.ndim == 1 and isinstance(cur.blocks, int) and \
            divisible(q.shape[1], cur.blocks * info.n) and divisible(k.shape[1], cur.blocks * info.n):
        # heads in blocks (DiffLlama's head pairs: head i with head i + heads / 2, q_proj's rows two blocks): each
        # rank attends its share of every block, its keys and values taken alike (a head's key/value head sits in
        # the same block, at the same share, for heads a multiple of key/value heads)
        m = info.inputs[3] if has_mask else None
        mask_p = () if m is None else (R if q.ndim - m.ndim > 1 or same(m.shape[1 - (q.ndim - m.ndim)], 1)
                                       else BlockShard(1 - (q.ndim - m.ndim), cur.blocks),)
        s.insert(0, Strategy((cur, cur, cur) + mask_p, (cur,), name="head_blocks"))
    if info.token_symbol is not None:
        # context parallel (cp): every rank's queries against every rank's keys, across ranks (mcompile.passes.cp.ops:
        # ring / all-gather / Ulysses); a mask's query rows are the rank's, its key columns all of them
        d = q.ndim - 2
        mask_p = ()
        if has_mask:
            m = info.inputs[3]
            md = m.ndim - 2
            mask_p = (R if md < 0 or same(m.shape[md], 1) else Shard(md),)
        s.insert(0, Strategy((Shard(d), Shard(d), Shard(d)) + mask_p, (Shard(d),), lowering="cp_attention",
                             name="context_parallel"))
    return s + [Strategy((R,) * len(info.inputs), (R,), name="replicate")]


@rule(aten.cross_entropy_loss.default)
def cross_entropy(info: OpInfo) -> list[Strategy]:
    x = info.inputs[0]
    reduction = info.arg(3, "reduction", 1)  # 0 none, 1 mean, 2 sum
    weight = len(info.inputs) > 2
    s = []
    cdim = 1 if x.ndim >= 2 else 0
    if not weight:  # the lowering carries ignore_index, reduction and label_smoothing
        s.append(Strategy((Shard(cdim), R), (R,), lowering="vocab_parallel_cross_entropy", name="vocab_parallel"))
    return s + _batch_loss(info, reduction)


def _batch_loss(info: OpInfo, reduction: int) -> list[Strategy]:
    """A loss over (N, C, ...) scores and (N, ...) targets split by rows: none -> S(0), sum -> Partial(sum).
    A mean over a batch-sharded target would be the mean of per-rank means, exact only when every rank
    counts the same (weighted) number of non-ignored targets: never offered. The runtime rewrites a mean
    loss into a sum and a count (passes/loss.py) before planning."""
    s = []
    if info.inputs[0].ndim >= 2 and reduction != 1:
        out = Shard(0) if reduction == 0 else Partial("sum")
        s.append(Strategy((Shard(0), Shard(0)) + (R,) * (len(info.inputs) - 2), (out,), name="batch"))
    return s + [Strategy((R,) * len(info.inputs), (R,), name="replicate")]


@rule(aten.nll_loss_nd.default)
def nll_loss(info: OpInfo) -> list[Strategy]:
    """``nll_loss`` of log-probabilities (ProphetNet): split by rows like cross-entropy (no vocab-parallel
    lowering: the log-softmax before it needs whole rows anyway)."""
    return _batch_loss(info, info.arg(3, "reduction", 1))


def einsum_letters(equation: str, ndims: list[int]) -> tuple[list[str], str]:
    """Each operand's and the output's letters, one per dim: ``...`` expanded right-aligned into uppercase
    letters (shared across operands, as einsum broadcasts them), an implicit output (no ``->``) the letters
    that occur once, sorted, after the ellipsis dims (torch's rule)."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    specs = lhs.split(",")
    if len(specs) != len(ndims):
        raise ValueError(f"einsum {equation!r}: {len(specs)} operands in the equation, {len(ndims)} given")
    n_ell = max((nd - len(sp.replace("...", "")) for sp, nd in zip(specs, ndims) if "..." in sp), default=0)
    ell = [chr(ord("A") + i) for i in range(n_ell)]

    def expand(spec: str, nd: int) -> str:
        if "..." not in spec:
            return spec
        k = nd - len(spec.replace("...", ""))
        return spec.replace("...", "".join(ell[n_ell - k:]))

    ops = [expand(sp, nd) for sp, nd in zip(specs, ndims)]
    if arrow:
        out = rhs.replace("...", "".join(ell))
    else:
        counts = "".join(sp.replace("...", "") for sp in specs)
        out = "".join(ell) + "".join(sorted(c for c in set(counts) if counts.count(c) == 1))
    return ops, out


@rule(aten.einsum.default)
def einsum(info: OpInfo) -> list[Strategy]:
    """``einsum(equation, operands)`` (Mamba-2's SSD in Bamba / Falcon-H1 / NemotronH, ProphetNet's and
    PEGASUS-X's attention). A letter L of size > 1 may be sharded: every operand that holds L at full size
    is sharded along it, one that broadcasts it (size 1) or lacks it stays whole; the output is sharded along
    L where it keeps L, else each rank sums its part of L: Partial(sum). A letter repeated in one operand (a
    diagonal) is not sharded. Multilinear: one Partial operand, the others whole, gives a Partial output."""
    metas = info.inputs
    ops, out = einsum_letters(info.arg(0), [m.ndim for m in metas])
    o = info.outputs[0]
    s = []
    for letter in dict.fromkeys("".join(ops)):
        sizes = [m.shape[sp.index(letter)] for sp, m in zip(ops, metas) if letter in sp]
        full = next((z for z in sizes if not same(z, 1)), None)
        if full is None or any(sp.count(letter) > 1 for sp in ops) or not divisible(full, info.n):
            continue
        if any(not same(z, 1) and not same(z, full) for z in sizes):
            continue
        ins = tuple(Shard(sp.index(letter)) if letter in sp and same(m.shape[sp.index(letter)], full) else R
                    for sp, m in zip(ops, metas))
        if letter in out:
            s.append(Strategy(ins, (Shard(out.index(letter)),), name=f"keep_{letter}"))
        elif o.dtype.is_floating_point:
            s.append(Strategy(ins, (P,), name=f"sum_{letter}"))
    cur = tuple(info.current)
    s.sort(key=lambda st: sum(a != b for a, b in zip(st.inputs, cur)))
    if o.dtype.is_floating_point:
        s += [Strategy(tuple(P if j == i else R for j in range(len(metas))), (P,), name="partial")
              for i in range(len(metas))]
    return s + [Strategy((R,) * len(metas), (R,), name="replicate")]


@rule(aten.outer.default)
def outer(info: OpInfo) -> list[Strategy]:
    return [
        Strategy((Shard(0), R), (Shard(0),), name="rows"),
        Strategy((R, Shard(0)), (Shard(1),), name="cols"),
        Strategy((P, R), (P,), name="partial"),
        Strategy((R, P), (P,), name="partial"),
        Strategy((R, R), (R,), name="replicate"),
    ]
