"""T5 encoder-decoder (issue 19): our models/t5.py and the unmodified Hugging Face ``T5ForConditionalGeneration``.

What is isolated, test by test:
- the model itself: models/t5.py computes Hugging Face's T5 (same weights, same loss and gradients), in the
  original form (ReLU, tied head scaled by d_model**-0.5) and the v1.1 form (gated-GELU);
- the plan (dp=2 x tp=2): no op left replicated; at tp=2 Megatron's layout (every attention's q/k/v and every FFN input
  column-parallel, attention and FFN outputs row-parallel, the shared embedding / LM head vocabulary-parallel,
  each stack's relative position table [num_buckets, heads] split by heads); the fewest tp collectives per layer;
- parity through the runtime on gloo processes (3 AdamW steps, losses, clip norms and unclipped gradients
  against one device at 1e-5, fp32) at tp=2 and dp=2 x tp=2, ours and HF's (its in-place shift of the labels
  taken functionally by the joint graph); pipeline parallelism at pp=2 (parity; the encoder and the decoder as
  the two stages);
- ``mcompile plan`` of the published T5-11B on a fake mesh, and a tp that does not divide the heads.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from runtime_cases import grad_errors, reference
from t5_cases import hf_t5, reference_hf, train_hf, train_t5

import mcompile as mc
from mcompile.ir.placements import Replicate, Shard

from conftest import build, pool, tiered

REL = 1e-5  # fp32, the tp pieces summed in another order: ~1e-7 measured (tests/test_runtime.py)

# Megatron's minimum without SP (Shoeybi et al. 2019 §3; Narayanan et al. 2021 for the encoder-decoder): one
# all-reduce forward after each row-parallel output: self-attention + MLP in an encoder layer; self-attention,
# cross-attention and MLP in a decoder layer.
ENCODER_ALL_REDUCES, DECODER_ALL_REDUCES = 2, 3
TABLES = ("encoder.relative_position.relative_attention_bias.weight",
          "decoder.relative_position.relative_attention_bias.weight")

_PLANS: dict = {}


def planned(name: str, mesh: str, overrides: dict | None = None):
    """compile_plan on a fake mesh, the sharding-rule warnings it raised and the seconds it took (cached)."""
    key = (name, mesh, tuple(sorted((overrides or {}).items())))
    if key not in _PLANS:
        model, inputs = hf_t5() if name == "hf-t5" else build(name)
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c = mc.compile_plan(model, mc.Mesh.parse(mesh), inputs, overrides=overrides)
        _PLANS[key] = (c, [str(w.message) for w in caught if "sharding rule" in str(w.message)],
                       time.perf_counter() - t0)
    return _PLANS[key]


# --- the model ------------------------------------------------------------------------------------------------

def _hf_with_our_weights(model):
    """HF's T5ForConditionalGeneration holding ``model``'s (models/t5.py) weights."""
    import transformers as hf

    c = model.config
    h = hf.T5ForConditionalGeneration(hf.T5Config(
        vocab_size=c.vocab_size, d_model=c.d_model, d_kv=c.d_kv, d_ff=c.d_ff, num_heads=c.num_heads,
        num_layers=c.num_layers, num_decoder_layers=c.num_decoder_layers, dropout_rate=0.0,
        relative_attention_num_buckets=c.relative_attention_num_buckets,
        relative_attention_max_distance=c.relative_attention_max_distance, feed_forward_proj=c.feed_forward,
        tie_word_embeddings=c.tie_word_embeddings, decoder_start_token_id=0, pad_token_id=0)).eval()
    sd = {"shared.weight": model.shared.weight}
    for st in ("encoder", "decoder"):
        stack = getattr(model, st)
        sd[f"{st}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = \
            stack.relative_position.relative_attention_bias.weight
        sd[f"{st}.final_layer_norm.weight"] = stack.final_norm.weight
        for i, layer in enumerate(stack.layers):
            sub = [(layer.attention_norm, layer.attention, "SelfAttention")] if st == "encoder" else [
                (layer.self_attention_norm, layer.self_attention, "SelfAttention"),
                (layer.cross_attention_norm, layer.cross_attention, "EncDecAttention")]
            for j, (norm, attn, hf_name) in enumerate(sub):
                sd[f"{st}.block.{i}.layer.{j}.layer_norm.weight"] = norm.weight
                for w in "qkvo":
                    sd[f"{st}.block.{i}.layer.{j}.{hf_name}.{w}.weight"] = getattr(attn, w).weight
            ff, j = layer.feed_forward, len(sub)
            sd[f"{st}.block.{i}.layer.{j}.layer_norm.weight"] = layer.ffn_norm.weight
            for w in ("wi_0", "wi_1", "wo") if ff.gated else ("wi", "wo"):
                sd[f"{st}.block.{i}.layer.{j}.DenseReluDense.{w}.weight"] = getattr(ff, w).weight
    missing, unexpected = h.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    assert not unexpected and set(missing) <= {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
                                               "lm_head.weight"}, (missing, unexpected)
    return h


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["t5-tiny", "t5-tiny-untied"])
def test_our_t5_computes_hugging_face_t5(name):
    """Same weights, same loss and gradients as HF's T5 at seq 40 (past the 8 exact buckets of the bidirectional
    table: the logarithmic buckets are used too), encoder padding and ignored labels included. transformers 5
    always ties T5's head to the shared embedding (T5Config forces tie_word_embeddings=True; False only turns
    the d_model**-0.5 rescale off), so the untied model is compared with its head set to the embedding."""
    from transformers.utils import logging

    from mcompile.models import get_preset

    logging.set_verbosity_error()
    preset = get_preset(name)
    torch.manual_seed(0)
    model = preset.build().eval()
    if not model.config.tie_word_embeddings:
        with torch.no_grad():
            model.lm_head.weight.copy_(model.shared.weight)
    h = _hf_with_our_weights(model)
    ids, mask, labels = preset.example_inputs(batch=2, seq=40, seed=1)
    ours = model(ids, mask, labels)
    theirs = h(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    ours.backward()
    theirs.backward()
    pairs = {"q": model.decoder.layers[1].cross_attention.q, "table": model.encoder.relative_position
             .relative_attention_bias, "wo": model.encoder.layers[0].feed_forward.wo}
    theirs_mods = {"q": h.decoder.block[1].layer[1].EncDecAttention.q,
                   "table": h.encoder.block[0].layer[0].SelfAttention.relative_attention_bias,
                   "wo": h.encoder.block[0].layer[1].DenseReluDense.wo}
    for k, mod in pairs.items():
        want = theirs_mods[k].weight.grad  # fp32, another op order: 1e-5 of the largest entry for those near 0
        torch.testing.assert_close(mod.weight.grad, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()), msg=k)


@pytest.mark.timeout(60)
def test_published_presets_have_the_published_sizes():
    """Parameter counts on the meta device: T5-11B 11.3B (Raffel et al. 2020 Table 14: "11B"), v1.1 XL 2.85B
    ("3B"), v1.1 XXL 11.1B ("11B")."""
    from mcompile.models import get_preset

    counts = {n: get_preset(n).build("meta").num_params() / 1e9 for n in ("t5-11b", "t5-v1_1-xl", "t5-v1_1-xxl")}
    assert counts == pytest.approx({"t5-11b": 11.31, "t5-v1_1-xl": 2.85, "t5-v1_1-xxl": 11.14}, abs=0.01)


# --- the plan -------------------------------------------------------------------------------------------------

@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["t5-tiny", "hf-t5"])
def test_no_op_runs_replicated(name):
    """dp x tp: the labels split over dp reach the decoder-input shift's aten.where.Scalar* (rules/pointwise.py)."""
    c, reported, _ = planned(name, "dp=2,tp=2")
    assert not reported, reported
    assert c.plan.fallbacks == []


