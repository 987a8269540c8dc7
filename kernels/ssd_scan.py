"""The Mamba-2 selective scan (SSD) as a Triton kernel pair beside its PyTorch reference.

SSD (Dao & Gu 2024, "Transformers are SSMs: Generalized Models and Efficient Algorithms Through
Structured State Space Duality", arXiv:2405.21060, §3 and Listing 1). Per batch row and head, a
state h of shape (p, n) runs over the l positions:

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T          (h_0 = 0)
    y_t = h_t C_t + D x_t

    x  (b, l, heads, p)      dt (b, l, heads)  after softplus (>= 0)
    A  (heads,)  negative    D  (heads,)
    B, C (b, l, groups, n)   head j reads group j // (heads / groups)  (mamba_ssm's "b l g n -> b l (g h) n")
    y  (b, l, heads, p), in x's dtype; everything is computed in fp32 (fp64 inputs: in fp64 by the reference)

One op, ``mcompile::ssd_scan(x, dt, A, B, C, D) -> y``, a ``torch.library.custom_op`` with a fake
(meta) kernel and a registered autograd whose backward is itself a custom op,
``mcompile::ssd_scan_backward(dy, x, dt, A, B, C, D) -> (dx, ddt, dA, dB, dC, dD)``: torch.export
and AOTAutograd see one opaque node each way, and the planner shards the node by heads
(mcompile/sharding/rules/ssm.py). Heads are independent, so a head-sharded scan is exact; the sequence is
never split inside it.

Reference (:func:`ssd_scan_reference`): the chunked SSD form of the paper's Listing 1 (``ssd_minimal``)
in PyTorch ops — within a chunk of Q positions the quadratic (attention-like) form with the
1-semiseparable decay mask exp(segsum(dt A)); between chunks the states passed by a scan over
chunks — plus the D skip. The length is zero-padded to a multiple of Q (dt = 0 there: no decay, no
input, so the padding changes nothing before it). :func:`ssd_scan_sequential` is the recurrence above,
step by step (the tests' ground truth in fp64). The reference's backward is autograd through it.

Triton kernels (correctness first, DESIGN §8). One program per (batch row, head) keeps the whole
(p, n) state in registers and walks the positions in order: the recurrence itself, O(l p n) work,
no quadratic term. Forward ``_ssd_fwd_kernel``: y, or (for the backward) only the state entering
each chunk of ``CHUNK`` positions. Backward ``_ssd_bwd_kernel``: chunks in reverse; for each, the
forward is replayed from the chunk's saved state, writing h_t of its ``CHUNK`` positions to a
per-program scratch buffer (so memory is (l/CHUNK + CHUNK) states, not l), then positions run
backwards with the state gradient g (p, n), a_t = exp(dt_t A):

    g   += dy_t C_t^T                                 (g = dL/dh_t)
    dC_t = h_t^T dy_t                                  dx_t = dt_t g B_t + D dy_t
    dB_t = dt_t g^T x_t                                ddt_t = A a_t <g, h_{t-1}> + x_t . (g B_t)
    dA  += dt_t a_t <g, h_{t-1}>                       dD   += dy_t . x_t
    g    = a_t g                                       (on to h_{t-1})

dB and dC are written per head and summed over each group's heads afterwards, dA and dD per
(batch row, head) and summed over rows: no atomics, deterministic. The parallelism is b x heads
programs and the positions are sequential — the simple scan the issue allows; the within-chunk
quadratic form on tensor cores (the paper's SSD algorithm, mamba_ssm's five kernels) is the
performance step after this one.

Dispatch: Triton on CUDA tensors. On CPU tensors the reference runs, unless Triton's interpreter is
on (``TRITON_INTERPRET=1`` when this module was imported) AND the tests ask for it explicitly
(:func:`triton_on_cpu`, or ``MCOMPILE_SSD_SCAN_INTERPRET=1`` in the environment): the test suite
sets TRITON_INTERPRET=1 for every process, and a model's scan interpreted step by step would be far
slower than the reference.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from mcompile.kernels._triton import jit as _jit
from mcompile.kernels._triton import pow2 as _pow2
from mcompile.kernels._triton import runs_triton, tl, triton

__all__ = ["ssd_scan", "ssd_scan_backward", "ssd_scan_reference", "ssd_scan_sequential", "triton_on_cpu",
           "uses_triton"]

_REF_CHUNK = 64  # Q of the reference's chunked form (mamba_ssm's default chunk_size is 256; 64 keeps CPU memory low)
_CHUNK = 64  # positions between the states the backward saves (its scratch holds CHUNK + 1 states a program)
_WARPS = 4
_CPU_TRITON = os.environ.get("MCOMPILE_SSD_SCAN_INTERPRET", "0").lower() in ("1", "true", "on")


@contextlib.contextmanager
def triton_on_cpu(on: bool = True):
    """Within the block, CPU tensors take the Triton kernels when the interpreter is on (tests)."""
    global _CPU_TRITON
    saved, _CPU_TRITON = _CPU_TRITON, on
    try:
        yield
    finally:
        _CPU_TRITON = saved


def uses_triton(device: torch.device | str) -> bool:
    """Whether the ops run their Triton kernels for tensors on ``device`` (else the reference)."""
    device = torch.device(device)
    if device.type == "cpu" and not _CPU_TRITON:
        return False
    return runs_triton(device, _INTERPRETED)


def _check(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(f"mcompile::ssd_scan: x must be (batch, length, heads, head_dim); got {tuple(x.shape)}")
    b, l, h, _ = x.shape  # noqa: E741
    if tuple(dt.shape) != (b, l, h):
        raise ValueError(f"mcompile::ssd_scan: dt of shape {tuple(dt.shape)} must be (batch, length, heads) = "
                         f"{(b, l, h)} for x of shape {tuple(x.shape)}")
    for name, t in (("A", A), ("D", D)):
        if tuple(t.shape) != (h,):
            raise ValueError(f"mcompile::ssd_scan: {name} of shape {tuple(t.shape)} must be (heads,) = ({h},)")
    if B.dim() != 4 or tuple(B.shape[:2]) != (b, l) or tuple(C.shape) != tuple(B.shape):
        raise ValueError(f"mcompile::ssd_scan: B {tuple(B.shape)} and C {tuple(C.shape)} must both be "
                         f"(batch, length, groups, state) with batch, length = {b}, {l}")
    g = B.shape[2]
    if g == 0 or h % g:
        raise ValueError(f"mcompile::ssd_scan: {g} groups of B/C must divide the {h} heads")


# ---- PyTorch references ---------------------------------------------------------------------
def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _segsum(a: Tensor) -> Tensor:
    """[..., T] -> [..., T, T]: out[i, j] = a[j+1] + ... + a[i] for i >= j, -inf above the diagonal
    (the stable masked-cumsum form of the paper's Listing 1)."""
    t = a.size(-1)
    a = a[..., None].expand(*a.shape, t)  # [..., i, j] = a[i]
    below = torch.ones(t, t, dtype=torch.bool, device=a.device).tril(-1)
    s = a.masked_fill(~below, 0).cumsum(dim=-2)
    return s.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=a.device).tril(0), float("-inf"))


