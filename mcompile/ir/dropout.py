"""Dropout whose masks do not depend on the layout: a counter-based generator over global indices.

A dropout mask drawn from a stateful generator (torch's) depends on how many numbers each rank drew
before, so a sharded activation would repeat the same mask on every tp rank, a dp rank would draw the
masks of the first rows, and no two layouts would train alike. Here the keep decision of one element is
a pure function

    keep(seed, step, node, row, index)  =  philox4x32_10(counter=(index lo, index hi, row, step),
                                                         key=(seed, node))[0]  >=  p * 2**32

of where the element sits in the single-device tensor: ``row`` is its coordinate along the dim that
carries the batch (``batch`` rows, or ``batch * k`` when that dim is a flattened ``[b*s]``), counted in
the *global* batch; ``index`` its linear index over the other dims in the global shape; ``node`` a
32-bit key of the captured dropout node (:func:`node_key`); ``step`` and ``seed`` come from the runtime as
a small int64 tensor (:func:`rng_state`), an input of the program, so nothing recompiles per step.

Each rank computes only its own elements, from index vectors the lowering derives from the plan's
placements (passes/lower_dropout.py): the same mask on every layout, in a 1-rank run included, which is the
parity oracle. Eager PyTorch's ``F.dropout`` (a stateful Philox on CUDA, mt19937 on CPU) cannot be matched
by any counter-based scheme: a model with dropout trains like mcompile's 1-rank run, not like eager.

The generator is Philox-4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2,
3", SC 2011), the generator behind cuRAND's and torch's CUDA dropout, written with int64 torch ops on
values below 2**32 (a 32x32-bit product is assembled from 16-bit halves, so no intermediate exceeds 2**49):
bit-identical on CPU and CUDA, checked against the paper's known-answer vectors in tests/test_dropout.py.

``mcompile::dropout`` is a custom op whose backward is the same op on the gradient (dropout is linear:
the gradient is masked and scaled by the same mask), recomputed from the counter: no mask is saved, and
activation recompute reproduces the forward exactly.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["philox4x32", "keep_mask", "draws", "dropout", "random_like", "RANDOM_KINDS", "node_key", "rng_state",
           "RNG_INPUT"]

RNG_INPUT = "mc_rng"  # the program input holding (seed, step, row offset): runtime/module.py, api.run_local

_M32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # round multipliers (Salmon et al. 2011, Philox-4x32)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # key schedule: the golden ratio and sqrt(3) - 1, as 32-bit fractions


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of ``a * m`` for int64 ``a`` in [0, 2**32) and a constant ``m`` < 2**32,
    exact in int64: the product is assembled from ``a * (m >> 16)`` and ``a * (m & 0xFFFF)`` (< 2**48)."""
    p_lo = a * (m & 0xFFFF)
    p_hi = a * (m >> 16)
    lo = ((p_hi & 0xFFFF) << 16) + p_lo  # < 2**49
    hi = (p_hi >> 16) + (lo >> 32)
    return hi, lo & _M32


def philox4x32(c0, c1, c2, c3, k0, k1, rounds: int = 10, lanes: int = 4) -> tuple[torch.Tensor, ...]:
    """Philox-4x32-``rounds`` of the counter (c0..c3) under the key (k0, k1): int64 tensors (broadcast
    together) holding 32-bit words. Returns the first ``lanes`` output words (the last round computes only
    those)."""
    c = [torch.as_tensor(x, dtype=torch.int64) for x in (c0, c1, c2, c3)]
    k0 = torch.as_tensor(k0, dtype=torch.int64)
    k1 = torch.as_tensor(k1, dtype=torch.int64)
    for r in range(rounds):
        if r:
            k0 = (k0 + _PHILOX_W[0]) & _M32
            k1 = (k1 + _PHILOX_W[1]) & _M32
        last = r == rounds - 1
        hi1, lo1 = _mulhilo(c[2], _PHILOX_M[1])
        if last and lanes <= 2:
            return ((hi1 ^ c[1] ^ k0), lo1)[:lanes]
        hi0, lo0 = _mulhilo(c[0], _PHILOX_M[0])
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return tuple(c[:lanes])


def _threshold(p: float) -> int:
    """Keep an element when its 32-bit draw is >= this: P(keep) = 1 - p to within 2**-32."""
    return min(round(p * 2**32), 2**32)


def keep_mask(shape, rng: torch.Tensor, p: float, key: int, index: list[torch.Tensor], sizes: list,
              row_dim: int, row_scale) -> torch.Tensor:
    """The boolean keep mask of a local piece of shape ``shape``. ``index[d]``: the global coordinate of
    each local position along dim ``d`` (for ``row_dim``: within this program's batch, which starts at
    row ``rng[2] * row_scale`` of the global tensor); ``sizes[d]``: the global size of dim ``d`` (not
    read for ``row_dim``). ``rng`` = (seed, step, batch offset) (:func:`rng_state`)."""
    return (draws(shape, rng, key, index, sizes, row_dim, row_scale) >= _threshold(p)).expand(shape)