def _check_megatron_layout(c):
    """Megatron's layout of our T5 at tp=2 (no SP): encoder layer = 2 all-reduces forward (self-attention out,
    MLP out), decoder layer = 3 (self-attention out, cross-attention out, MLP out), no other tp collective in a
    layer but the identity-forward / all-reduce-backward entering each tp region (Megatron's f); the table of
    relative position biases split by heads (no collective: each rank adds its heads' biases)."""
    params = c.plan.params
    for fqn, p in params.items():
        leaf = fqn.rsplit(".", 2)[-2]
        if leaf in ("q", "k", "v", "wi", "wi_0", "wi_1"):
            assert p.placements == (Shard(0),), (fqn, p.placements)  # column-parallel
        elif leaf in ("o", "wo"):
            assert p.placements == (Shard(1),), (fqn, p.placements)  # row-parallel
        elif "norm" in fqn:
            assert p.placements == (Replicate(),), (fqn, p.placements)
    assert params["shared.weight"].placements == (Shard(0),)  # vocabulary-parallel (the head tied to it)
    for fqn in TABLES:
        assert params[fqn].placements == (Shard(1),), (fqn, params[fqn].placements)
    fwd = [s for s in c.plan.collectives if s.axis == "tp" and s.forward != "none"]
    per_layer = {}
    for s in fwd:
        if s.layer is not None:
            stack = "decoder" if "decoder" in _where(c, s) else "encoder"
            per_layer.setdefault((stack, s.layer), []).append(s.forward)
    assert per_layer == {**{("encoder", i): ["all_reduce"] * ENCODER_ALL_REDUCES for i in range(2)},
                         **{("decoder", i): ["all_reduce"] * DECODER_ALL_REDUCES for i in range(2)}}, per_layer
    # outside the layers: the two embedding lookups' reductions and the vocabulary-parallel loss's three
    outside = sorted(s.purpose for s in fwd if s.layer is None)
    assert outside == sorted(["reduce partial"] * 2 + ["vocab-parallel loss: max", "vocab-parallel loss: sum exp",
                                                       "vocab-parallel loss: target logit"]), outside


