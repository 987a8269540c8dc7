"""Triton pointwise kernels — SwiGLU, GELU(x + bias), RoPE, softmax cross-entropy — against PyTorch.

What is isolated: each op's Triton forward and backward kernel (run on CPU tensors by Triton's
interpreter, so correctness only, DESIGN §8) against an independent fp32 computation by torch
autograd (F.silu, F.gelu, x·cos + rotate_half(x)·sin, F.cross_entropy), for random shapes with
non-power-of-two last dims and row tails, in fp32 and bf16. The vocabulary-sharded cross-entropy
statistics are combined by hand, as the tp all-reduces would, and compared with F.cross_entropy on
the unsharded logits. Tracing (torch.export, AOTAutograd's joint graph) and torch.library.opcheck
check that the ops stay opaque single nodes with consistent fake implementations.

Tolerances, per output dtype:

* fp32 — kernel and torch compute the same formula in fp32 in a different order, with different
  transcendental implementations (tanh-GELU through σ; torch's own fp32 tanh-GELU gradient is
  1.4e-6 off fp64 at |u| ≈ 10, measured): rtol 1e-5, atol 1e-5.
* bf16 — both compute in fp32 and round once to bf16; fp32 values a few ulps apart round to the
  same bf16 value or to neighbours, one bf16 ulp ≤ 2^-7 relative: rtol 2^-7; atol 1e-5 for values
  near 0, where the fp32 difference itself (~1e-7) shows.
* sums over rows (dbias) — fp32 accumulation in another order over ≤ 64 rows of |dx| ≲ 10:
  ≤ 64·10·6e-8 ≈ 4e-5 absolute, so atol 1e-4 on top of the element tolerance.

On a GPU machine, ``TRITON_INTERPRET=0 pytest tests/test_kernels_pointwise.py`` runs the same tests
with the compiled kernels on CUDA tensors.
"""

import contextlib
import os
from unittest import mock

# before anything imports triton, which reads it once: the kernels run on CPU tensors in its interpreter
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mcompile.kernels import activations, cross_entropy, rope  # noqa: E402
from mcompile.kernels.activations import gelu_bias, swiglu  # noqa: E402
from mcompile.kernels.cross_entropy import cross_entropy_loss, loss_from_statistics  # noqa: E402
from mcompile.kernels.rope import rotate_half  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"].lower() not in ("0", "false", "off")
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = [
    pytest.mark.skipif(activations.triton is None, reason="triton is not installed (Linux-only dependency)"),
    pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                       reason="TRITON_INTERPRET=0 compiles the kernels for a GPU, and there is none"),
    # the interpreter's numpy exp overflows to inf (and warns) in σ(-large) = 1 / (1 + inf) = 0: correct
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-7, atol=1e-5)}
SUM_ATOL = 1e-4  # row sums (dbias): see the module docstring
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
LAST_DIMS = st.one_of(st.sampled_from([6, 10, 100]), st.integers(1, 130))  # non-powers of two included
SETTINGS = settings(max_examples=15, deadline=None)  # the interpreter is slow; first calls build kernels
# Production tiles cover our small test rows in one block. Tiny tiles make the same shapes take several
# programs per row and several steps of the cross-entropy loop (its online max/sum rescaling).
TINY_TILES = st.booleans()


def tiles(module, tiny: bool):
    sizes = {
        activations: dict(_BLOCK=16, _TILE=16, _MAX_BLOCK_D=8, _MAX_GROUPS=2),  # dbias groups loop over row blocks
        cross_entropy: dict(_TILE=16),
    }[module]
    return mock.patch.multiple(module, **sizes) if tiny else contextlib.nullcontext()


def close(actual, expected, dtype, atol=None):
    tol = dict(TOL[dtype])
    if atol is not None:
        tol["atol"] = atol
    assert actual.dtype == dtype
    torch.testing.assert_close(actual, expected.to(dtype), **tol)


