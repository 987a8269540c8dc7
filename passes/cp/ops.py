"""Context parallelism: the sequence split over the ``cp`` mesh axis, and attention across the split.

**Layout.** With ``balanced=True`` (the load-balanced causal layout of Megatron-LM / Transformer Engine)
the global sequence of length ``s`` is cut into ``2 * cp`` chunks of ``c = s / (2 * cp)`` tokens and cp
rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, concatenated in that order: under a causal mask
every rank then has the same number of visible (query, key) pairs. ``balanced=False`` is the naive
contiguous split (rank ``r`` holds ``[r s / cp, (r + 1) s / cp)``), kept to measure the imbalance.
:func:`local_positions` gives a rank's global positions, :func:`gather_order` the permutation that
puts the ranks' concatenated tokens back into natural order.

**Ops** (``torch.library.custom_op``, namespace ``mcompile``, fake implementations, registered
autograd; the communicator is :func:`mcompile.ir.ops.current`'s):

=====================  =============================================  =====================================
op                     forward                                        backward
=====================  =============================================  =====================================
cp_slice               keep the rank's tokens of a replicated value   the grad into zeros at the rank's
                                                                      positions (no communication: the
                                                                      loss over cp is a sum of the ranks'
                                                                      partial losses; the runtime sums the
                                                                      replicated value's gradient)
cp_gather              all-gather the ranks' tokens, natural order    permute, reduce-scatter
cp_attention           attention of the local queries over the        ``cp_attention_backward`` (below)
                       whole sequence: ``(out, lse)``
=====================  =============================================  =====================================

``cp_attention`` variants:

* ``ring`` (Liu et al. 2023, Ring Attention): the K/V blocks go around the ring (n - 1 p2p steps, the
  next block's send issued before the current block's compute so they overlap on a GPU) and the
  partial results are merged by their log-sum-exp (online softmax). Work is done at chunk
  granularity: a (query chunk, key chunk) pair is fully visible, diagonal (causal within the chunk)
  or invisible (skipped). Backward recomputes each block's probabilities from q, k and the saved
  lse (FlashAttention-2's backward: ``D = rowsum(dout * out)``, ``ds = p * (dp - D)``); dq stays
  local, dk / dv travel around the ring with their K/V block and arrive back at its owner.
* ``allgather`` (the Llama 3 paper's CP): K/V all-gathered (cheap with few GQA kv heads), put in
  natural order; the local queries attend by global positions. Backward: dK / dV permuted and
  reduce-scattered back. The only variant with an arbitrary ``mask`` (boolean, True = attend, or
  additive float; broadcastable to ``[b, hq, s_loc, s]``: the local query rows in the local layout,
  every key in natural order).
* ``a2a`` (Ulysses, Jacobs et al. 2023): an all-to-all turns ``[b, h, s_loc, d]`` into
  ``[b, h / n, s, d]`` (heads split, every rank's tokens, natural order), attention on the local
  heads over the whole sequence, an all-to-all back. Needs ``hq % n == 0``; kv heads are split too
  when ``hkv % n == 0``, else repeated to ``hq`` first.

**Kernels.** Every variant computes block by block (a query chunk against a span of key chunks: adjacent
fully visible chunks in one call, a diagonal chunk alone, causal inside it by ``is_causal``; a2a: the whole
sequence in one causal call) through torch's fused flash kernel that returns the block's log-sum-exp —
``aten._scaled_dot_product_flash_attention_for_cpu`` on CPU (any float dtype; the allgather mask as an
additive mask in q's dtype), ``aten._scaled_dot_product_flash_attention`` on CUDA (fp16 / bf16, no mask,
head dim <= 256; both present with these signatures in torch 2.11 and 2.13) — in the input dtype, with
the kv heads as they are (GQA in the kernel, no repeated K / V), so no score block is materialised: memory
is linear in the chunk (``bench/cp_memory.py``). Blocks of a query chunk are merged by their log-sum-exp in
fp32 (the online softmax of Ring Attention, Liu et al. 2023, and FlashAttention-2, Dao 2023), ``out`` cast
back to ``q.dtype``; ``lse`` is fp32. The backward calls the fused backward kernel per block with the
*final* ``out`` and ``lse`` of the query rows (so each block's probabilities are its part of the global
softmax and ``D = rowsum(dout * out)`` the global one), dq / dk / dv summed in fp32; the gradient of
``lse`` itself (``D -= dlse``) and a2a's ``D`` computed before its all-to-all enter through extra head
columns (``out`` gets ``-dlse`` / ``D``, ``dout`` ones, ``v`` zeros: the kernels compute ``D`` from the
``out`` they are given); v of another head dim than q / k is zero-padded. Where no fused kernel takes a
block (CUDA fp32, a mask on CUDA, other devices) that block runs in fp32 by hand, scores materialised.
:class:`CPStats` counts the (query, key) pairs each rank computed, the measure of the causal load
balance.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["local_positions", "gather_order", "concat_positions", "check_cp_attention", "cp_slice", "cp_gather",
           "cp_attention", "cp_attention_backward", "CPStats", "VARIANTS", "CP_OPS"]

VARIANTS = ("ring", "allgather", "a2a")
FULL, DIAG = "full", "diag"  # a visible (query chunk, key chunk) pair: every score, or causal within the chunk


# --------------------------------------------------------------------------- layout

def _check_seq(seq: int, n: int, balanced: bool) -> None:
    if not isinstance(seq, int):  # symbolic under tracing: checked when it runs
        return
    m = 2 * n if balanced else n
    if seq % m:
        what = f"2*cp = {m}" if balanced else f"cp = {m}"
        raise ValueError(f"sequence length {seq} does not divide by {what}: use a multiple of {m}")


def _chunks_of(n: int, rank: int, balanced: bool) -> list[int]:
    """The global chunk ids a rank holds, in local order (chunks of s/(2n) tokens, or s/n contiguous)."""
    return [rank, 2 * n - 1 - rank] if balanced else [rank]


def _n_chunks(n: int, balanced: bool) -> int:
    return 2 * n if balanced else n


def local_positions(seq: int, n: int, rank: int, balanced: bool = True, device=None) -> torch.Tensor:
    """The global positions of ``rank``'s tokens, in local order (int64, ``seq / n`` of them)."""
    _check_seq(seq, n, balanced)
    c = seq // _n_chunks(n, balanced)
    return torch.cat([torch.arange(j * c, (j + 1) * c, device=device) for j in _chunks_of(n, rank, balanced)])