def _where(c, spec) -> str:
    """The module path of the node a collective was inserted for (nn_module_stack of its origin)."""
    for n in c.captured.gm.graph.nodes:
        if n.name == spec.origin:
            stack = n.meta.get("nn_module_stack") or {}
            return " ".join(str(v[0]) for v in stack.values())
    return ""


@pytest.mark.timeout(600)
def test_plan_is_megatrons_layout():
    c, _, _ = planned("t5-tiny", "tp=2")
    _check_megatron_layout(c)


@pytest.mark.timeout(600)
def test_hf_t5_plan_is_megatrons_layout():
    """Unmodified HF T5 at tp=2: every q/k/v and FFN input column-parallel, o and FFN output row-parallel,
    the relative position tables (in the first layer of each stack) split by heads, and per layer index
    2 + 3 forward all-reduces (encoder layer i and decoder layer i share the index), no all-gather. Found
    from the graph: planner.position_bias_hints; HF's empty cross-attention cache cat dropped
    (canonicalize.drop_empty_cats); its zero position bias for cross-attention sliced by heads."""
    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh

    model, inputs = hf_t5()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = compile_plan(model, Mesh.fake(tp=2), inputs)
    for fqn, p in c.plan.params.items():
        leaf = fqn.rsplit(".", 2)[-2]
        if leaf in ("q", "k", "v", "wi", "wi_0", "wi_1"):
            assert p.placements == (Shard(0),), (fqn, p.placements)
        elif leaf in ("o", "wo"):
            assert p.placements == (Shard(1),), (fqn, p.placements)
        elif leaf == "relative_attention_bias":
            assert p.placements == (Shard(1),), (fqn, p.placements)
    fwd = [s for s in c.plan.collectives if s.axis == "tp" and s.forward != "none" and s.layer is not None]
    assert sorted({s.forward for s in fwd}) == ["all_reduce"], fwd
    assert {i: sum(s.layer == i for s in fwd) for i in (0, 1)} == {0: 5, 1: 5}


# --- parity through the runtime -------------------------------------------------------------------------------

def _world(mesh: str) -> int:
    world = 1
    for part in mesh.split(","):
        world *= int(part.split("=")[1])
    return world


def _check(results, ref):
    ref_losses, ref_grads, ref_norms = ref
    for losses, _, _, norms in results:
        assert losses == pytest.approx(ref_losses, rel=REL, abs=0)
        assert norms == pytest.approx(ref_norms, rel=REL, abs=0)
    errors = grad_errors(results[0][1], ref_grads)
    for k, err in errors.items():
        assert err <= REL, (k, err)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(results[0][0], ref_losses))
    print(f"max relative error: loss {loss_err:.2e}, gradient {max(errors.values()):.2e}")


CASES = [(name, mesh) for name in ("t5-tiny", "t5-tiny-untied") for mesh in ("tp=2", "dp=2,tp=2")]
CI_CASES = [("t5-tiny", "dp=2,tp=2")]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,mesh", tiered(CASES, CI_CASES))
def test_parity(name, mesh):
    results = pool(_world(mesh)).run(train_t5, name, mesh, {}, 3, 4, timeout=900)
    _check(results, reference(name, batch=4))


