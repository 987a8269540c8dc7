"""Context parallelism's runtime ops (passes/cp/ops.py), each against single-device attention.

What is isolated: the ops on one ``cp`` axis of n ranks run in n threads (mcompile.runtime.sim), every
rank holding its tokens of random global q / k / v in the load-balanced layout (chunks r and 2n-1-r)
or the contiguous one. The reference is ``F.scaled_dot_product_attention`` on the global tensors; a
rank's output, lse and gradients must equal the reference's at the rank's ``local_positions``, the
gradients through a random output gradient (the sum of the ranks' losses is the global loss, so each
rank's dk / dv, summed over every rank's queries at the owner, is the global gradient's rows).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from mcompile.ir import ops
from mcompile.ir.mesh import Mesh
from mcompile.passes.cp import ops as cp
from mcompile.runtime.sim import ThreadedWorld, run_threads

TOL = 1e-5


def _run(n: int, fn):
    return run_threads(ThreadedWorld(Mesh(cp=n)), fn)


def _globals(b, hq, hkv, s, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(shape, generator=g).to(dtype) for shape in
                   ((b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d), (b, hq, s, d)))
    dlse = torch.randn((b, hq, s), generator=g)
    return q, k, v, do, dlse


def _reference(q, k, v, do, causal, scale, mask=None, dlse=None):
    """Single-device attention on the global tensors: (out, lse, dq, dk, dv) of loss = <out, do> (+ <lse, dlse>)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    # lse by hand (SDPA does not return it): the same scores and masking
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    sc = (q @ kk.transpose(-1, -2)) * scale
    if causal:
        sc = sc.masked_fill(torch.ones(sc.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        sc = sc.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else sc + mask
    lse = torch.logsumexp(sc, -1)
    loss = (out * do).sum() + ((lse * dlse).sum() if dlse is not None else 0)
    loss.backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _cp_run(n, variant, causal, q, k, v, do, scale, balanced=True, mask=None, dlse=None, local_mask=None):
    """Every rank's (positions, out, lse, dq, dk, dv, communicator log) from cp_attention."""
    s = q.shape[2]

    def rank(r):
        pos = cp.local_positions(s, n, r, balanced)
        ql, kl, vl = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
        m = None if mask is None else (local_mask(mask, pos) if local_mask else mask[:, :, pos])
        out, lse = cp.cp_attention(ql, kl, vl, m, "cp", n, variant, causal, scale, balanced)
        loss = (out * do[:, :, pos]).sum()
        if dlse is not None:
            loss = loss + (lse * dlse[:, :, pos]).sum()
        loss.backward()
        return pos, out.detach(), lse.detach(), ql.grad, kl.grad, vl.grad, list(ops.current().log)

    return _run(n, rank)


def _assert_matches(results, ref, tol=TOL):
    out, lse, dq, dk, dv = ref
    for pos, o, ls, gq, gk, gv, _ in results:
        for name, got, want in (("out", o, out), ("lse", ls, lse), ("dq", gq, dq), ("dk", gk, dk), ("dv", gv, dv)):
            want = want[:, :, pos]
            assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape)
            err = (got.float() - want.float()).abs().max().item()
            assert err <= tol, f"{name}: max error {err:.3g} at positions {pos.tolist()}"


# --------------------------------------------------------------------------- layout

@pytest.mark.timeout(30)
def test_layout():
    assert cp.local_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert cp.local_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    assert cp.local_positions(16, 4, 1, balanced=False).tolist() == [4, 5, 6, 7]
    for n, balanced in itertools.product((1, 2, 4), (True, False)):
        cat = cp.concat_positions(24, n, balanced)
        assert sorted(cat.tolist()) == list(range(24))
        assert cat[cp.gather_order(24, n, balanced)].tolist() == list(range(24))
    with pytest.raises(ValueError, match=r"sequence length 30 does not divide by 2\*cp = 4: use a multiple of 4"):
        cp.local_positions(30, 2, 0)
    with pytest.raises(ValueError, match=r"sequence length 30 does not divide by cp = 4: use a multiple of 4"):
        cp.local_positions(30, 4, 0, balanced=False)


# --------------------------------------------------------------------------- cp_attention against SDPA

@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("variant", cp.VARIANTS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 4)], ids=["gqa", "mha"])
def test_attention_matches_sdpa(n, variant, causal, hq, hkv):
    q, k, v, do, _ = _globals(2, hq, hkv, 16, 8, seed=n * 100 + hq + hkv + causal)
    scale = 1 / math.sqrt(8)
    results = _cp_run(n, variant, causal, q, k, v, do, scale)
    _assert_matches(results, _reference(q, k, v, do, causal, scale))
    sends = [e for e in results[0][6] if e[0] == "sendrecv"]
    if variant == "ring":  # forward: k, v n-1 times; backward: k, v n-1 times, dk, dv n times (the last hop home)
        assert len(sends) == 2 * ((n - 1) + (n - 1) + n), sends
    else:
        assert not sends


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant", cp.VARIANTS)
def test_attention_contiguous_layout_and_lse_gradient(variant):
    """The contiguous split (balanced=False), and a loss that reads lse too (its gradient enters D)."""
    n = 4
    q, k, v, do, dlse = _globals(2, 4, 2, 16, 8, seed=7)
    for balanced, causal in ((False, True), (True, True), (False, False)):
        results = _cp_run(n, variant, causal, q, k, v, do, 0.4, balanced=balanced, dlse=dlse)
        _assert_matches(results, _reference(q, k, v, do, causal, 0.4, dlse=dlse))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant", cp.VARIANTS)