def randn(shape, seed, dtype, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(DEVICE, dtype)


def leaf(t):
    return t.detach().clone().requires_grad_()


@pytest.fixture(autouse=True, scope="module")
def kernels_take_the_triton_path():
    """Guard: a silent fallback to the references would make every test here compare them with
    themselves. Triton fixes interpreter or compiler for its own library functions (tl.sum, tl.sigmoid)
    when it is first imported — and torch.utils.flop_counter imports it — so TRITON_INTERPRET=1 has to
    be set before the first test module that imports torch's flop counter or mcompile.ir.annotate."""
    import triton.language as tl

    for mod in (activations, rope, cross_entropy):
        assert mod.uses_triton(DEVICE), f"{mod.__name__} would run its reference on {DEVICE}"
    if INTERPRET and type(tl.sum).__name__ != "InterpretedFunction":
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set, so its own tl.sum/tl.sigmoid are "
                    "compiled-only: set TRITON_INTERPRET=1 in the environment (or at the top of tests/conftest.py)")


# ---- SwiGLU ---------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@SETTINGS
@given(rows=st.integers(1, 5), d=LAST_DIMS, dtype=DTYPES, tiny=TINY_TILES, seed=st.integers(0, 2**16))
def test_swiglu(rows, d, dtype, tiny, seed):
    a, b, g = (randn((rows, 3, d), seed + i, dtype, 2.0) for i in range(3))
    a1, b1 = leaf(a), leaf(b)
    with tiles(activations, tiny):
        y = swiglu(a1, b1)
        y.backward(g)
    a2, b2 = leaf(a.float()), leaf(b.float())
    y2 = F.silu(a2) * b2
    y2.backward(g.float())
    close(y, y2, dtype)
    close(a1.grad, a2.grad, dtype)
    close(b1.grad, b2.grad, dtype)


# ---- GELU(x + bias) -------------------------------------------------------------------------
@pytest.mark.timeout(300)
@SETTINGS
@given(rows=st.integers(1, 64), d=LAST_DIMS, approximate=st.sampled_from(["none", "tanh"]), dtype=DTYPES,
       tiny=TINY_TILES, seed=st.integers(0, 2**16))
def test_gelu_bias(rows, d, approximate, dtype, tiny, seed):
    x, g = randn((rows, d), seed, dtype, 3.0), randn((rows, d), seed + 1, dtype)
    bias = randn((d,), seed + 2, dtype)
    x1, bias1 = leaf(x), leaf(bias)
    with tiles(activations, tiny):
        y = gelu_bias(x1, bias1, approximate)
        y.backward(g)
    x2, bias2 = leaf(x.float()), leaf(bias.float())
    y2 = F.gelu(x2 + bias2, approximate=approximate)
    y2.backward(g.float())
    close(y, y2, dtype)
    close(x1.grad, x2.grad, dtype)
    close(bias1.grad, bias2.grad, dtype, atol=SUM_ATOL)


# ---- RoPE -----------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@SETTINGS
@given(b=st.integers(1, 2), heads=st.integers(1, 3), s=st.integers(1, 6),
       d=st.one_of(st.sampled_from([8, 18, 64]), st.integers(1, 35).map(lambda h: 2 * h)),
       per_batch=st.booleans(), transposed=st.booleans(), dtype=DTYPES, seed=st.integers(0, 2**16))
def test_rope(b, heads, s, d, per_batch, transposed, dtype, seed):
    if transposed:  # HF Llama's layout: a (b, s, heads, d) projection viewed as (b, heads, s, d)
        x = randn((b, s, heads, d), seed, dtype).transpose(1, 2)
    else:
        x = randn((b, heads, s, d), seed, dtype)
    cb = b if per_batch else 1
    cos, sin = randn((cb, 1, s, d), seed + 1, dtype), randn((cb, 1, s, d), seed + 2, dtype)
    g = randn((b, heads, s, d), seed + 3, dtype)
    x1 = leaf(x)
    y = rope.rope(x1, cos, sin)
    y.backward(g)
    x2 = leaf(x.float())
    y2 = x2 * cos.float() + rotate_half(x2) * sin.float()
    y2.backward(g.float())
    close(y, y2, dtype)
    close(x1.grad, x2.grad, dtype)


