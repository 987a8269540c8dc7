"""Hugging Face weights in and out (mcompile.apps.hf_io).

Presets -> Hugging Face (one process): a llama3-tiny (untied and tied) and a gpt2-tiny exported with
``export_hf`` load with ``from_pretrained`` with no missing, unexpected or mismatched key, and give the
preset's logits (fp32; the same ops in another order: 1e-5) — which also checks that our rotate-half RoPE is
Hugging Face's (a permuted q/k or another theta changes the logits at 1e-2). Hugging Face -> presets (gloo,
tp=2): ``hf_source`` reads such a folder into a preset built on meta: the full state dict equals the
preset's exactly, the logits program gives its logits, and exporting it again writes the same tensors.

The acceptance case (the issue's #4): a Hugging Face Llama saved with ``save_pretrained``, imported at tp=2,
trained 3 AdamW steps and exported: the files hold exactly the trained tensors, and
``LlamaForCausalLM.from_pretrained`` gives the logits of mcompile's logits program read from them.
Qwen3 (tied, q/k norms) at tp=2 and Mistral at pp=2 exported right after import hold the original tensors
exactly. Bad input (another config, a model that does not fit the config) is an error naming what differs.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hf_io_cases import batch, hf_model, hf_round_trip, preset_import, train_and_export
from safetensors.torch import load_file

from mcompile.apps.hf_io import HFSource, config_from_hf, export_hf, hf_config_for, hf_source
from mcompile.models import get_preset
from mcompile.models.llama import Llama
from mcompile.runtime.weights import WeightsError, open_weights

from conftest import pool


def _files(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _from_pretrained(folder):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return model.eval()


def _preset(name: str, seed: int = 0):
    torch.manual_seed(seed)
    if name == "llama3-tiny-tied":
        model = Llama(dataclasses.replace(get_preset("llama3-tiny").config, tie_embeddings=True))
    else:
        model = get_preset(name).build()
    with torch.no_grad():  # norm weights and biases away from their init (ones / zeros): a swap would show
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _sources_accepted() -> bool:
    """Whether ``parallelize(weights=)`` takes a source object (the open_weights patch in the hf_io report)."""
    probe = HFSource(path=None, entries={}, what="probe")
    try:
        return open_weights(probe) is probe
    except Exception:  # noqa: BLE001 - the unpatched open_weights refuses a non-path
        return False


needs_sources = pytest.mark.skipif(not _sources_accepted(), reason="weights= does not take a source object yet: "
                                   "apply the open_weights patch of the hf_io report (runtime/weights.py)")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Each preset exported once (single device): (model, folder)."""
    root = tmp_path_factory.mktemp("hf_io")
    out = {}
    for name in ("llama3-tiny", "llama3-tiny-tied", "gpt2-tiny"):
        model = _preset(name)
        out[name] = (model, export_hf(model, root / name, max_shard_size="40KB"))
    return out


@pytest.mark.parametrize("name", ["llama3-tiny", "llama3-tiny-tied", "gpt2-tiny"])
def test_preset_export_loads_in_transformers_with_the_same_logits(exported, name):
    model, folder = exported[name]
    hf = _from_pretrained(folder)
    assert type(hf).__name__ == ("GPT2LMHeadModel" if name.startswith("gpt2") else "LlamaForCausalLM")
    saved = _files(folder)
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 1
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(saved)
    tied = name != "llama3-tiny"
    assert ("lm_head.weight" in saved) != tied  # a tied output is written once, as from_pretrained expects
    assert hf.config.tie_word_embeddings == tied
    assert not (folder / "generation_config.json").exists()  # a preset has none: from_pretrained makes one
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # fp32, the same arithmetic up to the order of a few reductions
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-5, atol=1e-5)
    assert config_from_hf(folder) == model.config  # rope theta, norm eps, ties: kept


