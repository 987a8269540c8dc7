"""The Hugging Face zoo as the measure of "any model": every causal LM, masked LM and text encoder-decoder
class the installed ``transformers`` exports, shrunk to a tiny size, through capture, tp=2 planning,
Megatron's layout and tp=2 training at single-device parity.

    python bench/hf_zoo.py [--write | --out PATH] [--resume] [--only NAME,NAME] [--kind KIND] [--every K] [--jobs N]
    python bench/hf_zoo.py --table [--out PATH]      # the markdown table of a record

**Which classes.** Every ``*ForCausalLM`` (kind ``decoder``) and ``*ForMaskedLM`` (``encoder``) the package
exports (and the LM-head classes named otherwise, :data:`LM_HEADS`: GPT-2's ``GPT2LMHeadModel``, Marian's
``MarianMTModel``, ...), and every ``*ForConditionalGeneration`` whose config is a text sequence-to-sequence
model (``encoder-decoder``): ``is_encoder_decoder``,
``main_input_name == "input_ids"``, no image/audio/video input in ``forward`` and no sub-config other than a
text ``encoder``/``decoder`` pair. The other ``*ForConditionalGeneration`` classes (vision-language, speech,
audio, multi-part models) are listed under ``skipped`` with the reason, not dropped. Two names of one class
are run once (the other is listed as an alias).

**The tiny size.** Each model is built from its own config class (``cls.config_class``) with these values set
under whichever of the family's own names its config has (read from its dataclass fields and its
``attribute_map``; :data:`ROLES`): hidden 64, 4 layers (an encoder-decoder: 4 + 4), 4 heads, 2 kv heads where the
config has a kv-head count (GQA; as many as heads under multi-head latent attention), intermediate 128,
vocabulary 128, head_dim 16 where the config has one, every dropout / layerdrop / router jitter 0; MoE families
4 experts, top-2, one expert group; multi-head latent attention (and other low-rank) ranks 32; a size no
name above lists but whose name says its role (``*intermediate_size*``, ``*_head_dim``, a ``*heads*`` count: an
indexer's, a linear-attention mixer's) the role's value (:func:`_sized_role`); per-layer lists (``layer_types``, any
list with one entry per layer, a heterogeneous config's per-layer overrides) cut to 4 layers — the first 4, a
layer type they lack replacing the last ones; other vocabulary-sized attributes (entity, byte-hash vocabularies)
128; a partial rotary width (``rotary_dim``) at most half the head; sub-configs (Dbrx's attn_config/ffn_config,
a text_config, T5Gemma's encoder/decoder) shrunk by the same rules. A constraint of one family's own that these
values break, or a value its class defaults lack, is in the one table :data:`OVERRIDES`; a class that cannot be
trained on token ids alone (:data:`NOT_TEXT_ONLY`) is listed under ``skipped`` with why. Special token ids
outside the vocabulary are moved into it. The values the config ended up with are recorded.
A config still above :data:`MAX_PARAMS` parameters after shrinking (a size attribute under a name not known
here) is a build failure naming the count, never a long run.

**How it is called.** As training code calls it, in train mode (every dropout 0, so the step is
deterministic): ``model(input_ids=ids, labels=labels, use_cache=False)`` (``use_cache`` only where forward
takes it), batch 2, sequence 16. A decoder's labels are its ids (HF shifts them) with the first 3 targets of
row 0 ignored (-100); a masked LM's inputs have a quarter of the positions replaced by a mask token and its
labels are the original ids there, -100 elsewhere; an encoder-decoder gets random labels (HF derives
``decoder_input_ids`` by shifting them right, as its loss expects) with the first 3 of row 0 ignored.

**Stages**, each recorded with its outcome, seconds, and on failure the exception type and the first line of
its message (a later stage whose input is missing is ``skipped``):

1. ``builds``: the config shrinks, the model instantiates (fp32) and its eager forward returns a scalar loss
   (so a later failure is mcompile's, not the call's).
2. ``captures``: ``mcompile.capture.export.capture(model, (), kwargs)`` (the capture step alone, the cheapest public
   way) captures a scalar loss.
3. ``plans_tp2``: ``compile_plan(model, Mesh.fake(tp=2), (), kwargs)`` with ``plan.fallbacks == []`` and no
   ``FallbackWarning`` (an op without a sharding rule runs replicated).
4. ``megatron_layout``: that plan raised no ``PlanQualityWarning`` and ``c.quality == []``
(mcompile/sharding/quality.py).
5. ``parity_tp2``: 3 AdamW steps at tp=2 in the in-process thread simulator (mcompile.runtime.sim, as
   tests/sim_harness.py runs it), fp32, against the single-device model at the same parameters (below): every
   step's loss and every parameter's unclipped gradient within 1e-5 relative (the loss ``|l - l_ref| / |l_ref|``;
   a gradient's largest entry error over its largest reference entry, ``max|g - g_ref| / max|g_ref|``, which
   implies ``assert_close(rtol=1e-5, atol=1e-5 * max|g_ref|)``). A gradient that is zero in exact arithmetic (its
   reference's largest entry below 1e-6 of the model's largest gradient: an attention key bias, since softmax
   ignores a per-query constant) is rounding noise on both sides, where a relative error means nothing: it is
   held to ``max|g - g_ref| <= 1e-6 * max|g_ref of the model|`` instead (as tests/test_family_bert.py holds
   BERT's key.bias), and listed. Runs whenever stage 3 produced a plan, even one with fallbacks (its outcome is
   still informative).

What stage 5 proves and what it does not. Each step runs every rank's program on its local pieces of the
current parameters; the ranks' gradients are combined into full gradients the way the runtime reduces them
(tests/sim_harness.combine_grads: a sharded parameter's pieces concatenated by its placement, a replicated
parameter's partial gradients summed over tp) and compared with the single-device model's loss and gradients
*at the same parameters* (the reference's parameters are set to the plan's before each step). The optimizer step
is then taken by one torch AdamW on a copy of the *full* parameters with the combined gradients, and the updated
full parameters are resharded (``c.local_state(r, state)``) as the next step's local state. So it proves that the
per-rank programs compute the single-device loss and gradients at parameters that have moved off their initial
values (a bias or norm weight no longer 0 / 1, attention no longer uniform), and that sharding and resharding the
parameters round-trips. It does not prove the runtime's own optimizer path (DTensor AdamW on local shards,
gradient buckets, ZeRO), nor anything about gloo processes, the real collectives or memory: the runtime tests'
job. Why not compare against a reference trained on its own gradients: AdamW divides each entry by its own
magnitude, so an entry whose gradient is fp32 rounding noise moves by up to the learning rate either way, and two
exact programs whose gradients differ by 1e-7 relative (a different summation order) differ by ~2e-4 in their
gradients one step later (measured on the tiny Llama, one trajectory's gradients perturbed by 1e-7 of each
tensor's largest entry). That trajectory is still trained and its losses recorded (``trained_alone``), unjudged.

**How it runs.** One subprocess per architecture (``nice -n 19``, one intra-op thread), one at a time, with a
timeout (``--timeout``, 180 s: the machine this ran on was shared, at load averages of 6-15 on 2 cores); the
child writes its progress after every stage, so a timeout or crash records
the stage it was in. The record is rewritten after every architecture: ``--write`` rewrites
``bench/results/hf_zoo.json``, ``--out PATH`` another file, neither a temporary file (bench/_results.py); an
interrupted run goes on with ``--resume`` (architectures already recorded are kept); ``--resume --only A,B --redo``
runs A and B again at the current commit and replaces their records (``runs`` lists each run's commit and names).
``--every K`` runs a deterministic subset (every K-th architecture of the sorted list, per kind; the total is
recorded). The summary, per kind, is the fraction of the architectures run that pass each stage and all of them.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import copy
import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

_BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(_BENCH))
import _results  # noqa: E402

# then off the path: bench/kernels.py would shadow the ``kernels`` package that transformers imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _BENCH]

NAME = "hf_zoo"
STAGES = ("builds", "captures", "plans_tp2", "megatron_layout", "parity_tp2")
KINDS = ("decoder", "encoder", "encoder-decoder")
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB, HEAD_DIM = 64, 4, 4, 2, 128, 128, 16
BATCH, SEQ, STEPS, RTOL = 2, 16, 3, 1e-5
NOISE = 1e-6  # a gradient whose largest entry is below this fraction of the model's largest is rounding noise
MAX_PARAMS = 20_000_000  # the tiny config has ~0.3M; a model above this kept a size this script did not shrink

# role -> the names families give it (the config's attribute_map adds its own): each one the config has is set
ROLES = {
    "hidden": (HIDDEN, ("hidden_size", "n_embd", "n_embed", "d_model", "dim", "embed_dim", "model_dim",
                        "embedding_size", "word_embed_proj_dim", "d_embed", "hidden_dim", "d_latents",
                        "hidden_size_global")),
    "layers": (LAYERS, ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers",
                        "num_encoder_layers", "encoder_layers", "decoder_layers",
                        "num_self_attends_per_block")),
    "heads": (HEADS, ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
                      "decoder_attention_heads", "num_decoder_attention_heads")),
    "kv_heads": (KV_HEADS, ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_head_kv", "multi_query_group_num",
                         "kv_n_heads")),
    "ffn": (FFN, ("intermediate_size", "n_inner", "d_ff", "dff", "d_inner", "ffn_dim", "encoder_ffn_dim",
                  "decoder_ffn_dim", "ffn_hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "expert_intermediate_size", "hidden_dim")),
    "vocab": (VOCAB, ("vocab_size", "decoder_vocab_size", "src_vocab_size", "tgt_vocab_size")),
    "head_dim": (HEAD_DIM, ("head_dim", "d_kv", "kv_channels", "d_head", "attention_head_size")),
    "experts": (4, ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
                    "zero_expert_num")),  # LongCat's zero (identity) experts: 256 of them beside 4 routed
    "top_k": (2, ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_top_k")),
    "shared_experts": (1, ("n_shared_experts", "num_shared_experts")),  # only where the family leaves it None
    "expert_groups": (1, ("n_group", "topk_group")),  # DeepSeek's group-limited routing: one group of the 4
    "latent_rank": (32, ("q_lora_rank", "kv_lora_rank", "o_lora_rank", "hc_lowrank")),  # low-rank widths
    "rope_dim": (8, ("qk_rope_head_dim",)),
    "nope_dim": (HEAD_DIM, ("qk_nope_head_dim", "v_head_dim")),
}
# the LM-head classes of families whose class name does not say it (GPT-2's is GPT2LMHeadModel); XLM's and
# Flaubert's LM head is trained as a masked LM (its labels are not shifted)
LM_HEADS = {"GPT2LMHeadModel": "decoder", "OpenAIGPTLMHeadModel": "decoder", "CTRLLMHeadModel": "decoder",
            "XLNetLMHeadModel": "decoder", "ReformerModelWithLMHead": "decoder", "BertLMHeadModel": "decoder",
            "BlipTextLMHeadModel": "decoder", "XLMWithLMHeadModel": "encoder", "FlaubertWithLMHeadModel": "encoder",
            "MarianMTModel": "encoder-decoder"}
# The one table of per-family values no rule above derives, by config class: a constraint of the family's own
# (its validator or modeling code) that the tiny sizes break, or a value its class defaults lack that its hub
# checkpoints carry. "sub.attr" sets an attribute of a sub-config; a callable gets the other values set.
OVERRIDES: dict[str, dict] = {
    # the attention reads attn_config.rope_theta, which the class defaults lack (the checkpoints' config has it)
    "DbrxConfig": {"attn_config.rope_theta": 500000.0, "attn_config.clip_qkv": 8.0},  # clip None: clamp(None, None)
    # its layer pattern as (types, repeats) pairs: 2 x (global, local) for the 4 layers
    "GPTNeoConfig": {"attention_types": [[["global", "local"], LAYERS // 2]]},
    "ZayaConfig": {"num_experts_per_tok": 1},  # its validator: top-1 routing only
    "Kolibri1_1Config": {"index_num_heads": HEADS // KV_HEADS},  # its validator: <= query heads per key head
    # its validator: hidden * expand == (SSM) heads * head_dim
    "Mamba2Config": {"head_dim": lambda out: HIDDEN * 2 // out["num_heads"], "n_groups": KV_HEADS},
    # the class default leaves the QSA indexer unset, which the modeling always builds: its validator's constraints
    "Qwen4ExpTextConfig": {"indexer_n_heads": HEADS, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM,
                           "indexer_budget": 8, "indexer_compress_ratio": 4},
    # its masked-LM decoder emits max_position_embeddings outputs: the inputs are that long
    "PerceiverConfig": {"max_position_embeddings": SEQ},
    # the shared attention block is tied across the hybrid layers: at least two of them in the 4
    "ZambaConfig": {"layers_block_type": ["linear_attention", "hybrid"] * (LAYERS // 2)},
    # its ids are (batch x codebooks, seq) and its labels (batch, seq, codebooks): one codebook (labels: inputs())
    "MusicgenDecoderConfig": {"num_codebooks": 1},
    "MusicgenMelodyDecoderConfig": {"num_codebooks": 1},
    # the last num_kv_shared_layers reuse the K/V of the earlier layers of their type: both types before them
    "Gemma3nTextConfig": {"layer_types": ["sliding_attention", "full_attention"] * (LAYERS // 2),
                          "num_kv_shared_layers": LAYERS // 2},
    # the class default is all Mamba layers, whose mask creation fails (its checkpoints interleave attention)
    "GraniteMoeHybridConfig": {"layer_types": ["linear_attention", "full_attention"] * (LAYERS // 2)},
    # its rotary embedding reads rope_parameters per layer type, which the class default leaves empty
    "CohereCompassTextConfig": {"rope_parameters": lambda out: {t: {"rope_type": "default", "rope_theta": 10000.0}
                                                                for t in ("full_attention", "sliding_attention")}},
}
# Classes that cannot be trained alone on token ids, by class name, with why (listed under ``skipped``):
NOT_TEXT_ONLY = {
    "ViltForMaskedLM": "not text-only: its forward requires pixel_values or image_embeds",
    "BridgeTowerForMaskedLM": "not text-only: its forward requires pixel_values (the cross-modal layers read them)",
    "GitForCausalLM": "not text-only: its loss drops the first image_patch_tokens positions, assuming the image's "
                      "tokens precede the text (a text-only loss is not the model's)",
    "SeamlessM4TTextToUnitForConditionalGeneration": "not text-only: its encoder takes inputs_embeds (the speech "
                                                     "model's text hidden states), never input_ids",
    "Gemma4AssistantForCausalLM": "not standalone: a draft model whose every layer reuses the target model's K/V "
                                  "(shared_kv_states)",
    "Gemma4UnifiedAssistantForCausalLM": "not standalone: a draft model whose every layer reuses the target "
                                         "model's K/V (shared_kv_states)",
}
_DROP = re.compile(r"dropout|pdrop|layerdrop|drop_path|jitter")
_VOCABISH = re.compile(r"vocab")  # a vocabulary-sized attribute beside vocab_size: shrunk to VOCAB too
_MEDIA = {"pixel_values", "input_features", "input_values", "flattened_patches", "audio_values",
          "pixel_values_videos", "image_embeds", "input_audio_features", "audio_codes"}


# -- which classes -------------------------------------------------------------------------------------------


def zoo(only: set[str] | None = None) -> tuple[list[dict], list[dict]]:
    """(the architectures to run: name, kind; the skipped ones: name, kind, reason), sorted by name; of the
    names in ``only`` alone when given (importing every model module takes a while)."""
    import transformers as hf

    run, skipped, seen = [], [], {}
    for name in sorted(only if only is not None else dir(hf)):
        if name.startswith(("AutoModel", "TF", "Flax")):
            continue
        kind = ("decoder" if name.endswith("ForCausalLM") else "encoder" if name.endswith("ForMaskedLM") else
                "encoder-decoder" if name.endswith("ForConditionalGeneration") else LM_HEADS.get(name))
        if kind is None:
            continue
        try:
            cls = getattr(hf, name)
        except Exception as e:  # noqa: BLE001 - a class whose module does not import is a build failure
            run.append({"name": name, "kind": kind, "import_error": _why(e)})
            continue
        if cls in seen:
            skipped.append({"name": name, "kind": kind, "reason": f"an alias of {seen[cls]} (the same class)"})
            continue
        seen[cls] = name
        why = NOT_TEXT_ONLY.get(name) or (_not_text_seq2seq(cls) if kind == "encoder-decoder" else None)
        if why:
            skipped.append({"name": name, "kind": kind, "reason": why})
        else:
            run.append({"name": name, "kind": kind})
    return run, skipped


def _not_text_seq2seq(cls) -> str | None:
    """Why a ``*ForConditionalGeneration`` class is not a text encoder-decoder, or None."""
    try:
        cfg = cls.config_class()
    except Exception as e:  # noqa: BLE001
        return f"its default config does not build ({_why(e)})"
    media = sorted(set(inspect.signature(cls.forward).parameters) & _MEDIA)
    subs = sorted(getattr(cfg, "sub_configs", None) or {})
    if media:
        return f"not text-only: forward takes {', '.join(media)}"
    if not getattr(cfg, "is_encoder_decoder", False):
        return f"not an encoder-decoder (a conditioned decoder{'; sub-configs ' + ', '.join(subs) if subs else ''})"
    if getattr(cls, "main_input_name", "input_ids") != "input_ids":
        return f"not text-only: its main input is {cls.main_input_name}"
    if subs and subs != ["decoder", "encoder"]:
        return f"a multi-part model (sub-configs {', '.join(subs)})"
    return None


# -- the tiny config and the inputs ---------------------------------------------------------------------------


def _names(cfg_cls, cfg) -> set[str]:
    fields = {f.name for f in dataclasses.fields(cfg_cls)} if dataclasses.is_dataclass(cfg_cls) else set()
    return fields | set(inspect.signature(cfg_cls.__init__).parameters) - {"self", "kwargs"}


def _get(cfg, name: str):
    """``cfg.name`` (None where absent); a heterogeneous config's per-layer attribute (Gemma-4's head_dim) reads as
    its global value, which is what a constructor argument of that name sets."""
    raw = getattr(cfg, "_getattr_without_heterogeneous_validation", None)
    try:
        return raw(name) if raw is not None else getattr(cfg, name, None)
    except AttributeError:
        return None


def _role_values(names: set[str], amap: dict, base) -> dict:
    """ROLES: each role's value under every one of its names the config has (its own field name first, else where
    its ``attribute_map`` points: Bailing's field num_local_experts is itself an alias of num_experts)."""
    hidden_name = amap.get("hidden_size", "hidden_size")
    out: dict = {}
    for role, (value, aliases) in ROLES.items():
        for alias in aliases:
            if role == "hidden" and alias == "hidden_dim" and hidden_name != "hidden_dim":
                continue  # DistilBERT's hidden_dim is its FFN width (its hidden size is dim)
            if role == "ffn" and alias == "hidden_dim" and hidden_name == "hidden_dim":
                continue
            name = alias if alias in names else amap.get(alias, alias)
            if role == "kv_heads" and "kv_lora_rank" in names:
                value = HEADS  # multi-head latent attention: as many kv heads as heads (no GQA)
            if name in names and name not in out:
                if role == "latent_rank" and _get(base, name) is None:
                    continue  # q_lora_rank None: the family's full-rank query projection
                if role == "shared_experts" and _get(base, name) is not None:
                    continue  # Dots1's None, which its MoE multiplies by: one shared expert
                out[name] = value
    return out


