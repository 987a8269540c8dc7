"""The norm kernels (mcompile.kernels.norms) against their PyTorch references.

Isolated here: each Triton kernel pair (forward, backward) through its custom op and autograd,
compared with autograd through the fp32 reference — so the hand-written backward formulas are
checked against torch's own differentiation, not against themselves. On CPU the kernels run under
Triton's interpreter (TRITON_INTERPRET=1, set below before triton is imported).
Also: the plain-CPU reference path, torch.library.opcheck, torch.export and AOTAutograd tracing.

Run on a GPU with TRITON_INTERPRET=0 to test the compiled kernels on CUDA tensors.

Tolerances (per output dtype; expected values come from the same rounded inputs, in fp32):
- fp32: rtol 1e-5, and atol 1e-5 x the tensor's natural scale (the largest sum of |terms|: rstd·|dy·w|
  for dx, Σ_rows |dy·x̂| for dw, |y| for y). Kernel and reference differ only in the order of fp32
  reductions over at most a few thousand terms, an error of a few 2^-24 of the sum of |terms| — not
  of the result, which can cancel (dx of a 1-wide RMSNorm row is the difference of two nearly equal
  terms). 1e-5 is DESIGN §7's fp32 bound; over 570 random cases the worst error was 8% of it.
- bf16: rtol 2^-7 on top of the same atol. Both sides round a fp32 value once to bf16 (8
  significant bits, unit roundoff 2^-8); fp32 values a little apart can round to neighbouring bf16
  numbers, one ulp apart, and one ulp is at most 2^-7 of the value (worst seen: 94% of the bound).
  h = x + residual is compared exactly: one rounding of the same fp32 sum on both sides.
"""

from __future__ import annotations

import os

# before anything imports triton, which reads it once (TRITON_INTERPRET=0 keeps a GPU run compiled)
os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mcompile.kernels import norms  # noqa: E402

pytestmark = pytest.mark.skipif(norms.triton is None, reason="triton is not installed (Linux-only dependency)")

FP32_NOISE = 1e-5
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
HIDDEN = st.one_of(st.sampled_from([1, 3, 100, 257, 1024]), st.integers(2, 200))
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
# the interpreter is slow: few examples, no deadline, and no shrinking (shrinking a failure through
# the interpreter takes minutes; the failing case is reported as generated)
PROPERTY = settings(max_examples=12, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate),
                    suppress_health_check=[HealthCheck.too_slow])


@contextlib.contextmanager
def kernels_on(device: str):
    """Guard: the ops must take their Triton path for ``device`` (the interpreter for CPU, compiled
    on CUDA), or these tests would compare the reference with itself."""
    if device == "cpu" and not norms.uses_triton("cpu"):
        if os.environ["TRITON_INTERPRET"].lower() in ("0", "off", "false"):
            pytest.skip("TRITON_INTERPRET=0: kernels are compiled for the GPU, CPU tensors take the reference")
        pytest.fail("mcompile.kernels.norms was imported before TRITON_INTERPRET=1 was set: set it in the "
                    "environment or at the top of conftest.py")
    if device == "cpu":
        norms._launch_config(1)  # raises if triton itself was imported before TRITON_INTERPRET=1 was set
    if device == "cuda" and norms._INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 would interpret the kernels on CUDA tensors: run with TRITON_INTERPRET=0")
    yield


@st.composite
def cases(draw):
    """(shape, x dtype, weight dtype, seed): rows 1..37, sometimes as two leading dims."""
    rows, n, dtype = draw(st.integers(1, 37)), draw(HIDDEN), draw(DTYPES)
    shape = (2, rows // 2, n) if rows % 2 == 0 and draw(st.booleans()) else (rows, n)
    wdtype = draw(st.sampled_from([dtype, torch.float32]))  # bf16 activations may meet fp32 weights
    return shape, dtype, wdtype, draw(st.integers(0, 2**16))


def make(shape, dtype, wdtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)
    n = shape[-1]
    t = dict(x=rnd(*shape) * 2 + 0.5,  # off-centre, so LayerNorm's mean matters
             res=rnd(*shape), dy=rnd(*shape), dh=rnd(*shape),
             w=1 + 0.5 * rnd(n), b=0.5 * rnd(n))
    return {k: v.to(device, wdtype if k in "wb" else dtype) for k, v in t.items()}


def check(actual, expected, scale):
    """expected: fp32, from the same rounded inputs; scale: the natural magnitude (see module doc)."""
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=RTOL[actual.dtype],
                               atol=FP32_NOISE * float(torch.as_tensor(scale).detach()))


