"""Hugging Face weights in and out: export a trained model to a ``from_pretrained`` folder, and import a
Hugging Face checkpoint into our presets.

- :func:`export_hf` ``(pm, folder, model)``: a :class:`~mcompile.runtime.module.ParallelModule` (collective:
  call it on every rank) or a plain single-device module, written as ``save_pretrained`` would write it:
  ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` shards and ``model.safetensors.index.json``),
  ``config.json`` and, when the model has one, ``generation_config.json``, such that
  ``AutoModelForCausalLM.from_pretrained(folder)`` loads it with no missing and no unexpected key.
- :func:`hf_config_for` ``(model)``: the ``transformers`` config of a llama3-* / gpt2-* preset model.
- :func:`hf_source` ``(folder, model)``: a Hugging Face checkpoint seen under the names and layouts of
  ``model`` (a preset), to pass as ``parallelize(..., weights=hf_source(folder, model))``.
- :func:`config_from_hf` ``(folder)``: the preset config (``LlamaConfig`` / ``GPTConfig``) that holds a
  Hugging Face Llama / GPT-2 checkpoint, to build the model to import it into.

Names. A Hugging Face model parallelized directly (bare, or in a wrapper that prefixes every key, as
:class:`mcompile.models.hf.CausalLMLoss`'s ``m.``) keeps its own names and its own config. Our presets map:

- llama3-* (models/llama.py) <-> ``LlamaForCausalLM``, same layouts: ``tok_embeddings`` <-> ``model.embed_tokens``;
  ``layers.i.attention_norm`` <-> ``model.layers.i.input_layernorm``; ``layers.i.attention.wq|wk|wv|wo`` <->
  ``model.layers.i.self_attn.q_proj|k_proj|v_proj|o_proj``; ``layers.i.ffn_norm`` <->
  ``model.layers.i.post_attention_layernorm``; ``layers.i.feed_forward.w1|w3|w2`` <->
  ``model.layers.i.mlp.gate_proj|up_proj|down_proj``; ``norm`` <-> ``model.norm``; ``output`` <-> ``lm_head``.
  Config: dim, layers, heads, kv heads (GQA), ffn, vocabulary, rope theta, norm eps, tied or not.
- gpt2-* (models/gpt.py) <-> ``GPT2LMHeadModel``: the same names; the weights of ``attn.c_attn``,
  ``attn.c_proj``, ``mlp.c_fc`` and ``mlp.c_proj`` transposed (Hugging Face's Conv1D stores ``[in, out]``).

Why no permutation of ``wq`` / ``wk``: our rotary embedding is the rotate-half form over ``cat(freqs,
freqs)`` (the two halves of a head are the pair that rotates), which is the convention of Hugging Face's
Llama (Su et al. 2021, "RoFormer", with the pairs taken as (i, i + d/2) rather than (2i, 2i + 1));
Meta's original checkpoints use the interleaved pairs and are permuted when converted to Hugging Face,
ours need not be. tests/test_hf_io.py checks it numerically: the preset's logits and the Hugging Face
model's are equal. GPT-2's fused ``c_attn`` splits its output into q, k, v in the same order in both.

Tied weights are written once, under the name Hugging Face keeps (the first of the group in the
``state_dict`` order: the input embedding); ``from_pretrained`` ties the other.

Streaming. A ParallelModule is gathered one tensor at a time onto rank 0 (each tensor assembled from its
pieces over the axes it is sharded on; under pipeline parallelism sent from the stage that owns it), and
rank 0 writes each shard file as soon as its tensors are in: rank 0 holds at most one shard
(``max_shard_size``) plus one tensor, every other rank at most one tensor besides its pieces. Everything
that can fail is checked first (the names and shapes against the Hugging Face model the config builds,
on the meta device; the folder writable), on every rank, and every rank raises the same error.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from mcompile.runtime.weights import _fmt_names  # the same "a, b, ... and N more" as weights= errors

__all__ = ["HFSource", "config_from_hf", "export_hf", "hf_config_for", "hf_source"]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


# -- the preset <-> Hugging Face name mappings ------------------------------------------------------
@dataclass(frozen=True)
class _Rule:
    ours: str  # a name pattern, "{i}" the layer index
    hf: str
    transposed: bool = False  # HF Conv1D stores a Linear's weight as [in, out]

    def _regex(self, side: str) -> re.Pattern:
        return re.compile("^" + re.escape(getattr(self, side)).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


_LLAMA = [_Rule(o, h) for o, h in [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
]]
_GPT_T = {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"}
_GPT = [_Rule(n, n, n.split(".", 3)[-1] in _GPT_T) for n in [
    "transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias",
    "lm_head.weight",
    *(f"transformer.h.{{i}}.{part}.{wb}" for part in ("ln_1", "ln_2", "attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                       "mlp.c_proj") for wb in ("weight", "bias")),
]]


class _Names:
    """One family's renaming, both ways: ``to_hf(name) -> (hf_name, transposed)``, ``from_hf`` the inverse;
    None for a name the mapping does not know."""

    def __init__(self, rules: list[_Rule] | None):
        self.rules = rules
        self._ours = [(r, r._regex("ours")) for r in rules or ()]
        self._hf = [(r, r._regex("hf")) for r in rules or ()]

    def to_hf(self, name: str) -> tuple[str, bool] | None:
        return self._map(name, self._ours, "hf")

    def from_hf(self, name: str) -> tuple[str, bool] | None:
        return self._map(name, self._hf, "ours")

    def _map(self, name, table, side):
        if self.rules is None:  # a Hugging Face model: its own names
            return name, False
        for rule, rx in table:
            m = rx.match(name)
            if m:
                return getattr(rule, side).replace("{i}", m.groupdict().get("i") or ""), rule.transposed
        return None


@dataclass
class _Family:
    """What a model is, as far as Hugging Face names go."""

    kind: str  # "hf", "llama" (our preset), "gpt" (our preset)
    module: nn.Module  # the model itself (a wrapper's inner model)
    prefix: str  # the wrapper's prefix of every key ("m." for CausalLMLoss), "" for none
    names: _Names


def _is_hf(module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency of the HF paths only
        return False
    return isinstance(module, PreTrainedModel)


def _family(model: nn.Module) -> _Family:
    """The model or the outermost submodule that is a Hugging Face model or a preset, and the prefix of
    its keys (a wrapper's, such as CausalLMLoss's ``m.``)."""
    from mcompile.models.gpt import GPT
    from mcompile.models.llama import Llama

    keys = list(model.state_dict().keys())
    for name, sub in model.named_modules():
        prefix = f"{name}." if name else ""
        if not all(k.startswith(prefix) for k in keys):
            continue
        if _is_hf(sub):
            return _Family("hf", sub, prefix, _Names(None))
        if isinstance(sub, Llama):
            return _Family("llama", sub, prefix, _Names(_LLAMA))
        if isinstance(sub, GPT):
            return _Family("gpt", sub, prefix, _Names(_GPT))
    raise TypeError(f"{type(model).__name__} is neither a Hugging Face PreTrainedModel (bare or in a wrapper such "
                    "as mcompile.models.hf.CausalLMLoss) nor a llama3-*/gpt2-* preset model (mcompile.models): "
                    "pass hf_config= (its keys are then taken as the Hugging Face model's, without a wrapper's "
                    "prefix), or wrap the Hugging Face model itself")


# -- configs ----------------------------------------------------------------------------------------
def _transformers(feature: str):
    from mcompile.ir.compat import require

    return require("transformers", feature, extra="hf")


def hf_config_for(model: nn.Module, **overrides):
    """The ``transformers`` config of a llama3-* (``LlamaConfig``) or gpt2-* (``GPT2Config``) preset model
    (or of a wrapper around one); ``overrides`` are set on it (e.g. ``eos_token_id=``). The token ids are
    left unset (a preset knows no tokenizer), except GPT-2's ``<|endoftext|>`` 50256 when the vocabulary
    is GPT-2's 50257."""
    fam = _family(model)
    if fam.kind == "hf":
        cfg = fam.module.config.__class__.from_dict(fam.module.config.to_dict())
    elif fam.kind == "llama":
        LlamaConfig = _transformers("hf_config_for (a Hugging Face config of a preset model)").LlamaConfig

        c = fam.module.config
        cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_hidden,
                          num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
                          num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim, hidden_act="silu",
                          max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps,
                          rope_parameters={"rope_type": "default", "rope_theta": float(c.rope_theta)},
                          tie_word_embeddings=c.tie_embeddings, attention_bias=False, mlp_bias=False,
                          bos_token_id=None, eos_token_id=None, architectures=["LlamaForCausalLM"])
    else:
        GPT2Config = _transformers("hf_config_for (a Hugging Face config of a preset model)").GPT2Config

        c = fam.module.config
        if not c.bias:
            raise ValueError("GPTConfig(bias=False) has no Hugging Face GPT-2 equivalent (GPT2LMHeadModel always "
                             "has biases): export a model built with bias=True")
        eos = 50256 if c.vocab_size == 50257 else None
        cfg = GPT2Config(vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer,
                         n_head=c.n_head, n_inner=None, activation_function="gelu_new",
                         resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout,
                         layer_norm_epsilon=c.layer_norm_eps, tie_word_embeddings=True, scale_attn_weights=True,
                         bos_token_id=eos, eos_token_id=eos, architectures=["GPT2LMHeadModel"])
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def _read_hf_config(folder_or_config):
    if isinstance(folder_or_config, (str, os.PathLike)):
        AutoConfig = _transformers("reading a Hugging Face config.json (mcompile.apps.hf_io)").AutoConfig

        folder = Path(folder_or_config)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder}: no config.json (a folder written by save_pretrained / export_hf "
                                    "has one)")
        return AutoConfig.from_pretrained(str(folder))
    return folder_or_config