def _layer_pick(base, names: set[str], n_layers) -> list[int]:
    """Which of the family's layers the tiny model keeps: the first 4, except that a layer type (``layer_types``)
    the first 4 lack replaces the last ones (Gemma's 5 sliding : 1 full keeps a full-attention layer)."""
    pick = list(range(LAYERS))
    types = next((v for n in sorted(names) if n.endswith("layer_types")
                  for v in [_get(base, n)] if isinstance(v, list | tuple) and len(v) >= LAYERS), None)
    if types is None or not n_layers:
        return pick
    first = {}
    for i, t in enumerate(types):
        first.setdefault(t if isinstance(t, str) else repr(t), i)
    missing = [i for t, i in first.items() if i >= LAYERS]
    for k, i in enumerate(missing[:LAYERS - 1]):
        pick[LAYERS - 1 - k] = i
    return sorted(pick)


def _modeling_layer_types(cfg_cls) -> list[str] | None:
    """A default ``layer_types`` for a family whose config leaves it None but whose modeling code indexes it
    (LFM2-MoE, as its checkpoints' config.json carry it): the layer types the config's validator allows
    (``ALLOWED_ATTN_LAYER_TYPES``) that the modeling module names, alternating over the 4 layers, full attention
    last."""
    import importlib

    from transformers import configuration_utils as cu

    try:
        src = inspect.getsource(importlib.import_module(cfg_cls.__module__.replace(".configuration_", ".modeling_")))
    except (ImportError, OSError, TypeError):
        return None
    if "config.layer_types[" not in src:
        return None
    named = [t for t in cu.ALLOWED_ATTN_LAYER_TYPES if f'"{t}"' in src]
    if not named:
        return None
    named.sort(key=lambda t: t == "full_attention")  # full attention last
    return [named[i % len(named)] for i in range(LAYERS - len(named))] + named if len(named) <= LAYERS else None


