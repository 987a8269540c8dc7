"""FP8 training: the cast kernel, the scaled matmuls, delayed scaling, the pass, tracing, training.

What is isolated, and the bounds (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"):

* Cast round trip. E4M3 keeps 3 mantissa bits, so round-to-nearest moves a normal value v (|v| ≥
  2^-6) by at most half an ulp, 2^-4·|v|; below 2^-6 the spacing is the fixed 2^-9, an error of at
  most 2^-10. E5M2: 2 bits, 2^-3·|v| above 2^-14, 2^-17 below. With per-tensor scale s (x is stored
  as v = fl(x·s), read back as v8/s) that is |x̂ − x| ≤ u·|x| + a/s, u = 2^-4 (E5M2: 2^-3) plus
  2^-22 for the fp32 roundings of x·s and of 1/s (each ≤ 2^-24), a = 2^-10 (E5M2: 2^-17). The test
  also requires the worst element to reach 85% of the bound: nearest rounding, not truncation (whose
  error reaches 2u).
* Scaled matmul, y = x̂ ŵᵀ against float64 x wᵀ. With x̂ = x + ξ, |ξ| ≤ u|x| + α (α = a/s_x), and
  ŵ = w + η, |η| ≤ u|w| + β: x̂ŵ − xw = ξŵ + xη, so elementwise
      |y − y64| ≤ (u|x| + α)·((1+u)|w| + β)ᵀ + |x|·(u|w| + β)ᵀ + γ_K·(|x̂|·|ŵ|ᵀ),
  the last term the fp32 accumulation of K exact FP8 products (γ_K = K·2^-24/(1 − K·2^-24)) and of
  the final scaling. The same bound with E5M2's u, a for the gradient operand covers dx = ĝŵ and
  dW = ĝᵀx̂. This worst case adds every error with one sign, so it is loose by ~√K for random data;
  the tight check is the second one: y equals the float64 product of the *dequantized* operands up
  to the accumulation term alone.
* The Triton cast + amax kernel (TRITON_INTERPRET=1 on CPU) against torch's own cast: bit-identical
  FP8 codes and the same amax, for random shapes with tails of the 1024-element block, fp32 and
  bf16 inputs, both formats, and scales that push values into saturation and subnormals.
* Delayed scaling's history (first step = current scaling; one push per backward; oldest dropped;
  scale from the history's max; saturation; nothing recorded by forward-only or recomputed calls,
  also in a converted program cut into checkpointed regions by the recompute pass). bf16 operands.
* The pass on llama3-tiny (14 of 15 linears at tp=1 and 2; at tp=4 the 8-row kv shards stay) and on
  HF GPT-2 (Conv1D matmuls; the LM head tied to the embedding stays), traced by torch.export and
  by AOTAutograd (forward and backward one opaque node each; the history update a copy_ in backward).
* The runtime: Config(fp8=...) through mc.parallelize at tp=2 (gloo workers); under pipeline
  parallelism (pp=2 and pp=2,tp=2 against pp=1, the histories in the stages that run them, ZB-H1);
  the delayed histories through a checkpoint (a resumed run equal to the bit, mismatches refused).
* Training: FP8 (current scaling) tracks fp32 on llama3-tiny for 200 steps — see
  test_fp8_training_tracks_fp32 for the bound and its justification.
"""

from __future__ import annotations

import copy
import math
import os

# before anything imports triton, which reads it once (TRITON_INTERPRET=0 keeps a GPU run compiled)
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from fp8_cases import fp8_checkpoint, fp8_runs  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from kernel_paths import reference_kernels  # noqa: E402
from runtime_cases import train_steps  # noqa: E402

from mcompile.ir import ops  # noqa: E402
from mcompile.kernels import fp8  # noqa: E402
from mcompile.kernels.fp8 import E4M3, E5M2  # noqa: E402
from mcompile.passes.fp8_linears import FP8, convert_fp8  # noqa: E402
from mcompile.runtime.sim import ThreadedWorld  # noqa: E402

from conftest import build, compiled, pool  # noqa: E402

U = {E4M3: 2.0**-4 + 2.0**-22, E5M2: 2.0**-3 + 2.0**-22}  # relative rounding bound (module docstring)
A = {E4M3: 2.0**-10, E5M2: 2.0**-17}  # absolute bound below the smallest normal (half the subnormal step)
PROPERTY = settings(max_examples=25, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate),
                    suppress_health_check=[HealthCheck.too_slow])