def test_attention_value_head_dim(variant):
    """v's head dim differs from q / k's (out takes v's)."""
    n, b, hq, hkv, s = 2, 1, 4, 2, 16
    q, k, _, _, _ = _globals(b, hq, hkv, s, 8, seed=4)
    _, _, v, do, _ = _globals(b, hq, hkv, s, 6, seed=5)
    results = _cp_run(n, variant, True, q, k, v, do, 0.3)
    _assert_matches(results, _reference(q, k, v, do, True, 0.3))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant", cp.VARIANTS)
def test_attention_bf16(variant):
    """Low-precision inputs: every block through the fused kernel in bf16 (as the single-device model's SDPA
    runs), blocks merged in fp32; out in q's dtype, lse fp32, grads in the inputs' dtypes."""
    n = 2
    q, k, v, do, _ = _globals(1, 4, 2, 16, 8, seed=3, dtype=torch.bfloat16)
    ref = _reference(q.float(), k.float(), v.float(), do.float(), True, 0.35)
    # the lse of single-device bf16 flash attention on the global tensors, against fp32 (~5e-5 here: the
    # kernel sums the probabilities it rounds to bf16 for P @ V): cp's must be as close, to 1e-5
    lse_bf16 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=0.35)[1]
    kernel_err = (lse_bf16 - ref[1]).abs().max()
    results = _cp_run(n, variant, True, q, k, v, do, 0.35)
    bf16, f32 = torch.bfloat16, torch.float32
    for pos, o, ls, gq, gk, gv, _ in results:
        assert (o.dtype, ls.dtype, gq.dtype, gk.dtype, gv.dtype) == (bf16, f32, bf16, bf16, bf16)
        assert (ls - ref[1][:, :, pos]).abs().max() < 1e-5 + kernel_err
        assert (o.float() - ref[0][:, :, pos]).abs().max() < 2e-2
        assert (gk.float() - ref[3][:, :, pos]).abs().max() < 5e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA flash kernel path (no GPU here)")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", cp.VARIANTS)
def test_attention_bf16_through_the_cuda_flash_kernel(variant):
    """On a GPU: bf16 blocks through aten._scaled_dot_product_flash_attention and its backward (GQA unrepeated,
    head dim 64, the lse gradient through the extra columns), against fp32 attention on the CPU; errors
    relative to each tensor's largest entry, a few bf16 roundings (2^-8 = 3.9e-3 each)."""
    q, k, v, do, dlse = _globals(1, 4, 2, 256, 64, seed=3, dtype=torch.bfloat16)
    ref = _reference(q.float(), k.float(), v.float(), do.float(), True, 0.125, dlse=dlse)
    results = _cp_run(2, variant, True, q.cuda(), k.cuda(), v.cuda(), do.cuda(), 0.125, dlse=dlse.cuda())
    for pos, o, ls, gq, gk, gv, _ in results:
        assert o.is_cuda and o.dtype == torch.bfloat16 and ls.dtype == torch.float32
        for name, got, want in (("out", o, ref[0]), ("lse", ls, ref[1]), ("dq", gq, ref[2]), ("dk", gk, ref[3]),
                                ("dv", gv, ref[4])):
            want = want[:, :, pos]
            err = (got.float().cpu() - want).abs().max() / want.abs().max().clamp(min=1.0)
            assert err < 3e-2, (name, float(err))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["bool", "bool+causal", "additive", "key_padding"])