def _rope(cfg) -> tuple[str, float | None]:
    rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = rp.get("rope_type", rp.get("type", "default"))
    theta = rp.get("rope_theta", getattr(cfg, "rope_theta", None))
    return kind, theta


def config_from_hf(folder_or_config):
    """The preset config holding a Hugging Face Llama (``LlamaConfig`` of models/llama.py) or GPT-2
    (``GPTConfig``) checkpoint: ``Llama(config_from_hf(folder))`` builds the model to import it into. A
    feature the preset does not have (biases in Llama, RoPE scaling, another head_dim, another activation)
    is an error naming it."""
    from mcompile.models.gpt import GPTConfig
    from mcompile.models.llama import LlamaConfig

    cfg = _read_hf_config(folder_or_config)
    kind = getattr(cfg, "model_type", None)
    bad = []
    if kind == "llama":
        rope, theta = _rope(cfg)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        checks = [("hidden_act", cfg.hidden_act, "silu"), ("attention_bias", cfg.attention_bias, False),
                  ("mlp_bias", getattr(cfg, "mlp_bias", False), False), ("rope type", rope, "default"),
                  ("head_dim", head_dim, cfg.hidden_size // cfg.num_attention_heads),
                  ("pretraining_tp", getattr(cfg, "pretraining_tp", 1) or 1, 1)]
        bad = [f"{n}={have!r} (the preset has {want!r})" for n, have, want in checks if have != want]
        out = None if bad else LlamaConfig(
            vocab_size=cfg.vocab_size, dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers,
            n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            ffn_hidden=cfg.intermediate_size, norm_eps=cfg.rms_norm_eps, rope_theta=float(theta),
            max_seq_len=cfg.max_position_embeddings, tie_embeddings=bool(cfg.tie_word_embeddings))
    elif kind == "gpt2":
        checks = [("activation_function", cfg.activation_function in ("gelu_new", "gelu_pytorch_tanh"), True),
                  ("n_inner", cfg.n_inner in (None, 4 * cfg.n_embd), True),
                  ("scale_attn_weights", cfg.scale_attn_weights, True),
                  ("scale_attn_by_inverse_layer_idx", cfg.scale_attn_by_inverse_layer_idx, False),
                  ("add_cross_attention", getattr(cfg, "add_cross_attention", False), False),
                  ("tie_word_embeddings", cfg.tie_word_embeddings, True)]
        bad = [f"{n}={getattr(cfg, n, None)!r}" for n, ok, want in checks if ok != want]
        out = None if bad else GPTConfig(
            vocab_size=cfg.vocab_size, block_size=cfg.n_positions, n_layer=cfg.n_layer, n_head=cfg.n_head,
            n_embd=cfg.n_embd, dropout=0.0, bias=True, layer_norm_eps=cfg.layer_norm_epsilon)
    else:
        raise ValueError(f"model_type {kind!r}: the presets hold Hugging Face 'llama' (llama3-*) and 'gpt2' "
                         "(gpt2-*) checkpoints; parallelize any other Hugging Face model itself, with "
                         "weights=FOLDER")
    if bad:
        raise ValueError(f"this {kind} checkpoint uses what the {kind} preset does not implement: {', '.join(bad)}; "
                         "parallelize the Hugging Face model itself (weights=FOLDER) instead")
    return out


# -- import: a Hugging Face checkpoint seen as a preset's ---------------------------------------------
@dataclass(frozen=True)
class _At:
    """Where a preset tensor lies in the Hugging Face files (never a tuple: weights.py reads a tuple
    ``where`` as an mcompile checkpoint's blocks)."""

    file: Path
    hf_key: str
    transposed: bool


@dataclass
class HFSource:
    """A Hugging Face safetensors checkpoint under a preset's names and layouts, with the interface of
    mcompile.runtime.weights' sources (``entries``, ``read``, ``sliceable``, ``what``, ``path``): pass it as
    ``parallelize(model, mesh, inputs, weights=hf_source(folder, model))``. Read lazily, tensor by tensor;
    a transposed tensor's slice is read as the transposed slice of the file."""

    path: Path
    entries: dict
    what: str
    sliceable: bool = True

    def __str__(self) -> str:  # errors and warnings say weights=<folder>
        return str(self.path)

    def read(self, stored, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        from safetensors import safe_open

        at: _At = stored.where
        with safe_open(str(at.file), framework="pt") as f:
            if index is None:
                t = f.get_tensor(at.hf_key)
            else:
                t = f.get_slice(at.hf_key)[tuple(reversed(index)) if at.transposed else index]
        return t.t() if at.transposed else t


def hf_source(folder, model: nn.Module):
    """The Hugging Face checkpoint ``folder`` (``save_pretrained``'s, or :func:`export_hf`'s) under the names
    and layouts of ``model`` (a llama3-*/gpt2-* preset model, or a wrapper of one; it may be on meta).
    Its ``config.json``, when present, must describe ``model`` (every field that changes the result,
    also those not in the weights: rope theta, norm eps): else a WeightsError names each difference.
    For a Hugging Face model the folder is read as it is (``weights=folder`` does the same)."""
    from mcompile.runtime.weights import Stored, WeightsError, open_weights

    fam = _family(model)
    src = open_weights(folder)
    if fam.kind == "hf":
        return src
    if not hasattr(src, "files"):
        raise WeightsError(f"weights={folder}: hf_source reads Hugging Face safetensors checkpoints; this is "
                           f"{src.what}: pass it as weights={folder} directly")
    root = Path(folder)
    if root.is_dir() and (root / "config.json").is_file():
        diff = _config_differences(fam, _config_or_weights_error(root))
        if diff:
            cls = type(fam.module).__name__
            raise WeightsError(f"weights={folder}: its config.json describes another model than the {cls} given: "
                               f"{'; '.join(diff)}. Build the model from the checkpoint's config: "
                               f"{cls}(mcompile.apps.hf_io.config_from_hf(folder))")
    entries = {}
    for hf_key, s in src.entries.items():
        mapped = fam.names.from_hf(hf_key)
        if mapped is None:  # kept under its own name: weights.py lists it as not in the model
            entries[hf_key] = s
            continue
        key, transposed = mapped
        shape = tuple(reversed(s.shape)) if transposed else tuple(s.shape)
        entries[key] = Stored(key, shape, s.dtype, s.kind, where=_At(Path(s.where), hf_key, transposed))
    family = {"llama": "Llama", "gpt": "GPT-2"}[fam.kind]
    return HFSource(Path(folder), entries, f"Hugging Face {family} safetensors ({src.what}) read as the preset's")


def _config_or_weights_error(folder):
    from mcompile.runtime.weights import WeightsError

    try:
        return config_from_hf(folder)
    except ValueError as e:
        raise WeightsError(f"weights={folder}: {e}") from e


def _config_differences(fam: _Family, theirs) -> list[str]:
    ours = fam.module.config
    if type(theirs) is not type(ours):
        return [f"a {type(theirs).__name__} checkpoint for a {type(ours).__name__} model"]
    skip = {"max_seq_len", "dropout"}  # neither changes a weight nor the result
    return [f"{f}: {getattr(theirs, f)!r} in the checkpoint, {getattr(ours, f)!r} in the model"
            for f in vars(ours) if f not in skip and getattr(theirs, f) != getattr(ours, f)]


# -- export -----------------------------------------------------------------------------------------
@dataclass
class _Tensor:
    """One tensor to gather: every name it has in the model (tied names together), its shape, and how to
    get it whole (a collective for a ParallelModule)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    get: object  # () -> the whole tensor on rank 0, None elsewhere


def _pm_tensors(pm) -> list[_Tensor]:
    """A ParallelModule's parameters and persistent buffers, gathered one at a time onto rank 0."""
    order = list(dict.fromkeys(pm._compiled.captured.params.values()))

    def gather(fqn):
        def get():
            p = pm._params.get(fqn)
            pieces = {fqn: p.detach().to_local()} if p is not None else {}
            # held=True: under pp only the stage that owns fqn holds it (one all-reduce over pp says which)
            return pm._across_stages(pieces, rank=0, held=True).get(fqn)
        return get

    out = [_Tensor(tuple(pm._tied.get(f, (f,))), tuple(pm.plan.params[f].shape), gather(f)) for f in order]
    for fqn in pm._persistent_buffers:
        t = pm._extra[pm._buffer_ph[fqn]]
        out.append(_Tensor((fqn,), tuple(t.shape), lambda t=t: t.cpu() if pm._rank == 0 else None))
    return out


def _module_tensors(model: nn.Module) -> list[_Tensor]:
    groups: dict[int, list[str]] = {}
    tensors = {}
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
        tensors[id(t)] = t
    return [_Tensor(tuple(names), tuple(tensors[i].shape), lambda t=tensors[i]: t.detach().cpu())
            for i, names in groups.items()]


def _parse_size(size) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size={size!r}: give bytes (an int) or a size such as '500MB', '5GB', '2GiB'")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** "_KMGT".index(m.group(2).upper() or "_"))


def _hf_meta_model(cfg, cls=None):
    """The Hugging Face model ``cfg`` builds, on the meta device (names, shapes and ties; no memory): of class
    ``cls`` (the model being exported: a masked LM or a seq2seq model too), else the config's first
    ``architectures`` entry, else a causal LM."""
    transformers = _transformers("the Hugging Face exporter (mcompile.apps.hf_io.export_hf)")
    from transformers.utils import logging as hf_logging

    if cls is None:
        arch = next((a for a in (getattr(cfg, "architectures", None) or []) if hasattr(transformers, a)), None)
        cls = getattr(transformers, arch) if arch else transformers.AutoModelForCausalLM
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            return cls.from_config(cfg) if hasattr(cls, "from_config") else cls(cfg)
    finally:
        hf_logging.set_verbosity(verbosity)


@dataclass
class _Entry:
    hf_key: str
    transposed: bool
    shape: tuple[int, ...]  # in the file


def _plan_export(tensors: list[_Tensor], fam: _Family | None, cfg) -> list[list[_Entry]]:
    """Per tensor, the file entries it becomes; checked against the Hugging Face model ``cfg`` builds:
    every one of its tensors written once (a tied one under its kept name), no other, shapes equal."""
    hf = _hf_meta_model(cfg, type(fam.module) if fam is not None and fam.kind == "hf" else None)
    hf_sd = hf.state_dict(keep_vars=True)
    hf_groups: dict[int, list[str]] = {}
    for k, t in hf_sd.items():
        hf_groups.setdefault(id(t), []).append(k)
    kept = {names[0]: names for names in hf_groups.values()}  # a tied group is saved under its first name
    dropped = {n for names in hf_groups.values() for n in names[1:]}
    if fam is None:  # keys already the Hugging Face model's, under some wrapper prefix: the one that fits
        keys = [n for t in tensors for n in t.names]
        prefixes = [""] + sorted({k[: i + 1] for k in keys for i, c in enumerate(k) if c == "."}, key=len)
        prefix = max(prefixes, key=lambda p: (sum(k.startswith(p) and k[len(p):] in hf_sd for k in keys), -len(p)))
        fam = _Family("hf", hf, prefix, _Names(None))
    plan, wrote, unknown, shapes = [], {}, [], []
    holder: dict[str, int] = {}  # Hugging Face name -> the index of the tensor that has it here
    for i, t in enumerate(tensors):
        entries = []
        for name in t.names:
            mapped = fam.names.to_hf(name[len(fam.prefix):]) if name.startswith(fam.prefix) else None
            if mapped is None or mapped[0] not in hf_sd:
                unknown.append(mapped[0] if mapped else name)
                continue
            key, transposed = mapped
            holder[key] = i
            if key in dropped:
                continue  # the kept name of its group carries it (from_pretrained ties the others)
            shape = tuple(reversed(t.shape)) if transposed else t.shape
            if shape != tuple(hf_sd[key].shape):
                shapes.append(f"{key}: {list(shape)} here, {list(hf_sd[key].shape)} in {type(hf).__name__}")
            wrote[key] = name
            entries.append(_Entry(key, transposed, shape))
        plan.append(entries)
    # tied in the Hugging Face model but separate tensors here: writing one would lose the other's values
    untied = [" / ".join(names) for names in kept.values()
              if len({holder[n] for n in names if n in holder}) > 1]
    missing = [k for k in kept if k not in wrote]
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) of {type(hf).__name__} are not in the model: {_fmt_names(missing)}")
    if unknown:
        problems.append(f"{len(unknown)} tensor(s) of the model have no place in {type(hf).__name__}: "
                        f"{_fmt_names(unknown)}")
    if shapes:
        problems.append(f"{len(shapes)} tensor(s) have another shape: {_fmt_names(shapes)}")
    if untied:
        problems.append(f"the config ties {_fmt_names(untied)} but the model holds them as separate tensors: set "
                        "tie_word_embeddings=False in the config")
    if problems:
        raise ValueError("export_hf: the model does not fit the Hugging Face config given: " + "; ".join(problems)
                         + ". Pass the config of this model (or the model itself as model=)")
    return plan, type(hf).__name__


def export_hf(pm, folder, model: nn.Module | None = None, *, hf_config=None, dtype: torch.dtype | None = None,
              max_shard_size: int | str = "5GB") -> Path:
    """Write ``pm`` as a Hugging Face checkpoint folder that ``AutoModelForCausalLM.from_pretrained(folder)``
    loads with no missing and no unexpected key; returns the folder.

    ``pm``: a ParallelModule (collective: call on every rank; rank 0 writes, the others wait for it) or a
    plain module. ``model``: what ``pm`` was built from (it may be on the meta device; a plain module is its
    own): a Hugging Face model (bare or wrapped: its own names and config, its generation config too) or a
    llama3-*/gpt2-* preset (renamed, GPT-2's Conv1D weights transposed, config from :func:`hf_config_for`).
    ``hf_config``: the config to write (default: the model's); with no ``model``, ``pm``'s keys are the
    Hugging Face model's (a wrapper's prefix such as ``m.`` is found). ``dtype``: the stored dtype (default
    float32, what training holds). ``max_shard_size``: bytes per file (an int, or "500MB", "2GiB"); a model
    larger is written as ``model-0000k-of-0000n.safetensors`` shards with ``model.safetensors.index.json``."""
    import torch.distributed as dist

    from mcompile.runtime.module import ParallelModule

    parallel = isinstance(pm, ParallelModule)
    if not parallel and model is None:
        model = pm
    rank = dist.get_rank() if parallel else 0
    folder = Path(os.fspath(folder))
    error, plan, cfg, gen, tensors, architecture = None, None, None, None, None, None
    try:  # everything that can fail, before any collective
        limit = _parse_size(max_shard_size)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype={dtype!r}: give a floating torch dtype (torch.float32, torch.bfloat16, ...)")
        fam = _family(model) if model is not None else None
        if fam is None and hf_config is None:
            raise ValueError("export_hf needs the model pm was built from (model=, it may be on meta) or the "
                             "Hugging Face config to write (hf_config=)")
        cfg = hf_config if hf_config is not None else hf_config_for(model)
        cfg = cfg.__class__.from_dict(cfg.to_dict())  # ours to change
        if fam is not None and fam.kind == "hf" and getattr(fam.module, "generation_config", None) is not None \
                and fam.module.can_generate():
            gen = fam.module.generation_config
        tensors = _pm_tensors(pm) if parallel else _module_tensors(model)
        plan, architecture = _plan_export(tensors, fam, cfg)
        if rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            if not os.access(folder, os.W_OK):
                raise PermissionError(f"export_hf: {folder} is not writable")
    except Exception as e:  # noqa: BLE001 - every rank raises the first rank's error below
        error = e
    _agree(error, parallel)

    out_dtype = dtype or torch.float32
    size_of = torch.empty((), dtype=out_dtype).element_size()
    shards: list[list[tuple[int, _Entry]]] = [[]]  # (tensor index, entry), in gather order
    used = 0
    for i, entries in enumerate(plan):
        for e in entries:
            n = size_of * int(torch.Size(e.shape).numel())
            if shards[-1] and used + n > limit:
                shards.append([])
                used = 0
            shards[-1].append((i, e))
            used += n
    files = [WEIGHTS_NAME] if len(shards) == 1 else \
        [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    completes = {max(i for i, _ in shard): k for k, shard in enumerate(shards) if shard}  # tensor -> its shard

    from safetensors.torch import save_file

    error = None  # rank 0's write error: it still takes part in every gather after it, then all raise it
    held: dict[str, torch.Tensor] = {}  # rank 0: the tensors of the shard being filled
    weight_map, total = {}, 0
    with torch.no_grad():
        for i, t in enumerate(tensors):
            full = t.get()  # collective: every rank, in the same order
            if rank != 0 or error is not None:
                continue
            try:
                for e in plan[i]:
                    held[e.hf_key] = (full.t() if e.transposed else full).to(out_dtype).contiguous().clone()
                    total += held[e.hf_key].numel() * size_of
                del full
                if i in completes:
                    k = completes[i]
                    part = {e.hf_key: held.pop(e.hf_key) for _, e in shards[k]}
                    save_file(part, str(folder / files[k]), metadata={"format": "pt"})
                    weight_map.update(dict.fromkeys(part, files[k]))
                    del part
            except Exception as e:  # noqa: BLE001 - raised on every rank after the last gather
                error, held = e, {}
    if rank == 0 and error is None:
        try:
            for stale in [folder / INDEX_NAME, folder / WEIGHTS_NAME, *folder.glob("model-*-of-*.safetensors")]:
                if stale.name not in files and stale.exists():  # a previous export's: from_pretrained would mix
                    stale.unlink()
            if len(files) > 1:
                (folder / INDEX_NAME).write_text(json.dumps(
                    {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
            cfg.architectures = cfg.architectures or [architecture]
            cfg.dtype = str(out_dtype).removeprefix("torch.")
            cfg.save_pretrained(str(folder))
            if gen is not None:
                gen.save_pretrained(str(folder))
        except Exception as e:  # noqa: BLE001 - raised on every rank
            error = e
    _agree(error, parallel)
    return folder


def _agree(error: BaseException | None, parallel: bool) -> None:
    """Every rank raises rank r's error when any rank r failed (collective when parallel)."""
    if not parallel:
        if error is not None:
            raise error
        return
    import torch.distributed as dist

    msgs = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, None if error is None else f"{type(error).__name__}: {error}")
    bad = [(r, m) for r, m in enumerate(msgs) if m is not None]
    if not bad:
        return
    r, first = bad[0]
    if error is not None and f"{type(error).__name__}: {error}" == first:
        raise error
    raise RuntimeError(f"export_hf failed on rank {r}: {first}") from error