def ssd_scan_reference(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
                       chunk: int = _REF_CHUNK) -> Tensor:
    """The chunked SSD form (arXiv:2405.21060, Listing 1) plus the D skip; differentiable."""
    _check(x, dt, A, B, C, D)
    b, l, h, p = x.shape  # noqa: E741
    g, n = B.shape[2], B.shape[3]
    cd = _compute_dtype(x)
    xf, dtf, Af, Df = x.to(cd), dt.to(cd), A.to(cd), D.to(cd)
    Bh = B.to(cd).repeat_interleave(h // g, dim=2)  # (b, l, h, n)
    Ch = C.to(cd).repeat_interleave(h // g, dim=2)
    q = max(1, min(chunk, l))
    pad = (-l) % q
    X, a = xf * dtf[..., None], dtf * Af  # input dt x, log-decay dt A
    if pad:
        X, Bp, Cp = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (X, Bh, Ch))
        a = F.pad(a, (0, 0, 0, pad))
    else:
        Bp, Cp = Bh, Ch
    c = (l + pad) // q
    X, Bp, Cp = X.reshape(b, c, q, h, p), Bp.reshape(b, c, q, h, n), Cp.reshape(b, c, q, h, n)
    a = a.reshape(b, c, q, h).permute(0, 3, 1, 2)  # (b, h, c, q)
    a_cum = a.cumsum(-1)
    # 1. within each chunk: the quadratic form with the decay mask
    decay = torch.exp(_segsum(a))  # (b, h, c, q, q)
    y = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", Cp, Bp, decay, X)
    # 2. the state each chunk ends with, from its own inputs
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bp, torch.exp(a_cum[..., -1:] - a_cum), X)
    # 3. states passed between chunks (a scan over chunks, as a (c+1) x (c+1) decay matrix)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    chunk_decay = torch.exp(_segsum(F.pad(a_cum[..., -1], (1, 0))))  # (b, h, c+1, c+1)
    states = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)[:, :-1]  # state entering each chunk
    # 4. each position's output from the state entering its chunk
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", Cp, states, torch.exp(a_cum))
    y = y.reshape(b, c * q, h, p)[:, :l] + xf * Df[:, None]
    return y.to(x.dtype)


