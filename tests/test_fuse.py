"""The fusion pass on per-rank programs: every RMSNorm and SwiGLU of the Llama models is fused, at
tp=1 and tp=2, with SP on and off, and the fused programs give the unfused loss and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from mcompile.passes.fuse import fuse
from mcompile.runtime.sim import ThreadedWorld, run_threads

from conftest import compiled


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


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", ["llama3-tiny", "hf-llama"])
def test_fuse_every_rms_norm_and_swiglu(name, tp, sp, monkeypatch):
    # The ranks run in threads and Triton's interpreter is not thread-safe (it patches
    # triton.language while a kernel runs): the fused ops take their PyTorch reference path here.
    # The kernels themselves are checked against those references in tests/test_kernels_*.py.
    from mcompile.kernels import activations, norms

    monkeypatch.setattr(norms, "_INTERPRETED", False)
    monkeypatch.setattr(activations, "_INTERPRETED", False)
    model, inputs, c, _ = compiled(name, f"tp={tp}", sp and tp > 1)
    origins = {n.name: n for n in c.captured.gm.graph.nodes}
    layers = 2
    fused = []
    for r in range(c.mesh.size()):
        prog = copy.deepcopy(c.program(r))
        counts = fuse(prog, origins, set(c.captured.params))
        assert counts == {"rms_norm": 2 * layers + 1, "swiglu": layers}, counts
        assert not any(n.target is torch.ops.aten.rsqrt.default for n in prog.graph.nodes)
        fused.append(prog)
    ref = _run(c, inputs, [c.program(r) for r in range(c.mesh.size())])
    got = _run(c, inputs, fused)
    for (l0, g0), (l1, g1) in zip(ref, got):
        # fp32, same math in another order (the weight multiplies the fp32 normalised value): 1e-6
        assert torch.allclose(l1, l0, rtol=1e-6)
        for k in g0:
            assert torch.allclose(g1[k], g0[k], rtol=1e-5, atol=1e-7), k