def _sized_role(name: str, v: int) -> int | None:
    """The tiny value of a size attribute no ROLES name lists, recognised by the shape of its name (None where it
    is not one, or is already at most the tiny value): a further FFN width (``*intermediate_size*``: Kolibri's
    mlp_only_intermediate_size, GraniteMoeHybrid's shared_intermediate_size, Dots-3's
    shared_experts_intermediate_size), a further head width (``*_head_dim``: Kimi's linear_head_dim, an
    indexer's index_head_dim), a further head count (``*heads*``: a linear-attention mixer's
    linear_num_key_heads / linear_num_value_heads, an indexer's index_n_heads): a key / key-value head count
    gets the kv-head count, so a value-per-key ratio stays whole. A Mamba mixer's head count is left alone: its
    validator ties it to the hidden size and head_dim (Mamba2Config's OVERRIDES), and so is a count per group
    (Qwen4Exp's heads_per_ngram)."""
    if "intermediate_size" in name and v > FFN:
        return FFN
    if name.endswith("head_dim") and v > HEAD_DIM:
        return HEAD_DIM
    if "heads" in name and "mamba" not in name and "per_" not in name:
        tiny = KV_HEADS if re.search(r"key|kv", name) else HEADS
        return tiny if v > tiny else None
    return None


def _shrink(cfg_cls, base, kind: str) -> dict:
    """The constructor arguments that make ``base`` (an instance of ``cfg_cls``) tiny (module docstring)."""
    names = _names(cfg_cls, base)
    amap = dict(getattr(base, "attribute_map", {}) or {})
    out = _role_values(names, amap, base)
    n_layers = next((_get(base, n) for n in ROLES["layers"][1] if isinstance(_get(base, n), int)), None)
    rope = _get(base, "qk_rope_head_dim")
    for name in ROLES["head_dim"][1]:
        if name in out and rope is not None and _get(base, name) == rope:
            out[name] = out["qk_rope_head_dim"]  # LongCat's head_dim is its rotary (MLA rope) width
        if name in out and rope is not None and _get(base, name) == rope + (_get(base, "qk_nope_head_dim") or 0):
            out[name] = out["qk_rope_head_dim"] + out.get("qk_nope_head_dim", 0)  # Dots-3's: nope + rope
    for name in names:
        v = _get(base, name)
        if _DROP.search(name) and isinstance(v, float) and not isinstance(v, bool):
            out[name] = 0.0
        if name.endswith("token_id"):
            out[name] = _in_vocab(name, v, kind)
            if name == "pad_token_id" and out[name] is None and kind == "encoder":
                out[name] = 0  # ESM's position ids count the non-pad tokens
        if isinstance(v, int) and not isinstance(v, bool) and v > VOCAB and _VOCABISH.search(name) \
                and name not in out:
            out[name] = VOCAB  # entity / byte-group-hash / per-layer-input vocabularies (Luke, BLT, Gemma-3n)
        if name == "default_language" and v is None and _get(base, "languages"):
            out[name] = list(_get(base, "languages"))[0]  # X-MOD's adapters run the default language's
        if name.endswith("axial_pos_embds_dim") and isinstance(v, list | tuple):
            out[name] = [HIDDEN * d // sum(v) for d in v]  # Reformer's axial factors sum to the hidden size
        if name.endswith("axial_pos_shape") and isinstance(v, list | tuple) and len(v) == 2:
            out[name] = [4, SEQ // 4]  # ... and their shape multiplies to the (training) sequence length
        if re.search(r"_layers$", name) and isinstance(v, int) and not isinstance(v, bool) and v == n_layers \
                and name not in out:
            out[name] = LAYERS  # a count that is every layer (Gemma-4 assistant's num_kv_shared_layers)
        if name == "rotary_dim" and isinstance(v, int):
            out[name] = min(v, HEAD_DIM // 2)  # CodeGen's / GPT-J's rotated slice of each head: <= head_dim
        if name not in out and isinstance(v, int) and not isinstance(v, bool):
            size = _sized_role(name, v)
            if size is not None and name.endswith("head_dim") and rope is not None and \
                    v == rope + (_get(base, "qk_nope_head_dim") or 0):
                size = out["qk_rope_head_dim"] + out.get("qk_nope_head_dim", 0)  # LongCat's qk_head_dim: nope + rope
            if size is not None:
                out[name] = size
    if kind == "decoder" and "is_decoder" in names:
        out["is_decoder"] = True  # BERT-like ForCausalLM classes attend causally only as decoders
    pick = _layer_pick(base, names, n_layers)
    for name in names:  # per-layer lists (layer_types, Zamba-2's layers_block_type, ...): the picked layers
        v = _get(base, name)
        if name in out or not isinstance(v, list | tuple):
            continue
        ints = bool(v) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        at = {j: i for i, j in enumerate(pick)}
        if ints and name.endswith("_layers") and n_layers and len(v) == n_layers and all(x <= j for j, x in
                                                                                         enumerate(v)):
            out[name] = [at.get(v[j], i) for i, j in enumerate(pick)]  # per layer, an earlier layer's index
            continue  # (Kolibri's kv_source_layers: whose K/V it reads; one not kept: its own)
        if ints and name.endswith("_layers") and n_layers and len(v) < n_layers and max(v) < n_layers:
            out[name] = [at[j] for j in v if j in at]  # layer indices (Kolibri's index_layers): the kept ones
            continue
        role = next((r for r, (_, al) in ROLES.items() if any(a in name for a in al)), None)
        if role and n_layers and len(v) == n_layers and all(isinstance(x, int) for x in v):
            out[name] = [ROLES[role][0]] * LAYERS  # Laguna's num_attention_heads_per_layer: the role's value
        elif name.endswith("layer_types") or (n_layers and n_layers > LAYERS and len(v) == n_layers):
            out[name] = [v[i] for i in pick] if len(v) > max(pick) else None
        elif name.endswith("layer_types"):
            out[name] = None
    if "layer_types" in names and _get(base, "layer_types") is None and "layer_types" not in out:
        types = _modeling_layer_types(cfg_cls)
        if types:
            out["layer_types"] = types
    spec = base.__dict__.get("_heterogeneity_spec")
    if spec is not None:  # a heterogeneous config's per-layer overrides (Gemma-4's wider global-attention heads)
        tiny = {**_role_values(set(ROLES["head_dim"][1]), {}, base), **out}  # a per-layer head_dim as the global
        out["per_layer_config"] = {}
        for i, j in enumerate(pick):
            if j not in spec.per_layer_overrides:
                continue
            ov = spec.per_layer_overrides[j]
            layer = {k: tiny.get(k, v) for k, v in ov.items()}
            was = {k: ov.get(k, _get(base, k)) for k in ("head_dim", "qk_rope_head_dim", "qk_nope_head_dim")}
            if None not in was.values() and was["head_dim"] == was["qk_rope_head_dim"] + was["qk_nope_head_dim"]:
                # Dots-3's sliding layers: head_dim = nope + rope, as in the family's layer
                layer["head_dim"] = sum(layer.get(k, tiny.get(k)) for k in ("qk_rope_head_dim", "qk_nope_head_dim"))
            out["per_layer_config"][i] = layer
    subs = getattr(cfg_cls, "sub_configs", None) or getattr(cfg_cls, "sub_configs_defaults", None) or {}
    for name in subs:  # sub-configs (Dbrx's attn_config / ffn_config, a text_config, T5Gemma's encoder / decoder)
        sb = _get(base, name)
        if hasattr(sb, "to_dict") and name not in out:
            # its own arguments only: a value its __post_init__ derives (BLT's head_dim) is derived again, tiny
            own = _names(type(sb), sb) | {"model_type"}
            out[name] = {**{k: v for k, v in sb.to_dict().items() if k in own}, **_shrink(type(sb), sb, kind)}
    out = {k: v for k, v in out.items() if k in names or k == "per_layer_config"}
    for key, value in OVERRIDES.get(cfg_cls.__name__, {}).items():
        sub, _, attr = key.rpartition(".")
        (out.setdefault(sub, {}) if sub else out)[attr] = value(out) if callable(value) else value
    return out


def tiny_config(cfg_cls, kind: str):
    """The family's config at the tiny size (module docstring), and the values set, by name."""
    out = _shrink(cfg_cls, cfg_cls(), kind)
    try:
        cfg = cfg_cls(**out)
    except Exception as e:  # noqa: BLE001 - its validator refuses GQA (ESM-C): kv heads as many as heads
        kv = [k for k in out if k in ROLES["kv_heads"][1] and out[k] == KV_HEADS]
        if not kv or "key_value" not in str(e.__cause__ or e) + str(e):
            raise
        out.update({k: HEADS for k in kv})
        cfg = cfg_cls(**out)
    if kind == "encoder-decoder" and getattr(cfg, "decoder_start_token_id", None) is None:
        # HF's label shift reads it; a hub checkpoint's config.json carries it (T5's: the pad token), the
        # config class's defaults may not
        cfg.decoder_start_token_id = cfg.pad_token_id if getattr(cfg, "pad_token_id", None) is not None else 0
    return cfg, {k: v for k, v in out.items() if not (_DROP.search(k) or k.endswith("token_id") or k == "is_decoder"
                                                      or isinstance(v, dict))}


def _in_vocab(name: str, v, kind: str):
    """A special token id inside the tiny vocabulary (the family's own when it already is). An
    encoder-decoder needs a pad and a decoder start token (HF's label shift reads them)."""
    low = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0}.get(name, 3)
    if isinstance(v, list | tuple):
        return [x if isinstance(x, int) and x < VOCAB else low for x in v]
    if v is None:
        return low if kind == "encoder-decoder" and name in ("pad_token_id", "decoder_start_token_id") else None
    return v if isinstance(v, int) and v < VOCAB else low


def inputs(kind: str, cfg, takes_cache: bool) -> dict:
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, VOCAB, (BATCH, SEQ), generator=g)
    kw = {"input_ids": ids}
    if kind == "decoder":
        labels = ids.clone()
    elif kind == "encoder":
        masked = torch.rand(BATCH, SEQ, generator=g) < 0.25
        masked[:, 1] = True  # every row has a target
        mask_id = getattr(cfg, "mask_token_id", None)
        kw["input_ids"] = torch.where(masked, mask_id if isinstance(mask_id, int) and mask_id < VOCAB else 4, ids)
        labels = torch.where(masked, ids, -100)
    else:
        labels = torch.randint(5, VOCAB, (BATCH, SEQ), generator=g)
    if kind != "encoder":
        labels[0, :3] = -100
    if getattr(cfg, "num_codebooks", None) == 1 and kind == "decoder":
        labels = labels[..., None]  # MusicGen's labels carry the codebook axis
    kw["labels"] = labels
    if takes_cache:
        kw["use_cache"] = False
    return kw


# -- one architecture (the child process) ---------------------------------------------------------------------


def _why(e: BaseException) -> str:
    """The exception's type and first line; for a CaptureError also the model's line it failed at (``at ...``,
    the construct the record must name: the first line alone, which explains the kind of failure, filled the
    400 characters) and torch's own message, each cut to its share."""
    lines = str(e).strip().splitlines() or [""]
    more = [ln.strip() for ln in lines[1:]]
    at = next((ln for ln in more if ln.startswith("at ")), None)
    if at is not None and "site-packages/" in at:
        at = "at " + at.split("site-packages/", 1)[1]  # the package's path, not this machine's
    said = next((ln for ln in more if ln.startswith("torch says:")), None)
    head = f"{type(e).__name__}: {lines[0]}"
    if at is None and said is None:
        return head[:400]
    tail = "".join(f" | {part[:200]}" for part in (at, said) if part)
    return (head if len(head) <= 400 - len(tail) else head[:400 - len(tail) - 3] + "...") + tail


class _Progress:
    """The child's record, rewritten after every stage (the parent reads it after a timeout or a crash)."""

    def __init__(self, path: Path, rec: dict):
        self.path, self.rec = path, rec
        rec["stages"] = {s: {"outcome": "skipped"} for s in STAGES}
        self.save()

    def save(self):
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.rec, default=str))
        os.replace(tmp, self.path)

    def start(self, stage: str):
        self.rec["stages"][stage] = {"outcome": "running"}
        self.rec["running"] = stage
        self.t0 = time.perf_counter()
        self.save()

    def end(self, stage: str, ok: bool, reason: str | None = None, **extra):
        self.rec["stages"][stage] = {"outcome": "pass" if ok else "fail",
                                     "seconds": round(time.perf_counter() - self.t0, 2),
                                     **({"reason": reason} if reason else {}), **extra}
        self.rec.pop("running", None)
        self.save()