def ssd_scan_sequential(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor) -> Tensor:
    """The recurrence, position by position (slow; the tests' ground truth)."""
    _check(x, dt, A, B, C, D)
    b, l, h, p = x.shape  # noqa: E741
    g, n = B.shape[2], B.shape[3]
    cd = _compute_dtype(x)
    Bh = B.to(cd).repeat_interleave(h // g, dim=2)
    Ch = C.to(cd).repeat_interleave(h // g, dim=2)
    xf, dtf, Af, Df = x.to(cd), dt.to(cd), A.to(cd), D.to(cd)
    state = xf.new_zeros(b, h, p, n)
    ys = []
    for t in range(l):
        a = torch.exp(dtf[:, t] * Af)[..., None, None]  # (b, h, 1, 1)
        state = a * state + (dtf[:, t, :, None] * xf[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]) + Df[:, None] * xf[:, t])
    return torch.stack(ys, dim=1).to(x.dtype) if ys else torch.zeros_like(x)


@contextlib.contextmanager
def _autograd_inside_op():
    """A custom op's kernel runs with autograd's dispatch keys excluded; the reference backward
    differentiates the reference with autograd, so it lifts that exclusion for its own block."""
    keys = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutogradFunctionality)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), keys), torch.enable_grad():
        yield


def _reference_backward(dy, x, dt, A, B, C, D):
    with _autograd_inside_op():
        leaves = [t.detach().requires_grad_() for t in (x, dt, A, B, C, D)]
        y = ssd_scan_reference(*leaves)
        grads = torch.autograd.grad(y, leaves, dy.to(y.dtype), allow_unused=True)
    return tuple(torch.zeros_like(t) if gr is None else gr.detach().to(t.dtype).contiguous()
                 for gr, t in zip(grads, (x, dt, A, B, C, D)))


