"""The fusion pass on per-rank programs (mcompile.passes.fuse).

What is isolated: the pass alone, on the programs the lowering makes for our presets and for
unmodified Hugging Face models, at tp=1 and tp=2 with SP off and on. Every RMSNorm (residual add
included where one feeds it), SwiGLU, RoPE and LayerNorm is fused — counted exactly, and no aten
op of the patterns is left — and the fused programs give the unfused programs' loss and gradients.
The fused ops stay traceable: make_fx of a fused program's forward and backward records each as one
node forward and its backward op as one node. The kernels themselves are checked against their
references in tests/test_kernels_*.py; one test here runs them (Triton's interpreter) inside a
fused program.

Tolerances (fp32 programs): the fused ops compute the patterns' math in fp32 in another order
(the norm weight multiplies the fp32 normalised value; the backward formulas of the kernels'
docstrings instead of autograd's chain; LayerNorm's two-pass variance instead of aten's), a few
ulps per element: loss rtol 1e-6, gradients rtol 1e-5 with atol 1e-7 for gradients near 0.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch

from mcompile.passes.fuse import FUSED, PATTERNS, fuse
from mcompile.runtime.sim import ThreadedWorld, run_threads

from conftest import compiled

aten = torch.ops.aten
LAYERS = 2  # every tiny model of conftest.build has 2 layers
LLAMA = {"rms_norm": 1, "add_rms_norm": 2 * LAYERS, "swiglu": LAYERS, "rope": 2 * LAYERS}
GPT2 = {"layer_norm": 2 * LAYERS + 1}
# per model, what one rank's program fuses: 2 norms per layer and the final one — the first layer's
# input norm reads the embedding (rms_norm), the other 2L norms read a residual sum (add_rms_norm);
# one SwiGLU per layer; one RoPE op per rotated tensor, q and k of each layer
EXPECTED = {"llama3-tiny": LLAMA, "hf-llama": LLAMA, "gpt2-tiny": GPT2, "hf-gpt2": GPT2}
# aten ops that only the fused patterns use in these models: none may be left
LEFT_OVER = {aten.rsqrt.default, aten.silu.default, aten.neg.default, aten.layer_norm.default}
LAYOUTS = [("tp=1", False), ("tp=2", False), ("tp=2", True)]


def _reference_kernels(monkeypatch):
    # The ranks run in threads and Triton's interpreter is not thread-safe (it patches
    # triton.language while a kernel runs): the fused ops take their PyTorch reference path here.
    from mcompile.kernels import activations, norms, rope

    for module in (norms, activations, rope):
        monkeypatch.setattr(module, "_INTERPRETED", False)


def _fused_programs(c):
    origins = {n.name: n for n in c.captured.gm.graph.nodes}
    out = []
    for r in range(c.mesh.size()):
        prog = copy.deepcopy(c.program(r))
        out.append((prog, fuse(prog, origins, set(c.captured.params))))
    return out


def _run(c, inputs, programs):
    state = c.captured.state_values()

    def fn(r):
        local = {k: v.detach().clone().requires_grad_(k in c.captured.params)
                 for k, v in c.local_state(r, state).items()}
        prog = programs[r]
        names = [n.name for n in prog.graph.nodes if n.op == "placeholder"]
        user = dict(zip(c.captured.user_inputs, inputs))
        (loss,) = prog(*[local[n] if n in local else user[n] for n in names])
        loss.backward()
        return loss.detach(), {k: v.grad for k, v in local.items() if v.grad is not None}

    return run_threads(ThreadedWorld(c.mesh), fn)


def _assert_same(ref, got):
    for (l0, g0), (l1, g1) in zip(ref, got):
        assert torch.allclose(l1, l0, rtol=1e-6), (l1, l0)
        assert sorted(g1) == sorted(g0)
        for k in g0:
            assert torch.allclose(g1[k], g0[k], rtol=1e-5, atol=1e-7), k


@pytest.mark.parametrize("mesh,sp", LAYOUTS, ids=["tp1", "tp2", "tp2+sp"])
@pytest.mark.parametrize("name", list(EXPECTED))
def test_fuse_every_occurrence_and_keep_loss_and_gradients(name, mesh, sp, monkeypatch):
    _reference_kernels(monkeypatch)
    model, inputs, c, _ = compiled(name, mesh, sp)
    expected = dict.fromkeys(PATTERNS, 0) | EXPECTED[name]
    fused = _fused_programs(c)
    for prog, counts in fused:
        assert counts == expected, counts
        left = [n.name for n in prog.graph.nodes if n.op == "call_function" and n.target in LEFT_OVER]
        assert not left, left
        ops = [n for n in prog.graph.nodes if n.meta.get(FUSED) and n.target is not operator.getitem]
        assert sorted(n.meta[FUSED] for n in ops) == sorted(k for k, v in expected.items() for _ in range(v))
        assert all(n.meta.get("mc_origin") for n in ops)
    ref = _run(c, inputs, [c.program(r) for r in range(c.mesh.size())])
    _assert_same(ref, _run(c, inputs, [p for p, _ in fused]))


def test_the_residual_sum_is_still_produced_for_its_other_users():
    """add_rms_norm replaces the residual add for every user: the next residual add reads its h."""
    _, _, c, _ = compiled("llama3-tiny", "tp=2", True)
    (prog, _), _ = _fused_programs(c)
    for n in prog.graph.nodes:
        if n.target is torch.ops.mcompile.add_rms_norm.default:
            h = [u for u in n.users if u.args[1] == 0]
            if h:  # the final norm's sum has no other user: its h is dead and dropped
                assert h[0].users, n.name
    # the sums of layer 0 and the first sum of layer 1 feed the next add_rms_norm, the last one nothing
    hs = [u for n in prog.graph.nodes if n.target is torch.ops.mcompile.add_rms_norm.default
          for u in n.users if u.args[1] == 0]
    assert len(hs) == 2 * LAYERS - 1


@pytest.mark.parametrize("name", ["llama3-tiny", "hf-gpt2"])
def test_fused_program_traces_with_one_node_per_op_and_backward(name):
    """make_fx (fake tensors) of the fused tp=1 program's forward and backward: every fused op and its
    registered backward op appear as single nodes (fake implementations and autograd work)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    _, inputs, c, _ = compiled(name, "tp=1", False)
    ((prog, counts),) = _fused_programs(c)
    state = c.local_state(0, c.captured.state_values())
    names = [n.name for n in prog.graph.nodes if n.op == "placeholder"]
    user = dict(zip(c.captured.user_inputs, inputs))
    args = [state[n].detach().clone().requires_grad_(n in c.captured.params) if n in state else user[n]
            for n in names]
    grad_at = [i for i, n in enumerate(names) if n in c.captured.params]

    def joint(*a):
        (loss,) = prog(*a)
        return loss, torch.autograd.grad(loss, [a[i] for i in grad_at])

    gm = make_fx(joint, tracing_mode="fake")(*args)
    seen = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and str(n.target).startswith("mcompile."):
            op = str(n.target).split(".")[1]
            seen[op] = seen.get(op, 0) + 1
    for op, k in counts.items():
        assert seen.get(op, 0) == k and seen.get(f"{op}_backward", 0) == k, (op, seen)