@pytest.mark.parametrize("n", [2, 4])
def test_allgather_arbitrary_mask(kind, n):
    b, hq, hkv, s = 2, 4, 2, 16
    q, k, v, do, _ = _globals(b, hq, hkv, s, 8, seed=11 + n)
    g = torch.Generator().manual_seed(5)
    local_mask = None
    if kind == "additive":
        mask = torch.randn((b, 1, s, s), generator=g)
    elif kind == "key_padding":  # [b, 1, 1, s]: every query row sees the same keys
        mask = torch.rand((b, 1, 1, s), generator=g) < 0.6
        mask[..., 0] = True
        local_mask = lambda m, pos: m  # noqa: E731 (no query rows to select)
    else:
        mask = torch.rand((b, hq, s, s), generator=g) < 0.4
        mask |= torch.eye(s, dtype=torch.bool)  # every row keeps at least one key (under causal too)
    causal = kind == "bool+causal"
    ref_mask = mask & torch.ones(s, s, dtype=torch.bool).tril() if causal else mask
    results = _cp_run(n, "allgather", causal, q, k, v, do, 0.3, mask=mask, local_mask=local_mask)
    _assert_matches(results, _reference(q, k, v, do, False, 0.3, mask=ref_mask))


@pytest.mark.timeout(60)
def test_autograd_through_surrounding_ops():
    """cp_slice -> projections -> ring cp_attention -> loss on every rank: the replicated weights' gradients,
    summed over the ranks (what the runtime does over cp), equal single-device attention's. In float64: in
    fp32 both sides carry ~1.5e-5 of rounding against float64 here (gradients up to ~45; the flash kernel in
    each), which this test of the autograd wiring is not about."""
    n, b, s, dm, h, d = 2, 2, 16, 16, 4, 4
    g = torch.Generator().manual_seed(0)
    x = torch.randn((b, s, dm), generator=g, dtype=torch.float64)
    weights = [torch.randn((dm, h * d), generator=g, dtype=torch.float64) * 0.3 for _ in range(3)]

    def heads(t):
        return t.unflatten(-1, (h, d)).transpose(1, 2)

    def loss(xs, ws, attend):
        return attend(*(heads(xs @ w) for w in ws)).square().sum()

    ws = [w.clone().requires_grad_() for w in weights]
    loss(x, ws, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)).backward()
    want = [w.grad for w in ws]

    def rank(r):
        ws = [w.clone().requires_grad_() for w in weights]
        xl = cp.cp_slice(x, 1, "cp", n, s)
        loss(xl, ws, lambda q, k, v: cp.cp_attention(q, k, v, None, "cp", n, "ring", True, 1 / math.sqrt(d),
                                                     True)[0]).backward()
        return [w.grad for w in ws]

    grads = _run(n, rank)
    for i in range(3):
        assert torch.allclose(sum(gr[i] for gr in grads), want[i], atol=1e-5)


# --------------------------------------------------------------------------- memory