def concat_positions(seq: int, n: int, balanced: bool = True, device=None) -> torch.Tensor:
    """The global positions of every rank's local tokens concatenated in rank order (what an all-gather
    of the local tokens holds): ``natural[concat_positions]`` is that concatenation."""
    return torch.cat([local_positions(seq, n, r, balanced, device) for r in range(n)])


def gather_order(seq: int, n: int, balanced: bool = True, device=None) -> torch.Tensor:
    """The inverse of :func:`concat_positions`: ``concatenation[gather_order]`` is in natural order."""
    return torch.argsort(concat_positions(seq, n, balanced, device))


def _to_natural(x: torch.Tensor, dim: int, seq: int, n: int, balanced: bool) -> torch.Tensor:
    """``x``'s ``dim`` holds every rank's tokens in rank order: reorder it naturally."""
    return x.index_select(dim, gather_order(seq, n, balanced, x.device))


def _to_concat(x: torch.Tensor, dim: int, seq: int, n: int, balanced: bool) -> torch.Tensor:
    """The inverse of :func:`_to_natural`."""
    return x.index_select(dim, concat_positions(seq, n, balanced, x.device))


# --------------------------------------------------------------------------- per-rank statistics

def _rank_key():
    """The communicator bound for this rank (``ops.bind``; None when none is): the in-process simulator
    runs several ranks as threads of one process, so per-rank state is kept per communicator."""
    from mcompile.ir import ops

    try:
        return ops.current()
    except RuntimeError:
        return None


class CPStats:
    """The attention score elements (query-key pairs, per batch and head) each rank computed in
    ``cp_attention``'s forward since :meth:`reset`, per bound communicator: a fully visible chunk pair
    counts ``c * c``, a diagonal (causal) one ``c * (c + 1) / 2``, an invisible one nothing (what a
    kernel that skips masked tiles computes). With the balanced layout every rank's count is equal
    under a causal mask; the contiguous split shows the naive imbalance (the last rank does
    about ``2n - 1`` times the first's work). ``elements`` is the same count times batch x heads."""

    _pairs: dict = {}
    _elements: dict = {}
    _lock = threading.Lock()

    @classmethod
    def add(cls, pairs: int, batch_heads: int) -> None:
        key = _rank_key()
        with cls._lock:
            cls._pairs[key] = cls._pairs.get(key, 0) + pairs
            cls._elements[key] = cls._elements.get(key, 0) + pairs * batch_heads

    @classmethod
    def of(cls, comm) -> int:
        """``comm``'s rank's count of (query, key) pairs per batch and head."""
        with cls._lock:
            return cls._pairs.get(comm, 0)

    @classmethod
    def elements(cls, comm) -> int:
        """``comm``'s rank's count of score elements (pairs x batch x the heads it computed)."""
        with cls._lock:
            return cls._elements.get(comm, 0)

    @classmethod
    def reset(cls, comm=None) -> None:
        """Zero ``comm``'s counts (None: every rank's)."""
        with cls._lock:
            if comm is None:
                cls._pairs.clear()
                cls._elements.clear()
            else:
                cls._pairs.pop(comm, None)
                cls._elements.pop(comm, None)


# --------------------------------------------------------------------------- cp_slice / cp_gather

def _seq_view(x: torch.Tensor, dim: int, seq: int) -> torch.Tensor:
    """``x`` with ``dim`` moved first and viewed as (outer, seq, *rest)."""
    t = x.movedim(dim, 0)
    return t.reshape(-1, seq, *t.shape[1:])


def _unview(t: torch.Tensor, dim: int) -> torch.Tensor:
    """(outer, L, *rest) -> ``dim`` of size outer * L, back in place."""
    return t.reshape(-1, *t.shape[2:]).movedim(0, dim).contiguous()


def _comm():
    from mcompile.ir import ops

    return ops.current()