def run_one(name: str, kind: str, path: Path, dtype: str = "float32") -> None:
    """One architecture's stages, recorded in ``path``; at float64 every float32 cast of the model's own code keeps
    float64 (:func:`float64_casts`: entered once the modeling code is imported, and again after the build, for the
    modules its first forward imported)."""
    with contextlib.ExitStack() as stack:
        widen = (lambda: stack.enter_context(float64_casts())) if dtype == "float64" else (lambda: None)
        _run_one(name, kind, path, dtype, widen)


def _run_one(name: str, kind: str, path: Path, dtype: str, widen) -> None:
    import torch
    import transformers as hf
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.set_num_threads(1)
    prog = _Progress(path, {"name": name, "kind": kind, "dtype": dtype})
    rec = prog.rec
    if dtype == "float64":
        float64_experts()

    prog.start("builds")
    try:
        cls = getattr(hf, name)
        widen()
        cfg, shrunk = tiny_config(cls.config_class, kind)
        rec["model_type"], rec["config"] = getattr(cfg, "model_type", ""), shrunk
        with torch.device("meta"):
            n = sum(p.numel() for p in cls(cfg).parameters())
        if n > MAX_PARAMS:
            raise ValueError(f"the shrunk config still has {n / 1e6:.0f}M parameters: a size attribute not shrunk")
        torch.manual_seed(0)
        model = cls(cfg).to(getattr(torch, dtype)).train()  # --dtype float64: model and plan in float64
        rec["params"] = n
        kw = inputs(kind, cfg, "use_cache" in inspect.signature(model.forward).parameters)
        ref = copy.deepcopy(model)  # the single-device model, trained alongside
        # the model runs as called (eager, on a copy): a failure here is the call's or the config's, not mcompile's
        loss = copy.deepcopy(model)(**kw).loss
        if loss is None or loss.ndim != 0:
            raise RuntimeError(f"the eager forward returned loss {loss!r}, not a scalar")
    except Exception as e:  # noqa: BLE001
        prog.end("builds", False, _why(e))
        return
    prog.end("builds", True)
    widen()

    from mcompile.api import compile_plan
    from mcompile.capture.export import capture
    from mcompile.ir.mesh import Mesh
    from mcompile.sharding.propagate import FallbackWarning
    from mcompile.sharding.quality import PlanQualityWarning

    prog.start("captures")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cap = capture(copy.deepcopy(model), (), kw)
        out = [v.meta.get("val") for v in cap.gm.graph.output_node().args[0]]
        if not (len(out) == 1 and getattr(out[0], "ndim", None) == 0):
            raise RuntimeError(f"captured {cap.output}, not a scalar loss")
        prog.end("captures", True, output=cap.output)
    except Exception as e:  # noqa: BLE001
        prog.end("captures", False, _why(e))
        return

    prog.start("plans_tp2")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c = compile_plan(model, Mesh.fake(tp=2), (), kw)
    except Exception as e:  # noqa: BLE001
        prog.end("plans_tp2", False, _why(e))
        return
    fallback = [str(w.message).splitlines()[0] for w in caught if issubclass(w.category, FallbackWarning)]
    n_fb = len(c.plan.fallbacks)
    reason = None
    if fallback or n_fb:
        reason = f"FallbackWarning: {fallback[0]}" if fallback else f"plan.fallbacks: {c.plan.fallbacks[0]}"
    prog.end("plans_tp2", not reason, reason, fallbacks=n_fb, fallback_warnings=fallback[:5] or None)

    prog.start("megatron_layout")
    quality = [str(w.message).splitlines()[0] for w in caught if issubclass(w.category, PlanQualityWarning)]
    findings = [str(f) for f in c.quality]
    reason = None
    if quality or findings:
        reason = f"PlanQualityWarning: {(findings or quality)[0]}"
    prog.end("megatron_layout", not reason, reason, findings=findings[:5] or None)

    prog.start("parity_tp2")
    try:
        worst, losses = _parity(c, ref, kw)
        ok = worst["loss"] <= RTOL and worst["grad"] <= RTOL and worst["noise"] <= NOISE
        reason = None if ok else (
            f"loss relative error {worst['loss']:.1e} (step {worst['loss_step']})" if worst["loss"] > RTOL else
            f"gradient relative error {worst['grad']:.1e} in {worst['grad_param']} (step {worst['grad_step']})"
            if worst["grad"] > RTOL else f"a zero gradient off by {worst['noise']:.1e} of the largest gradient")
        floor = {} if "floor" not in worst else {  # information only: not part of the criterion
            "fp32_floor_grad_rel": worst["floor"], "fp32_floor_worst_grad": worst["floor_param"],
            "fp32_floor_of_worst_grad": worst["floor_of"].get(worst["grad_param"], 0.0)}
        if "floor_failed" in worst:
            floor = {"fp32_floor_failed": worst["floor_failed"]}
        prog.end("parity_tp2", ok, reason, max_loss_rel=worst["loss"], max_grad_rel=worst["grad"],
                 worst_grad=worst["grad_param"], max_zero_grad_abs=worst["noise"], **floor,
                 noise_level_grads=sorted(worst["noise_level"]) or None, losses=losses)
    except Exception as e:  # noqa: BLE001
        prog.end("parity_tp2", False, _why(e))