# ---- casts ---------------------------------------------------------------------------------------
def _spread(n: int, seed: int) -> torch.Tensor:
    """Values over 12 binades (log-uniform magnitudes, random signs): normals and, after scaling,
    subnormals of both formats."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.rand(n, generator=g, dtype=torch.float64) * 12 - 10)
    return (mag * torch.randint(0, 2, (n,), generator=g).mul(2).sub(1)).float()


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_cast_round_trip_within_half_an_ulp(dtype):
    x = _spread(20000, 0)
    scale = fp8.compute_scale(fp8.amax(x), dtype)
    x8, amax = fp8.cast_to_fp8(x, scale, dtype)
    assert amax == x.abs().max()
    back = x8.double() / scale.double()
    bound = U[dtype] * x.double().abs() + A[dtype] / scale.double()
    err = (back - x.double()).abs()
    assert (err <= bound).all(), (err / bound).max()
    # nearest rounding reaches the bound: the worst normal case, a midpoint just above a power of two,
    # is u/(1+u) of the value (0.94 u for E4M3, 0.89 u for E5M2); truncation would exceed it (2u/(1+2u))
    assert (err / bound).max() > 0.85
    assert x8.float().abs().max() == fp8.fp8_max(dtype)  # the current scale puts amax on the largest value


def test_scale_edge_cases():
    zero, inf, nan = torch.tensor(0.0), torch.tensor(math.inf), torch.tensor(math.nan)
    for a in (zero, inf, nan, torch.tensor(1e-45)):  # no finite positive scale: keep magnitudes
        assert fp8.compute_scale(a, E4M3) == 1.0
    assert fp8.compute_scale(torch.tensor(2.0), E4M3, margin=1) == 448.0 / 2 / 2
    x8, _ = fp8.cast_to_fp8(torch.tensor([1e6, -1e6, math.inf]), torch.tensor(1.0), E4M3)
    assert x8.float().tolist() == [448.0, -448.0, 448.0]  # saturation, as Transformer Engine casts


def _bound(a, b, ua, aa, ub, ab, a_hat, b_hat):
    """Elementwise bound on |â b̂ − a b| (module docstring): a (M, K), b (K, N) in float64."""
    k = a.shape[1]
    gamma = k * 2.0**-24 / (1 - k * 2.0**-24) + 4 * 2.0**-24
    a, b = a.abs(), b.abs()
    return ((ua * a + aa) @ ((1 + ub) * b + ab) + a @ (ub * b + ab)
            + gamma * (a_hat.abs() @ b_hat.abs()))


def test_fp8_linear_forward_and_backward_against_float64():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 16, 64, generator=g) * 3
    w = torch.randn(48, 64, generator=g) * 0.02
    dy = torch.randn(3, 16, 48, generator=g) * 1e-3
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8.fp8_linear(xr, wr)
    y.backward(dy)
    x64, w64, g64 = x.double().reshape(-1, 64), w.double(), dy.double().reshape(-1, 48)
    sx, sw, sg = (fp8.compute_scale(fp8.amax(t), dt) for t, dt in ((x, E4M3), (w, E4M3), (dy, E5M2)))
    xh = fp8.cast_to_fp8_reference(x64.float(), sx, E4M3)[0].double() / sx.double()
    wh = fp8.cast_to_fp8_reference(w, sw, E4M3)[0].double() / sw.double()
    gh = fp8.cast_to_fp8_reference(g64.float(), sg, E5M2)[0].double() / sg.double()
    ax, aw, ag = A[E4M3] / sx.double(), A[E4M3] / sw.double(), A[E5M2] / sg.double()
    cases = {  # name: (result, exact product, dequantized operands, bound, u of the first operand)
        "y": (y.reshape(-1, 48), x64 @ w64.T, (xh, wh.T), _bound(x64, w64.T, U[E4M3], ax, U[E4M3], aw, xh, wh.T)),
        "dx": (xr.grad.reshape(-1, 64), g64 @ w64, (gh, wh), _bound(g64, w64, U[E5M2], ag, U[E4M3], aw, gh, wh)),
        "dw": (wr.grad, g64.T @ x64, (gh.T, xh), _bound(g64.T, x64, U[E5M2], ag, U[E4M3], ax, gh.T, xh)),
    }
    for name, (got, exact, (a_hat, b_hat), bound) in cases.items():
        got = got.double()
        assert ((got - exact).abs() <= bound).all(), (name, ((got - exact).abs() / bound).max())
        # tight: the product of the dequantized operands, up to fp32 accumulation (γ_K) alone
        k = a_hat.shape[1]
        gamma = k * 2.0**-24 / (1 - k * 2.0**-24) + 4 * 2.0**-24
        assert ((got - a_hat @ b_hat).abs() <= gamma * (a_hat.abs() @ b_hat.abs())).all(), name
        # and the quantization error is really there, of FP8's size (not an fp32 matmul in disguise):
        # relative error of the result between 2^-8 and twice the larger operand's rounding bound
        rel = ((got - exact).norm() / exact.norm()).item()
        assert 2.0**-8 < rel < 2 * (U[E4M3] if name == "y" else U[E5M2]), (name, rel)


def test_fp8_linear_in_bf16():
    """Under Config(dtype=bfloat16) the op gets bf16 activations and the bf16 copy of the weight: y and
    dx come back in bf16, dw in the weight's dtype, each one rounding of the fp32 result."""
    x, w, dy = (t.to(torch.bfloat16) for t in _linear_inputs())
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8.fp8_linear(xr, wr)
    y.backward(dy.to(torch.bfloat16))
    assert y.dtype == xr.grad.dtype == wr.grad.dtype == torch.bfloat16
    y32 = fp8.fp8_linear(x.float(), w.float())  # bf16 values are exact in fp32: the same FP8 operands
    assert torch.equal(y, y32.to(torch.bfloat16))


def test_scaled_mm_equals_the_dequantized_fallback():
    g = torch.Generator().manual_seed(2)
    a8 = (torch.randn(32, 64, generator=g) * 50).to(E4M3)
    b8 = (torch.randn(64, 48, generator=g) * 1e-2 * 2**16).to(E5M2)
    sa, sb = torch.tensor(0.37), torch.tensor(2.0**-16)
    got = fp8.scaled_mm(a8, b8, sa, sb, torch.float32)
    ref = (a8.double() * sa.double()) @ (b8.double() * sb.double())
    assert torch.allclose(got.double(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())


# ---- the Triton kernel ---------------------------------------------------------------------------
@pytest.mark.skipif(fp8.triton is None, reason="triton is not installed (Linux-only dependency)")
@PROPERTY
@given(shape=st.lists(st.integers(1, 70), min_size=1, max_size=3).filter(lambda s: math.prod(s) <= 6000)
       | st.sampled_from([(1024,), (1025,), (2047,), (3, 1024)]),
       dtype=st.sampled_from([E4M3, E5M2]), in_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       log_scale=st.floats(-24, 24), seed=st.integers(0, 2**16))
def test_triton_cast_amax_matches_torch(shape, dtype, in_dtype, log_scale, seed):
    if not fp8.uses_triton("cpu"):
        pytest.skip("TRITON_INTERPRET=0: the kernel is compiled for a GPU; CPU tensors take the reference")
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g).float()))
    x = x.to(in_dtype)
    scale = torch.tensor(2.0**log_scale)
    got8, got_amax = fp8.cast_to_fp8(x, scale, dtype)
    ref8, ref_amax = fp8.cast_to_fp8_reference(x, scale, dtype)
    assert got8.dtype == dtype and got8.shape == x.shape
    assert torch.equal(got8.view(torch.uint8), ref8.view(torch.uint8))
    assert torch.equal(got_amax, ref_amax)