# HF's _shift_right writes the labels into a slice of a new tensor in place (shifted[..., 1:] = labels[..., :-1]):
# the joint graph (the default execution) takes it functionally (passes/joint.functional_writes; before, the
# write was lost: loss 6.0714 against 5.7999 at step 0); execution="autograd" runs the forward module eagerly
HF_CASES = [("tp=2", {}), ("dp=2,tp=2", {}), ("tp=2", {"execution": "autograd"})]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mesh,options", tiered(HF_CASES, [("tp=2", {})]))
def test_hf_t5_parity(mesh, options):
    results = pool(_world(mesh)).run(train_hf, mesh, options, 3, 4, timeout=900)
    _check(results, reference_hf(batch=4))


# --- pipeline parallelism over the two stacks --------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pipeline_parity_at_pp2():
    """pp=2, 2 microbatches (1F1B), the partitioner's cut (inside decoder layer 0: the encoder memory and the
    position biases travel with each microbatch): the single-device losses, clip norms and gradients (the
    tied embedding used by both stages)."""
    results = pool(2).run(train_t5, "t5-tiny", "pp=2", {"microbatches": 2}, 3, 4, timeout=900)
    _check(results, reference("t5-tiny", batch=4))


@pytest.mark.timeout(600)
def test_pipeline_stages_are_the_encoder_and_the_decoder():
    """pp=2 with ``layers_per_stage=[2, 2]`` (the layers of both stacks count, mcompile.sharding.blocks.Trunk.runs): the
    encoder (with the shared embedding) one stage, the decoder's layers the other; the encoder output, the
    decoder's position bias and the padding mask cross the cut with each microbatch. The partitioner's own
    split is no worse: its candidates include the cuts inside the decoder, which the encoder memory and the
    position bias cross beside the residual stream (t5-tiny: inside decoder layer 0, 309M / 301M, against
    0.217 imbalance at encoder | decoder)."""
    model, inputs = build("t5-tiny", batch=4)
    c = mc.compile_plan(model, mc.Mesh.fake(pp=2), inputs, microbatches=2, layers_per_stage=[2, 2])
    stages = c.plan.pipeline["param_stages"]
    for fqn, used in stages.items():
        if fqn.startswith("encoder."):
            assert used == [0], (fqn, used)
        elif fqn.startswith("decoder.layers."):  # the decoder's position bias is made before its first layer
            assert used == [1], (fqn, used)
    auto = mc.compile_plan(model, mc.Mesh.fake(pp=2), inputs, microbatches=2)
    assert max(s["cost"] for s in auto.plan.pipeline["stages"]) <= \
        max(s["cost"] for s in c.plan.pipeline["stages"])


# --- the CLI on the published size, and a bad tp -----------------------------------------------------------

@pytest.mark.slow  # 2 + 2 of 24 + 24 layers captured (mcompile.sharding.repeat): 16 s on an idle 2-core machine
@pytest.mark.timeout(900)
def test_cli_plans_t5_11b_at_tp8(capsys):
    """``mcompile plan t5-11b --mesh tp=8``: no fallbacks, memory per rank."""
    import json

    from mcompile.apps.cli import main

    t0 = time.perf_counter()
    main(["plan", "t5-11b", "--mesh", "tp=8", "--json"])
    seconds = time.perf_counter() - t0
    out = json.loads(capsys.readouterr().out)
    assert out["fallbacks"] == []
    # fp32 parameters: 11.31B / 8 a rank (norms replicated, the 32128-row vocabulary divides by 8: no padding)
    n = mc.models.get_preset("t5-11b").build("meta").num_params()
    assert out["memory_per_rank"]["params"] == pytest.approx(4 * n / 8, rel=1e-3)
    assert out["params"]["decoder.layers.23.cross_attention.o.weight"]["local_shape"] == [1024, 16384 // 8]
    # 16.2 s on 2 idle cores (2026-12-03; 83-199 s when both stacks were captured whole): printed, not asserted
    print(f"t5-11b tp=8 planned in {seconds:.1f} s")


def _refusal(tp: int) -> str:
    from mcompile.sharding.planner import PlanError

    model, inputs = build("t5-tiny")
    with pytest.raises(PlanError) as e:
        mc.compile_plan(model, mc.Mesh.fake(tp=tp), inputs)
    return str(e.value)


@pytest.mark.timeout(600)
def test_tp_not_dividing_the_heads_is_refused_naming_the_attention_and_the_valid_sizes():
    """8 heads at tp=3: refused before planning, naming the first attention module and the sizes that work."""
    msg = _refusal(3)
    assert msg.startswith("tp=3 does not divide num_heads=8"), msg
    assert "encoder.layers.0.attention" in msg and "valid tp sizes: 1, 2, 4, 8" in msg, msg