def _slice(x, dim, axis, n, seq, balanced):
    pos = local_positions(seq, n, _comm().rank(axis), balanced, x.device)
    return _unview(_seq_view(x, dim, seq).index_select(1, pos), dim)


def _unslice(g, dim, axis, n, seq, balanced):
    """The grad of the rank's tokens scattered into zeros of the whole dim."""
    pos = local_positions(seq, n, _comm().rank(axis), balanced, g.device)
    t = _seq_view(g, dim, seq // n)
    z = t.new_zeros((t.shape[0], seq, *t.shape[2:]))
    z[:, pos] = t
    return _unview(z, dim)


def _gather(x, dim, axis, n, seq, balanced):
    """Every rank's tokens (outer, seq/n each, along dim) all-gathered, put in natural order."""
    t = _comm().all_gather(x.movedim(dim, 0).contiguous(), 0, axis)  # (n * outer * L, *rest), rank-major
    L = seq // n
    t = t.reshape(n, -1, L, *t.shape[1:]).transpose(0, 1).reshape(-1, seq, *t.shape[1:])  # (outer, seq) rank order
    return _unview(_to_natural(t, 1, seq, n, balanced), dim)


def _gather_backward(g, dim, axis, n, seq, balanced):
    """The adjoint of :func:`_gather` when every rank's gradient of the whole value is a partial sum:
    permuted to rank order, reduce-scattered."""
    t = _to_concat(_seq_view(g, dim, seq), 1, seq, n, balanced)  # (outer, seq) in rank order
    L = seq // n
    t = t.reshape(t.shape[0], n, L, *t.shape[2:]).transpose(0, 1).reshape(-1, *t.shape[2:]).contiguous()
    t = _comm().reduce_scatter(t, 0, axis)  # (outer * L, *rest)
    return t.movedim(0, dim).contiguous()


def _check_dim(x: torch.Tensor, dim: int, unit, op: str) -> None:
    size = x.shape[dim]
    if isinstance(size, int) and isinstance(unit, int) and size % unit:
        raise ValueError(f"{op}: dim {dim} of a {list(x.shape)} tensor holds {size} tokens, not a multiple of "
                         f"{unit} (the dim is viewed as (-1, {unit}))")


def _resized(x: torch.Tensor, dim: int, size) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = size
    return x.new_empty(shape)


@torch.library.custom_op("mcompile::cp_slice", mutates_args=())
def cp_slice(x: torch.Tensor, dim: int, axis: str, n: int, seq: int, balanced: bool = True) -> torch.Tensor:
    """This rank's tokens of ``x``, whose ``dim`` holds the whole sequence viewed as (-1, seq)."""
    _check_seq(seq, n, balanced)
    _check_dim(x, dim, seq, "cp_slice")
    return _slice(x, dim, axis, n, seq, balanced)


@cp_slice.register_fake
def _(x, dim, axis, n, seq, balanced=True):
    _check_seq(seq, n, balanced)
    _check_dim(x, dim, seq, "cp_slice")
    return _resized(x, dim, x.shape[dim] // n)


@torch.library.custom_op("mcompile::cp_slice_backward", mutates_args=())
def cp_slice_backward(g: torch.Tensor, dim: int, axis: str, n: int, seq: int, balanced: bool = True) -> torch.Tensor:
    return _unslice(g, dim, axis, n, seq, balanced)


@cp_slice_backward.register_fake
def _(g, dim, axis, n, seq, balanced=True):
    return _resized(g, dim, g.shape[dim] * n)


@torch.library.custom_op("mcompile::cp_gather", mutates_args=())
def cp_gather(x: torch.Tensor, dim: int, axis: str, n: int, seq: int, balanced: bool = True) -> torch.Tensor:
    """Every rank's tokens (``dim`` viewed as (-1, seq / n)) gathered into natural order."""
    _check_seq(seq, n, balanced)
    _check_dim(x, dim, seq // n, "cp_gather")
    return _gather(x, dim, axis, n, seq, balanced)


@cp_gather.register_fake
def _(x, dim, axis, n, seq, balanced=True):
    _check_seq(seq, n, balanced)
    _check_dim(x, dim, seq // n, "cp_gather")
    return _resized(x, dim, x.shape[dim] * n)


@torch.library.custom_op("mcompile::cp_gather_backward", mutates_args=())
def cp_gather_backward(g: torch.Tensor, dim: int, axis: str, n: int, seq: int, balanced: bool = True) -> torch.Tensor:
    return _gather_backward(g, dim, axis, n, seq, balanced)


@cp_gather_backward.register_fake
def _(g, dim, axis, n, seq, balanced=True):
    return _resized(g, dim, g.shape[dim] // n)


def _layout_setup(ctx, inputs, output):
    ctx.args = tuple(inputs[1:])


torch.library.register_autograd(
    "mcompile::cp_slice", lambda ctx, g: (cp_slice_backward(g.contiguous(), *ctx.args),) + (None,) * 5,
    setup_context=_layout_setup)
torch.library.register_autograd(
    "mcompile::cp_gather", lambda ctx, g: (cp_gather_backward(g.contiguous(), *ctx.args),) + (None,) * 5,
    setup_context=_layout_setup)


# --------------------------------------------------------------------------- blockwise attention

_CPU_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_LOW = (torch.float16, torch.bfloat16)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a row that sees no key) as 0, so ``exp(score - lse)`` is 0 there, not nan."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _kind(qc: int, kc: int, causal: bool) -> str | None:
    """How query chunk ``qc`` sees key chunk ``kc`` (global chunk ids, chunks of equal size)."""
    if not causal or kc < qc:
        return FULL
    return DIAG if kc == qc else None


def _pairs(kind: str, c: int) -> int:
    return c * c if kind == FULL else c * (c + 1) // 2


class _Blocks:
    """Query rows and key rows cut into chunks of ``c`` tokens with global chunk ids ``q_ids`` /
    ``k_ids`` (in the tensors' order); ``mask`` (or None) is indexed by the tensors' positions."""

    def __init__(self, q_ids: list[int], k_ids: list[int], c: int, causal: bool, mask=None):
        self.q_ids, self.k_ids, self.c, self.causal, self.mask = q_ids, k_ids, c, causal, mask

    def visible(self):
        """(query chunk index, kind, query slice, key slice, pairs) of every kernel call: per query chunk,
        fully visible key chunks that lie next to each other in the tensor as one slice, a diagonal chunk
        (causal inside a square block) alone."""
        c = self.c
        for i, qc in enumerate(self.q_ids):
            qs, run = slice(i * c, (i + 1) * c), None  # run: [first, end) of adjacent fully visible key chunks
            for j, kc in enumerate(self.k_ids):
                kind = _kind(qc, kc, self.causal)
                if kind == FULL and run is not None and run[1] == j:
                    run[1] = j + 1
                    continue
                if run is not None:
                    yield i, FULL, qs, slice(run[0] * c, run[1] * c), (run[1] - run[0]) * c * c
                    run = None
                if kind == FULL:
                    run = [j, j + 1]
                elif kind == DIAG:
                    yield i, DIAG, qs, slice(j * c, (j + 1) * c), _pairs(DIAG, c)
            if run is not None:
                yield i, FULL, qs, slice(run[0] * c, run[1] * c), (run[1] - run[0]) * c * c

    def mask_of(self, qs: slice, ks: slice):
        return None if self.mask is None else self.mask[..., qs, ks]


def _expand_heads(x: torch.Tensor, g: int) -> torch.Tensor:
    """kv heads repeated to the query heads (query head j uses kv head j // g)."""
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _sum_heads(x: torch.Tensor, g: int) -> torch.Tensor:
    """The adjoint of :func:`_expand_heads`."""
    return x if g == 1 else x.unflatten(1, (-1, g)).sum(2)


# One block (query rows x key rows, causal inside it or not) through torch's fused flash kernel, which
# returns the block's log-sum-exp: aten._scaled_dot_product_flash_attention_for_cpu (any float dtype, an
# additive mask) on CPU, aten._scaled_dot_product_flash_attention (fp16 / bf16, no mask, head dim <= 256) on
# CUDA; both take grouped kv heads (GQA without repeating k / v) and is_causal for a square diagonal block.
# Where neither applies (CUDA fp32 or a mask, other devices) the block runs in fp32 by hand (_math_*).

def _width(q: torch.Tensor, v: torch.Tensor, mask, extra: int) -> int | None:
    """The head dim the fused kernel runs this block at (q / k / v zero-padded to it: the kernels need one
    head dim for q, k and v; ``extra`` more columns carry the backward's D term), or None where no fused
    kernel takes the block."""
    width = max(q.shape[-1], v.shape[-1] + extra)
    if q.device.type == "cpu":
        return width
    if q.device.type == "cuda" and mask is None and q.dtype in _LOW:
        width = -(-width // 8) * 8
        return width if width <= 256 else None
    return None


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` zero-padded in its last dim to ``width`` (zero q / k columns leave the scores as they are, the
    scale being explicit; zero v columns give zero output columns)."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _additive(mask, dtype):
    """The mask as the CPU kernel takes it: additive, in the queries' dtype."""
    if mask is None or mask.dtype == dtype:
        return mask
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.to(dtype)


def _sees(mask: torch.Tensor) -> torch.Tensor:
    """Per query row: does the mask leave it any key?"""
    return mask.any(-1) if mask.dtype == torch.bool else (mask != float("-inf")).any(-1)


def _attend(q, k, v, causal: bool, scale: float, mask):
    """One block: (out [b, hq, L, dv], q's dtype on the fused kernel; lse [b, hq, L], fp32); a row that
    sees no key has lse -inf and out 0."""
    dv = v.shape[-1]
    width = _width(q, v, mask, 0)
    if width is None:
        return _math_attend(q, k, v, causal, scale, mask)
    qp, kp, vp = (_pad(t, width) for t in (q, k, v))
    if q.device.type == "cpu":
        out, lse = _CPU_FWD(qp, kp, vp, 0.0, causal, attn_mask=_additive(mask, q.dtype), scale=scale)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention.default(qp, kp, vp, 0.0, causal, False,
                                                                               scale=scale)[:2]
    if mask is not None:  # the kernel gives a row with no visible key lse 0 (and out 0): the merge needs -inf
        lse = lse.masked_fill(~_sees(mask), float("-inf"))
    return out[..., :dv], lse


def _split(x: torch.Tensor, dtype, cols: int) -> list[torch.Tensor]:
    """fp32 ``x`` as ``cols`` values of ``dtype`` whose sum is ``x`` (two for fp16 / bf16: high and low part)."""
    hi = x.to(dtype)
    return [hi] if cols == 1 else [hi, (x - hi.float()).to(dtype)]


def _attend_backward(do, q, k, v, out, lse, corr, causal: bool, scale: float, mask):
    """(dq, dk, dv) of one block (dk / dv with k's heads; the kernel's dtype, fp32 by hand): FlashAttention-2's
    backward given the *final* lse of these query rows (so p = exp(s - lse) is the block's part of the global
    softmax) and ``D = rowsum(do * out) + corr`` (``out`` None: D = corr). The kernels compute D from the
    ``out`` they are given, so ``corr`` travels in extra columns: out gets columns ``corr`` (split in two
    for fp16 / bf16), do columns of ones, v zero columns (scores and do @ v^T unchanged)."""
    d, dv = q.shape[-1], v.shape[-1]
    extra = 0 if corr is None and out is not None else (2 if q.dtype in _LOW else 1)
    width = _width(q, v, mask, extra)
    if width is None:
        return _math_attend_backward(do, q, k, v, out, lse, corr, causal, scale, mask)
    qp, kp, vp = (_pad(t, width) for t in (q, k, v))
    if extra:
        o = out if out is not None else do.new_zeros(do.shape)
        parts = _split(corr if corr is not None else torch.zeros_like(lse), q.dtype, extra)
        o = torch.cat([o, *(p.unsqueeze(-1) for p in parts)], -1)
        do = torch.cat([do, do.new_ones(do.shape[:-1] + (extra,))], -1)
        out = o
    dop, op = _pad(do, width), _pad(out, width)
    lse = _finite(lse).contiguous()
    if q.device.type == "cpu":
        dq, dk, dvv = _CPU_BWD(dop, qp, kp, vp, op, lse, 0.0, causal, attn_mask=_additive(mask, q.dtype), scale=scale)
    else:  # no dropout: the rng state is not read; cum_seq_* undefined (not variable-length)
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        dq, dk, dvv = torch.ops.aten._scaled_dot_product_flash_attention_backward.default(
            dop, qp, kp, vp, op, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)
    return dq[..., :d], dk[..., :d], dvv[..., :dv]


def _scores(q, k, scale, causal, mask):
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        c = s.shape[-1]
        s = s.masked_fill(torch.ones(c, c, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return s


def _math_attend(q, k, v, causal, scale, mask):
    """:func:`_attend` in fp32 by hand (the block's scores materialised): where no fused kernel applies."""
    g = q.shape[1] // k.shape[1]
    s = _scores(q.float(), _expand_heads(k.float(), g), scale, causal, mask)
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - _finite(lse).unsqueeze(-1)) @ _expand_heads(v.float(), g), lse


def _math_attend_backward(do, q, k, v, out, lse, corr, causal, scale, mask):
    """:func:`_attend_backward` in fp32 by hand."""
    g = q.shape[1] // k.shape[1]
    qf, kf, vf, dof = q.float(), _expand_heads(k.float(), g), _expand_heads(v.float(), g), do.float()
    D = (dof * out.float()).sum(-1) if out is not None else torch.zeros_like(lse)
    if corr is not None:
        D = D + corr
    p = torch.exp(_scores(qf, kf, scale, causal, mask) - _finite(lse).unsqueeze(-1))
    ds = p * (dof @ vf.transpose(-1, -2) - D.unsqueeze(-1))
    dq = (ds @ kf) * scale
    return dq, _sum_heads((ds.transpose(-1, -2) @ qf) * scale, g), _sum_heads(p.transpose(-1, -2) @ dof, g)


class _Softmax:
    """The running output (fp32) and log-sum-exp of every query chunk, blocks merged by their log-sum-exp
    (the online softmax of Ring Attention, Liu et al. 2023, and FlashAttention-2, Dao 2023)."""

    def __init__(self, n_chunks: int):
        self.out: list = [None] * n_chunks
        self.lse: list = [None] * n_chunks
        self.pairs = 0

    def add(self, blocks: _Blocks, q, k, v, scale) -> None:
        """Fold the visible pairs of ``blocks`` in (q, k, v in their dtype, k / v with their kv heads)."""
        for i, kind, qs, ks, pairs in blocks.visible():
            out_b, lse_b = _attend(q[:, :, qs], k[:, :, ks], v[:, :, ks], kind == DIAG, scale,
                                   blocks.mask_of(qs, ks))
            self.pairs += pairs
            if self.out[i] is None:
                self.out[i], self.lse[i] = out_b.float(), lse_b
                continue
            lse = torch.logaddexp(self.lse[i], lse_b)
            new = _finite(lse).unsqueeze(-1)
            self.out[i].mul_(torch.exp(self.lse[i].unsqueeze(-1) - new)).add_(
                out_b.float() * torch.exp(lse_b.unsqueeze(-1) - new))
            self.lse[i] = lse

    def result(self, q, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, L = q.shape[:3]
        c = L // len(self.out)
        out = [o if o is not None else q.new_zeros((b, h, c, dv), dtype=torch.float32) for o in self.out]
        lse = [x if x is not None else q.new_full((b, h, c), float("-inf"), dtype=torch.float32) for x in self.lse]
        if len(out) == 1:
            return out[0], lse[0]
        return torch.cat(out, 2), torch.cat(lse, 2)


def _blocks_backward(blocks: _Blocks, q, k, v, do, out, lse, corr, scale):
    """The backward over the visible blocks: (dq, dk, dv) for these q and k rows, fp32, dk / dv with k's
    heads; ``out`` / ``lse`` are the final ones of the query rows, ``D = rowsum(do * out) + corr``
    (:func:`_attend_backward`)."""
    f32 = torch.float32
    dq, dk, dv = q.new_zeros(q.shape, dtype=f32), k.new_zeros(k.shape, dtype=f32), v.new_zeros(v.shape, dtype=f32)
    for _, kind, qs, ks, _ in blocks.visible():
        dq_b, dk_b, dv_b = _attend_backward(do[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks],
                                            None if out is None else out[:, :, qs], lse[:, :, qs],
                                            None if corr is None else corr[:, :, qs], kind == DIAG, scale,
                                            blocks.mask_of(qs, ks))
        dq[:, :, qs] += dq_b
        dk[:, :, ks] += dk_b
        dv[:, :, ks] += dv_b
    return dq, dk, dv


# --------------------------------------------------------------------------- checks

def check_cp_attention(variant: str, n: int, hq: int, hkv: int, seq: int, has_mask: bool,
                       balanced: bool = True) -> None:
    """Raise ValueError when ``variant`` cannot run this attention over cp = ``n`` (the planner may call
    it before lowering; the op and its fake implementation do)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown cp attention variant {variant!r}: use one of {', '.join(VARIANTS)}")
    if hkv <= 0 or hq % hkv:
        raise ValueError(f"grouped-query attention needs the {hq} query heads to be a multiple of the {hkv} kv heads")
    _check_seq(seq, n, balanced)
    name = {"ring": "ring attention", "a2a": "Ulysses (a2a) attention"}.get(variant)
    if has_mask and name is not None:
        raise ValueError(f"{name} supports causal or no mask; an arbitrary mask needs cp_attention='allgather'")
    if variant == "a2a" and hq % n:
        valid = ", ".join(str(m) for m in range(2, hq + 1) if hq % m == 0) or "none"
        raise ValueError(f"Ulysses (a2a) attention splits the {hq} query heads over cp={n}: use cp in {{{valid}}} "
                         "or cp_attention='ring'/'allgather'")


def _check(q, k, v, mask, n, variant, balanced):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"cp_attention takes q, k, v as [b, heads, s_loc, d]; got {list(q.shape)}, "
                         f"{list(k.shape)}, {list(v.shape)}")
    check_cp_attention(variant, n, q.shape[1], k.shape[1], n * q.shape[2], mask is not None, balanced)


def _full_mask(mask, L: int, s: int):
    """``mask`` broadcast over its last two dims to [.., .., L, s] (batch and head dims kept as given)."""
    if mask is None:
        return None
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask.expand(mask.shape[0], mask.shape[1], L, s)


# --------------------------------------------------------------------------- ring

def _ring_start(comm, tensors: list[torch.Tensor], axis: str):
    """Send ``tensors`` to the next rank of ``axis`` and receive the previous rank's: a handle whose
    ``wait()`` returns them (asynchronous where the communicator has ``start_sendrecv_ring``)."""
    start = getattr(comm, "start_sendrecv_ring", None)
    if start is not None:
        return start([t.contiguous() for t in tensors], axis)
    got = comm.sendrecv_ring([t.contiguous() for t in tensors], axis)
    return _Ready(got)


class _Ready:
    def __init__(self, tensors):
        self.tensors = tensors

    def wait(self):
        return self.tensors


def _ring_setup(q, axis, n, balanced):
    """What both ring passes start from: the communicator, this rank, the rank's chunk ids and chunk length."""
    comm = _comm()
    r = comm.rank(axis)
    ids = _chunks_of(n, r, balanced)
    return comm, r, ids, q.shape[2] // len(ids)


def _ring_forward(q, k, v, axis, n, causal, scale, balanced):
    comm, r, ids, c = _ring_setup(q, axis, n, balanced)
    acc = _Softmax(len(ids))
    kv = [k, v]
    for t in range(n):
        nxt = _ring_start(comm, kv, axis) if t < n - 1 else None  # the next block is in flight during this one
        acc.add(_Blocks(ids, _chunks_of(n, (r - t) % n, balanced), c, causal), q, kv[0], kv[1], scale)
        if nxt is not None:
            kv = nxt.wait()
    out, lse = acc.result(q, v.shape[-1])
    return out, lse, acc.pairs


def _ring_backward(do, out, corr, q, k, v, lse, axis, n, causal, scale, balanced):
    comm, r, ids, c = _ring_setup(q, axis, n, balanced)
    dq = None
    kv, dkv_in = [k, v], None
    for t in range(n):
        nxt = _ring_start(comm, kv, axis) if t < n - 1 else None
        blocks = _Blocks(ids, _chunks_of(n, (r - t) % n, balanced), c, causal)
        dq_b, dk_b, dv_b = _blocks_backward(blocks, q, kv[0], kv[1], do, out, lse, corr, scale)
        dq = dq_b if dq is None else dq.add_(dq_b)
        dkv = [dk_b, dv_b]
        if dkv_in is not None:  # the block's dk / dv so far, from the ranks before this one
            dk_in, dv_in = dkv_in.wait()
            dkv = [dk_in + dkv[0], dv_in + dkv[1]]
        dkv_in = _ring_start(comm, dkv, axis) if n > 1 else _Ready(dkv)  # to the block's next rank (finally: its owner)
        if nxt is not None:
            kv = nxt.wait()
    dk, dv = dkv_in.wait()
    return dq, dk, dv


# --------------------------------------------------------------------------- allgather

def _gather_kv(x, axis, n, balanced):
    """[b, h, s_loc, d] of every rank -> [b, h, s, d] in natural order."""
    full = _comm().all_gather(x.contiguous(), 2, axis)
    return _to_natural(full, 2, full.shape[2], n, balanced)


def _allgather_blocks(q, n, axis, causal, balanced, mask):
    L = q.shape[2]
    r = _comm().rank(axis)
    ids = _chunks_of(n, r, balanced)
    c = L // len(ids)
    return _Blocks(ids, list(range(_n_chunks(n, balanced))), c, causal, _full_mask(mask, L, n * L))


def _allgather_forward(q, k, v, mask, axis, n, causal, scale, balanced):
    blocks = _allgather_blocks(q, n, axis, causal, balanced, mask)
    acc = _Softmax(len(blocks.q_ids))
    acc.add(blocks, q, _gather_kv(k, axis, n, balanced), _gather_kv(v, axis, n, balanced), scale)
    out, lse = acc.result(q, v.shape[-1])
    return out, lse, acc.pairs


def _allgather_backward(do, out, corr, q, k, v, lse, mask, axis, n, causal, scale, balanced):
    """K / V gathered again (not kept from the forward), dK / dV permuted to rank order and
    reduce-scattered to their owners."""
    comm = _comm()
    blocks = _allgather_blocks(q, n, axis, causal, balanced, mask)
    k_all, v_all = _gather_kv(k, axis, n, balanced), _gather_kv(v, axis, n, balanced)
    dq, dk, dv = _blocks_backward(blocks, q, k_all, v_all, do, out, lse, corr, scale)
    s = k_all.shape[2]
    dk = comm.reduce_scatter(_to_concat(dk, 2, s, n, balanced).contiguous(), 2, axis)
    dv = comm.reduce_scatter(_to_concat(dv, 2, s, n, balanced).contiguous(), 2, axis)
    return dq, dk, dv


# --------------------------------------------------------------------------- a2a (Ulysses)

def _heads_to_seq(x, axis, n, balanced):
    """[b, h, s_loc, *rest] of every rank -> [b, h / n, s, *rest]: this rank's head group, every rank's
    tokens, natural order."""
    b, h, L = x.shape[:3]
    rest = x.shape[3:]
    send = x.reshape(b, n, h // n, L, *rest).transpose(0, 1).contiguous()  # head group j -> rank j
    got = _comm().all_to_all(send, [1] * n, [1] * n, axis)  # (n, b, h/n, L, *rest): rank i's tokens
    got = got.movedim(0, 2).reshape(b, h // n, n * L, *rest)
    return _to_natural(got, 2, n * L, n, balanced)


def _seq_to_heads(x, axis, n, balanced):
    """The inverse of :func:`_heads_to_seq`."""
    b, hl, s = x.shape[:3]
    rest = x.shape[3:]
    send = _to_concat(x, 2, s, n, balanced).reshape(b, hl, n, s // n, *rest).movedim(2, 0).contiguous()
    got = _comm().all_to_all(send, [1] * n, [1] * n, axis)  # (n, b, h/n, L, *rest): head group i
    return got.transpose(0, 1).reshape(b, n * hl, s // n, *rest)


def _a2a_kv(x, hq, n):
    """kv heads as the all-to-all needs them: split over cp if they divide, else repeated to hq (each rank
    then receives only its query heads' share)."""
    return x if x.shape[1] % n == 0 else _expand_heads(x, hq // x.shape[1])


def _a2a_blocks(s, causal):
    """Every token in natural order on both sides: one block, causal as a whole."""
    return _Blocks([0], [0], s, causal)


def _a2a_forward(q, k, v, axis, n, causal, scale, balanced):
    hq = q.shape[1]
    qh = _heads_to_seq(q, axis, n, balanced)
    kh = _heads_to_seq(_a2a_kv(k, hq, n), axis, n, balanced)
    vh = _heads_to_seq(_a2a_kv(v, hq, n), axis, n, balanced)
    acc = _Softmax(1)
    acc.add(_a2a_blocks(qh.shape[2], causal), qh, kh, vh, scale)
    out, lse = acc.result(qh, v.shape[-1])
    return _seq_to_heads(out, axis, n, balanced), _seq_to_heads(lse, axis, n, balanced), acc.pairs


def _a2a_backward(do, out, corr, q, k, v, lse, axis, n, causal, scale, balanced):
    """D = rowsum(do * out) + corr is computed on the rank's tokens and travels with lse (not out itself)."""
    hq, hkv = q.shape[1], k.shape[1]
    D = (do.float() * out.float()).sum(-1)
    if corr is not None:
        D = D + corr
    qh = _heads_to_seq(q, axis, n, balanced)
    kh = _heads_to_seq(_a2a_kv(k, hq, n), axis, n, balanced)
    vh = _heads_to_seq(_a2a_kv(v, hq, n), axis, n, balanced)
    doh = _heads_to_seq(do, axis, n, balanced)
    stats = _heads_to_seq(torch.stack([lse, D], -1), axis, n, balanced)
    dq, dk, dv = _blocks_backward(_a2a_blocks(qh.shape[2], causal), qh, kh, vh, doh, None, stats[..., 0],
                                  stats[..., 1], scale)
    dq = _seq_to_heads(dq, axis, n, balanced)
    dk = _seq_to_heads(dk, axis, n, balanced)
    dv = _seq_to_heads(dv, axis, n, balanced)
    if dk.shape[1] != hkv:  # repeated to hq before the all-to-all
        dk, dv = _sum_heads(dk, hq // hkv), _sum_heads(dv, hq // hkv)
    return dq, dk, dv


# --------------------------------------------------------------------------- the ops

@torch.library.custom_op("mcompile::cp_attention", mutates_args=())
def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, axis: str, n: int,
                 variant: str, causal: bool, scale: float, balanced: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's queries ``q`` [b, hq, s_loc, d] over the whole sequence, whose keys and
    values are spread over ``axis`` like the queries (``k``, ``v``: [b, hkv, s_loc, d]); ``(out, lse)``
    for the local query rows, as single-device attention on the global tensors (module docstring)."""
    _check(q, k, v, mask, n, variant, balanced)
    if variant == "ring":
        out, lse, pairs = _ring_forward(q, k, v, axis, n, causal, scale, balanced)
    elif variant == "allgather":
        out, lse, pairs = _allgather_forward(q, k, v, mask, axis, n, causal, scale, balanced)
    else:
        out, lse, pairs = _a2a_forward(q, k, v, axis, n, causal, scale, balanced)
    heads = q.shape[1] // n if variant == "a2a" else q.shape[1]
    CPStats.add(pairs, q.shape[0] * heads)
    return _bshd(out.to(q.dtype)), lse.contiguous()


def _bshd(x: torch.Tensor) -> torch.Tensor:
    """[b, h, s, d] laid out as [b, s, h, d], as torch's attention kernels return it (a captured graph
    may view the transposed output without a copy); fake and real outputs must have the same strides."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


@cp_attention.register_fake
def _(q, k, v, mask, axis, n, variant, causal, scale, balanced):
    _check(q, k, v, mask, n, variant, balanced)
    b, h, s = q.shape[:3]
    return q.new_empty((b, s, h, v.shape[-1])).transpose(1, 2), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("mcompile::cp_attention_backward", mutates_args=())
def cp_attention_backward(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, mask: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, axis: str,
                          n: int, variant: str, causal: bool, scale: float,
                          balanced: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of this rank's q, k, v: every rank's queries' contributions to dk / dv summed at
    the keys' owner."""
    do = dout.to(q.dtype)
    # lse's own gradient: d lse / d score = p, so it enters D = rowsum(do * out) as -dlse
    corr = None if dlse is None else -dlse.float()
    if variant == "ring":
        dq, dk, dv = _ring_backward(do, out, corr, q, k, v, lse, axis, n, causal, scale, balanced)
    elif variant == "allgather":
        dq, dk, dv = _allgather_backward(do, out, corr, q, k, v, lse, mask, axis, n, causal, scale, balanced)
    else:
        dq, dk, dv = _a2a_backward(do, out, corr, q, k, v, lse, axis, n, causal, scale, balanced)
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()


@cp_attention_backward.register_fake
def _(dout, dlse, q, k, v, mask, out, lse, axis, n, variant, causal, scale, balanced):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def _attn_setup(ctx, inputs, output):
    q, k, v, mask = inputs[:4]
    # an output nobody used gets None, not zeros: an unused lse then costs the backward nothing (a zero
    # dlse would still send D through the kernels' extra columns)
    ctx.set_materialize_grads(False)
    ctx.args = tuple(inputs[4:])
    ctx.save_for_backward(q, k, v, mask, *output)


def _attn_backward(ctx, dout, dlse):
    q, k, v, mask, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = cp_attention_backward(dout.contiguous(), dlse, q, k, v, mask, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


torch.library.register_autograd("mcompile::cp_attention", _attn_backward, setup_context=_attn_setup)


CP_OPS = {
    "cp_slice": torch.ops.mcompile.cp_slice.default,
    "cp_gather": torch.ops.mcompile.cp_gather.default,
    "cp_attention": torch.ops.mcompile.cp_attention.default,
}