# ---- Triton kernels -------------------------------------------------------------------------
@_jit
def _ssd_fwd_kernel(X, DT, A, B, C, D, Y, S, L, H, G, P, N, n_chunks,
                    WRITE_Y: tl.constexpr, WRITE_STATES: tl.constexpr, CHUNK: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (batch row, head): the recurrence over the L positions, state (P, N) in
    registers. WRITE_Y: y_t = h_t C_t + D x_t. WRITE_STATES: the state entering each chunk of CHUNK
    positions, to S (b, heads, n_chunks, P, N) fp32 (what the backward replays from)."""
    pid = tl.program_id(0)
    bi = pid // H
    hi = pid % H
    gi = hi // (H // G)
    ps = tl.arange(0, BLOCK_P)
    ns = tl.arange(0, BLOCK_N)
    pm = ps < P
    nm = ns < N
    tile = ps[:, None] * N + ns[None, :]
    tmask = pm[:, None] & nm[None, :]
    a_coef = tl.load(A + hi).to(tl.float32)
    d_coef = tl.load(D + hi).to(tl.float32)
    state = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for c in range(0, n_chunks):
        if WRITE_STATES:
            tl.store(S + (pid.to(tl.int64) * n_chunks + c) * P * N + tile, state, mask=tmask)
        start = c * CHUNK
        cnt = tl.minimum(L - start, CHUNK)
        for i in range(0, cnt):
            row = (bi * L + start + i).to(tl.int64)
            x = tl.load(X + (row * H + hi) * P + ps, mask=pm, other=0.0).to(tl.float32)
            dt = tl.load(DT + row * H + hi).to(tl.float32)
            b = tl.load(B + (row * G + gi) * N + ns, mask=nm, other=0.0).to(tl.float32)
            state = state * tl.exp(dt * a_coef) + (dt * x)[:, None] * b[None, :]
            if WRITE_Y:
                cc = tl.load(C + (row * G + gi) * N + ns, mask=nm, other=0.0).to(tl.float32)
                y = tl.sum(state * cc[None, :], axis=1) + d_coef * x
                tl.store(Y + (row * H + hi) * P + ps, y.to(Y.dtype.element_ty), mask=pm)


@_jit
def _ssd_bwd_kernel(X, DT, A, B, C, D, DY, S, W, DX, DDT, DBH, DCH, DA, DD, L, H, G, P, N, n_chunks,
                    CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (batch row, head), chunks in reverse: replay the chunk's forward from its saved
    state into the scratch W (CHUNK + 1 states a program), then walk its positions backwards with the
    state gradient g (module docstring). dB, dC per head (DBH, DCH: b, l, heads, N fp32); dA, dD per
    (batch row, head)."""
    pid = tl.program_id(0)
    bi = pid // H
    hi = pid % H
    gi = hi // (H // G)
    ps = tl.arange(0, BLOCK_P)
    ns = tl.arange(0, BLOCK_N)
    pm = ps < P
    nm = ns < N
    tile = ps[:, None] * N + ns[None, :]
    tmask = pm[:, None] & nm[None, :]
    a_coef = tl.load(A + hi).to(tl.float32)
    d_coef = tl.load(D + hi).to(tl.float32)
    work = W + pid.to(tl.int64) * (CHUNK + 1) * P * N
    g = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    da = tl.sum(tl.zeros([BLOCK_P], dtype=tl.float32), axis=0)
    dd = tl.sum(tl.zeros([BLOCK_P], dtype=tl.float32), axis=0)
    for cr in range(0, n_chunks):
        c = n_chunks - 1 - cr
        start = c * CHUNK
        cnt = tl.minimum(L - start, CHUNK)
        state = tl.load(S + (pid.to(tl.int64) * n_chunks + c) * P * N + tile, mask=tmask, other=0.0)
        tl.store(work + tile, state, mask=tmask)
        for i in range(0, cnt):  # replay: h_t of the chunk's positions into work[1 ..]
            row = (bi * L + start + i).to(tl.int64)
            x = tl.load(X + (row * H + hi) * P + ps, mask=pm, other=0.0).to(tl.float32)
            dt = tl.load(DT + row * H + hi).to(tl.float32)
            b = tl.load(B + (row * G + gi) * N + ns, mask=nm, other=0.0).to(tl.float32)
            state = state * tl.exp(dt * a_coef) + (dt * x)[:, None] * b[None, :]
            tl.store(work + (i + 1) * P * N + tile, state, mask=tmask)
        tl.debug_barrier()
        for j in range(0, cnt):
            i = cnt - 1 - j
            row = (bi * L + start + i).to(tl.int64)
            x = tl.load(X + (row * H + hi) * P + ps, mask=pm, other=0.0).to(tl.float32)
            dy = tl.load(DY + (row * H + hi) * P + ps, mask=pm, other=0.0).to(tl.float32)
            dt = tl.load(DT + row * H + hi).to(tl.float32)
            b = tl.load(B + (row * G + gi) * N + ns, mask=nm, other=0.0).to(tl.float32)
            cc = tl.load(C + (row * G + gi) * N + ns, mask=nm, other=0.0).to(tl.float32)
            h_t = tl.load(work + (i + 1) * P * N + tile, mask=tmask, other=0.0)
            h_prev = tl.load(work + i * P * N + tile, mask=tmask, other=0.0)
            g += dy[:, None] * cc[None, :]
            decay = tl.exp(dt * a_coef)
            gb = tl.sum(g * b[None, :], axis=1)  # (P,): g B_t
            through = tl.sum(tl.sum(g * h_prev, axis=1), axis=0)  # <g, h_{t-1}>
            tl.store(DX + (row * H + hi) * P + ps, (dt * gb + d_coef * dy).to(DX.dtype.element_ty), mask=pm)
            tl.store(DDT + row * H + hi, a_coef * decay * through + tl.sum(x * gb, axis=0))
            tl.store(DBH + (row * H + hi) * N + ns, dt * tl.sum(g * x[:, None], axis=0), mask=nm)
            tl.store(DCH + (row * H + hi) * N + ns, tl.sum(h_t * dy[:, None], axis=0), mask=nm)
            da += dt * decay * through
            dd += tl.sum(dy * x, axis=0)
            g = g * decay
        tl.debug_barrier()  # the next chunk's replay overwrites work
    tl.store(DA + pid, da)
    tl.store(DD + pid, dd)


_INTERPRETED = type(_ssd_fwd_kernel).__name__ == "InterpretedFunction"


def _launch_shape(x: Tensor, B: Tensor) -> tuple[int, int, int, int, int, int, int, int]:
    b, l, h, p = x.shape  # noqa: E741
    g, n = B.shape[2], B.shape[3]
    return b, l, h, p, g, n, _pow2(p), _pow2(n)


def _warps(block_p: int, block_n: int) -> int:
    # the state (and, backward, its gradient) spread over the program's threads: at most 32 fp32 values of
    # each a thread (a 64 x 128 state: 8 warps)
    return max(_WARPS, min(16, block_p * block_n // (32 * 32)))


def _triton_forward(x, dt, A, B, C, D):
    b, l, h, p, g, n, bp, bn = _launch_shape(x, B)  # noqa: E741
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    n_chunks = triton.cdiv(l, _CHUNK)
    _ssd_fwd_kernel[(b * h,)](x, dt, A, B, C, D, y, y, l, h, g, p, n, n_chunks, WRITE_Y=True, WRITE_STATES=False,
                              CHUNK=_CHUNK, BLOCK_P=bp, BLOCK_N=bn, num_warps=_warps(bp, bn))
    return y


def _triton_backward(dy, x, dt, A, B, C, D):
    b, l, h, p, g, n, bp, bn = _launch_shape(x, B)  # noqa: E741
    n_chunks = triton.cdiv(l, _CHUNK)
    f32 = dict(dtype=torch.float32, device=x.device)
    states = torch.empty(b * h * n_chunks * p * n, **f32)
    warps = _warps(bp, bn)
    _ssd_fwd_kernel[(b * h,)](x, dt, A, B, C, D, x, states, l, h, g, p, n, n_chunks, WRITE_Y=False,
                              WRITE_STATES=True, CHUNK=_CHUNK, BLOCK_P=bp, BLOCK_N=bn, num_warps=warps)
    work = torch.empty(b * h * (_CHUNK + 1) * p * n, **f32)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    ddt = torch.empty(b, l, h, **f32)
    dbh = torch.empty(b, l, h, n, **f32)
    dch = torch.empty(b, l, h, n, **f32)
    da = torch.empty(b, h, **f32)
    dd = torch.empty(b, h, **f32)
    # the backward keeps four (P, N) tiles live (state, its gradient, h_t, h_{t-1}). sm_90, a 64 x 128 state
    # (tests/test_kernels_scan.py): 254 registers a thread at 8 warps and no spill; at 16 warps the 128-register
    # cap a thread spills 32 bytes to the stack. So the forward's warps.
    _ssd_bwd_kernel[(b * h,)](x, dt, A, B, C, D, dy, states, work, dx, ddt, dbh, dch, da, dd, l, h, g, p, n,
                              n_chunks, CHUNK=_CHUNK, BLOCK_P=bp, BLOCK_N=bn, num_warps=warps)
    dB = dbh.view(b, l, g, h // g, n).sum(3)
    dC = dch.view(b, l, g, h // g, n).sum(3)
    return (dx, ddt.to(dt.dtype), da.sum(0).to(A.dtype), dB.to(B.dtype), dC.to(C.dtype), dd.sum(0).to(D.dtype))


# ---- custom ops -----------------------------------------------------------------------------
@torch.library.custom_op("mcompile::ssd_scan", mutates_args=())
def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor) -> Tensor:
    """y of the SSD recurrence (module docstring) for x (b, l, heads, p); contiguous, in x's dtype."""
    _check(x, dt, A, B, C, D)
    if not uses_triton(x.device) or x.numel() == 0 or B.shape[-1] == 0:
        return ssd_scan_reference(x, dt, A, B, C, D).contiguous()
    return _triton_forward(*(t.contiguous() for t in (x, dt, A, B, C, D)))


@ssd_scan.register_fake
def _(x, dt, A, B, C, D):
    _check(x, dt, A, B, C, D)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("mcompile::ssd_scan_backward", mutates_args=())
def ssd_scan_backward(dy: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                      D: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, ddt, dA, dB, dC, dD) of ssd_scan for the output gradient ``dy``, each in its input's dtype."""
    if not uses_triton(x.device) or x.numel() == 0 or B.shape[-1] == 0:
        return _reference_backward(dy, x, dt, A, B, C, D)
    return _triton_backward(*(t.contiguous() for t in (dy, x, dt, A, B, C, D)))


@ssd_scan_backward.register_fake
def _(dy, x, dt, A, B, C, D):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (x, dt, A, B, C, D))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    return ssd_scan_backward(dy, *ctx.saved_tensors)


torch.library.register_autograd("mcompile::ssd_scan", _backward, setup_context=_setup)