def test_fused_program_runs_the_triton_kernels():
    """At tp=1 the one rank runs alone (one thread: the interpreter is safe), so the fused ops take
    their Triton kernels through the interpreter, and the fused program matches the unfused one
    (same tolerances: the kernels match their references to fp32 rounding)."""
    from mcompile.kernels import activations, norms, rope

    if not (norms.uses_triton("cpu") and activations.uses_triton("cpu") and rope.uses_triton("cpu")):
        pytest.skip("the Triton interpreter is off (TRITON_INTERPRET unset or triton missing)")
    _, inputs, c, _ = compiled("llama3-tiny", "tp=1", False)
    ((prog, _),) = _fused_programs(c)
    _assert_same(_run(c, inputs, [c.program(0)]), _run(c, inputs, [prog]))


def test_bf16_programs_fuse_the_same_patterns():
    """Captured in bf16 (the runtime's compute dtype, meta device) the casts are real: the patterns
    still match, with the same counts (each pattern returns its input's dtype, as the ops do)."""
    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh

    from conftest import build

    for name in ("llama3-tiny", "hf-llama"):
        model, inputs = build(name)
        c = compile_plan(model, Mesh.parse("tp=2"), inputs, sequence_parallel=True, meta_dtype=torch.bfloat16)
        for _, counts in _fused_programs(c):
            assert counts == dict.fromkeys(PATTERNS, 0) | EXPECTED[name], (name, counts)


def _rotate_half(x, form):
    if form == "slice":
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    elif form == "chunk":
        x1, x2 = x.chunk(2, dim=-1)
    else:
        x1, x2 = x.split(x.shape[-1] // 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Rotary(torch.nn.Module):
    def __init__(self, form, transposed, x_first, cos_from_param=False):
        super().__init__()
        self.form, self.transposed, self.x_first = form, transposed, x_first
        self.scale = torch.nn.Parameter(torch.ones(8)) if cos_from_param else None

    def forward(self, x, cos, sin):
        if self.transposed:  # (b, s, heads, d) -> (b, heads, s, d), as q and k are made
            x = x.transpose(1, 2)
        if self.scale is not None:
            cos = cos * self.scale
        if self.x_first:  # the add takes x's layout (transposed), as Llama and HF Llama write it
            return x * cos + _rotate_half(x, self.form) * sin
        return sin * _rotate_half(x, self.form) + cos * x  # the add's layout is contiguous


@pytest.mark.parametrize("x_first", [True, False], ids=["x*cos+", "sin*rot+"])
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("form", ["slice", "chunk", "split"])
def test_rope_forms_of_rotate_half(form, transposed, x_first):
    """Each way plain PyTorch splits the halves fuses; the fused output has the pattern's values and
    strides (views downstream were traced against them); cos from a parameter is left alone."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 8, generator=g).transpose(1, 2).contiguous() if transposed else \
        torch.randn(2, 3, 5, 8, generator=g)
    cos, sin = torch.randn(5, 8, generator=g), torch.randn(1, 1, 5, 8, generator=g)
    for from_param in (False, True):
        model = _Rotary(form, transposed, x_first, from_param)
        gm = torch.export.export(model, (x, cos, sin), strict=False).graph_module  # parameters lifted
        args = [*model.parameters(), x, cos, sin]
        (ref,) = gm(*args)
        params = {n.name for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("p_")}
        nodes = {n.name: n for n in gm.graph.nodes}  # the captured graph is its own origin
        counts = fuse(gm, nodes, params)
        assert counts["rope"] == (0 if from_param else 1), counts
        (got,) = gm(*args)
        assert got.stride() == ref.stride()
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)  # fp32, one rounding order apart