@pytest.mark.skipif(fp8.triton is None, reason="triton is not installed (Linux-only dependency)")
def test_triton_cast_special_values():
    if not fp8.uses_triton("cpu"):
        pytest.skip("TRITON_INTERPRET=0: the kernel is compiled for a GPU; CPU tensors take the reference")
    x = torch.tensor([0.0, -0.0, 1.0625, 17.0, -7.9161, 2.0**-12, 3 * 2.0**-18, 460.0, 1e30, -math.inf])
    for dtype in (E4M3, E5M2):  # ties to even, carries into the exponent, subnormals, saturation
        got8, amax = fp8.cast_to_fp8(x, torch.tensor(1.0), dtype)
        assert torch.equal(got8.view(torch.uint8), fp8.cast_to_fp8_reference(x, torch.tensor(1.0), dtype)[0]
                           .view(torch.uint8))
        assert amax == math.inf
    got8, amax = fp8.cast_to_fp8(torch.tensor([1.0, math.nan]), torch.tensor(1.0), E4M3)
    assert amax.isnan() and got8.float()[1].isnan()  # NaN propagates: delayed scaling must see it


# ---- delayed scaling -----------------------------------------------------------------------------
def _linear_inputs(seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 32, generator=g), torch.randn(16, 32, generator=g) * 0.05, torch.randn(4, 16, generator=g)


def test_delayed_scaling_history():
    x, w, dy = _linear_inputs()
    hist = fp8.new_amax_history(3)
    # first step: empty history -> current scaling, exactly
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8.fp8_linear_delayed(xr, wr, hist)
    assert torch.equal(y, fp8.fp8_linear(x, w))
    assert not hist.any()  # forward records nothing
    y.backward(dy)
    assert hist[:, 0].tolist() == [fp8.amax(x).item(), fp8.amax(w).item(), fp8.amax(dy).item()]
    assert not hist[:, 1:].any()
    # steps 2..4: one push per backward, newest first; the oldest falls off after 3
    for k in (2.0, 0.5, 0.25):
        fp8.fp8_linear_delayed((x * k).requires_grad_(), w, hist).backward(dy)
    assert hist[0].tolist() == pytest.approx([0.25 * x.abs().max().item(), 0.5 * x.abs().max().item(),
                                              2.0 * x.abs().max().item()])
    # the scale comes from the history's max (2·amax(x)), not from x: x's values land at 448 / 2
    out = torch.ops.mcompile.fp8_linear_delayed(x, w, hist, 0)
    x_scale_inv = out[2]
    assert x_scale_inv == pytest.approx(2 * x.abs().max().item() / 448, rel=1e-6)
    assert out[1].float().abs().max() == pytest.approx(224, rel=2**-3)
    # a value beyond the history saturates instead of overflowing
    big = torch.ops.mcompile.fp8_linear_delayed(x * 10, w, hist, 0)
    assert big[1].float().abs().max() == 448 and torch.isfinite(big[0]).all()
    # forward-only runs leave the history alone
    before = hist.clone()
    with torch.no_grad():
        fp8.fp8_linear_delayed(x, w, hist)
    assert torch.equal(hist, before)