def _absmax(t) -> float:
    """The largest magnitude in ``t``; 0 for a tensor with no elements (``max()`` refuses one)."""
    return float(t.abs().max()) if t.numel() else 0.0


def float64_experts() -> None:
    """Transformers' grouped-GEMM experts call ``torch._grouped_mm``, which has no float64 kernel: at float64 they
    take transformers' own fallback (its ``grouped_mm_fallback`` op, a loop of per-expert matmuls, which it
    takes itself under torch.compile for any dtype but bf16), on both sides."""
    import torch
    from transformers.integrations import moe

    if getattr(moe._can_use_grouped_mm, "_float64", False):
        return
    can = moe._can_use_grouped_mm

    def can_use(input, weight, offs):
        return weight.dtype != torch.float64 and can(input, weight, offs)

    can_use._float64 = True
    moe._can_use_grouped_mm = can_use


class _Float64Torch:
    """``torch`` as a module of transformers sees it under :func:`float64_casts`: its float32 is float64."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name: str):
        return self._torch.float64 if name in ("float32", "float") else getattr(self._torch, name)


@contextlib.contextmanager
def float64_casts():
    """Inside: the casts to float32 of a model's own code keep float64. Hugging Face models compute parts in fp32
    whatever their dtype (``hidden_states.to(torch.float32)`` in RMSNorm, ``.float()`` in rotary tables and
    gated-delta kernels, ``softmax(..., dtype=torch.float32)``), so a ``.double()`` copy still rounds there: a
    float64 run of BailingHybrid then differed by 9.6e-6 between two exact programs (5.9e-15 with the casts
    kept float64), and the fp32 floor measured against such a copy was the difference of two partly-fp32 runs.
    Every loaded ``transformers`` module's ``torch`` reads float64 for ``float32`` / ``float``, and
    ``Tensor.float()`` is ``.double()``; restored on exit. Only for float64 runs and the floor's float64 copy."""
    import torch

    proxy = _Float64Torch(torch)
    mods = [m for n, m in list(sys.modules.items()) if n.startswith("transformers") and
            getattr(m, "torch", None) is torch]
    to_float = torch.Tensor.float
    try:
        for m in mods:
            m.torch = proxy
        torch.Tensor.float = lambda self, *a, **k: self.double(*a, **k)
        yield
    finally:
        torch.Tensor.float = to_float
        for m in mods:
            m.torch = torch


