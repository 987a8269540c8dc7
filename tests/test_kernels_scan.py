"""The Mamba-2 SSD scan (mcompile.kernels.ssd_scan) against its PyTorch references.

Each Triton kernel (forward; backward = replayed forward + reverse scan) through its custom op and
autograd, compared with the fp64 sequential recurrence (forward) and fp64 autograd through the chunked
reference (backward) — so the hand-written backward is checked against torch's own differentiation. On
CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set below before triton is imported)
and only inside ``triton_on_cpu()`` (the op's explicit switch: a model on CPU otherwise takes the reference).
Also: the chunked reference against the recurrence at several chunk sizes, the op's reference path
(forward and backward), torch.library.opcheck, torch.export capturing one node, and the kernels compiled
for sm_90 without register spills (bench/kernels_sm90.py's compiler path, in a subprocess).

Tolerance (fp32; the expected values in fp64 from the same inputs): |actual - expected| <= 1e-5 x the
tensor's natural scale, the largest |value| of the same computation on |inputs| (|x|, |B|, |C|, |D|, |dy|:
a bound on the sum of |terms| of the y and dx/dB/dC entries, each a sum over at most l positions of
products decayed by factors <= 1) or of the result itself, whichever is larger. The kernel rounds each
of its l <= 40 steps to fp32 (2^-24 relative of the running sum of |terms|), so its error stays below
l x 2^-24 ~ 2.4e-6 of that scale; 1e-5 is DESIGN §7's fp32 bound. dA and dD sum over b x l positions
(at most 120): 7e-6 of their scale.
"""

from __future__ import annotations

import os

# before anything imports triton, which reads it once (TRITON_INTERPRET=0 keeps a GPU run compiled)
os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mcompile.kernels import ssd_scan as S  # noqa: E402

from conftest import examples  # noqa: E402

pytestmark = pytest.mark.skipif(S.triton is None, reason="triton is not installed (Linux-only dependency)")

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-5
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
# the interpreter is slow: few examples, no deadline, no shrinking (the failing case is reported as generated)
PROPERTY = settings(max_examples=10, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate),
                    suppress_health_check=[HealthCheck.too_slow])


@contextlib.contextmanager
def kernels_on(device: str, chunk: int | None = None):
    """The ops must take their Triton path for ``device`` (else these tests would compare the reference with
    itself); ``chunk``: the backward's saved-state interval, small to exercise the replay across chunks."""
    saved = S._CHUNK
    with S.triton_on_cpu():
        if device == "cpu" and not S.uses_triton("cpu"):
            if os.environ["TRITON_INTERPRET"].lower() in ("0", "off", "false"):
                pytest.skip("TRITON_INTERPRET=0: kernels are compiled for the GPU, CPU tensors take the reference")
            pytest.fail("mcompile.kernels.ssd_scan was imported before TRITON_INTERPRET=1 was set")
        if device == "cuda" and S._INTERPRETED:
            pytest.skip("TRITON_INTERPRET=1 would interpret the kernels on CUDA tensors: run with TRITON_INTERPRET=0")
        S._CHUNK = chunk or saved
        try:
            yield
        finally:
            S._CHUNK = saved


@st.composite
def cases(draw):
    """(b, l, heads, p, groups, n, chunk, seed): lengths 1..40 (mostly not powers of two), groups < heads."""
    groups = draw(st.sampled_from([1, 2, 3]))
    heads = groups * draw(st.integers(1, 3))
    return (draw(st.integers(1, 3)), draw(st.integers(1, 40)), heads, draw(st.sampled_from([1, 3, 8, 12])),
            groups, draw(st.sampled_from([1, 5, 16, 17])), draw(st.sampled_from([1, 3, 8, 64])),
            draw(st.integers(0, 2**16)))


def make(b, l, h, p, g, n, seed, device="cpu", dtype=torch.float32):  # noqa: E741
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    t = dict(x=rnd(b, l, h, p), dt=F.softplus(rnd(b, l, h) - 1), A=-torch.exp(rnd(h)).clamp(0.05, 8),
             B=rnd(b, l, g, n), C=rnd(b, l, g, n), D=rnd(h), dy=rnd(b, l, h, p))
    return {k: v.to(device, dtype) for k, v in t.items()}


NAMES = ("x", "dt", "A", "B", "C", "D")


def _abs(t):
    return {k: (v if k in ("A", "dt") else v.abs()) for k, v in t.items()}


def expected(t):
    """fp64: y by the recurrence, and autograd's gradients through the chunked reference, for t and |t|."""
    out = {}
    for tag, inputs in (("", t), ("abs", _abs(t))):
        leaves = [inputs[k].detach().cpu().double().requires_grad_() for k in NAMES]
        y = S.ssd_scan_sequential(*leaves)
        grads = torch.autograd.grad(S.ssd_scan_reference(*leaves, chunk=7), leaves, inputs["dy"].cpu().double())
        out[tag] = (y.detach(), grads)
    return out