def test_rope_and_config_are_checked_by_the_logits(exported):
    """The test above can fail: a Hugging Face Llama whose q/k rows are permuted to the interleaved
    (Meta) RoPE pairs, or whose rope theta is Hugging Face's default, no longer gives the preset's logits."""
    model, folder = exported["llama3-tiny"]
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids)
        hf = _from_pretrained(folder)
        hd = model.config.head_dim
        perm = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])  # half-split <-> interleaved
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                w = proj.weight.view(-1, hd, proj.weight.shape[1])
                proj.weight.copy_(w[:, perm].reshape_as(proj.weight))
        assert (hf(ids).logits - ref).abs().max() > 1e-3
        cfg = hf_config_for(model)
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        other = type(hf)(cfg).eval()
        other.load_state_dict(_from_pretrained(folder).state_dict())
        assert (other(ids).logits - ref).abs().max() > 1e-3


def test_hf_source_renames_transposes_and_slices(exported):
    model, folder = exported["gpt2-tiny"]
    src = hf_source(folder, model)
    sd = model.state_dict()
    assert set(src.entries) == set(sd) - {"lm_head.weight"}  # tied: found under wte's name
    for key, stored in src.entries.items():
        assert stored.shape == tuple(sd[key].shape), key
        assert torch.equal(src.read(stored), sd[key]), key
    stored = src.entries["transformer.h.1.attn.c_proj.weight"]  # a Conv1D weight: [in, out] in the file
    assert stored.where.transposed
    box = (slice(32, 64), slice(0, 16))
    assert torch.equal(src.read(stored, box), sd["transformer.h.1.attn.c_proj.weight"][box])
    assert str(src) == str(folder)


def test_hf_source_names_what_differs(exported, tmp_path):
    _, folder = exported["llama3-tiny"]
    other = Llama(dataclasses.replace(get_preset("llama3-tiny").config, rope_theta=10000.0, norm_eps=1e-6))
    with pytest.raises(WeightsError, match=r"norm_eps: 1e-05 in the checkpoint, 1e-06 in the model; "
                                           r"rope_theta: 500000.0 in the checkpoint, 10000.0 in the model"):
        hf_source(folder, other)
    gpt = get_preset("gpt2-tiny").build(device="meta")
    with pytest.raises(WeightsError, match="a LlamaConfig checkpoint for a GPTConfig model"):
        hf_source(folder, gpt)
    qwen = hf_model("qwen3", "cpu", wrapped=False)
    qwen.save_pretrained(tmp_path / "qwen")
    with pytest.raises(WeightsError, match="model_type 'qwen3'.*parallelize any other Hugging Face model itself"):
        hf_source(tmp_path / "qwen", get_preset("llama3-tiny").build(device="meta"))
    assert hf_source(tmp_path / "qwen", qwen).entries.keys() == set(_files(tmp_path / "qwen"))  # as it is


def test_export_refuses_a_model_that_does_not_fit_the_config(tmp_path):
    model = _preset("llama3-tiny")
    cfg = hf_config_for(model, num_hidden_layers=3, intermediate_size=96)
    with pytest.raises(ValueError, match=r"9 tensor\(s\) of LlamaForCausalLM are not in the model: model.layers.2.*"
                                         r"6 tensor\(s\) have another shape: model.layers.0.mlp.gate_proj.weight"):
        export_hf(model, tmp_path / "a", hf_config=cfg)
    with pytest.raises(ValueError, match="the config ties lm_head.weight / model.embed_tokens.weight|"
                                         "ties model.embed_tokens.weight / lm_head.weight"):
        export_hf(model, tmp_path / "b", hf_config=hf_config_for(model, tie_word_embeddings=True))
    with pytest.raises(ValueError, match="max_shard_size='5 parsecs'"):
        export_hf(model, tmp_path / "c", max_shard_size="5 parsecs")
    with pytest.raises(TypeError, match="neither a Hugging Face PreTrainedModel"):
        export_hf(torch.nn.Linear(2, 2), tmp_path / "d")
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())  # nothing half-written