def _parity(c, ref, kw) -> tuple[dict, list]:
    """Stage 5 (module docstring): the largest relative errors (and where), and per step the loss and the
    independently trained reference's loss. In fp32 also the fp32 rounding floor, as information: the
    single-device fp32 model's own gradient error against a float64 copy of it at the same parameters
    (``floor``: the largest over the parameters, ``floor_of``: per parameter, the largest over the steps)."""
    import torch

    sys.path.append(str(_results.ROOT / "tests"))
    from sim_harness import combine_grads  # how the runtime reduces each placement's gradient

    from mcompile.runtime.sim import ThreadedWorld, run_threads

    cap = c.captured
    state = dict(cap.state_values())
    alone = copy.deepcopy(ref)  # trained on its own gradients: the drift, recorded, not judged
    ref_params = dict(ref.named_parameters())
    alias = {f: canon for canon, group in cap.tied.items() for f in group}
    full = {fqn: state[ph].detach().clone() for ph, fqn in cap.params.items()}  # the plan's parameters, full
    for f, p in ref_params.items():
        if not torch.equal(full[alias.get(f, f)], p.detach()):
            raise RuntimeError(f"the captured value of {f} is not the model's")
    # a frozen parameter (requires_grad=False: Marian's sinusoidal positions) gets no gradient, as in the model
    needs_grad = {alias.get(f, f) for f, p in ref.named_parameters(remove_duplicate=False) if p.requires_grad}
    trained = {ph for ph, fqn in cap.params.items() if fqn in needs_grad}
    opt_full, opt_alone = torch.optim.AdamW(list(full.values())), torch.optim.AdamW(alone.parameters())
    worst = {"loss": 0.0, "grad": 0.0, "loss_step": 0, "grad_step": 0, "grad_param": "", "noise_level": set(),
             "noise": 0.0}
    exact = None  # the float64 copy of the fp32 reference (the fp32 floor); none when the run is float64 already
    if next(iter(ref_params.values())).dtype == torch.float32:
        float64_experts()  # its grouped-GEMM experts have no float64 kernel (the fp32 side is untouched)
        exact = copy.deepcopy(ref).double()
        exact_params = dict(exact.named_parameters())
        worst.update(floor=0.0, floor_param="", floor_of={})
    losses = []
    for step in range(STEPS):
        with torch.no_grad():  # the reference at the plan's current parameters
            for f, p in ref_params.items():
                p.copy_(full[alias.get(f, f)])
                p.grad = None
        ref_loss = ref(**kw).loss
        ref_loss.backward()
        if exact is not None:
            with torch.no_grad():
                for f, p in exact_params.items():
                    p.copy_(full[alias.get(f, f)])
                    p.grad = None
            try:
                with float64_casts():
                    exact(**kw).loss.backward()
            except Exception as e:  # noqa: BLE001 - information only: a model that will not run in float64
                worst["floor_failed"] = _why(e)  # (Inkling2's experts mix dtypes) has no floor, not a failed parity
                exact, exact_params = None, {}
            top = top_of(ref_params)
            for f, p in ref_params.items() if exact is not None else ():
                g64 = exact_params[f].grad
                if p.grad is None or g64 is None or p.numel() == 0 or float(p.grad.abs().max()) <= NOISE * top:
                    continue
                err = float((p.grad.double() - g64).abs().max()) / float(g64.abs().max())
                worst["floor_of"][f] = max(worst["floor_of"].get(f, 0.0), err)
                if err > worst["floor"]:
                    worst.update(floor=err, floor_param=f)
        opt_alone.zero_grad(set_to_none=True)
        alone_loss = alone(**kw).loss
        alone_loss.backward()
        opt_alone.step()
        losses.append({"loss": float(ref_loss), "trained_alone": float(alone_loss)})
        world = ThreadedWorld(c.mesh)

        def rank_fn(r):
            local = {k: v.detach().clone().requires_grad_(k in trained) for k, v in c.local_state(r, state).items()}
            out = c.run_local(r, local, (), kw)
            out[0].backward()
            # a parameter this rank's program does not use has a zero gradient (None in autograd)
            return out[0].detach(), {k: v.grad if v.grad is not None else torch.zeros_like(v)
                                     for k, v in local.items() if k in cap.params}  # frozen: zeros

        results = run_threads(world, rank_fn)
        for loss, _ in results:
            err = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
            if err > worst["loss"]:
                worst.update(loss=err, loss_step=step + 1)
        got = combine_grads(c, [g for _, g in results])
        top = top_of(ref_params)
        for f, p in ref_params.items():
            mine = got[alias.get(f, f)]
            if p.numel() == 0:  # nothing to compare (MobileBert's cls.predictions.dense [vocab, 0] at equal widths)
                full[alias.get(f, f)].grad = None if p.grad is None else mine.clone()
                continue
            if p.grad is None:
                if _absmax(mine) > 0:
                    raise RuntimeError(f"{f} has no gradient in the model but a nonzero one in the plan")
                full[alias.get(f, f)].grad = None
                continue
            if float(p.grad.abs().max()) <= NOISE * top:
                # zero in exact arithmetic (an attention key bias: softmax ignores a per-query constant), so
                # both sides hold rounding noise and a relative error means nothing: an absolute bound instead
                # against the model's largest gradient (as tests/test_family_bert.py holds BERT's key.bias)
                worst["noise_level"].add(f)
                worst["noise"] = max(worst["noise"], float((mine - p.grad).abs().max()) / top)
                err = 0.0
            else:
                err = float((mine - p.grad).abs().max()) / float(p.grad.abs().max())
            if err > worst["grad"]:
                worst.update(grad=err, grad_step=step + 1, grad_param=f)
            full[alias.get(f, f)].grad = mine.clone()
        opt_full.step()  # AdamW on the combined full gradients; resharded by local_state next step
        for ph, fqn in cap.params.items():
            state[ph] = full[fqn]
    return worst, losses