def close(name, actual, want, abs_scale):
    scale = max(float(abs_scale.abs().max()) if abs_scale.numel() else 0.0,
                float(want.abs().max()) if want.numel() else 0.0)
    err = (actual.double().cpu() - want).abs().max().item() if want.numel() else 0.0
    assert err <= TOL * scale + 1e-30, f"{name}: max error {err:.3g} > {TOL} x scale {scale:.3g}"
    return err / scale if scale else 0.0


@pytest.mark.timeout(900)
@pytest.mark.parametrize("n_examples", examples(ci=4, slow=20))  # 1-6 s an example through the interpreter
@pytest.mark.parametrize("device", DEVICES)
def test_kernels_forward_and_backward_match_the_references(device, n_examples):
    @settings(PROPERTY, max_examples=n_examples)
    @given(case=cases())
    def check(case):
        b, l, h, p, g, n, chunk, seed = case  # noqa: E741
        t = make(b, l, h, p, g, n, seed, device)
        ref = expected(t)
        with kernels_on(device, chunk):
            leaves = [t[k].clone().requires_grad_() for k in NAMES]
            y = S.ssd_scan(*leaves)
            grads = torch.autograd.grad(y, leaves, t["dy"])
        close("y", y, ref[""][0], ref["abs"][0])
        for name, got, want, scale in zip(NAMES, grads, ref[""][1], ref["abs"][1]):
            assert got.shape == t[name].shape and got.dtype == t[name].dtype
            close(f"d{name}", got, want, scale)

    check()


@pytest.mark.timeout(300)
def test_kernels_fixed_case_with_many_chunks():
    """A deterministic case (so a CI run without hypothesis's draws still crosses 5 saved-state chunks):
    l = 37 positions, chunk 8, 2 groups of 3 heads."""
    t = make(2, 37, 6, 8, 2, 16, seed=3)
    ref = expected(t)
    with kernels_on("cpu", 8):
        leaves = [t[k].clone().requires_grad_() for k in NAMES]
        y = S.ssd_scan(*leaves)
        grads = torch.autograd.grad(y, leaves, t["dy"])
    worst = [close("y", y, ref[""][0], ref["abs"][0])]
    worst += [close(nm, g_, w, s) for nm, g_, w, s in zip(NAMES, grads, ref[""][1], ref["abs"][1])]
    assert max(worst) < TOL


@pytest.mark.timeout(300)
@settings(max_examples=40, deadline=None)
@given(case=cases())
def test_chunked_reference_is_the_recurrence(case):
    """fp64: the chunked SSD form equals the recurrence at any chunk size (1, a divisor or not, longer than l)."""
    b, l, h, p, g, n, chunk, seed = case  # noqa: E741
    t = make(b, l, h, p, g, n, seed, dtype=torch.float64)
    args = [t[k] for k in NAMES]
    torch.testing.assert_close(S.ssd_scan_reference(*args, chunk=chunk), S.ssd_scan_sequential(*args),
                               rtol=1e-10, atol=1e-10)


