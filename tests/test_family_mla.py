"""Multi-head latent attention (models/mla.py, DeepSeek-V2/V3 MLA on a dense SwiGLU FFN) under tensor parallelism.

Megatron Core's MLA layout (megatron/core/transformer/multi_latent_attention.py): the down-projections to
the query and KV latents (``wq_a``, ``wkv_a``) and the decoupled RoPE key (``wk_rope``, fused into
linear_kv_down_proj there) are not split over tp: they are small and every head reads them. The
up-projections (``wq_b``, ``wkv_b``) are column-parallel by heads, the output projection (``wo``)
row-parallel; the MLP is Megatron's (w1/w3 column, w2 row), the head vocabulary-parallel. Forward, that
is Megatron's minimum of 2 all-reduces per layer (after ``wo``, after ``w2``), as for any self-attention +
MLP layer without sequence parallelism. Backward adds one all-reduce per replicated input that a
column-parallel linear (or the heads-sharded attention) reads: the q latent, the kv latent, the rope key
(Megatron: the kv latent and the rope key are one tensor) and the MLP's input.

The planner finds this layout from the graph (planner.latent_hints: a down-projection whose whole output
is normalised, or broadcast to every head, before any other contraction stays whole; rules/views.py
expand: a replicated key broadcast over heads comes out sharded by heads at no cost). Pinning the latents
with ``overrides`` gives the same plan.
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import pytest
import torch
from runtime_cases import check_parity

from mcompile.ir.placements import Replicate, Shard

from conftest import build, tiered

REL = 1e-5  # fp32, another summation order over the tp pieces: ~1e-7 measured
# the Megatron placement of the latent down-projections and the rope key, pinned (the planner shards them)
LATENT = ("wq_a", "wkv_a", "wk_rope")
OVERRIDES = {f"layers.{i}.attention.{w}.weight": "tp=R" for i in range(2) for w in LATENT}

def _plan(tp: int = 2, overrides=None, name: str = "mla-tiny"):
    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh

    model, inputs = build(name, batch=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = compile_plan(model, Mesh.fake(tp=tp), inputs, overrides=overrides)
    assert not [w for w in caught if "sharding rule" in str(w.message)]
    assert c.plan.fallbacks == []
    return model, inputs, c


def _placement(c, fqn):
    return c.plan.params[fqn].placements[0]


def _assert_megatron_mla(c, n_layers=2):
    """The Megatron Core MLA layout and its 2 forward all-reduces per layer (no all-gather anywhere)."""
    for i in range(n_layers):
        a, f = f"layers.{i}.attention", f"layers.{i}.feed_forward"
        for w in LATENT:
            assert _placement(c, f"{a}.{w}.weight") == Replicate(), w
        for w in ("q_norm", "kv_norm"):
            assert _placement(c, f"{a}.{w}.weight") == Replicate(), w
        assert _placement(c, f"{a}.wq_b.weight") == Shard(0)
        assert _placement(c, f"{a}.wkv_b.weight") == Shard(0)
        assert _placement(c, f"{a}.wo.weight") == Shard(1)
        assert _placement(c, f"{f}.w1.weight") == Shard(0)
        assert _placement(c, f"{f}.w3.weight") == Shard(0)
        assert _placement(c, f"{f}.w2.weight") == Shard(1)
    assert _placement(c, "output.weight") == Shard(0)  # vocabulary-parallel head
    assert _placement(c, "tok_embeddings.weight") == Shard(0)
    for i in range(n_layers):
        fwd = [s for s in c.plan.collectives if s.layer == i and s.axis == "tp" and s.forward != "none"]
        assert [s.forward for s in fwd] == ["all_reduce", "all_reduce"], fwd


@pytest.mark.timeout(120)
def test_mla_tiny_computes_and_published_shapes_count():
    """The tiny model's loss is finite and its gradients reach every weight; the published shapes build on
    meta with the parameter counts of their configs (embeddings untied)."""
    from mcompile.models import get_preset

    model, inputs = build("mla-tiny", batch=2)
    loss = model(*inputs)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert inputs[1][0, :5].eq(-100).all()  # ignored targets: dp ranks count different numbers of tokens
    # DeepSeek-V2-Lite's form: queries projected directly (q_lora_rank=None)
    from mcompile.models.mla import MLATransformer

    lite = MLATransformer(dataclasses.replace(model.config, q_lora_rank=None))
    assert not hasattr(lite.layers[0].attention, "wq_a")
    lite(*inputs).backward()
    assert all(p.grad is not None for p in lite.parameters())

    def count(name):
        cfg = get_preset(name).config
        d, h, ql, kvl = cfg.dim, cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank
        qk, v = cfg.qk_head_dim, cfg.v_head_dim
        q = d * h * qk if ql is None else d * ql + ql + ql * h * qk
        attn = q + d * kvl + kvl + kvl * h * (cfg.qk_nope_head_dim + v) + d * cfg.qk_rope_head_dim + h * v * d
        layer = attn + 3 * d * cfg.ffn_hidden + 2 * d
        return cfg.n_layers * layer + 2 * cfg.vocab_size * d + d

    for name, billions in (("deepseek-v3-mla-dense", 37.45), ("deepseek-v2-lite-dense", 2.61)):
        meta = get_preset(name).build(device="meta")
        n = sum(p.numel() for p in meta.parameters())
        assert n == count(name)
        assert n / 1e9 == pytest.approx(billions, abs=0.01), n


@pytest.mark.timeout(300)
def test_planner_finds_megatron_mla_layout():
    """Megatron Core's MLA layout from the graph alone: latent down-projections and the rope key
    replicated, up-projections column-parallel (Shard(0)), wo row-parallel (Shard(1)), MLP column then
    row, head vocabulary-parallel; 2 forward all-reduces per layer (Megatron's minimum without SP)."""
    _, _, c = _plan(2)
    _assert_megatron_mla(c)


@pytest.mark.timeout(300)
def test_megatron_mla_layout_with_latents_pinned():
    """As above with only the down-projections pinned replicated: the heads-sharded attention must follow
    (2 forward all-reduces per layer, wo row-parallel)."""
    _, _, c = _plan(2, OVERRIDES)
    _assert_megatron_mla(c)


@pytest.mark.timeout(300)
def test_default_plan_parity_tp2_sim():
    """The planner's own plan computes the model: loss and every gradient at tp=2 through the in-process
    thread simulator (tests/sim_harness.py) against one device."""
    from sim_harness import combine_grads, run_sim

    model, inputs, c = _plan(2)
    model.zero_grad()
    ref_loss = model(*inputs)
    ref_loss.backward()
    results = run_sim(c, inputs, backward=True)
    for loss, _, _ in results:
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=REL, atol=0)
    full = combine_grads(c, [g for _, g, _ in results])
    for fqn, p in model.named_parameters():
        torch.testing.assert_close(full[fqn], p.grad, rtol=REL, atol=REL * float(p.grad.abs().max()))


