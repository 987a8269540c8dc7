"""Tests for the plain single-device reference models and presets (mcompile.models)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from mcompile.models import GPT, PRESETS, GPTConfig, Llama, LlamaConfig, Preset, get_preset, list_presets

TINY = ["gpt2-tiny", "llama3-tiny"]


def _tiny(name: str, seed: int = 0) -> tuple[Preset, torch.nn.Module]:
    torch.manual_seed(seed)
    preset = get_preset(name)
    return preset, preset.build().eval()


# ---------------------------------------------------------------------------------------------
# forward contract
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_logits_shape_and_initial_loss(name: str) -> None:
    preset, model = _tiny(name)
    idx, targets = preset.example_inputs(batch=2, seq=16, seed=0)
    with torch.no_grad():
        logits = model(idx)
        loss = model(idx, targets)
    assert logits.shape == (2, 16, preset.vocab_size)
    assert logits.dtype == torch.float32
    assert loss.dim() == 0
    assert torch.isfinite(loss)
    # small init => nearly uniform predictions => loss close to ln(vocab)
    assert abs(loss.item() - math.log(preset.vocab_size)) < 0.1
    # the loss is exactly the cross-entropy of the returned logits
    ref = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
    torch.testing.assert_close(loss, ref)


@pytest.mark.parametrize("name", TINY)
def test_ignore_index_is_mean_over_the_rest(name: str) -> None:
    preset, model = _tiny(name)
    idx, targets = preset.example_inputs(batch=2, seq=12, seed=1)
    masked = targets.clone()
    masked[0, :5] = -100
    masked[1, 7:] = -100
    keep = masked != -100
    with torch.no_grad():
        loss = model(idx, masked)
        logits = model(idx)
    per_token = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction="none")
    expected = per_token[keep.view(-1)].mean()
    torch.testing.assert_close(loss, expected)
    # and it differs from the unmasked loss (the masked positions really were dropped)
    with torch.no_grad():
        assert not torch.allclose(loss, model(idx, targets))


@pytest.mark.parametrize("name", TINY)
def test_causal(name: str) -> None:
    """Changing token t must not change logits at positions < t."""
    preset, model = _tiny(name)
    idx, _ = preset.example_inputs(batch=1, seq=10, seed=2)
    idx2 = idx.clone()
    idx2[0, 6] = (idx2[0, 6] + 1) % preset.vocab_size
    with torch.no_grad():
        a, b = model(idx), model(idx2)
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_gpt_weights_tied() -> None:
    _, model = _tiny("gpt2-tiny")
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names  # one Parameter
    # a gradient through the output projection lands on the embedding
    preset = get_preset("gpt2-tiny")
    idx, targets = preset.example_inputs(batch=2, seq=8, seed=3)
    model(idx, targets).backward()
    assert model.transformer.wte.weight.grad is not None


def test_gpt_retie_after_to_empty() -> None:
    model = get_preset("gpt2-tiny").build(device="meta")
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_weights()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.isfinite(model.lm_head.weight).all()


def test_llama_untied_by_default_and_tied_on_request() -> None:
    _, model = _tiny("llama3-tiny")
    assert model.output.weight is not model.tok_embeddings.weight
    cfg = LlamaConfig(
        vocab_size=64,
        dim=32,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=48,
        max_seq_len=16,
        tie_embeddings=True,
    )
    tied = Llama(cfg)
    assert tied.output.weight is tied.tok_embeddings.weight


def test_llama_gqa_matches_repeated_kv_heads() -> None:
    """The enable_gqa SDPA path equals explicitly repeating each kv head over its query group."""
    _, model = _tiny("llama3-tiny")
    attn = model.layers[0].attention
    x = torch.randn(2, 9, model.config.dim)
    cos = torch.ones(9, model.config.head_dim)
    sin = torch.zeros(9, model.config.head_dim)
    with torch.no_grad():
        out = attn(x, cos, sin)
        b, s, _ = x.shape
        hd, nh, nkv = attn.head_dim, attn.n_heads, attn.n_kv_heads
        q = attn.wq(x).view(b, s, nh, hd).transpose(1, 2)
        k = attn.wk(x).view(b, s, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        v = attn.wv(x).view(b, s, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ref = attn.wo(y.transpose(1, 2).reshape(b, s, nh * hd))
    torch.testing.assert_close(out, ref)


def test_llama_bf16_build_keeps_rope_in_fp32() -> None:
    model = get_preset("llama3-tiny").build(dtype=torch.bfloat16)
    assert torch.get_default_dtype() == torch.float32  # restored
    assert model.output.weight.dtype == torch.bfloat16
    assert model.inv_freq.dtype == torch.float32
    idx, targets = get_preset("llama3-tiny").example_inputs(batch=1, seq=8, seed=4)
    with torch.no_grad():
        assert torch.isfinite(model(idx, targets))


# ---------------------------------------------------------------------------------------------
# parameter counts of the published shapes, built on meta
# ---------------------------------------------------------------------------------------------


def _gpt_params(v: int, ctx: int, n_layer: int, h: int) -> int:
    # wte (tied with lm_head, counted once) + wpe + per layer (2 LN, qkv, proj, fc, proj) + ln_f
    per_layer = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * 4 * h + 4 * h) + (4 * h * h + h)
    return v * h + ctx * h + n_layer * per_layer + 2 * h


def _llama_params(v: int, d: int, n_layers: int, n_heads: int, n_kv: int, ffn: int) -> int:
    hd = d // n_heads
    per_layer = d * d + 2 * d * (n_kv * hd) + d * d + 3 * d * ffn + 2 * d
    return 2 * v * d + n_layers * per_layer + d  # untied embedding + output, final norm


BIG = {
    "gpt2-small": (_gpt_params(50257, 1024, 12, 768), 124_439_808),
    "gpt2-medium": (_gpt_params(50257, 1024, 24, 1024), 354_823_168),
    "gpt2-large": (_gpt_params(50257, 1024, 36, 1280), 774_030_080),
    "gpt2-xl": (_gpt_params(50257, 1024, 48, 1600), 1_557_611_200),
    "gpt3-175b": (_gpt_params(50257, 2048, 96, 12288), None),
    "llama3-8b": (_llama_params(128256, 4096, 32, 32, 8, 14336), 8_030_261_248),
    "llama3-70b": (_llama_params(128256, 8192, 80, 64, 8, 28672), 70_553_706_496),
    "llama3-405b": (_llama_params(128256, 16384, 126, 128, 8, 53248), 405_853_388_800),
}


@pytest.mark.parametrize("name", sorted(BIG))
def test_param_counts_on_meta(name: str) -> None:
    formula, published = BIG[name]
    if published is not None:
        assert formula == published
    model = get_preset(name).build(device="meta")
    tensors = list(model.parameters()) + list(model.buffers())
    assert all(t.is_meta for t in tensors), "a meta build must allocate no real storage"
    assert sum(p.numel() for p in model.parameters()) == formula  # parameters() counts tied weights once
    if name == "gpt3-175b":
        assert 174e9 < formula < 176e9


def test_meta_example_inputs() -> None:
    preset = get_preset("llama3-8b")
    idx, targets = preset.example_inputs(batch=2, seq=16, device="meta")
    assert idx.is_meta and targets.is_meta
    assert idx.shape == targets.shape == (2, 16) and idx.dtype == targets.dtype == torch.long


@pytest.mark.parametrize("name", TINY)
def test_example_inputs(name: str) -> None:
    preset = get_preset(name)
    idx, targets = preset.example_inputs(batch=3, seq=20, seed=5)
    assert idx.shape == targets.shape == (3, 20) and idx.dtype == targets.dtype == torch.long
    for t in (idx, targets):
        assert int(t.min()) >= 0 and int(t.max()) < preset.vocab_size
    again, _ = preset.example_inputs(batch=3, seq=20, seed=5)
    assert torch.equal(idx, again)


# ---------------------------------------------------------------------------------------------
# torch.export with dynamic batch and sequence
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_export_dynamic_batch_and_seq(name: str) -> None:
    preset, model = _tiny(name)
    idx, targets = preset.example_inputs(batch=2, seq=16, seed=6)
    batch = Dim("batch", min=2)
    seq = Dim("seq", min=2, max=preset.max_seq_len)
    ep = torch.export.export(
        model,
        (idx, targets),
        dynamic_shapes={"idx": {0: batch, 1: seq}, "targets": {0: batch, 1: seq}},
        strict=False,
    )
    # the captured graph keeps SDPA as one causal op
    sdpa = [n for n in ep.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default]
    cfg = preset.config
    assert len(sdpa) == (cfg.n_layer if isinstance(cfg, GPTConfig) else cfg.n_layers)
    exported = ep.module()
    for b, s in [(3, 37), (5, preset.max_seq_len)]:
        idx2, targets2 = preset.example_inputs(batch=b, seq=s, seed=b + s)
        targets2[0, :3] = -100
        with torch.no_grad():
            torch.testing.assert_close(exported(idx2, targets2), model(idx2, targets2))


# ---------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------


def test_registry() -> None:
    expected = {
        "gpt2-tiny",
        "gpt2-small",
        "gpt2-medium",
        "gpt2-large",
        "gpt2-xl",
        "gpt3-175b",
        "llama3-tiny",
        "llama3-8b",
        "llama3-70b",
        "llama3-405b",
        "mixtral-tiny",
        "mixtral-8x7b",
        "deepseek-tiny",
        "deepseek-v3",
    }
    import importlib

    from mcompile.models.presets import FAMILY_MODULES

    modules = [importlib.import_module(f"mcompile.models.{m}") for m in FAMILY_MODULES
               if importlib.util.find_spec(f"mcompile.models.{m}") is not None]
    families = {p.name: p for mod in modules for p in mod.PRESETS}  # models/<family>.py: their own presets
    assert set(PRESETS) == expected | set(families)
    assert list_presets() == sorted(expected | set(families))
    for name, preset in families.items():
        assert PRESETS[name] is preset and preset.model_class is not None and preset.inputs is not None
        assert isinstance(preset.build(device="meta"), preset.model_class)
    for name, preset in PRESETS.items():
        assert preset.name == name
        if name in families:
            continue
        family = {"gpt2": "gpt", "gpt3": "gpt", "llama3": "llama"}.get(name.split("-")[0], name.split("-")[0])
        assert preset.family == family
        assert isinstance(preset.config, GPTConfig if preset.family == "gpt" else LlamaConfig)
    assert get_preset("gpt2-tiny").config.vocab_size == 257
    assert isinstance(get_preset("gpt2-tiny").build(device="meta"), GPT)
    assert isinstance(get_preset("llama3-tiny").build(device="meta"), Llama)


def test_presets_are_frozen_and_builds_get_their_own_config() -> None:
    preset = get_preset("gpt2-tiny")
    with pytest.raises(AttributeError):
        preset.name = "other"  # type: ignore[misc]
    model = preset.build(device="meta")
    model.config.n_layer = 99
    assert preset.config.n_layer == 2


def test_unknown_preset_lists_names() -> None:
    with pytest.raises(ValueError) as exc:
        get_preset("gpt5-huge")
    msg = str(exc.value)
    assert "gpt5-huge" in msg
    assert ", ".join(sorted(PRESETS)) in msg