# ---- cross-entropy --------------------------------------------------------------------------
def _logits_and_target(n, vocab, ignore_index, dtype, seed):
    logits = randn((n, vocab), seed, dtype, 4.0)  # peaky softmax: large and tiny probabilities
    gen = torch.Generator().manual_seed(seed + 1)
    target = torch.randint(0, vocab, (n,), generator=gen)
    target[torch.rand(n, generator=gen) < 0.25] = ignore_index
    return logits, target.to(DEVICE)


@pytest.mark.timeout(300)
@SETTINGS
@given(n=st.integers(1, 20), vocab=st.sampled_from([7, 100, 257]), ignore_index=st.sampled_from([-100, 0]),
       dtype=DTYPES, tiny=TINY_TILES, seed=st.integers(0, 2**16))
def test_cross_entropy_loss(n, vocab, ignore_index, dtype, tiny, seed):
    """Per-row losses and softmax - onehot gradients equal F.cross_entropy's in fp32, ignored rows
    (ignore_index -100, or a real class 0) giving 0 and no gradient."""
    logits, target = _logits_and_target(n, vocab, ignore_index, dtype, seed)
    g = randn((n,), seed + 2, torch.float32)
    x1 = leaf(logits)
    with tiles(cross_entropy, tiny):
        loss = cross_entropy_loss(x1, target, ignore_index)
        loss.backward(g)
    x2 = leaf(logits.float())
    loss2 = F.cross_entropy(x2, target, ignore_index=ignore_index, reduction="none")
    loss2.backward(g)
    close(loss, loss2, torch.float32)  # the loss is fp32 whatever the logits' dtype
    close(x1.grad, x2.grad, dtype)
    assert torch.all(loss[target == ignore_index] == 0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tiny", [False, True], ids=["tile", "tiny-tile"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "vocab,shards",
    [(257, 2),  # 2 shards of 129: one padding column on the last
     (101, 2),  # 2 shards of 51: with tiny tiles the padding column sits inside the last column block
     (7, 3),  # 3 shards of 3: two padding columns
     (5, 4)],  # 4 shards of 2: the last shard is padding only (max -inf, sum 0)
)
def test_sharded_statistics(vocab, shards, dtype, tiny):
    """The per-shard statistics combined as the tp all-reduces combine them (max, then sums) give
    F.cross_entropy's mean loss and gradient over the full vocabulary; padding gets no gradient."""
    n, ignore_index = 9, -100
    logits, target = _logits_and_target(n, vocab, ignore_index, dtype, seed=vocab)
    v_local = -(-vocab // shards)
    padding = randn((n, shards * v_local - vocab), 99, dtype, 100.0)  # garbage that must be masked
    padded = torch.cat([logits, padding], dim=1)
    parts = [leaf(padded[:, r * v_local:(r + 1) * v_local]) for r in range(shards)]
    with tiles(cross_entropy, tiny):
        stats = [cross_entropy.cross_entropy(p, target, ignore_index, r * v_local, vocab)
                 for r, p in enumerate(parts)]
    for r, (p, st_r) in enumerate(zip(parts, stats)):  # kernel statistics == reference statistics
        ref = cross_entropy.cross_entropy_reference(p.detach(), target, ignore_index, r * v_local, vocab)
        for got, want in zip(st_r, ref):
            torch.testing.assert_close(got, want, **TOL[torch.float32])
    # what the three all-reduces compute; the max all-reduce takes a detached input (DESIGN §11)
    global_max = torch.stack([m.detach() for m, _, _ in stats]).amax(0)
    sum_exp = sum(s * torch.exp(m - global_max) for m, s, _ in stats)
    target_logit = sum(t for _, _, t in stats)
    rows = loss_from_statistics(global_max, sum_exp, target_logit, target, ignore_index)
    loss = rows.sum() / (target != ignore_index).sum()
    with tiles(cross_entropy, tiny):
        loss.backward()

    x2 = leaf(logits.float())
    loss2 = F.cross_entropy(x2, target, ignore_index=ignore_index)
    loss2.backward()
    close(loss, loss2, torch.float32)
    grad = torch.cat([p.grad for p in parts], dim=1)
    close(grad[:, :vocab], x2.grad, dtype)
    assert torch.all(grad[:, vocab:] == 0)


# ---- the plain-CPU path: references behind the same ops ---------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.skipif(not INTERPRET, reason="compares the interpreted kernels with the plain-CPU path")
def test_reference_dispatch_matches_kernels(monkeypatch):
    """Without Triton's interpreter the ops run their references on CPU; both paths agree."""
    a, b, bias = randn((4, 10), 0, torch.float32), randn((4, 10), 1, torch.float32), randn((10,), 2, torch.float32)
    x4 = randn((2, 3, 5, 18), 3, torch.float32)
    cos, sin = randn((1, 1, 5, 18), 4, torch.float32), randn((1, 1, 5, 18), 5, torch.float32)
    logits, target = _logits_and_target(6, 100, -100, torch.float32, seed=1)

    def run():
        leaves = [leaf(t) for t in (a, b, x4, logits)]
        la, lb, lx, ll = leaves
        out = (swiglu(la, lb), gelu_bias(la, bias, "tanh"), rope.rope(lx, cos, sin), cross_entropy_loss(ll, target))
        sum(o.sum() for o in out).backward()
        return [o.detach() for o in out] + [t.grad for t in leaves]

    kernels = run()
    for mod in (activations, rope, cross_entropy):
        monkeypatch.setattr(mod, "_INTERPRETED", False)
        assert not mod.uses_triton("cpu")
    for got, want in zip(run(), kernels):
        torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.timeout(300)
def test_bad_inputs_name_the_fix():
    with pytest.raises(ValueError, match="one shape"):
        swiglu(torch.randn(2, 4), torch.randn(2, 5))
    with pytest.raises(ValueError, match="approximate"):
        gelu_bias(torch.randn(2, 4), torch.randn(4), "sigmoid")
    with pytest.raises(ValueError, match="d even"):
        rope.rope(torch.randn(1, 2, 3, 5), torch.randn(1, 1, 3, 5), torch.randn(1, 1, 3, 5))
    with pytest.raises(ValueError, match="does not broadcast"):
        rope.rope(torch.randn(1, 2, 3, 4), torch.randn(1, 1, 4, 4), torch.randn(1, 1, 3, 4))
    with pytest.raises(ValueError, match="flatten"):
        cross_entropy.cross_entropy(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), -100, 0, 5)