def reference_grads(fn, inputs, grads):
    """fn's outputs and autograd's gradients for fp32 copies of inputs."""
    leaves = [t.detach().float().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = torch.autograd.grad(outs, leaves, [g.float() for g in grads])
    return tuple(o.detach() for o in outs), grads


def op_grads(fn, inputs, grads):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return outs, torch.autograd.grad(outs, leaves, grads)


def rows_sum(t):
    return t.reshape(-1, t.shape[-1]).sum(0)


# ---- the three ops against autograd through their references ----------------------------
def run_rms(shape, dtype, wdtype, seed, device):
    t = make(shape, dtype, wdtype, seed, device)
    (y,), (dx, dw) = op_grads(norms.rms_norm, (t["x"], t["w"]), (t["dy"],))
    (yr,), (dxr, dwr) = reference_grads(lambda x, w: norms.rms_norm_reference(x, w)[0], (t["x"], t["w"]), (t["dy"],))
    _, rstd = norms.rms_norm_reference(t["x"], t["w"])
    g = (t["dy"].float() * t["w"].float()).abs()
    check(y, yr, yr.abs().max())
    check(dx, dxr, (g * rstd.unsqueeze(-1)).max())
    check(dw, dwr, rows_sum((t["dy"].float() * t["x"].float() * rstd.unsqueeze(-1)).abs()).max())


def run_ln(shape, dtype, wdtype, seed, device):
    t = make(shape, dtype, wdtype, seed, device)
    args = (t["x"], t["w"], t["b"])
    (y,), (dx, dw, db) = op_grads(norms.layer_norm, args, (t["dy"],))
    (yr,), (dxr, dwr, dbr) = reference_grads(lambda *a: norms.layer_norm_reference(*a)[0], args, (t["dy"],))
    _, mean, rstd = norms.layer_norm_reference(*args)
    xhat = (t["x"].float() - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    dyf = t["dy"].float()
    check(y, yr, yr.abs().max())
    check(dx, dxr, ((dyf * t["w"].float()).abs() * rstd.unsqueeze(-1)).max())
    check(dw, dwr, rows_sum((dyf * xhat).abs()).max())
    check(db, dbr, rows_sum(dyf.abs()).max())


def run_add_rms(shape, dtype, wdtype, seed, device):
    t = make(shape, dtype, wdtype, seed, device)
    args = (t["x"], t["res"], t["w"])
    (h, y), (dx, dres, dw) = op_grads(norms.add_rms_norm, args, (t["dh"], t["dy"]))
    # h is rounded to x's dtype before the norm: the reference must see the same rounded h
    h_ref = t["x"] + t["res"]
    (yr,), (dhr, dwr) = reference_grads(lambda h, w: norms.rms_norm_reference(h, w)[0], (h_ref, t["w"]), (t["dy"],))
    _, rstd = norms.rms_norm_reference(h_ref, t["w"])
    dxr = dhr + t["dh"].float()
    g = (t["dy"].float() * t["w"].float()).abs()
    assert torch.equal(h, h_ref)  # one rounding of the fp32 sum on both sides
    check(y, yr, yr.abs().max())
    check(dx, dxr, (g * rstd.unsqueeze(-1)).max() + t["dh"].float().abs().max())
    assert torch.equal(dx, dres)  # h = x + residual: the same gradient reaches both
    check(dw, dwr, rows_sum((t["dy"].float() * h_ref.float() * rstd.unsqueeze(-1)).abs()).max())


RUNS = {"rms_norm": run_rms, "layer_norm": run_ln, "add_rms_norm": run_add_rms}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(RUNS))
@PROPERTY
@given(case=cases())
def test_op_matches_reference(op, device, case):
    with kernels_on(device):
        RUNS[op](*case, device)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(RUNS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_rows_loop_over_column_blocks(op, dtype, device):
    """16385 columns > the widest block (16384): each row kernel walks two column blocks (the second
    one column wide), and backward takes the split dx + weight-gradient kernels."""
    n = norms._MAX_BLOCK_N + 1
    assert norms._bwd_layout(3, n, torch.device(device))[0] is False
    with kernels_on(device):
        RUNS[op]((3, n), dtype, dtype, 0, device)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", list(RUNS))
@pytest.mark.parametrize("groups", [1, 2])
def test_weight_grad_row_groups_loop_over_tiles(op, groups, monkeypatch):
    """Rows wider than the widest block (capped at 16 columns here; 40 columns walk 3 blocks) and
    fewer row groups than row tiles (which takes > 8192 rows at the default caps): each program of
    the weight-gradient kernel sums several tiles of rows. Row tiles of 8 rows here (32 by default), so
    37 rows make 5 tiles, the last one partial: the interpreter runs a program per row in the other kernels
    (150 rows of 32-row tiles took 5.8 s a case)."""
    monkeypatch.setattr(norms, "_MAX_BLOCK_N", 16)
    monkeypatch.setattr(norms, "_DW_MAX_GROUPS", groups)
    monkeypatch.setattr(norms, "_DW_BLOCK_M", 8)
    rows = 37
    assert rows > 2 * groups * norms._DW_BLOCK_M and rows % norms._DW_BLOCK_M
    assert norms._bwd_layout(rows, 40, torch.device("cpu"))[::3] == (False, groups)
    with kernels_on("cpu"):
        RUNS[op]((rows, 40), torch.float32, torch.float32, 2, "cpu")


def test_backward_layout_by_width():
    """One backward kernel up to 8192 columns; wider rows (their registers would spill on sm_90, see
    bench/kernels_sm90.py) take the split dx + weight-gradient kernels, also where one block holds them."""
    cpu = torch.device("cpu")
    assert [norms._bwd_layout(64, n, cpu)[0] for n in (1, 4096, 8192, 8193, 16384, 16385)] == \
        [True, True, True, False, False, False]
    assert norms._launch_config(16384)[0] == 16384  # one forward block all the same


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", list(RUNS))
@pytest.mark.parametrize("rows", [1, 7, 8, 37])
def test_one_block_backward_splits_rows_over_programs(op, rows):
    """Rows that fit one block: one backward kernel, each program a run of consecutive rows whose
    weight gradient it sums in registers — fewer rows than programs, as many, and 37 rows over 8
    programs of 5 (the last takes 2)."""
    one_block, _, _, programs, per = norms._bwd_layout(rows, 96, torch.device("cpu"))
    assert one_block and programs == min(rows, norms._INTERPRETER_BWD_PROGRAMS)
    assert (programs - 1) * per < rows <= programs * per
    with kernels_on("cpu"):
        for dtype in (torch.float32, torch.bfloat16):
            RUNS[op]((rows, 96), dtype, dtype, rows, "cpu")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", list(RUNS))
def test_strided_inputs_and_gradients(op):
    """Transposed x and residual, every-other-element weight and bias, and the stride-0 gradient of
    a .sum(): the ops must not read memory as if it were contiguous."""
    g = torch.Generator().manual_seed(3)
    x, res = torch.randn(40, 6, generator=g).t(), torch.randn(40, 6, generator=g).t()  # (6, 40), strides (1, 6)
    w, b = torch.randn(80, generator=g)[::2], torch.randn(80, generator=g)[1::2]
    fns = {
        "rms_norm": (lambda x, r, w, b: norms.rms_norm(x, w), lambda x, r, w, b: norms.rms_norm_reference(x, w)[0]),
        "layer_norm": (lambda x, r, w, b: norms.layer_norm(x, w, b),
                       lambda x, r, w, b: norms.layer_norm_reference(x, w, b)[0]),
        "add_rms_norm": (lambda x, r, w, b: sum(norms.add_rms_norm(x, r, w)),
                         lambda x, r, w, b: sum(norms.add_rms_norm_reference(x, r, w)[:2])),
    }
    results = []
    with kernels_on("cpu"):
        for fn in fns[op]:
            leaves = [t.detach().requires_grad_() for t in (x, res, w, b)]  # detach keeps the strides
            y = fn(*leaves)
            results.append((y, torch.autograd.grad(y.sum(), leaves, allow_unused=True)))
    (y, grads), (y_ref, grads_ref) = results
    check(y, y_ref, y_ref.abs().max())
    for got, want in zip(grads, grads_ref, strict=True):
        assert (got is None) == (want is None)
        if got is not None:  # O(1) randn inputs: the terms of every sum are O(1)
            check(got, want, max(1.0, want.abs().max()))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", list(RUNS))
def test_plain_cpu_runs_the_reference(op, monkeypatch):
    """With kernels compiled (no TRITON_INTERPRET), CPU tensors take the reference forward and the
    explicit backward formulas of the module docstring."""
    monkeypatch.setattr(norms, "_INTERPRETED", False)
    assert not norms.uses_triton("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        RUNS[op]((5, 2, 33), dtype, dtype, 1, "cpu")


# ---- tracing: opcheck, torch.export, AOTAutograd ------------------------------------------
def _opcheck_cases():
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s, grad=False: torch.randn(*s, generator=g).requires_grad_(grad)
    x, r, w, b, dy = rnd(3, 8, grad=True), rnd(3, 8, grad=True), rnd(8, grad=True), rnd(8, grad=True), rnd(3, 8)
    rstd, mean = torch.rand(3) + 0.5, torch.randn(3)
    ops = torch.ops.mcompile
    return {
        "rms_norm": (ops.rms_norm.default, (x, w, 1e-6)),
        "layer_norm": (ops.layer_norm.default, (x, w, b, 1e-5)),
        "add_rms_norm": (ops.add_rms_norm.default, (x, r, w, 1e-6)),
        "rms_norm_backward": (ops.rms_norm_backward.default, (dy, x.detach(), w.detach(), rstd)),
        "layer_norm_backward": (ops.layer_norm_backward.default, (dy, x.detach(), w.detach(), mean, rstd)),
        "add_rms_norm_backward": (ops.add_rms_norm_backward.default, (dy, dy, x.detach(), w.detach(), rstd)),
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck(name):
    op, args = _opcheck_cases()[name]
    with kernels_on("cpu"):
        torch.library.opcheck(op, args)


class Block(torch.nn.Module):
    """A pre-norm residual step using all three ops."""

    def __init__(self, n: int):
        super().__init__()
        self.w1 = torch.nn.Parameter(1 + 0.1 * torch.randn(n))
        self.w2 = torch.nn.Parameter(1 + 0.1 * torch.randn(n))
        self.ln_w = torch.nn.Parameter(torch.ones(n))
        self.ln_b = torch.nn.Parameter(torch.zeros(n))

    def forward(self, x, res):
        h, y = norms.add_rms_norm(x, res, self.w2)
        return norms.layer_norm(norms.rms_norm(y, self.w1) * 2, self.ln_w, self.ln_b) + h


OPS = {"mcompile.rms_norm.default", "mcompile.layer_norm.default", "mcompile.add_rms_norm.default"}
BACKWARD_OPS = {"mcompile.rms_norm_backward.default", "mcompile.layer_norm_backward.default",
                "mcompile.add_rms_norm_backward.default"}


def _targets(gm) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.timeout(300)
def test_export_traces_the_ops():
    torch.manual_seed(0)
    m = Block(24)
    rows = torch.export.Dim("rows", min=2, max=64)
    with kernels_on("cpu"):
        ep = torch.export.export(m, (torch.randn(4, 24), torch.randn(4, 24)), strict=False,
                                 dynamic_shapes=({0: rows}, {0: rows}))
        assert OPS <= _targets(ep.graph_module)
        x, res = torch.randn(7, 24), torch.randn(7, 24)  # another row count: the shapes stayed symbolic
        torch.testing.assert_close(ep.module()(x, res), m(x, res), rtol=0, atol=0)


@pytest.mark.timeout(300)
def test_aot_autograd_traces_the_registered_backwards():
    from functorch.compile import aot_module, make_boxed_func

    torch.manual_seed(0)
    m = Block(24)
    graphs = {}

    def keep(kind):
        def compiler(gm, _):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)
        return compiler

    x, res = torch.randn(2, 3, 24, requires_grad=True), torch.randn(2, 3, 24, requires_grad=True)
    with kernels_on("cpu"):
        compiled = aot_module(m, fw_compiler=keep("fw"), bw_compiler=keep("bw"))
        out = compiled(x, res)
        grads = torch.autograd.grad(out.square().sum(), [x, res, *m.parameters()])
        expected = torch.autograd.grad(m(x, res).square().sum(), [x, res, *m.parameters()])
    assert OPS <= _targets(graphs["fw"])
    assert BACKWARD_OPS <= _targets(graphs["bw"])
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same kernels run either way


@pytest.mark.timeout(300)
@pytest.mark.parametrize("call", [
    lambda x, w: norms.rms_norm(x, w[:-1]),
    lambda x, w: norms.layer_norm(x, w, w[:-1]),
    lambda x, w: norms.add_rms_norm(x, x[:, :-1], w),
])
def test_mismatched_shapes_say_what_to_pass(call):
    with pytest.raises(ValueError, match="must match|does not match"):
        call(torch.randn(2, 8), torch.randn(8))

