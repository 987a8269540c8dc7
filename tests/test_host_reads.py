"""Host reads of device values (issue 38 item 6): on a GPU each one stalls the host until the stream drains.

mcompile.ir.host_reads counts them on the CPU, op by op. The MoE dispatch makes none dropless without expert
parallelism, and exactly one per layer per microbatch (its forward; none in backward) over an ep axis of
two or more ranks: all_to_all_single takes host split sizes, read in one transfer. The oracles: the
layers' own eager experts (the Mixtral preset's GroupedExperts, Hugging Face's MixtralExperts).
"""

from __future__ import annotations

import moe_cases
import pytest
import torch

from mcompile.ir.host_reads import count_host_reads
from mcompile.ir.moe import ExpertForm, moe_ep_call, moe_local

pytestmark = pytest.mark.skipif(not hasattr(torch.overrides, "redispatch_function"),
                                reason="count_host_reads needs torch >= 2.12 (torch.overrides.redispatch_function)")


@torch.library.custom_op("host_reads_test::body_reads", mutates_args=())
def _body_reads(x: torch.Tensor) -> torch.Tensor:
    y, vjp = torch.func.vjp(lambda t: t.sin() * 2, x)  # torch.func inside a custom op's body (moe_ep's)
    n = int((x > 0).sum())  # one read
    return y + vjp(torch.ones_like(y))[0] * n


_body_reads.register_fake(lambda x: torch.empty_like(x))


def test_the_counter_sees_each_kind_of_host_read():
    x = torch.randn(8, requires_grad=True)
    cases = [
        ("item", lambda: x.sum().item(), 1), ("int", lambda: int(x.argmax()), 1), ("bool", lambda: bool(x[0] > 0), 1),
        ("tolist", lambda: x.tolist(), 1), ("nonzero", lambda: (x > 0).nonzero(), 1),
        ("mask index + its backward", lambda: x[x > 0].sum().backward(), 2),
        ("repeat_interleave", lambda: torch.arange(3).repeat_interleave(torch.tensor([1, 2, 3])), 1),
        ("repeat_interleave sized",
         lambda: torch.arange(3).repeat_interleave(torch.tensor([1, 2, 3]), output_size=6), 0),
        ("bincount", lambda: torch.bincount(torch.tensor([1, 2, 2])), 1),
        ("long index + its backward", lambda: x[x.argsort()].sum().backward(), 0),
        ("custom op body", lambda: _body_reads(x.detach()), 1),
    ]
    for name, fn, want in cases:
        with count_host_reads() as reads:
            fn()
        assert reads.total == want, (name, reads.sites())


def _layer(kind: str):
    """The first MoE layer of the tiny model ``kind``: (its eager experts module, its expert weights, its form,
    tokens x (T, d) and the layer's own router's choice idx (T, k) and weights (T, k))."""
    model, _ = moe_cases.moe_model(kind, batch=2, seq=8)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    if kind == "mixtral":
        moe = model.layers[0].feed_forward
        experts, ws, form = moe.experts, [moe.experts.w1, moe.experts.w3, moe.experts.w2], "silu/sep/oi"
        probs = moe.router(x).float().softmax(-1)
        top_p, idx = probs.topk(2, dim=-1)
        weights = top_p / top_p.sum(-1, keepdim=True)
    else:
        block = model.model.layers[0].mlp
        experts, ws, form = block.experts, [block.experts.gate_up_proj, block.experts.down_proj], "silu/fused_gu/oi"
        _, weights, idx = block.gate(x)
    return experts, ws, ExpertForm.parse(form), x, idx.detach(), weights.detach()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["mixtral", "hf-mixtral"])
