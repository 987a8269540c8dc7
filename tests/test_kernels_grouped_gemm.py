"""Grouped GEMM (mcompile::grouped_mm, kernels/grouped_gemm.py) against a loop over the groups.

What is isolated: the op's forward and backward (dx, dw) — the Triton kernels (run on CPU tensors by
Triton's interpreter, so correctness only, DESIGN §8) and, separately, the PyTorch path
(``torch._grouped_mm`` with zero-padding to its alignment, and the padded-bmm fallback) — against an
independent oracle: ``x[s:e] @ w[g]`` for each group in a Python loop, in fp64 on the same inputs, with
torch autograd for the gradients. Shapes cover empty groups (first, middle, last), a single group, all
rows in one group among empty ones, N = 0, and reduction/output widths that are not multiples of the
tile; tiny 16-wide tiles make the small shapes take several row, column and reduction tiles and several
tiles per group.

Tolerances, against the unrounded fp64 oracle (``exact``), per output dtype:

* fp32 — an fp32 dot of k terms in another order: rtol 1e-5, atol 1e-5 (measured ≤ 6e-6 absolute at
  k ≤ 40 with |values| ≲ 20).
* bf16 — fp32 accumulation (error ≤ k·2^-24·Σ|x||w|, the standard dot-product bound) and one rounding to
  bf16: at most one bf16 ulp ≤ 2^-7·|exact| (a full ulp, not half: the interpreter's fp32 -> bf16 cast
  truncates, the GPU rounds to nearest). So |actual - exact| ≤ 2^-7·|exact| + (k + 1)·2^-24·Σ|x||w|,
  checked element by element with Σ|x||w| from the oracle on |x|, |w|.

On a GPU machine, ``TRITON_INTERPRET=0 pytest tests/test_kernels_grouped_gemm.py`` runs the same tests
with the compiled kernels on CUDA tensors.
"""

import contextlib
import os
from unittest import mock

# before anything imports triton, which reads it once: the kernels run on CPU tensors in its interpreter
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mcompile.kernels import grouped_gemm  # noqa: E402
from mcompile.kernels.grouped_gemm import grouped_mm  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"].lower() not in ("0", "false", "off")
DEVICE = "cpu" if INTERPRET else "cuda"
NO_TRITON = grouped_gemm.triton is None
NO_GPU = not INTERPRET and not torch.cuda.is_available()


def needs_triton(fn):
    fn = pytest.mark.skipif(NO_TRITON, reason="triton is not installed (Linux-only dependency)")(fn)
    return pytest.mark.skipif(NO_GPU, reason="TRITON_INTERPRET=0 compiles the kernels for a GPU, and there is none")(fn)


DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
# rows per group: empty groups are frequent (hypothesis shrinks towards 0), sizes cross the 16-row tile
GROUPS = st.lists(st.one_of(st.just(0), st.integers(1, 40)), min_size=1, max_size=4)
WIDTHS = st.one_of(st.sampled_from([1, 16, 33]), st.integers(1, 40))  # multiples of the tiny tile and not
SETTINGS = settings(max_examples=20, deadline=None, derandomize=True)  # the interpreter is slow
TINY = dict(_BLOCK_M=16, _BLOCK_N=16, _BLOCK_K=16, _BLOCK_A=16, _BLOCK_B=16, _BLOCK_R=16)


def tiles(tiny: bool):
    return mock.patch.multiple(grouped_gemm, **TINY) if tiny else contextlib.nullcontext()


# ---- the oracle -------------------------------------------------------------------------------
def loop_oracle(x, w, offs):
    """out[s:e] = x[s:e] @ w[g] for each group, in a Python loop (fp64 in, fp64 out)."""
    out = x.new_zeros(x.shape[0], w.shape[2])
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[g]
        start = end
    return out


def exact(x, w, offs, grad):
    """(out, dx, dw) of the loop oracle in fp64 by autograd, and their Σ|·||·| magnitudes (same loop on
    absolute values) for the bf16 bound."""
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    out = loop_oracle(x64, w64, offs)
    dx, dw = torch.autograd.grad(out, (x64, w64), grad.double()) if out.numel() else (x64 * 0, w64 * 0)
    ax, aw, ag = x64.detach().abs(), w64.detach().abs(), grad.double().abs()
    mag_out = loop_oracle(ax, aw, offs)
    mag_dx = loop_oracle(ag, aw.transpose(1, 2), offs)
    mag_dw = torch.zeros_like(aw)
    start = 0
    for g, end in enumerate(offs.tolist()):
        mag_dw[g] = ax[start:end].T @ ag[start:end]
        start = end
    return (out.detach(), mag_out), (dx, mag_dx), (dw, mag_dw)