PARITY = [("mla-tiny", "tp=2", "planned"), ("mla-tiny", "dp=2,tp=2", "planned")]
OPTIONS = {"planned": {}}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,mesh,options", tiered(PARITY, PARITY[:1]))
def test_mla_parity(name, mesh, options):
    """3 AdamW steps on gloo processes (tests/runtime_cases.py train): losses, clip norms and the unclipped
    gradients of the last step equal one device's at 1e-5 relative (fp32); the up-projections are sharded
    on every rank (local sizes), the latents whole."""
    results, errors = check_parity(name, mesh, OPTIONS[options], rel=REL)
    print(f"{mesh}: max gradient error {max(errors.values()):.2e}")
    local = results[0][2]
    assert local["layers.0.attention.wq_b.weight"] == 12 * 8 * 32 // 2  # heads x (nope + rope) x q_lora, / tp
    assert local["layers.0.attention.wkv_b.weight"] == 16 * 8 * 16 // 2
    assert local["layers.0.attention.wq_a.weight"] == 32 * 64


def _cli_plan(capsys, name, extra=()):
    import json

    from mcompile.apps.cli import main

    start = time.perf_counter()
    assert main(["plan", name, "--mesh", "tp=8", "--json", *extra]) in (0, None)
    took = time.perf_counter() - start
    return json.loads(capsys.readouterr().out), took


@pytest.mark.timeout(300)
def test_cli_plans_deepseek_v3_mla_dense(capsys):
    """``mcompile plan deepseek-v3-mla-dense --mesh tp=8`` on a fake mesh (meta device): memory per rank
    and the Megatron placements (latents whole, up-projections by heads), in seconds (61 layers planned
    from 2 captured)."""
    plan, took = _cli_plan(capsys, "deepseek-v3-mla-dense")
    assert plan["fallbacks"] == []
    mem = plan["memory_per_rank"]
    assert 0 < mem["params"] < 37.45e9 * 4 / 8 * 1.2  # fp32 params, mostly split 8 ways
    p = plan["params"]
    for i in (0, 60):  # repeated layers take the captured blocks' placements
        for w in LATENT:
            assert p[f"layers.{i}.attention.{w}.weight"]["placements"] == ["R"]
        assert p[f"layers.{i}.attention.wq_b.weight"]["local_shape"] == [128 * 192 // 8, 1536]
        assert p[f"layers.{i}.attention.wkv_b.weight"]["local_shape"] == [128 * 256 // 8, 512]
        assert p[f"layers.{i}.attention.wo.weight"]["placements"] == ["S(1)"]
    assert took < 120, took


@pytest.mark.timeout(300)
def test_tp_not_dividing_heads_is_refused_with_valid_sizes():
    """tp=3 over 8 heads: refused before planning, naming num_heads, the valid sizes and the attention's
    source line."""
    from mcompile.sharding.propagate import PlanError

    with pytest.raises(PlanError, match=r"tp=3 does not divide num_heads=8; valid tp sizes: 1, 2, 4\b") as e:
        _plan(3, OVERRIDES)
    assert "models/mla.py" in str(e.value)


@pytest.mark.timeout(300)
def test_tp_equal_to_heads_is_accepted():
    """tp=8 = n_heads is a valid Megatron layout: the rope key (4 wide) and the latents are not split, so
    their sizes do not need to divide."""
    _, _, c = _plan(8)
    _assert_megatron_mla(c)