def test_moe_dispatch_without_ep_reads_nothing_from_the_host(kind):
    """Dropless, every expert local (the ``moe_ffn`` node's lowering off ep: moe_local, and moe_ep on an ep
    axis of one rank): forward and backward make no host read, and compute the layer's own experts."""
    from mcompile.ir.mesh import Mesh
    from mcompile.runtime.sim import ThreadedWorld, run_threads

    experts, ws, form, x, idx, weights = _layer(kind)
    ref = experts(x, idx, weights)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, [*ws], g)
    with count_host_reads() as reads:
        out = moe_local(x, idx, weights, list(ws), form)
        grads = torch.autograd.grad(out, [*ws], g)
    assert reads.total == 0, reads.sites()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    def rank_fn(r):
        with count_host_reads() as reads:
            y = moe_ep_call(x, idx, weights, *ws, form=form.text(), n_experts=ws[0].shape[0], axis="ep", n=1)
            torch.autograd.grad(y, [*ws], g)
        return y.detach(), reads.total, reads.sites()

    y, total, sites = run_threads(ThreadedWorld(Mesh(ep=1)), rank_fn)[0]
    assert total == 0, sites
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["mixtral", "hf-mixtral"])
def test_moe_dispatch_over_ep_reads_the_host_once_per_layer(kind):
    """ep=2 (ranks as threads), both dispatchers, dropless and under a capacity: each rank's forward reads
    the host exactly once (the split sizes, with the dropped count, in one transfer), its backward never;
    dropless, the outputs are the layer's own experts on each rank's tokens."""
    from mcompile.ir.mesh import Mesh
    from mcompile.runtime.sim import ThreadedWorld, run_threads

    experts, ws, form, x, idx, weights = _layer(kind)
    E, n = ws[0].shape[0], 2
    ref = experts(x, idx, weights).detach()
    for dispatcher in ("alltoall", "allgather"):
        for capacity in (0.0, 0.75):
            def rank_fn(r, dispatcher=dispatcher, capacity=capacity):
                rows = slice(r * 8, (r + 1) * 8)
                lws = [w[r * E // n:(r + 1) * E // n].detach().requires_grad_(True) for w in ws]
                xr = x[rows].clone().requires_grad_(True)
                with count_host_reads() as fwd:
                    y = moe_ep_call(xr, idx[rows], weights[rows], *lws, form=form.text(), n_experts=E, axis="ep",
                                    n=n, dispatcher=dispatcher, capacity=capacity)
                with count_host_reads() as bwd:
                    y.sum().backward()
                return y.detach(), (fwd.total, fwd.sites()), (bwd.total, bwd.sites())

            res = run_threads(ThreadedWorld(Mesh(ep=n)), rank_fn)
            for r, (y, fwd, bwd) in enumerate(res):
                assert fwd[0] == 1 and bwd[0] == 0, (dispatcher, capacity, r, fwd, bwd)
                if capacity == 0:
                    torch.testing.assert_close(y, ref[r * 8:(r + 1) * 8], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["mixtral", "hf-mixtral"])
def test_a_compiled_moe_model_reads_the_host_once_per_moe_layer_over_ep(kind):
    """The whole compiled program, forward and backward, per rank (threads): no host read at ep=1, one per MoE
    layer (2) at ep=2 — nothing else in the program reads the host either."""
    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh
    from mcompile.runtime.sim import ThreadedWorld, run_threads

    for mesh, want in (("ep=1", 0), ("ep=2", 2)):
        model, inputs = moe_cases.moe_model(kind)
        c = compile_plan(model, Mesh.parse(mesh), inputs)
        state, n = c.captured.state_values(), c.mesh.size("ep")

        def rank_fn(r, c=c, state=state, n=n, inputs=inputs):
            local = {k: v.detach().clone().requires_grad_(k in c.captured.params)
                     for k, v in c.local_state(r, state).items()}
            mine = tuple(t.chunk(n)[r] for t in inputs)
            c.program(r)  # lowered outside the count
            with count_host_reads() as reads:
                c.run_local(r, local, mine)[0].backward()
            return reads.total, reads.sites()

        for total, sites in run_threads(ThreadedWorld(c.mesh), rank_fn):
            assert total == want, (mesh, sites)