def top_of(params: dict) -> float:
    """The model's largest gradient entry (the scale a rounding-noise gradient is held to)."""
    return max(_absmax(p.grad) for p in params.values() if p.grad is not None)


# -- the run (the parent process) -----------------------------------------------------------------------------


def run_child(arch: dict, timeout: float, dtype: str = "float32") -> dict:
    """One architecture in a niced subprocess; its record, with the stage a timeout or a crash hit."""
    if "import_error" in arch:
        rec = {"name": arch["name"], "kind": arch["kind"], "dtype": dtype,
               "stages": {s: {"outcome": "skipped"} for s in STAGES}}
        rec["stages"]["builds"] = {"outcome": "fail", "reason": arch["import_error"]}
        rec["seconds"] = 0.0
        return rec
    with tempfile.TemporaryDirectory(prefix="mcompile-zoo-") as tmp:
        path = Path(tmp) / "progress.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        cmd = ["nice", "-n", "19", sys.executable, str(Path(__file__).resolve()), "--child", arch["name"],
               "--child-kind", arch["kind"], "--child-progress", str(path), "--dtype", dtype]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout)
            failure = None if proc.returncode == 0 else \
                f"the process exited with {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1][:200]}"
        except subprocess.TimeoutExpired:
            failure = f"timeout after {timeout:.0f} s"
        seconds = round(time.perf_counter() - t0, 1)
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            rec = {"name": arch["name"], "kind": arch["kind"], "dtype": dtype,
                   "stages": {s: {"outcome": "skipped"} for s in STAGES}, "running": "builds"}
    if failure:
        stage = rec.pop("running", None)
        if stage:
            rec["stages"][stage] = {"outcome": "fail", "reason": failure}
        else:
            rec["error"] = failure
    rec["seconds"] = seconds
    return rec


def passed(rec: dict) -> bool:
    return all(rec["stages"][s]["outcome"] == "pass" for s in STAGES)


def summary(records: list[dict]) -> dict:
    """Per kind (and over all): the architectures run and the fraction passing each stage and all of them."""
    out = {}
    for kind in (*KINDS, "all"):
        recs = [r for r in records if kind in ("all", r["kind"])]
        if not recs:
            continue
        row = {"run": len(recs)}
        for s in STAGES:
            row[s] = round(sum(r["stages"][s]["outcome"] == "pass" for r in recs) / len(recs), 3)
        row["all_stages"] = round(sum(passed(r) for r in recs) / len(recs), 3)
        out[kind] = row
    return out