def check(actual, expected, magnitude, k, dtype):
    """The module docstring's tolerance for an output of k-term dot products."""
    assert actual.dtype == dtype and actual.shape == expected.shape
    if dtype == torch.float32:
        torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5)
        return
    err = (actual.double() - expected).abs()
    bound = 2**-7 * expected.abs() + (k + 1) * 2**-24 * magnitude
    assert torch.all(err <= bound), f"max excess {(err - bound).max().item():.3g} over the bf16 bound"


def inputs(sizes, a, b, dtype, seed, device=None):
    gen = torch.Generator().manual_seed(seed)
    n, g = sum(sizes), len(sizes)
    x, w, grad = (torch.randn(shape, generator=gen).to(device or DEVICE, dtype)
                  for shape in ((n, a), (g, a, b), (n, b)))
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(device or DEVICE)
    return x, w, offs, grad


def run_and_check(x, w, offs, grad, dtype):
    x1, w1 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = grouped_mm(x1, w1, offs)
    dx, dw = torch.autograd.grad(out, (x1, w1), grad) if out.numel() else (torch.zeros_like(x1), None)
    (e_out, m_out), (e_dx, m_dx), (e_dw, m_dw) = exact(x.cpu(), w.cpu(), offs.cpu(), grad.cpu())
    sizes = torch.diff(offs.cpu(), prepend=offs.new_zeros(1).cpu())
    check(out.cpu(), e_out, m_out, w.shape[1], dtype)
    check(dx.cpu(), e_dx, m_dx, w.shape[2], dtype)
    if dw is None:  # no output element: autograd never calls the backward, the gradient is zero
        dx, dw = torch.ops.mcompile.grouped_mm_backward(grad, x, w, offs)
    check(dw.cpu(), e_dw, m_dw, int(sizes.max()) if sizes.numel() else 0, dtype)


@pytest.fixture(scope="module")
def triton_path():
    """Guard: a silent fallback to the PyTorch path would make the kernel tests test it instead."""
    import triton.language as tl

    assert grouped_gemm.uses_triton(DEVICE), f"grouped_gemm would run its PyTorch path on {DEVICE}"
    if INTERPRET and type(tl.sum).__name__ != "InterpretedFunction":
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set: set it in the environment")


@contextlib.contextmanager
def torch_path():
    """The ops take their PyTorch path on CPU tensors (as without the interpreter)."""
    with mock.patch.object(grouped_gemm, "_INTERPRETED", False):
        assert not grouped_gemm.uses_triton("cpu")
        yield


# ---- Triton kernels ---------------------------------------------------------------------------
@needs_triton
@pytest.mark.timeout(300)
@SETTINGS
@given(sizes=GROUPS, a=WIDTHS, b=WIDTHS, dtype=DTYPES, tiny=st.booleans(), seed=st.integers(0, 2**16))
def test_kernels_match_the_loop(triton_path, sizes, a, b, dtype, tiny, seed):
    """Forward, dx and dw of the Triton kernels against the loop oracle, random groups and widths."""
    with tiles(tiny):
        run_and_check(*inputs(sizes, a, b, dtype, seed), dtype)