# ---- tracing --------------------------------------------------------------------------------
class TinyBlock(torch.nn.Module):
    """An MLP with SwiGLU and GELU+bias, RoPE on heads in HF's transposed layout, and the loss."""

    def __init__(self, d=16, ff=24, heads=2, vocab=37):
        super().__init__()
        self.heads = heads
        self.up = torch.nn.Linear(d, 2 * ff, bias=False)
        self.bias = torch.nn.Parameter(torch.randn(ff))
        self.down = torch.nn.Linear(ff, d, bias=False)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, x, cos, sin, target):
        b, s, d = x.shape
        gate, up = self.up(x).chunk(2, dim=-1)
        h = self.down(gelu_bias(swiglu(gate, up), self.bias, "tanh"))
        q = rope.rope(h.view(b, s, self.heads, d // self.heads).transpose(1, 2), cos, sin)  # (b, heads, s, d/heads)
        logits = self.head(q.transpose(1, 2).reshape(b, s, d))
        return cross_entropy_loss(logits, target).sum() / (target != -100).sum()


def _block_inputs():
    target = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(0))
    target[0, :2] = -100
    f32 = torch.float32
    return randn((2, 5, 16), 1, f32), randn((1, 1, 5, 8), 2, f32), randn((1, 1, 5, 8), 3, f32), target.to(DEVICE)


@pytest.mark.timeout(300)
def test_export_and_joint_graph():
    """torch.export keeps each op one node and the exported module trains like eager; AOTAutograd's
    joint graph holds each backward as one node too (DESIGN §5)."""
    from torch._functorch.aot_autograd import aot_export_module

    torch.manual_seed(0)
    model, inputs = TinyBlock().to(DEVICE), _block_inputs()
    ep = torch.export.export(model, inputs, strict=False)
    fwd_ops = {"swiglu", "gelu_bias", "rope", "cross_entropy"}
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert sorted(t for t in targets if t.startswith("mcompile.")) == sorted(f"mcompile.{o}.default" for o in fwd_ops)

    loss = model(*inputs)
    loss.backward()
    exported = ep.module()
    loss2 = exported(*inputs)
    loss2.backward()
    torch.testing.assert_close(loss2, loss, rtol=0, atol=0)  # same kernels, same order: bit-identical
    grads = dict(exported.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=0, atol=0)

    class Tupled(torch.nn.Module):  # aot_export_module wants tuple outputs
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, *args):
            return (self.m(*args),)

    joint, _ = aot_export_module(Tupled(TinyBlock().to(DEVICE)), inputs, trace_joint=True, output_loss_index=0)
    ops = [str(n.target) for n in joint.graph.nodes if str(n.target).startswith("mcompile.")]
    assert sorted(ops) == sorted([f"mcompile.{o}.default" for o in fwd_ops]
                                 + [f"mcompile.{o}_backward.default" for o in fwd_ops])