def test_delayed_scaling_recompute_records_once():
    x, w, dy = _linear_inputs()
    results = []
    for use_checkpoint in (False, True):
        hist = fp8.new_amax_history(4)
        wr = w.clone().requires_grad_()
        for step in range(3):
            xr = (x * (step + 1)).requires_grad_()
            if use_checkpoint:
                y = torch.utils.checkpoint.checkpoint(fp8.fp8_linear_delayed, xr, wr, hist, use_reentrant=False)
            else:
                y = fp8.fp8_linear_delayed(xr, wr, hist)
            y.backward(dy)
        results.append((hist.clone(), wr.grad.clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert results[0][0][:, :3].all() and not results[0][0][:, 3].any()  # three steps, three columns


def test_delayed_backward_run_twice_pushes_once():
    """A zero-bubble pipeline's B step takes dx only, its W step runs the same node's backward again
    for dW (torch's stage_backward_input / stage_backward_weight): one push, and the dW of a single
    backward — the second call scales dy from the history the first one saw."""
    x, w, dy = _linear_inputs()
    hist, ref = fp8.new_amax_history(4), fp8.new_amax_history(4)
    ref[:, 0] = hist[:, 0] = torch.tensor([3.0, 0.5, 0.01])  # a past step: delayed scales, not current
    wr = w.clone().requires_grad_()
    fp8.fp8_linear_delayed(x.clone().requires_grad_(), wr, ref).backward(dy)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8.fp8_linear_delayed(xs, ws, hist)
    (dx,) = torch.autograd.grad(y, xs, dy, retain_graph=True)
    (dw,) = torch.autograd.grad(y, ws, dy)
    assert torch.equal(hist, ref) and hist[:, :2].all() and not hist[:, 2:].any()
    assert torch.equal(dw, wr.grad) and torch.isfinite(dx).all()


# ---- the weight cast per step, one amax per cast, the layout copies (issue 38 item 7) ---------------
def _microbatch(recipe, x, w, dy, hist):
    xr = x.clone().requires_grad_()
    y = fp8.fp8_linear(xr, w) if recipe == "current" else fp8.fp8_linear_delayed(xr, w, hist)
    y.backward(dy)
    return y.detach(), xr.grad


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_weight_cast_cached_per_step(recipe):
    """Within step_cache (train_step opens one per step) the weight is cast once: the second microbatch
    reuses the cast (and gives what casting again gives), an in-place write of the weight within the step
    (its version counter) and the next step cast it again; outside a step every call casts."""
    x, w0, dy = _linear_inputs()
    casts = lambda: fp8.stats["weight_casts"]  # noqa: E731
    hist, ref_hist = fp8.new_amax_history(4), fp8.new_amax_history(4)
    w, ref_w = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    with reference_kernels("fp8"):  # the cache is the same on both paths; the kernels' tests are above
        for _ in range(2):
            n = casts()
            with fp8.step_cache():
                outs = [_microbatch(recipe, x * k, w, dy, hist) for k in (1.0, 0.5)]
                assert casts() == n + 1  # the second microbatch did not cast the weight again
                assert len(fp8._BY_W8) == 1
            assert not fp8._BY_W8  # the step's casts are released with it
            n = casts()
            refs = [_microbatch(recipe, x * k, ref_w, dy, ref_hist) for k in (1.0, 0.5)]  # no step: casts each call
            assert casts() == n + 2
            for (y, dx), (ry, rdx) in zip(outs, refs):
                assert torch.equal(y, ry) and torch.equal(dx, rdx)
            assert torch.equal(w.grad, ref_w.grad) and torch.equal(hist, ref_hist)
            with torch.no_grad():  # the optimizer step (in place): the next step casts the new weight
                for p in (w, ref_w):  # shrinking it keeps the delayed scale (the history's max) the same with or
                    p.mul_(0.9)  # without the cache; a weight outgrowing its history: the next test
                    p.grad = None
        n = casts()
        with fp8.step_cache():
            y1, _ = _microbatch(recipe, x, w, dy, hist)
            with torch.no_grad():
                w.mul_(2)  # written within the step: the cached cast is stale
            y2, _ = _microbatch(recipe, x, w, dy, hist)
            assert casts() == n + 2 and not torch.equal(y1, y2)
            gathered = w0.clone().requires_grad_()  # a weight made per microbatch (ZeRO-3's gather), then freed:
            _microbatch(recipe, x, gathered, dy, fp8.new_amax_history(4))
            assert len(fp8._BY_W8) == 2
            del gathered
            assert len(fp8._BY_W8) == 1  # its cast is not kept for the rest of the step


def test_delayed_cached_weight_keeps_the_first_microbatchs_scale():
    """Delayed scaling: a weight that outgrew its history saturates in the step's first microbatch; the cached
    cast keeps that scale for the step (Transformer Engine's cached FP8 weights likewise), with its own
    scale⁻¹, and every microbatch still records the weight's true amax, so the next step's scale covers it."""
    x, w, _ = _linear_inputs()
    hist = fp8.new_amax_history(4)
    hist[:, 0] = torch.tensor([fp8.amax(x).item(), fp8.amax(w).item() / 4, 1.0])  # W's history: a quarter of it
    op = torch.ops.mcompile.fp8_linear_delayed
    with fp8.step_cache():
        first = op(x, w, hist, 0)
        hist[1, 0] = fp8.amax(w)  # what the first microbatch's backward pushed
        second = op(x, w, hist, 0)
    assert first[3].float().abs().max() == 448 and first[4] == second[4] and first[3] is second[3]
    assert first[5][1] == second[5][1] == fp8.amax(w)
    fresh = op(x, w, hist, 0)  # the next step: the scale from the history that now holds the true amax
    assert fresh[4] == pytest.approx(fp8.amax(w).item() / 448, rel=1e-6)


def test_kmajor_layout_gives_the_same_results(monkeypatch):
    """CUDA's layout rule (row-major a, column-major b, K a multiple of 16), applied on CPU: the copies it
    makes — the dgrad's weight once per step, the wgrad's two transposes with the token dim zero-padded
    from 24 to 32 in the same copy — change no bit of y, dx or dW."""
    g = torch.Generator().manual_seed(5)
    x, w, dy = torch.randn(2, 12, 32, generator=g), torch.randn(48, 32, generator=g) * 0.1, \
        torch.randn(2, 12, 48, generator=g)
    results = []
    for layout in ("any", "kmajor"):
        if layout == "kmajor":
            monkeypatch.setattr(fp8, "KMAJOR_DEVICES", {"cuda", "cpu"})
        wr = w.clone().requires_grad_()
        with fp8.step_cache():
            results.append([_microbatch("current", x * k, wr, dy, None) for k in (1.0, 0.5)] + [wr.grad])
            if layout == "kmajor":
                (entry,) = fp8._BY_W8.values()
                assert entry.w8_kmajor is not None and entry.w8_kmajor.t().is_contiguous()
    (a1, a2, agw), (b1, b2, bgw) = results
    assert all(torch.equal(p, q) for p, q in zip((*a1, *a2, agw), (*b1, *b2, bgw)))


# after-counts per FP8 linear, from bench/fp8_ops.py (its docstring: the second of two steps, the reference
# path, layouts "cpu" and "cuda"); per category (fp8_casts, amax, copies, gemms, history_max, other_copies)
# forward | backward. Before (24f43cb, bench/results/fp8_ops.json): current F 2 2 0 1 0 0 every microbatch,
# B 1 1 3 2 0 0 on the CUDA layout; delayed F 2 4 0 1 2 0, B 1 2 3 2 1 4 on the CUDA layout.
FP8_OPS_AFTER = {  # (recipe, layout, microbatch): (forward, backward)
    ("current", "cpu", 1): ((2, 2, 0, 1, 0, 0), (1, 1, 0, 2, 0, 0)),
    ("current", "cpu", 2): ((1, 1, 0, 1, 0, 0), (1, 1, 0, 2, 0, 0)),  # the weight's cast reused
    ("current", "cuda", 1): ((2, 2, 0, 1, 0, 0), (1, 1, 3, 2, 0, 0)),
    ("current", "cuda", 2): ((1, 1, 0, 1, 0, 0), (1, 1, 2, 2, 0, 0)),  # and the dgrad's K-major weight
    ("delayed", "cpu", 1): ((2, 2, 0, 1, 2, 0), (1, 1, 0, 2, 1, 4)),
    ("delayed", "cpu", 2): ((1, 1, 0, 1, 1, 0), (1, 1, 0, 2, 1, 4)),
    ("delayed", "cuda", 1): ((2, 2, 0, 1, 2, 0), (1, 1, 3, 2, 1, 4)),
    ("delayed", "cuda", 2): ((1, 1, 0, 1, 1, 0), (1, 1, 2, 2, 1, 4)),
}


def test_fp8_op_counts_per_linear():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "fp8_ops.py"
    spec = importlib.util.spec_from_file_location("mcompile_bench_fp8_ops", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with reference_kernels("fp8"):
        got = bench.counts(fp8)
    cats = bench.CATEGORIES[:-1]  # not the total of every op (the scale arithmetic's small ops)
    for (recipe, layout, mb), want in FP8_OPS_AFTER.items():
        m = got[recipe][layout][f"microbatch {mb}"]
        assert tuple(tuple(m[p][c] for c in cats) for p in ("forward", "backward")) == want, (recipe, layout, mb)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_zero_bubble_split_backward_runs_each_gemm_once(recipe, monkeypatch):
    """A zero-bubble pipeline's backward in two calls (torch's stage_backward_input, then
    stage_backward_weight, which runs each linear's backward node again): the B call computes dx
    alone and the W call dW alone — 1 forward + 2 backward GEMMs per linear, as one plain backward
    — and the gradients equal that plain backward's to the bit. Before, each call computed both (4
    backward GEMMs a linear). Weights enter through a view, as the runtime's DTensor.to_local does."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    monkeypatch.setattr(fp8, "_INTERPRETED", False)
    calls = []
    real = fp8.scaled_mm
    monkeypatch.setattr(fp8, "scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run(split):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4, 32, generator=g).requires_grad_()
        w1, w2 = (torch.nn.Parameter(torch.randn(32, 32, generator=g) * 0.1) for _ in range(2))
        hists = [fp8.new_amax_history(4) for _ in range(2)]
        lin = (lambda a, w, h: fp8.fp8_linear(a, w)) if recipe == "current" else fp8.fp8_linear_delayed
        out = lin(torch.relu(lin(x, w1.view_as(w1), hists[0])), w2.view_as(w2), hists[1]).square().sum()
        calls.clear()
        if split:
            (dx,), groups = stage_backward_input([out], None, [x], [w1, w2])
            b_calls = len(calls)
            stage_backward_weight([w1, w2], groups)
        else:
            out.backward()
            dx, b_calls = x.grad, None
        return dx, w1.grad, w2.grad, b_calls, len(calls), hists

    *plain, _, plain_calls, plain_hists = run(split=False)
    *split, b_calls, split_calls, split_hists = run(split=True)
    assert plain_calls == 4 and (b_calls, split_calls) == (2, 4)  # B: dx of both linears; W: dW of both
    assert all(torch.equal(a, b) for a, b in zip(plain, split))
    assert all(torch.equal(a, b) for a, b in zip(plain_hists, split_hists))


def test_opcheck():
    x, w, _ = _linear_inputs()
    torch.library.opcheck(torch.ops.mcompile.fp8_linear.default, (x, w, 0))
    torch.library.opcheck(torch.ops.mcompile.fp8_linear_delayed.default, (x, w, fp8.new_amax_history(2), 0))


# ---- the pass ------------------------------------------------------------------------------------
def _convert(name, mesh, recipe="current", rank=0):
    _, inputs, c, _ = compiled(name, mesh, False)
    gm = copy.deepcopy(c.program(rank))
    return c, inputs, gm, convert_fp8(gm, c.plan, dict(c.captured.params), recipe=recipe,
                                      user_inputs=set(c.captured.user_inputs))


@pytest.mark.parametrize("tp, converted, kept", [
    (1, 14, {"output.weight"}),
    (2, 14, {"output.weight"}),
    (4, 10, {"output.weight"} | {f"layers.{i}.attention.{p}.weight" for i in (0, 1) for p in ("wk", "wv")}),
])
def test_pass_converts_the_llama_linears(tp, converted, kept):
    _, _, gm, report = _convert("llama3-tiny", f"tp={tp}")
    assert len(report.converted) == converted  # 2 layers x (q, k, v, o, gate, up, down)
    assert {s.fqn for s in report.skipped} == kept
    assert "LM head" in next(s.reason for s in report.skipped if s.fqn == "output.weight")
    if tp == 4:  # kv heads: 32 rows / 4 = 8, below torch._scaled_mm's multiple of 16
        assert all("multiples of 16" in s.reason for s in report.skipped if s.fqn != "output.weight")
    ops_ = [n for n in gm.graph.nodes if n.target is torch.ops.mcompile.fp8_linear.default]
    assert len(ops_) == converted and all(n.meta[FP8] == "current" and n.meta.get("mc_layer") is not None
                                          for n in ops_)
    assert sum(n.target is torch.ops.aten.linear.default for n in gm.graph.nodes) == len(kept)


def test_pass_on_hf_gpt2_conv1d_and_tied_head():
    _, _, gm, report = _convert("hf-gpt2", "tp=1")
    assert len(report.converted) == 8  # 2 layers x (c_attn, attn c_proj, c_fc, mlp c_proj): matmul(x, W)
    (head,) = report.skipped
    assert "embedding" in head.reason  # lm_head is wte: one weight, kept
    assert not any(n.target is torch.ops.aten.matmul.default and n.args[1].op == "placeholder"
                   for n in gm.graph.nodes)


def test_config_and_backend_errors():
    from mcompile.ir.config import Config

    with pytest.raises(ValueError, match="'current' or 'delayed'"):
        Config(fp8="e4m3")
    with pytest.raises(ValueError, match="positive integer"):
        Config(fp8="delayed", fp8_amax_history_len=0)
    with pytest.raises(ValueError, match="use 'mcompile' or 'te'"):
        Config(fp8="current", fp8_backend="cublas")
    _, _, c, _ = compiled("llama3-tiny", "tp=1", False)
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="Transformer Engine"):
            convert_fp8(copy.deepcopy(c.program(0)), c.plan, dict(c.captured.params), backend="te")
    else:  # pragma: no cover - not installed on our machines
        with pytest.raises(NotImplementedError):
            convert_fp8(copy.deepcopy(c.program(0)), c.plan, dict(c.captured.params), backend="te")


def test_cli_shows_the_fp8_linears(capsys):
    from mcompile.apps.cli import main

    assert main(["show", "llama3-tiny", "--mesh", "tp=2", "--fp8", "delayed"]) == 0
    out = capsys.readouterr().out
    assert "14 linears in FP8, 1 kept" in out and out.count("mcompile.fp8_linear_delayed.default(") == 14


# ---- tracing -------------------------------------------------------------------------------------
def _program_args(c, inputs, gm, requires_grad=False):
    state = c.local_state(0)
    user = dict(zip(c.captured.user_inputs, inputs))
    return [state[n].detach().clone().requires_grad_(requires_grad and n in c.captured.params)
            if n in state else user[n] for n in (p.name for p in gm.graph.nodes if p.op == "placeholder")]


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_converted_program_traces(recipe, monkeypatch):
    from functorch.compile import aot_module, make_boxed_func

    monkeypatch.setattr(fp8, "_INTERPRETED", False)  # tracing, not the kernel, is under test here
    c, inputs, gm, _ = _convert("llama3-tiny", "tp=1", recipe)
    comm = ThreadedWorld(c.mesh).communicator(0)
    with ops.bind(comm):
        ep = torch.export.export(copy.deepcopy(gm), tuple(_program_args(c, inputs, gm)), strict=False)
    op = torch.ops.mcompile.fp8_linear if recipe == "current" else torch.ops.mcompile.fp8_linear_delayed
    assert sum(n.target is op.default for n in ep.graph.nodes) == 14
    graphs = {}

    def keep(name):
        def compiler(g, _):
            graphs[name] = g
            return make_boxed_func(g.forward)
        return compiler

    traced = copy.deepcopy(gm)
    aot = aot_module(traced, fw_compiler=keep("fw"), bw_compiler=keep("bw"))
    runs = []
    for fn in (aot, gm):
        args = _program_args(c, inputs, gm, requires_grad=True)
        with ops.bind(comm, process_wide=True):
            (loss,) = fn(*args)
            loss.backward()
        runs.append((loss.detach(), [a.grad for a in args if isinstance(a, torch.Tensor) and a.grad is not None]))
    assert torch.equal(runs[0][0], runs[1][0]) and all(map(torch.equal, runs[0][1], runs[1][1]))
    targets = {name: [n.target for n in g.graph.nodes] for name, g in graphs.items()}
    backward = torch.ops.mcompile.fp8_linear_backward if recipe == "current" else \
        torch.ops.mcompile.fp8_linear_delayed_backward
    assert targets["fw"].count(op.default) == 14 and targets["bw"].count(backward.default) == 14
    if recipe == "delayed":  # the history pushes: copied into the 14 buffers at the end of backward
        assert targets["bw"].count(torch.ops.aten.copy_.default) == 14
        assert all(torch.equal(a, b) for a, b in zip(traced.buffers(), gm.buffers()))
        assert all(b[:, 0].all() for b in gm.buffers())


def test_delayed_program_under_recompute_is_exact(monkeypatch):
    """A converted program cut into checkpointed regions (the runtime applies recompute after fp8):
    two steps give the same loss, gradients and amax histories, bit for bit — the recomputed forwards
    use the same scales and record nothing (the history's get_attr nodes travel into the regions)."""
    from mcompile.passes.recompute import apply_recompute, recompute_nodes

    monkeypatch.setattr(fp8, "_INTERPRETED", False)
    runs = []
    for mode in ("none", "full", "selective"):
        c, inputs, gm, report = _convert("llama3-tiny", "tp=1", "delayed")
        program = apply_recompute(gm, recompute_nodes(gm, mode, "uniform", 1))
        args = _program_args(c, inputs, program, requires_grad=True)
        for _ in range(2):
            with ops.bind(ThreadedWorld(c.mesh).communicator(0), process_wide=True):
                (loss,) = program(*args)
                loss.backward()
        runs.append((loss.detach(), [a.grad for a in args if isinstance(a, torch.Tensor) and a.grad is not None],
                     list(report.histories.values())))
    assert all(h[:, :2].all() and not h[:, 2:].any() for h in runs[0][2])  # two steps, two columns
    for loss, grads, hist in runs[1:]:
        assert torch.equal(loss, runs[0][0]) and all(map(torch.equal, grads, runs[0][1]))
        assert all(map(torch.equal, hist, runs[0][2]))


# ---- runtime ------------------------------------------------------------------------------------
def fp8_train_steps(rank, world, mesh, recipe, steps=2):
    """Worker: train_step under Config(fp8=recipe); losses, what was converted, the histories."""
    import mcompile as mc

    model, inputs = build("llama3-tiny", batch=4)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, fp8=recipe)
    losses = train_steps(pm, torch.optim.AdamW(pm.parameters(), lr=1e-3), inputs, steps)
    report = pm.fp8
    histories = {k: v.clone() for k, v in report.histories.items()} if report else {}
    return losses, (len(report.converted) if report else 0), histories


def test_runtime_applies_fp8():
    p = pool(2)
    ref = p.run(fp8_train_steps, "tp=2", None)[0][0]
    for recipe in ("current", "delayed"):
        (losses, converted, hist), (losses1, _, _) = p.run(fp8_train_steps, "tp=2", recipe)
        assert converted == 14 and losses == losses1
        # Two steps from the same start (the workers run the Triton kernel in its interpreter: slow).
        # FP8 rounds each operand element by ≤ 2^-4 (gradients 2^-3), errors of random sign that
        # average out in 64- to 128-term sums and the 256-way softmax of the (higher-precision) LM
        # head. Measured: 1.4e-4 relative at step 1, ≤ 3e-4 after AdamW steps at lr 1e-3; 2e-3 leaves
        # 7x room, and a wrong FP8 linear (a missed scale) moves the loss by O(1).
        for a, b in zip(losses, ref):
            assert abs(a - b) / b < 2e-3, (recipe, losses, ref)
        if recipe == "delayed":
            assert len(hist) == 14 and all(h[:, :2].all() and not h[:, 2:].any() for h in hist.values())


# ---- pipeline parallelism and checkpoints (workers in fp8_cases.py: reference casts, see there) -------
M2 = {"microbatches": 2}
# Pipeline parallelism only reorders the same microbatches' work, so pp=2 must give the pp=1 losses up
# to fp32 rounding (the loss sum, the gradient accumulation and the token-count division run in another
# order). Measured over 5 AdamW steps: FP8 current scaling at pp=2 vs pp=1 ≤ 9.0e-8 relative (one ulp
# of a loss of 5.3, 4.8e-7), delayed scaling with one microbatch ≤ 9.8e-8, and without FP8 ≤ 2.8e-7;
# pp=2,tp=2 vs tp=2 equal to the bit. 1e-6 (~8 ulp) leaves that room. What it catches: FP8 lost
# inside a stage moves the loss by ≥ 3e-5 (1.6e-4 at step 1), the other recipe by ≥ 1.6e-5.
PP_RTOL = 1e-6


def _close(losses, ref):
    return all(abs(a - b) <= PP_RTOL * abs(b) for a, b in zip(losses, ref, strict=True))


GRAD_RTOL = 1e-5  # per tensor in norm: FP8 casts of the same scales, reductions in another order


def _assert_grads_close(steps, ref_steps):
    assert len(steps) == len(ref_steps)
    for step, (grads, ref) in enumerate(zip(steps, ref_steps)):
        assert sorted(grads) == sorted(ref)
        for k, g in grads.items():
            err = ((g - ref[k]).norm() / ref[k].norm()).item()
            assert err <= GRAD_RTOL, (step, k, err)


@pytest.mark.timeout(300)
def test_fp8_under_pipeline_parallelism():
    """pp=2 (two stages of llama3-tiny, 7 FP8 linears each) against pp=1 with the same microbatches.

    Current scaling, 2 microbatches, and delayed scaling with 1 microbatch: the same losses (PP_RTOL).
    Delayed scaling with 2 microbatches is *not* compared with pp=1: 1F1B runs stage 0's forward of
    microbatch 1 before the backward of microbatch 0, so that forward scales from a history without
    microbatch 0's amaxes, where pp=1 (F0 B0 F1 B1) has them — delayed scaling follows the order
    microbatches run in, as Transformer Engine's does (measured: 7.7e-6 relative at step 1, up to
    1.7e-4 by step 5, the size of the gap between the two recipes). What must hold there: each stage
    program holds the history buffers of its own linears, as the report's tensors (so its pushes are
    the runtime's state), every one advanced exactly once per microbatch (2 columns a step, as at
    pp=1) and the other stage's untouched; and ZB-H1, whose weight step runs each linear's backward a
    second time, gives the 1F1B losses and histories to the bit (the same F/B order per stage; before
    the fix its last stage pushed twice per microbatch and lost 8e-6 at step 2)."""
    from runtime_cases import expect_error

    steps = 3
    ref = pool(1).run(fp8_runs, "tp=1", [("current", M2), ("delayed", {"microbatches": 1})], steps)[0]
    runs = [("current", M2), ("delayed", {"microbatches": 1}), ("delayed", M2),
            ("delayed", {**M2, "schedule": "zbh1"})]
    res = pool(2).run(fp8_runs, "pp=2", runs, steps)
    for r in res:
        assert [x["losses"] for x in r] == [x["losses"] for x in res[0]]  # every rank returns the loss
        assert _close(r[0]["losses"], ref[0]["losses"]), (r[0]["losses"], ref[0]["losses"])
        assert _close(r[1]["losses"], ref[1]["losses"]), (r[1]["losses"], ref[1]["losses"])
    for run in (0, 1):  # and every step's unclipped gradients
        _assert_grads_close(res[0][run]["grads"], ref[run]["grads"])
        delayed, zbh1 = r[2], r[3]
        (stage, (names, shared)), = delayed["stages"].items()
        assert shared and names == sorted(delayed["histories"]) and not delayed["idle"]
        assert all(h[:, :2 * steps].all() and not h[:, 2 * steps:].any() for h in delayed["histories"].values())
        assert zbh1["losses"] == delayed["losses"]
        assert all(torch.equal(zbh1["histories"][n], h) for n, h in delayed["histories"].items())
    # each weight cast to FP8 once per step, not once per microbatch (kernels/fp8.py step_cache), on every rank
    for r in [ref, *res]:
        assert [x["weight_casts"] for x in r] == [steps * x["fp8_nodes"] for x in r] and r[0]["fp8_nodes"] >= 7
    mine = [set(r[2]["histories"]) for r in res]
    assert len(mine[0]) == len(mine[1]) == 7 and not mine[0] & mine[1] and res[0][2]["converted"] == 14
    # recomputing a delayed FP8 linear whose history an earlier microbatch's backward advanced: refused
    err = pool(2).run(expect_error, "llama3-tiny", "pp=2", {**M2, "fp8": "delayed", "recompute": "full"})[0]
    assert err.startswith("NotImplementedError: fp8='delayed' with recompute='full' under pipeline") and \
        "before the backward of microbatch 0" in err, err


@pytest.mark.timeout(300)
def test_fp8_delayed_checkpoint_resumes_bit_identically(tmp_path):
    """pp=2,tp=2: FP8 current scaling gives the tp=2 losses (PP_RTOL); delayed scaling trained 4
    steps with a checkpoint at step 2, resumed by a fresh module from other initial weights: the same
    losses and histories to the bit. Each rank saves its own histories: the two tp ranks of a stage hold
    different ones (amaxes of their own shards) — resuming with the histories left empty, or with tp
    rank 0's on both, moves the resumed losses by 5e-5 to 9e-5 (measured), so the check is sharp.
    Then what loading refuses, with what to do, and fp8_state=False."""
    ref = pool(2).run(fp8_runs, "tp=2", [("current", M2)], 3)[0][0]
    res = pool(4).run(fp8_runs, "pp=2,tp=2", [("current", M2)], 3)
    assert all(_close(r[0]["losses"], ref["losses"]) for r in res), ([r[0]["losses"] for r in res], ref)
    _assert_grads_close(res[0][0]["grads"], ref["grads"])

    out = pool(4).run(fp8_checkpoint, "pp=2,tp=2", str(tmp_path), M2)
    for r in out:
        assert r["resumed"] == r["continued"][2:] and r["extra"] == {"step": 2} and r["fresh_empty"]
        assert sorted(r["loaded"]) == sorted(r["saved"]) and len(r["saved"]) == 7
        assert all(torch.equal(r["loaded"][n], h) for n, h in r["saved"].items())
        assert all(torch.equal(r["resumed_final"][n], h) for n, h in r["final"].items())
        assert r["skip_kept"] and r["skip_loaded"]
    by_stage: dict = {}
    for r in out:
        by_stage.setdefault(tuple(sorted(r["saved"])), []).append(r["saved"])
    assert len(by_stage) == 2  # two stages, disjoint linears, two tp ranks each with their own histories
    for a, b in by_stage.values():
        assert all(not torch.equal(a[n], b[n]) for n in a)
    errors = out[0]["errors"]
    assert "holds FP8 delayed-scaling amax histories" in errors["into_current"] and \
        "fp8='current'" in errors["into_current"] and "fp8_state=False" in errors["into_current"]
    assert "of 16 steps" in errors["into_len8"] and "keeps 8" in errors["into_len8"]
    assert "holds no FP8 amax histories (saved with fp8='current')" in errors["current_into_delayed"]


# ---- training ------------------------------------------------------------------------------------
STEPS, BATCH, SEQ, LR = 200, 8, 64, 3e-3
SEEDS = (0, 1, 2, 3)


def _train_curve(c, data, recipe, seed):
    """200 AdamW steps (clipping 1.0) of llama3-tiny's rank-0 program at tp=1, initialised with
    ``seed``; the training loss of every step."""
    from mcompile.models import get_preset

    gm = copy.deepcopy(c.program(0))
    if recipe:
        convert_fp8(gm, c.plan, dict(c.captured.params), recipe=recipe)
    torch.manual_seed(seed)
    weights = get_preset("llama3-tiny").build().state_dict()
    state = {ph: t.detach().clone() for ph, t in c.captured.state_values().items()}
    state.update({ph: weights[fqn].detach().clone().requires_grad_() for ph, fqn in c.captured.params.items()})
    params = [state[ph] for ph in c.captured.params]
    opt = torch.optim.AdamW(params, lr=LR)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    comm = ThreadedWorld(c.mesh).communicator(0)
    losses = []
    for x, y in data:
        user = dict(zip(c.captured.user_inputs, (x, y)))
        with ops.bind(comm, process_wide=True):
            (loss,) = gm(*[state[n] if n in state else user[n] for n in names])
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.slow  # the CI tier keeps the cheaper checks of this capability (README: -m slow)
@pytest.mark.timeout(300)
def test_fp8_training_tracks_fp32(monkeypatch):
    """llama3-tiny, 200 steps of 8 x 64 bytes of mcompile.apps.demo's corpus, fp32 vs FP8 (current scaling),
    for 4 initialisations; "final loss" = mean training loss of the last 20 steps (the same batches
    in both runs).

    Why a mean over the last 20 steps and over seeds, and why 2%. The runs do not follow one
    trajectory: at lr 3e-3 even a 1e-6 relative perturbation of fp32 weights moves the last step's
    loss by 0.8% (measured), and FP8's rounding (≤ 2^-4 per operand element, ≤ 2^-3 per gradient
    element) is a far larger perturbation at every step. So each seed's final-loss gap is a random
    quantity: over seeds 0-9 it ranged from −1.8% to +2.3% (σ ≈ 1.2%), about the spread of the fp32
    final loss between seeds itself. What must hold is that FP8 has no systematic cost: the mean gap
    over seeds 0-9 was +0.2%, over the 4 seeds here +0.1% (standard error ≈ 0.6%), so the bound of 2%
    sits > 3 standard errors away and passes for the right reason. It fails for a recipe that costs
    loss: FP8 without scaling (every scale 1: weights of ~0.02 on E4M3's subnormal grid, gradients of
    the mean loss, ~1e-5, partly below E5M2's smallest subnormal 2^-16) gave a mean gap of +2.7% over
    these 4 seeds (measured with fp8.compute_scale patched to return 1). bench/fp8_curve.py runs the
    same comparison through mc.parallelize over 8 seeds (current: +0.13%, delayed: -0.5%).
    """
    from mcompile.apps.demo import batches

    # the Triton kernel is bit-identical to its reference (test_triton_cast_amax_matches_torch); the
    # interpreter would take minutes for 2 x 4 x 200 steps
    monkeypatch.setattr(fp8, "_INTERPRETED", False)
    _, _, c, _ = compiled("llama3-tiny", "tp=1", False)
    data = batches(STEPS, BATCH, SEQ)
    final = {None: [], "current": []}
    for seed in SEEDS:
        for recipe in final:
            losses = _train_curve(c, data, recipe, seed)
            assert math.isfinite(losses[-1]) and losses[-1] < losses[0] / 5  # it trained (5.5 -> ~0.5)
            final[recipe].append(sum(losses[-20:]) / 20)
    fp32, fp8_ = (sum(v) / len(v) for v in final.values())
    assert abs(fp8_ - fp32) / fp32 <= 0.02, final