def _group(reason: str) -> str:
    """A failure reason without what differs per model (numbers, quoted names, layer lists, shapes)."""
    if "forward tp collectives where Megatron runs" in reason:  # the collectives listed differ per model
        return "PlanQualityWarning: more forward tp collectives per layer than Megatron runs"
    r = re.sub(r"\b[a-z][a-z_]*_\d+\b", "<node>", reason)  # captured node names: mean_1, linear_12
    r = re.sub(r"'[^']*'|\"[^\"]*\"|`[^`]*`", "'…'", r)
    r = re.sub(r"\[[^\]]*\]|\([^)]*\)", "(…)", r)
    r = re.sub(r"\b\d[\d.e+-]*\b", "N", r)
    r = re.sub(r"\b(layers?) N(, N)*(, \.\.\.)?", r"\1 N", r)
    return r[:160]


def failure_groups(records: list[dict]) -> list[dict]:
    """Every failing stage's reason, grouped by stage and reason (most common first): a plan with fallbacks
    still has its layout and parity judged, so one architecture may appear under several stages."""
    groups: dict = collections.defaultdict(list)
    for r in records:
        for s in STAGES:
            st = r["stages"][s]
            if st["outcome"] == "fail":
                groups[(s, _group(st.get("reason", "")))].append(r["name"])
    return [{"stage": s, "reason": why, "count": len(names), "architectures": sorted(names)}
            for (s, why), names in sorted(groups.items(), key=lambda kv: -len(kv[1]))]


def table(rec: dict) -> str:
    """The record as a markdown table: architecture, kind, each stage ✓ / ✗ (with the reason) / – (not run)."""
    mark = {"pass": "✓", "skipped": "–"}
    lines = ["| architecture | kind | " + " | ".join(STAGES) + " |", "|---|---|" + "---|" * len(STAGES)]
    for r in sorted(rec["architectures"].values(), key=lambda r: (KINDS.index(r["kind"]), r["name"])):
        cells = []
        for s in STAGES:
            st = r["stages"][s]
            cells.append(mark.get(st["outcome"]) or "✗ " + st.get("reason", st["outcome"]).replace("|", "\\|")[:120])
        lines.append(f"| {r['name']} | {r['kind']} | " + " | ".join(cells) + " |")
    if rec.get("skipped"):
        lines += ["", "| not run | kind | reason |", "|---|---|---|"]
        lines += [f"| {s['name']} | {s['kind']} | {s['reason']} |" for s in rec["skipped"]]
    return "\n".join(lines)


def _write(path: Path | None, rec: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rec, indent=1, default=str, ensure_ascii=False) + "\n")
    os.replace(tmp, path)  # a kill leaves the old record or the new one, never half of one


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _results.add_arguments(ap, NAME)
    ap.add_argument("--resume", action="store_true", help="keep the architectures the record already has")
    ap.add_argument("--redo", action="store_true",
                    help="with --resume and --only: run the named architectures again, replacing their records "
                         "(the record's runs list says which commit ran which names)")
    ap.add_argument("--only", default=None, help="comma-separated class names")
    ap.add_argument("--kind", choices=KINDS, default=None)
    ap.add_argument("--every", type=int, default=1, help="run every K-th architecture of each kind (a subset)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per architecture")
    ap.add_argument("--jobs", type=int, default=1, help="architectures run at once (one process each)")
    ap.add_argument("--table", action="store_true", help="print the record (--out, else the committed one) as markdown")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                    help="the model's and the plan's dtype (both sides, the model's own float32 casts kept float64: "
                         "float64_casts); a diagnostic: a correct program agrees to ~1e-12 there (the issue's "
                         "criterion is fp32's)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-kind", help=argparse.SUPPRESS)
    ap.add_argument("--child-progress", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run_one(args.child, args.child_kind, Path(args.child_progress), args.dtype)
        return
    path = _results.destination(NAME, args.write, args.out, temporary=True)
    if args.table:
        src = Path(args.out) if args.out else _results.RESULTS / f"{NAME}.json"
        print(table(json.loads(src.read_text())))
        return

    import transformers

    wanted = set(args.only.split(",")) if args.only else None
    todo, skipped = zoo(wanted)
    if wanted:
        unknown = wanted - {a["name"] for a in todo} - {s["name"] for s in skipped}
        if unknown:
            sys.exit(f"--only: {', '.join(sorted(unknown))} is not a causal LM, masked LM or encoder-decoder class "
                     f"of transformers {transformers.__version__}")
    total = collections.Counter(a["kind"] for a in todo)
    if args.kind:
        todo = [a for a in todo if a["kind"] == args.kind]
    if args.every > 1:
        todo = [a for k in KINDS for a in [a for a in todo if a["kind"] == k][::args.every]]
    rec = json.loads(path.read_text()) if args.resume and path and path.exists() else {}
    archs = rec.get("architectures", {}) if args.resume else {}
    runs = rec.get("runs", []) + [{"only": args.only, "kind": args.kind, "every": args.every, "dtype": args.dtype,
                                   "commit": _results.commit(),
                                   "date": time.strftime("%Y-%m-%d %H:%M")}]
    if not wanted or "total_in_zoo" not in rec:
        rec["total_in_zoo"] = dict(total)  # with --only: of those names
    if not wanted or "skipped" not in rec:
        rec["skipped"] = skipped
    rec.update({
        "benchmark": NAME, "transformers": transformers.__version__, "torch": __import__("torch").__version__,
        "machine": _results.machine(), "commit": _results.commit(), "date": time.strftime("%Y-%m-%d"),
        "tiny": {"hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS, "intermediate": FFN,
                 "vocab": VOCAB, "head_dim": HEAD_DIM, "batch": BATCH, "seq": SEQ, "steps": STEPS, "rtol": RTOL},
        "timeout_s": args.timeout, "dtype": args.dtype, "runs": runs, "architectures": archs,
    })
    print(f"{len(todo)} architectures to run ({dict(total)} of {'those named' if wanted else 'the zoo'}; "
          f"{len(skipped)} not run, with a reason); "
          f"record: {path}", file=sys.stderr)
    if args.redo and not (args.resume and wanted):
        sys.exit("--redo replaces named architectures in an existing record: give it with --resume and --only")
    pending = [a for a in todo if args.redo or a["name"] not in archs]
    done = len(todo) - len(pending)
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:  # each job waits on its own process
        futures = {pool.submit(run_child, arch, args.timeout, args.dtype): arch for arch in pending}
        for fut in concurrent.futures.as_completed(futures):
            arch, r = futures[fut], fut.result()
            archs[arch["name"]] = r
            done += 1
            first = next((f"{s}: {r['stages'][s].get('reason', '')}" for s in STAGES
                          if r["stages"][s]["outcome"] == "fail"), "all stages pass")
            print(f"[{done}/{len(todo)}] {arch['name']} ({arch['kind']}, {r['seconds']} s): {first[:150]}",
                  file=sys.stderr)
            rec["summary"], rec["failures"] = summary(list(archs.values())), failure_groups(list(archs.values()))
            _write(path, rec)
    rec["summary"], rec["failures"] = summary(list(archs.values())), failure_groups(list(archs.values()))
    _write(path, rec)
    for kind, row in rec["summary"].items():
        print(f"{kind:16s} run {row['run']:3d}  " + "  ".join(f"{s} {row[s]:.2f}" for s in (*STAGES, "all_stages")))
    for g in rec["failures"][:15]:
        print(f"  {g['count']:3d}  {g['stage']}: {g['reason']}")
    if path:
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