def _peak_bytes(variant, n, seq, hq=2, hkv=1, d=8):
    """Per rank, the peak bytes cp_attention's forward + backward allocate (inside the op too: OpenOpsTracker),
    the rank's q / k / v / dout registered first; and one rank's q, k, v, out bytes."""
    from mcompile.runtime.memory import OpenOpsTracker

    q, k, v, do, _ = _globals(1, hq, hkv, seq, d, seed=seq)

    def rank(r):
        pos = cp.local_positions(seq, n, r)
        ql, kl, vl = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
        dol = do[:, :, pos].clone()
        tracker = OpenOpsTracker()
        with tracker:
            tracker.register([ql, kl, vl, dol], "parameters")
            out, _ = cp.cp_attention(ql, kl, vl, None, "cp", n, variant, True, d ** -0.5, True)
            out.backward(dol)
        return tracker.max["activations"]

    return max(_run(n, rank)), (2 * hq + 2 * hkv) * (seq // n) * d * 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant", cp.VARIANTS)
def test_attention_memory_is_linear_in_the_chunk(variant):
    """Every block goes through the fused flash kernel, which returns its log-sum-exp: no chunk x chunk score
    block is made, so a rank's peak grows as its chunk, not as its square. Doubling the sequence (cp=2, chunks
    of 256 -> 512 tokens) doubles the peak: 2.00x for every variant (the fp32 score blocks, their mask and
    probabilities made it 3.70x / 3.78x / 3.60x for ring / allgather / a2a before the fused kernel); the peak
    stays a few times one rank's q, k, v and out (3.4x / 3.4x / 5.9x; 58x / 58x / 31x before).
    bench/cp_memory.py measures seq 16K at cp=4."""
    small, lin_small = _peak_bytes(variant, 2, 1024)
    big, lin_big = _peak_bytes(variant, 2, 2048)
    print(f"\n{variant}: peak {small} -> {big} B ({big / small:.2f}x), {big / lin_big:.1f}x q/k/v/out")
    assert big / small < 2.2, (small, big)
    assert big < 8 * lin_big, (big, lin_big)


# --------------------------------------------------------------------------- cp_slice / cp_gather

@pytest.mark.timeout(30)
@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("flat", [False, True], ids=["seq_dim", "flat_tokens"])
def test_slice_gather_roundtrip_and_grads(balanced, flat):
    n, b, s, h = 4, 3, 16, 5
    g = torch.Generator().manual_seed(1)
    x = torch.randn((b, s, h), generator=g)
    gs = [torch.randn((b, s // n, h), generator=g) for _ in range(n)]  # per-rank grads of the local slice
    gg = [torch.randn((b, s, h), generator=g) for _ in range(n)]  # per-rank grads of the gathered value
    dim = 0 if flat else 1
    shape = (lambda t: t.reshape(-1, h)) if flat else (lambda t: t)

    def rank(r):
        pos = cp.local_positions(s, n, r, balanced)
        xs = shape(x).clone().requires_grad_()
        loc = cp.cp_slice(xs, dim, "cp", n, s, balanced)
        assert torch.equal(loc, shape(x[:, pos]))
        loc.backward(shape(gs[r]))
        xl = shape(x[:, pos]).clone().requires_grad_()
        full = cp.cp_gather(xl, dim, "cp", n, s, balanced)
        full.backward(shape(gg[r]))
        return pos, xs.grad, full.detach(), xl.grad

    for r, (pos, dx_slice, full, dx_gather) in enumerate(_run(n, rank)):
        want = torch.zeros_like(x)
        want[:, pos] = gs[r]  # no communication: the rank's grad at its positions, zeros elsewhere
        assert torch.equal(dx_slice, shape(want))
        assert torch.equal(full, shape(x))  # the round trip
        assert torch.allclose(dx_gather, shape(sum(gg)[:, pos]), atol=1e-6)  # summed over ranks, the rank's rows


# --------------------------------------------------------------------------- errors

@pytest.mark.timeout(30)
def test_errors():
    q = torch.zeros(1, 6, 4, 8)
    k = torch.zeros(1, 2, 4, 8)

    def call(n, variant, mask=None, seq_loc=4, balanced=True):
        qq, kk = q[:, :, :seq_loc], k[:, :, :seq_loc]
        return _run(n, lambda r: cp.cp_attention(qq, kk, kk, mask, "cp", n, variant, True, 1.0, balanced))

    with pytest.raises(ValueError, match=r"Ulysses \(a2a\) attention splits the 6 query heads over cp=4: use cp in "
                                         r"\{2, 3, 6\} or cp_attention='ring'/'allgather'"):
        call(4, "a2a")
    with pytest.raises(ValueError, match="ring attention supports causal or no mask; an arbitrary mask needs "
                                         "cp_attention='allgather'"):
        call(2, "ring", mask=torch.ones(4, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"Ulysses \(a2a\) attention supports causal or no mask"):
        call(2, "a2a", mask=torch.ones(4, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"sequence length 6 does not divide by 2\*cp = 4: use a multiple of 4"):
        call(2, "ring", seq_loc=3)
    call(2, "ring", seq_loc=3, balanced=False)  # the contiguous split only needs s % cp
    with pytest.raises(ValueError, match="unknown cp attention variant"):
        call(2, "tree")
    with pytest.raises(ValueError, match=r"sequence length 30 does not divide by 2\*cp = 4"):
        _run(2, lambda r: cp.cp_slice(torch.zeros(30, 2), 0, "cp", 2, 30))
    with pytest.raises(ValueError, match=r"cp_gather: dim 0 of a \[6, 2\] tensor holds 6 tokens, not a multiple of 4"):
        _run(2, lambda r: cp.cp_gather(torch.zeros(6, 2), 0, "cp", 2, 8))
    # the same checks without running (the planner's entry point, and the fake implementation)
    with pytest.raises(ValueError, match=r"use cp in \{2, 3, 6\}"):
        cp.check_cp_attention("a2a", 4, 6, 2, 16, False)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fq = torch.empty(1, 6, 4, 8)
        with pytest.raises(ValueError, match="use cp in"):
            cp.cp_attention(fq, fq[:, :2], fq[:, :2], None, "cp", 4, "a2a", True, 1.0, True)


# --------------------------------------------------------------------------- tracing

@pytest.mark.timeout(60)
def test_fake_implementations_and_tracing():
    """The ops trace with fake tensors (shapes only, no communicator) and pass torch's op checks."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(2, 4, 8, 16, dtype=torch.bfloat16), torch.empty(2, 2, 8, 16, dtype=torch.bfloat16)
        out, lse = cp.cp_attention(q, k, k, None, "cp", 4, "ring", True, 0.25, True)
        assert out.shape == q.shape and out.dtype == torch.bfloat16 and lse.shape == (2, 4, 8)
        assert lse.dtype == torch.float32
        x = torch.empty(6, 32, 5)
        assert cp.cp_slice(x, 1, "cp", 4, 32).shape == (6, 8, 5)
        assert cp.cp_gather(torch.empty(6 * 8, 5), 0, "cp", 4, 32).shape == (6 * 32, 5)

    def rank(r):
        g = torch.Generator().manual_seed(r)
        q, k, v = (torch.randn((1, 4, 8, 4), generator=g, requires_grad=True) for _ in range(3))
        for variant in cp.VARIANTS:
            torch.library.opcheck(torch.ops.mcompile.cp_attention.default,
                                  (q, k, v, None, "cp", 2, variant, True, 0.5, True),
                                  test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
        x = torch.randn((2, 16, 3), generator=g, requires_grad=True)
        torch.library.opcheck(torch.ops.mcompile.cp_slice.default, (x, 1, "cp", 2, 16, True),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
        xl = torch.randn((2, 8, 3), generator=g, requires_grad=True)
        torch.library.opcheck(torch.ops.mcompile.cp_gather.default, (xl, 1, "cp", 2, 16, True),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))

    _run(2, rank)


@pytest.mark.timeout(60)
def test_aot_dispatch():
    """Through AOTAutograd with dynamic shapes (torch's opcheck), forward and registered backward; one rank
    (dynamo's tracing is not thread-safe, so not in the threaded simulator's ranks)."""
    def rank(r):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn((1, 4, 8, 4), generator=g, requires_grad=True) for _ in range(3))
        mask = torch.rand((1, 1, 8, 8), generator=g) < 0.7
        mask[..., 0] = True
        checks = [(torch.ops.mcompile.cp_attention.default, (q, k, v, None, "cp", 1, variant, True, 0.5, True))
                  for variant in cp.VARIANTS]
        checks.append((torch.ops.mcompile.cp_attention.default, (q, k, v, mask, "cp", 1, "allgather", False, 0.5,
                                                                  True)))
        x = torch.randn((2, 16, 3), generator=g, requires_grad=True)
        checks += [(torch.ops.mcompile.cp_slice.default, (x, 1, "cp", 1, 16, True)),
                   (torch.ops.mcompile.cp_gather.default, (x, 1, "cp", 1, 16, True))]
        for op, args in checks:
            torch.library.opcheck(op, args, test_utils=("test_aot_dispatch_dynamic",))

    _run(1, rank)


# --------------------------------------------------------------------------- load balance

@pytest.mark.timeout(60)
def test_stats_causal_load_balance():
    n, s = 4, 32
    q, k, v, do, _ = _globals(1, 4, 2, s, 4, seed=2)

    def counts(variant, balanced, causal=True):
        def rank(r):
            comm = ops.current()
            cp.CPStats.reset(comm)
            pos = cp.local_positions(s, n, r, balanced)
            cp.cp_attention(q[:, :, pos], k[:, :, pos], v[:, :, pos], None, "cp", n, variant, causal, 1.0, balanced)
            return cp.CPStats.of(comm), cp.CPStats.elements(comm)

        got = _run(n, rank)
        return [p for p, _ in got], [e for _, e in got]

    total = s * (s + 1) // 2  # every causal pair once
    bal, bal_el = counts("ring", True)
    naive, _ = counts("ring", False)
    print(f"\ncausal cp={n} s={s}: (query, key) pairs per rank, balanced {bal}, contiguous {naive}")
    assert bal == [total // n] * n and bal_el == [total // n * 4] * n  # b * hq = 4
    L = s // n  # contiguous: rank r's queries see r whole blocks before their own diagonal one
    assert naive == [r * L * L + L * (L + 1) // 2 for r in range(n)] and sum(naive) == total
    assert counts("allgather", True)[0] == bal  # the same tiles, visited from the gathered keys
    assert counts("allgather", False)[0] == naive
    a2a, a2a_el = counts("a2a", True)
    assert a2a == [total] * n and a2a_el == [total * 4 // n] * n  # every token, hq / n heads
    assert counts("ring", True, causal=False)[0] == [s * s // n] * n


# --------------------------------------------------------------------------- property test

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None

if given is not None:
    @pytest.mark.timeout(60)
    @settings(max_examples=8, deadline=None)
    @given(n=st.sampled_from([1, 2, 4]), variant=st.sampled_from(cp.VARIANTS), causal=st.booleans(),
           balanced=st.booleans(), heads=st.sampled_from([(4, 1), (4, 2), (8, 2), (4, 4)]),
           chunks=st.integers(1, 3), d=st.sampled_from([4, 8]), seed=st.integers(0, 2 ** 16))
    def test_property(n, variant, causal, balanced, heads, chunks, d, seed):
        hq, hkv = heads
        s = 2 * n * chunks
        q, k, v, do, dlse = _globals(1, hq, hkv, s, d, seed)
        scale = 1 / math.sqrt(d)
        results = _cp_run(n, variant, causal, q, k, v, do, scale, balanced=balanced, dlse=dlse)
        _assert_matches(results, _reference(q, k, v, do, causal, scale, dlse=dlse))


# --------------------------------------------------------------------------- the real communicator

_GLOO_RANK = """
import sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from mcompile.passes.cp import ops as cp
from mcompile.ir import ops
from mcompile.runtime.comm import DistCommunicator

rank, world, tmp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
try:
    comm = DistCommunicator(init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)))
    a, b = torch.full((3,), float(rank)), torch.full((2, 2), 10.0 + rank)
    got = comm.sendrecv_ring([a, b], "cp")
    started = comm.start_sendrecv_ring([b, a], "cp").wait()
    q, k, v, do = torch.load(f"{tmp}/inputs")
    pos = cp.local_positions(q.shape[2], world, rank)
    ql, kl, vl = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    with ops.bind(comm):
        o, lse = cp.cp_attention(ql, kl, vl, None, "cp", world, "ring", True, 0.5, True)
        o.backward(do[:, :, pos])
    torch.save({"got": got, "started": started, "pos": pos, "out": o.detach(), "dq": ql.grad, "dk": kl.grad,
                "dv": vl.grad}, f"{tmp}/res.{rank}")
finally:
    dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_dist_communicator_ring_on_gloo(tmp_path):
    """DistCommunicator.sendrecv_ring / start_sendrecv_ring (one batch_isend_irecv) and ring attention over
    real gloo processes (plain subprocesses: a spawned child would import this module, pytest and all)."""
    import os
    import subprocess
    import sys

    world = 2
    q, k, v, do, _ = _globals(1, 4, 2, 16, 4, seed=9)
    torch.save((q, k, v, do), tmp_path / "inputs")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _GLOO_RANK, str(r), str(world), str(tmp_path)], cwd=root,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    for p in procs:
        out, _ = p.communicate(timeout=100)
        assert p.returncode == 0, out
    ref = _reference(q, k, v, do, True, 0.5)
    for r in range(world):
        res = torch.load(tmp_path / f"res.{r}")
        prev = (r - 1) % world
        assert torch.equal(res["got"][0], torch.full((3,), float(prev)))
        assert torch.equal(res["got"][1], torch.full((2, 2), 10.0 + prev))
        assert torch.equal(res["started"][1], torch.full((3,), float(prev)))
        pos = res["pos"]
        for name, want in (("out", ref[0]), ("dq", ref[2]), ("dk", ref[3]), ("dv", ref[4])):
            assert (res[name] - want[:, :, pos]).abs().max() < TOL, name