@needs_triton
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sizes,tiny", [([13], True), ([0, 0, 37, 0], True), ([0, 17, 0], True),
                                        ([5, 0, 0, 3, 0], True), ([0, 0], True), ([70, 0, 150], False)],
                         ids=["one-group", "all-in-one-of-four", "empty-ends", "empty-middle", "no-rows",
                              "production-tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_edge_groups(triton_path, sizes, tiny, dtype):
    """Named group layouts. Tiny tiles: a 37-row group spans three row tiles; the production tiles
    (64 rows) need groups of 70 and 150 rows for a group of several row tiles."""
    with tiles(tiny):
        run_and_check(*inputs(sizes, 20, 18, dtype, seed=len(sizes)), dtype)


@needs_triton
@pytest.mark.timeout(120)
def test_kernels_take_strided_operands(triton_path):
    """A stacked nn.Linear weight (G, b, a) passed as its transposed view and rows of a wider buffer:
    the kernel reads through the strides, no copy, and gets the same numbers."""
    x, w, offs, grad = inputs([9, 0, 20], 24, 17, torch.float32, seed=3)
    w_linear = w.transpose(1, 2).contiguous()  # (G, b, a), as nn.Linear stores it
    x_wide = torch.cat([x, torch.ones_like(x)], dim=1)[:, :24]  # row stride 48
    with tiles(True):
        out = grouped_mm(x_wide, w_linear.transpose(1, 2), offs)
    torch.testing.assert_close(out.double(), loop_oracle(x.double(), w.double(), offs), rtol=1e-5, atol=1e-5)


# ---- PyTorch path -----------------------------------------------------------------------------
@pytest.mark.timeout(60)
@settings(max_examples=40, deadline=None, derandomize=True)
@given(sizes=GROUPS, a=WIDTHS, b=WIDTHS, dtype=DTYPES, native=st.booleans(), seed=st.integers(0, 2**16))
def test_torch_path_matches_the_loop(sizes, a, b, dtype, native, seed):
    """torch._grouped_mm (a, b padded to 16 bytes when they are not) and the padded-bmm fallback."""
    patch = contextlib.nullcontext() if native else mock.patch.object(grouped_gemm, "_native_ok", lambda *a: False)
    with torch_path(), patch:
        run_and_check(*inputs(sizes, a, b, dtype, seed, device="cpu"), dtype)


def test_torch_path_takes_grouped_mm_where_it_can():
    """The native path runs for fp32/bf16 on CPU, padded or not; fp64 takes the bmm fallback (and is exact)."""
    calls = []
    native = torch._grouped_mm

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return native(*args, **kwargs)

    with torch_path(), mock.patch.object(torch, "_grouped_mm", spy):
        for a in (16, 7):  # aligned, and padded to 8 fp32 (4 bf16 would be 8 too)
            grouped_mm(*inputs([3, 4], a, 5, torch.float32, 0, device="cpu")[:3])
        assert [s[1] for s in calls] == [16, 8]
        x, w, offs, _ = inputs([3, 0, 4], 7, 5, torch.float64, 0, device="cpu")
        out = grouped_mm(x, w, offs)
        assert len(calls) == 2
    torch.testing.assert_close(out, loop_oracle(x, w, offs), rtol=1e-12, atol=1e-12)


# ---- dispatch: torch._grouped_mm / Triton / reference (issue 38 item 9) -------------------------
H100, H200, B200, A100, RTX5090 = (9, 0), (9, 0), (10, 0), (8, 0), (12, 0)
BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("device,dtype,a,b,groups,cap,aligned,want", [
    ("cuda", BF16, 4096, 1408, 8, H100, True, "torch._grouped_mm"),  # DeepSeek-V2-Lite-like experts
    ("cuda", BF16, 4096, 14336, 8, H200, True, "torch._grouped_mm"),
    ("cuda", BF16, 2048, 768, 256, B200, True, "torch._grouped_mm"),
    ("cuda", BF16, 4096, 1408, 8, A100, True, "triton"),  # torch's fallback there syncs on offs
    ("cuda", BF16, 4096, 1408, 8, RTX5090, True, "triton"),
    ("cuda", FP32, 4096, 1408, 8, H100, True, "triton"),  # the CUTLASS kernel is bf16 only
    ("cuda", torch.float16, 4096, 1408, 8, H100, True, "triton"),
    ("cuda", BF16, 4100, 1408, 8, H100, True, "triton"),  # a not a multiple of 8: padding would copy w
    ("cuda", BF16, 4096, 1404, 8, H100, True, "triton"),
    ("cuda", BF16, 4096, 1408, 8, H100, False, "triton"),  # an operand off its 16-byte alignment
    ("cuda", BF16, 512, 256, 1024, H100, True, "triton"),  # the kernel takes fewer than 1024 groups
    ("cuda", torch.float64, 64, 64, 4, H100, True, "reference"),  # neither kernel takes fp64
])
def test_dispatch_decision(device, dtype, a, b, groups, cap, aligned, want):
    """Which path a device / dtype / shape takes; decided without a GPU (the capability is given)."""
    assert grouped_gemm.grouped_mm_path(device, dtype, a, b, groups, capability=cap, aligned=aligned) == want


def test_dispatch_without_triton_rocm_or_grouped_mm(monkeypatch):
    """CPU: the reference (the Triton kernels only under the interpreter); CUDA without Triton: the reference
    (bf16 on sm90 still torch._grouped_mm); ROCm, or a torch without ``_grouped_mm``: Triton."""
    path = grouped_gemm.grouped_mm_path
    with torch_path():
        assert path("cpu", BF16, 64, 64, 4) == path("cpu", FP32, 64, 64, 4) == "reference"
    assert path("cpu", BF16, 64, 64, 4) == ("triton" if INTERPRET and not NO_TRITON else "reference")
    with mock.patch.object(grouped_gemm, "runs_triton", lambda *a: False):
        assert path("cuda", FP32, 64, 64, 4, capability=H100) == "reference"
        assert path("cuda", BF16, 64, 64, 4, capability=H100) == "torch._grouped_mm"
    with mock.patch.object(torch.version, "hip", "6.3"):
        assert path("cuda", BF16, 64, 64, 4, capability=H100) == "triton"
    monkeypatch.delattr(torch, "_grouped_mm")
    assert path("cuda", BF16, 64, 64, 4, capability=H100) == "triton"


def test_alignment_is_read_off_the_operands():
    """The 16-byte rule on real tensors: contiguous, transposed-contiguous and row-offset operands pass; a
    start moved off 16 bytes, or a row stride that is not a multiple of 16 bytes, does not."""
    x = torch.zeros(10, 32, dtype=BF16)
    w_linear = torch.zeros(3, 24, 16, dtype=BF16)  # (G, b, a) as nn.Linear stores it
    assert grouped_gemm._aligned(x) and grouped_gemm._aligned(w_linear.transpose(1, 2))
    assert grouped_gemm._aligned(x[3:, :16])  # 3 rows of 64 bytes in, row stride 64 bytes
    assert not grouped_gemm._aligned(x[:, 4:])  # starts 8 bytes in
    assert not grouped_gemm._aligned(torch.zeros(10, 12, dtype=BF16))  # rows of 24 bytes


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_op_on_the_grouped_mm_path_matches_the_loop(dtype):
    """The op's ``torch._grouped_mm`` path (forced here: on CPU it is the CUDA decision's stand-in) runs
    forward, dx and dw as one ``torch._grouped_mm`` call each, on the operands as they are (aligned: no
    padding), and matches the loop oracle; torch._grouped_mm runs on CPU tensors in this torch."""
    calls = []
    native = torch._grouped_mm

    def spy(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return native(*args, **kwargs)

    with mock.patch.object(grouped_gemm, "_path", lambda x, w: "torch._grouped_mm"), \
            mock.patch.object(torch, "_grouped_mm", spy):
        run_and_check(*inputs([5, 0, 19, 8], 16, 24, dtype, seed=1, device="cpu"), dtype)
    assert calls == [(32, 16), (32, 24), (16, 32)], calls  # x, grad (dx), x^T (dw): never padded


# ---- the op -----------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_opcheck(path):
    """Schema, fake-tensor and autograd-registration consistency, and AOT dispatch (static, dynamic)."""
    if path == "triton" and (NO_TRITON or NO_GPU):
        pytest.skip("the Triton path does not run here (no triton, or TRITON_INTERPRET=0 without a GPU)")
    device = DEVICE if path == "triton" else "cpu"
    x, w, offs, _ = inputs([5, 0, 11], 16, 8, torch.float32, 0, device=device)
    patch = torch_path() if path == "torch" else contextlib.nullcontext()
    with patch, tiles(True):
        torch.library.opcheck(grouped_mm, (x.requires_grad_(), w.requires_grad_(), offs))


def test_export_keeps_one_node():
    """torch.export sees mcompile.grouped_mm as one node, and the exported program computes the same."""

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 8, 6))

        def forward(self, x, offs):
            return grouped_mm(x, self.w, offs)

    x, _, offs, _ = inputs([2, 0, 4], 8, 6, torch.float32, 0, device="cpu")
    model = Experts()
    ep = torch.export.export(model, (x, offs), strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.mcompile.grouped_mm.default]
    torch.testing.assert_close(ep.module()(x, offs), model(x, offs))


@pytest.mark.parametrize("bad,match", [
    (dict(x=(4, 5)), "needs x \\(N, a\\) and w"),
    (dict(offs=(2,)), "offs of integer dtype and shape \\(G,\\) = \\(3,\\)"),
    (dict(offs_dtype=torch.float32), "offs of integer dtype"),
    (dict(w_dtype=torch.float64), "x, w of one dtype"),
])
def test_errors_name_the_fix(bad, match):
    x = torch.zeros(bad.get("x", (4, 8)))
    w = torch.zeros(3, 8, 6, dtype=bad.get("w_dtype", torch.float32))
    offs = torch.tensor([1, 2, 4][: bad.get("offs", (3,))[0]], dtype=bad.get("offs_dtype", torch.int64))
    with pytest.raises(ValueError, match=match):
        grouped_mm(x, w, offs)