def draws(shape, rng: torch.Tensor, key: int, index: list[torch.Tensor], sizes: list, row_dim: int,
          row_scale) -> torch.Tensor:
    """Each element's 32-bit Philox draw (int64 in [0, 2**32), broadcastable to ``shape``), a function of
    (seed, step, key, global row, global index within the row): :func:`keep_mask`'s arguments."""
    nd = len(shape)
    device = rng.device
    within = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(nd)):
        if d == row_dim:
            continue
        view = [1] * nd
        view[d] = -1
        within = within + index[d].to(device, torch.int64).view(view) * stride
        stride = stride * int(sizes[d])
    if row_dim >= 0:
        view = [1] * nd
        view[row_dim] = -1
        row = index[row_dim].to(device, torch.int64).view(view) + rng[2] * int(row_scale)
    else:
        row = torch.zeros((), dtype=torch.int64, device=device)
    seed, step = rng[0], rng[1]
    (draw,) = philox4x32(within & _M32, within >> 32, row & _M32, step & _M32, seed & _M32, key & _M32,
                         lanes=1)
    return draw


@torch.library.custom_op("mcompile::dropout", mutates_args=())
def dropout(x: torch.Tensor, rng: torch.Tensor, p: float, key: int, index: list[torch.Tensor],
            sizes: list[int], row_dim: int, row_scale: int) -> torch.Tensor:
    """``x`` masked by :func:`keep_mask` and scaled by 1 / (1 - p) (zero where p == 1, as torch does)."""
    if p >= 1.0:
        return torch.zeros_like(x)
    keep = keep_mask(x.shape, rng, p, key, index, sizes, row_dim, row_scale)
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


@dropout.register_fake
def _(x, rng, p, key, index, sizes, row_dim, row_scale):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    _, rng, p, key, index, sizes, row_dim, row_scale = inputs
    ctx.save_for_backward(rng, *index)
    ctx.args = (p, key, sizes, row_dim, row_scale)


def _backward(ctx, grad):
    # dropout is linear in x: its gradient is the same mask and scale applied to grad, recomputed here
    rng, *index = ctx.saved_tensors
    p, key, sizes, row_dim, row_scale = ctx.args
    # one gradient per input, in the inputs' structure (the index list: one None per tensor)
    return dropout(grad, rng, p, key, list(index), sizes, row_dim, row_scale), None, None, None, \
        [None] * len(index), None, None, None


dropout.register_autograd(_backward, setup_context=_setup)


RANDOM_KINDS = ("uniform", "exponential")


@torch.library.custom_op("mcompile::random_like", mutates_args=())
def random_like(x: torch.Tensor, rng: torch.Tensor, kind: str, key: int, index: list[torch.Tensor],
                sizes: list[int], row_dim: int, row_scale: int, a: float, b: float) -> torch.Tensor:
    """Random numbers shaped and typed like ``x`` (whose values are not read), each a function of where the
    element sits in the single-device tensor, as :func:`keep_mask`'s (the same on every layout): ``u`` =
    (draw + 1/2) / 2**32 in (0, 1); ``"uniform"``: ``a + (b - a) * u`` (``torch.rand_like``, ``Tensor.uniform_``);
    ``"exponential"``: ``-log(u) / a`` (``Tensor.exponential_(lambd=a)``: the Gumbel noise of sampling
    routers, Phi-MoE's sparsemixer). Like mcompile's dropout these are not the numbers torch's generator draws
    (eager PyTorch cannot be matched by a counter-based scheme); they are the same on every layout."""
    if kind not in RANDOM_KINDS:
        raise ValueError(f"mcompile::random_like: kind {kind!r} is not one of {RANDOM_KINDS}")
    d = draws(x.shape, rng, key, index, sizes, row_dim, row_scale).expand(x.shape)
    u = (d.to(torch.float64) + 0.5) / 2.0**32
    out = a + (b - a) * u if kind == "uniform" else -torch.log(u) / a
    return out.to(x.dtype)


@random_like.register_fake
def _(x, rng, kind, key, index, sizes, row_dim, row_scale, a, b):
    return torch.empty_like(x)


def _random_setup(ctx, inputs, output):
    ctx.n_index = len(inputs[4])


def _random_backward(ctx, grad):  # the numbers do not depend on x's values: no gradient flows to any input
    return None, None, None, None, [None] * ctx.n_index, None, None, None, None, None


random_like.register_autograd(_random_backward, setup_context=_random_setup)


def node_key(name: str) -> int:
    """The 32-bit key of a captured node (its name in the full-depth capture, copies of repeated blocks
    included: ``dropout_1_L3``), the same on every rank and layout; SHA-256 so it is stable across
    processes (Python's ``hash`` is salted)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")


def rng_state(seed: int, step: int, batch_offset: int = 0, device=None) -> torch.Tensor:
    """The program input ``mc_rng``: (seed, step, the first row of the program's batch in the global
    batch: its data-parallel slice's and microbatch's offset, in samples)."""
    return torch.tensor([seed & _M32, step & _M32, batch_offset], dtype=torch.int64, device=device)