def _opcheck_cases():
    f32 = torch.float32
    a, b = leaf(randn((3, 10), 0, f32)), leaf(randn((3, 10), 1, f32))
    x, bias = leaf(randn((3, 6), 2, f32)), leaf(randn((6,), 3, f32))
    q = randn((1, 3, 2, 2, 6), 4, f32).select(2, 0).transpose(1, 2).requires_grad_()  # (1, 2, 3, 6), strided
    cos, sin = randn((1, 1, 3, 6), 5, f32), randn((1, 1, 3, 6), 6, f32)
    logits = leaf(randn((4, 5), 7, f32))
    target = torch.tensor([0, 4, -100, 3], device=DEVICE)
    ones = torch.ones(4, device=DEVICE)
    m = torch.ops.mcompile
    return [
        (m.swiglu.default, (a, b)),
        (m.swiglu_backward.default, (a.detach(), a.detach(), b.detach())),
        (m.gelu_bias.default, (x, bias, "none")),
        (m.gelu_bias.default, (x, bias, "tanh")),
        (m.gelu_bias_backward.default, (x.detach(), x.detach(), bias.detach(), "tanh")),
        (m.rope.default, (q, cos, sin)),
        (m.rope_backward.default, (q.detach(), cos, sin)),
        (m.cross_entropy.default, (logits, target, -100, 0, 5)),
        (m.cross_entropy.default, (logits, target, -100, 3, 7)),  # a shard with padding columns
        (m.cross_entropy_backward.default,
         (logits.detach(), target, 0 * ones, ones, -ones, -100, 0, 5)),
    ]


@pytest.mark.timeout(300)
def test_opcheck():
    """Schema, fake-tensor and autograd-registration consistency, and AOT dispatch (static, dynamic)."""
    for op, args in _opcheck_cases():
        torch.library.opcheck(op, args)