@pytest.mark.timeout(300)
def test_reference_path_of_the_op_forward_and_backward():
    """Without the switch, CPU tensors take the reference: y and the backward op's gradients (autograd through
    the reference inside the op) equal autograd through the reference itself."""
    assert not S.uses_triton("cpu")
    t = make(2, 19, 4, 8, 2, 16, seed=5)
    leaves = [t[k].clone().requires_grad_() for k in NAMES]
    y = S.ssd_scan(*leaves)
    grads = torch.autograd.grad(y, leaves, t["dy"])
    leaves2 = [t[k].clone().requires_grad_() for k in NAMES]
    y2 = S.ssd_scan_reference(*leaves2)
    grads2 = torch.autograd.grad(y2, leaves2, t["dy"])
    torch.testing.assert_close(y, y2, rtol=0, atol=0)
    for a, b_ in zip(grads, grads2):
        torch.testing.assert_close(a, b_, rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(300)
def test_opcheck_and_export_capture_one_node():
    t = make(1, 5, 2, 4, 1, 3, seed=1)
    args = tuple(t[k].clone().requires_grad_() for k in NAMES)
    torch.library.opcheck(torch.ops.mcompile.ssd_scan.default, args)

    class M(torch.nn.Module):
        def forward(self, *a):
            return S.ssd_scan(*a).sum()

    ep = torch.export.export(M(), tuple(t[k] for k in NAMES))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.mcompile.ssd_scan.default in targets


@pytest.mark.timeout(300)
def test_bad_shapes_are_refused_by_name():
    t = make(1, 4, 4, 2, 2, 3, seed=0)
    with pytest.raises(ValueError, match="groups of B/C must divide"):
        S.ssd_scan(t["x"], t["dt"], t["A"], t["B"][:, :, :1].expand(1, 4, 3, 3), t["C"][:, :, :1].expand(1, 4, 3, 3),
                   t["D"])
    with pytest.raises(ValueError, match="dt of shape"):
        S.ssd_scan(t["x"], t["dt"][:, :2], t["A"], t["B"], t["C"], t["D"])


_SM90 = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import kernels_sm90 as K  # noqa: the sm_90 compile path of bench/kernels_sm90.py
import torch
from triton.backends.compiler import GPUTarget
from mcompile.kernels import ssd_scan as S

launches = []
saved = {n: getattr(S, n) for n in ("_ssd_fwd_kernel", "_ssd_bwd_kernel", "_INTERPRETED", "_CPU_TRITON")}
for n in ("_ssd_fwd_kernel", "_ssd_bwd_kernel"):
    setattr(S, n, K._Recorder(saved[n], launches))
S._INTERPRETED = S._CPU_TRITON = True
rows = []
try:
    # the 8B preset's per-rank scan at tp=8: 16 heads of p=64, state n=128, 8 groups -> 1 a rank; bf16 and fp32
    for dtype in (torch.bfloat16, torch.float32):
        b, l, h, p, g, n = 1, 128, 16, 64, 1, 128
        x = torch.zeros(b, l, h, p, dtype=dtype, requires_grad=True)
        dt = torch.zeros(b, l, h, dtype=dtype, requires_grad=True)
        A = torch.zeros(h, dtype=dtype, requires_grad=True)
        B = torch.zeros(b, l, g, n, dtype=dtype, requires_grad=True)
        C = torch.zeros(b, l, g, n, dtype=dtype, requires_grad=True)
        D = torch.zeros(h, dtype=dtype, requires_grad=True)
        launches.clear()
        try:
            y = S.ssd_scan(x, dt, A, B, C, D)
        except Exception:
            y = torch.zeros_like(x)
        try:
            S.ssd_scan_backward(torch.zeros_like(x), x, dt, A, B, C, D)
        except Exception:
            pass
        for fn, args, kwargs in list(launches):
            try:
                r = K.compile_launch(fn, args, kwargs, GPUTarget("cuda", 90, 32))
                r.pop("key")
                rows.append({"kernel": fn.__name__, "dtype": str(dtype), **r})
            except Exception as e:
                rows.append({"kernel": fn.__name__, "dtype": str(dtype), "error": f"{type(e).__name__}: {e}"[:1500]})
finally:
    for n, v in saved.items():
        setattr(S, n, v)
print(json.dumps(rows))
"""


@pytest.mark.timeout(600)
@pytest.mark.skipif(not (Path(S.triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists()
                    if S.triton is not None else True, reason="this triton wheel ships no NVIDIA tools")
def test_scan_kernels_compile_for_sm90_without_spills(tmp_path):
    """The forward and backward kernels at the 8B preset's per-rank shape (p 64, state 128: a 64 x 128 fp32
    state a program), compiled by Triton and ptxas for sm_90 as bench/kernels_sm90.py compiles the others:
    no error, no register spill (local / stack bytes), registers within one SM."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", _SM90], capture_output=True, text=True, timeout=580, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(rows, indent=1))
    assert {r["kernel"] for r in rows} == {"_ssd_fwd_kernel", "_ssd_bwd_kernel"}
    for r in rows:
        assert "error" not in r, r
        assert r["local"] == r["stack"] == 0 and 0 < r["reg"] <= 255, r
        assert r["reg"] * 32 * r["num_warps"] <= 65536, r


@pytest.mark.timeout(300)
def test_the_tiny_hybrid_model_with_the_kernels_equals_its_reference_path():
    """The model's own calls (x, B, C are non-contiguous views of the conv's transposed output): loss and every
    gradient of mamba2-hybrid-tiny with the Triton kernels (interpreter) vs the reference path, fp32."""
    from mcompile.models import get_preset

    pre = get_preset("mamba2-hybrid-tiny")
    torch.manual_seed(0)
    model = pre.build().eval()
    inputs = pre.example_inputs(2, 16, seed=1)
    loss = model(*inputs)
    loss.backward()
    ref = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    with kernels_on("cpu", 8):
        loss_k = model(*inputs)
        loss_k.backward()
    torch.testing.assert_close(loss_k, loss, rtol=1e-6, atol=0)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[k], rtol=1e-5, atol=1e-5 * float(ref[k].abs().max()), msg=k)