# -- with processes -----------------------------------------------------------------------------------
@pytest.mark.timeout(600)
def test_hf_llama_imported_trained_exported_loads_with_mcompile_logits_and_generates_as_hf(tmp_path):
    folder, out = tmp_path / "llama", tmp_path / "out"
    original = hf_model("llama", "cpu", seed=0, wrapped=False)
    original.save_pretrained(folder)
    r = pool(2).run(train_and_export, str(folder), str(out), "tp=2", timeout=600)[0]
    assert r["losses"][2] < r["losses"][0]  # it trained
    saved = _files(out)
    assert set(saved) == {k[2:] for k in r["trained"]}  # untied: every tensor once
    for k, v in r["trained"].items():  # exactly the trained fp32 tensors, not the original ones
        assert saved[k[2:]].dtype == torch.float32 and torch.equal(saved[k[2:]], v), k
    assert not torch.equal(saved["model.norm.weight"], original.state_dict()["model.norm.weight"])
    assert (out / "generation_config.json").is_file()  # the model's own, beside its config
    hf = _from_pretrained(out)
    assert hf.config.rope_parameters["rope_theta"] == 10000.0 and hf.config.num_key_value_heads == 4
    ids, _ = batch(128)
    with torch.no_grad():
        torch.testing.assert_close(r["logits"], hf(ids).logits, rtol=1e-5, atol=1e-5)
    # greedy generation under tp=2 (from the exported folder) equals HF generate of the loaded model, token for token
    prompt = ids[:2, :5]
    ref = hf.generate(prompt, max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(prompt),
                      pad_token_id=0)
    assert torch.equal(r["tokens"], ref), (r["tokens"], ref)


@needs_sources
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["llama3-tiny", "gpt2-tiny"])
def test_preset_imports_hf_weights_at_tp2(exported, tmp_path, name):
    model, folder = exported[name]
    r = pool(2).run(preset_import, name, str(folder), "tp=2", str(tmp_path / "again"), timeout=600)[0]
    ref = model.state_dict()
    assert list(r["state"]) == list(ref)
    for k, v in ref.items():
        assert torch.equal(r["state"][k], v), k
    with torch.no_grad():
        torch.testing.assert_close(r["logits"], model(r["ids"]), rtol=1e-5, atol=1e-5)
    first, again = _files(folder), _files(tmp_path / "again")
    assert list(sorted(again)) == list(sorted(first))
    assert all(torch.equal(again[k], first[k]) for k in first)


@pytest.mark.timeout(600)
def test_qwen3_and_mistral_round_trip_exactly(tmp_path):
    cases = []
    for kind, mesh in (("qwen3", "tp=2"), ("mistral", "pp=2")):
        original = hf_model(kind, "cpu", seed=7, wrapped=False)
        original.save_pretrained(tmp_path / kind)
        cases.append((kind, str(tmp_path / kind), mesh, str(tmp_path / f"{kind}-out")))
    (tmp_path / "a-file").write_text("")
    errors = pool(2).run(hf_round_trip, cases, str(tmp_path / "a-file"), timeout=600)
    for what in ("qwen3 folder", "qwen3 write", "mistral folder", "mistral write"):  # raised on both ranks
        assert what in errors[0] and what in errors[1], what
        assert errors[1][what].startswith("RuntimeError: export_hf failed on rank 0: ")
        assert errors[1][what].endswith(errors[0][what])
    assert "No space left on device" in errors[0]["qwen3 write"]
    for kind, _, _, out in cases:
        first, again = _files(tmp_path / kind), _files(tmp_path / f"{kind}-out")
        assert sorted(again) == sorted(first), kind
        for k in first:
            assert torch.equal(again[k], first[k]), (kind, k)
        hf = _from_pretrained(out)
        unsaved = ("_name_or_path", "dtype", "architectures", "transformers_version")  # set when written / read
        assert {k: v for k, v in hf.config.to_dict().items() if k not in unsaved} == \
            {k: v for k, v in hf_model(kind, "cpu", wrapped=False).config.to_dict().items() if k not in unsaved}
        if kind == "qwen3":
            assert "lm_head.weight" not in again and hf.config.tie_word_embeddings
