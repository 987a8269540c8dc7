"""Models built on the meta device: initialised shard by shard with their own initialisation, seeded per
tensor, so the values do not depend on the layout (mcompile.runtime.init).

One pool call per world size runs every model on every layout of that size (tp=1 on world 1; tp=2 and
pp=2 on world 2; dp=2 x tp=2 on world 4); each layout's ``full_state_dict()`` (and its buffers) must be
bit-identical to ``materialize`` of the same meta model in this process, with the same seed.
"""

from __future__ import annotations

import math

import pytest
import torch
from init_cases import MODELS, meta_build, meta_errors

from mcompile.runtime.init import materialize

from conftest import pool

SEED = 7
WORLDS = {1: ["tp=1"], 2: ["tp=2", "pp=2"], 4: ["dp=2,tp=2"]}


@pytest.fixture(scope="module")
def results():
    from init_cases import layouts

    out = {}
    for world, meshes in WORLDS.items():
        ranks = pool(world).run(layouts, meshes, SEED, timeout=600)
        for key, r0 in ranks[0].items():
            out[key] = {**r0, "losses_all": [r[key]["losses"] for r in ranks],
                        "still_meta_all": all(r[key]["still_meta"] for r in ranks)}
    return out


def _reference(name, seed=SEED):
    model, inputs = meta_build(name)
    materialize(model, seed)
    return model


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", MODELS)
def test_meta_init_is_bit_identical_on_every_layout(results, name):
    ref = _reference(name)
    sd = ref.state_dict()
    buffers = dict(ref.named_buffers())
    for meshes in WORLDS.values():
        for mesh in meshes:
            r = results[(name, mesh)]
            assert list(r["state"]) == list(sd), mesh
            for k, v in sd.items():
                assert r["state"][k].dtype == v.dtype and torch.equal(r["state"][k], v), (mesh, k)
            for k, v in r["buffers"].items():  # RoPE inv_freq & co: recomputed, not left empty
                assert torch.equal(v, buffers[k]), (mesh, k)
            assert all(math.isfinite(x) for losses in r["losses_all"] for x in losses), mesh
            assert r["losses_all"][0][1] < r["losses_all"][0][0], mesh  # the step trained
            assert r["still_meta_all"], mesh  # the model given to parallelize was never materialised
    # the same values as the single-device model initialised by materialize: same first loss everywhere
    model, inputs = meta_build(name)
    loss = materialize(model, SEED)(*inputs).item()
    for meshes in WORLDS.values():
        for mesh in meshes:
            assert results[(name, mesh)]["losses_all"][0][0] == pytest.approx(loss, rel=1e-5), mesh


def test_values_follow_the_seed_and_the_init():
    a, b = _reference("llama3-tiny", 0).state_dict(), _reference("llama3-tiny", 1).state_dict()
    assert not torch.equal(a["layers.0.attention.wq.weight"], b["layers.0.attention.wq.weight"])
    assert not torch.equal(a["layers.0.attention.wq.weight"], a["layers.1.attention.wq.weight"])  # per name
    assert torch.equal(a["norm.weight"], torch.ones(64))
    model = _reference("llama3-tiny", 0)
    std = model.layers[0].feed_forward.w2.weight.std().item()  # the scaled residual projection
    assert std == pytest.approx(0.02 / math.sqrt(4), rel=0.1)
    expect = 1.0 / (500000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    assert torch.equal(model.inv_freq, expect)
    gpt = _reference("gpt2-tiny", 0)
    assert gpt.lm_head.weight is gpt.transformer.wte.weight  # still tied
    assert gpt.transformer.h[0].mlp.c_proj.weight.std().item() == pytest.approx(0.02 / 2, rel=0.1)


@pytest.mark.timeout(300)
def test_meta_model_without_initialiser_is_an_error():
    for out in pool(2).run(meta_errors, "tp=2"):
        msg, untouched = out["_NoInit"]
        assert "MetaInitError" in msg and "scale.gain" in msg and "nothing initialises" in msg, msg
        assert "emb.weight" not in msg
        assert untouched
        msg, untouched = out["_Partial"]
        assert "MetaInitError" in msg and "scale.gain" in msg and "left it (partly) unset" in msg, msg
        assert untouched


def test_a_parent_reinitialising_a_child_wins():
    """HF GPT-2's _init_weights re-draws c_proj.weight when it visits the attention / MLP block (after
    the Conv1D itself): the path's initialisers run child first, so the scaled std is what comes out."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    from mcompile.models.hf import CausalLMLoss

    logging.set_verbosity_error()
    cfg = GPT2Config(vocab_size=129, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    with torch.device("meta"):
        model = CausalLMLoss(GPT2LMHeadModel(cfg))
    gpt2 = materialize(model, 0).m
    assert gpt2.transformer.h[0].attn.c_proj.weight.std().item() == pytest.approx(0.02 / 2, rel=0.1)
    assert gpt2.transformer.h[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert gpt2.transformer.h[0].attn.c_attn.bias.eq(0).all()
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
