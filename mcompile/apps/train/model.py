"""What a run trains: the model ``[model]`` names (a preset, a Hugging Face config, or a factory), the inputs it
is captured with, and the data files shipped with mcompile (the ``tiny`` corpus and tokenizer). Used by the training
loop (mcompile.apps.train.loop), the export (mcompile.apps.train.export) and the commands around them."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import sys
from pathlib import Path

import torch

from mcompile.apps.train.config import ConfigError, TrainConfig

__all__ = ["build_model", "example_inputs"]


def _import(spec: str, key: str):
    mod, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:  # a package of the current folder, as `python -m`
        # appended, not first: installed packages keep their names (a checkout's folders, such as mcompile's own
        # kernels/, would otherwise shadow the Hub's `kernels` that transformers imports)
        sys.path.append(os.getcwd())
    try:
        return getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key} = {spec!r}: cannot load it ({e})") from e


def build_model(cfg: TrainConfig):
    """(model, vocab_size, example_inputs or None) as ``[model]`` says; on the meta device when
    ``model.init = "meta"``."""
    m = cfg.model
    torch.manual_seed(cfg.train.seed)
    device = torch.device("meta") if m.init == "meta" else contextlib.nullcontext()
    example = None
    if m.preset:
        from mcompile.models import get_preset

        pre = get_preset(m.preset)
        try:
            config = dataclasses.replace(pre.config, **m.overrides)  # the config validates the new values
        except ValueError as e:
            raise ConfigError(f"model.overrides {m.overrides} of preset {m.preset!r}: {e}") from e
        with device:
            model = pre.model_class(config)
        vocab = config.vocab_size
    elif m.hf:
        # the bare Hugging Face model: its checkpoints hold its own names (eval, generate, weights= and the
        # exporter read them as they are); mcompile binds its example inputs as (input_ids, labels)
        import transformers

        from mcompile.apps.train.objective import resolve

        hf_config = _hf_config(m.hf)
        for k, v in m.overrides.items():
            if not hasattr(hf_config, k):
                raise ConfigError(f"unknown key 'model.overrides.{k}': {type(hf_config).__name__} has no field {k!r}")
            setattr(hf_config, k, v)
        objective = resolve(cfg)
        auto = getattr(transformers, objective.auto_class)
        try:
            with device:
                model = auto.from_config(hf_config)
        except ValueError as e:
            raise ConfigError(f"model.hf = {m.hf!r}: {auto.__name__} cannot build a {type(hf_config).__name__} "
                              f"(objective {objective.kind!r}): set model.objective to what the model is trained "
                              f"for ({e})") from None
        vocab = hf_config.vocab_size
    else:
        factory = _import(m.factory, "model.factory")
        with device:
            made = factory(**m.kwargs)
        model, example = made if isinstance(made, tuple) else (made, None)
        emb = next((x for x in model.modules() if isinstance(x, torch.nn.Embedding)), None)
        vocab = emb.num_embeddings if emb is not None else None
    return model, vocab, example


def example_inputs(cfg: TrainConfig, objective, vocab: int | None, batch: int = 2) -> tuple:
    """The inputs the model is captured with: random tokens of ``train.seq_len`` through the run's objective
    (random ids, not zeros: a Hugging Face model's second input is taken for an attention mask when 0/1)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab or 2, (batch, cfg.train.seq_len + 1), generator=g)
    return objective.inputs(tokens[:, :-1], tokens[:, 1:])


def _hf_config(path: str):
    from transformers import AutoConfig

    p = Path(path)
    if p.is_file():  # a config.json itself
        d = json.loads(p.read_text())
        if "model_type" not in d:
            raise ConfigError(f"model.hf = {path!r}: the JSON has no model_type; give a Hugging Face config.json")
        return AutoConfig.for_model(d.pop("model_type"), **d)
    if not (p / "config.json").is_file():
        raise ConfigError(f"model.hf = {path!r}: neither a config.json nor a folder holding one")
    return AutoConfig.from_pretrained(str(p))



def _shipped(name: str, kind: str) -> str:
    if name != "tiny":
        return name
    import mcompile.apps.data as data

    return str(data.tiny_corpus() if kind == "corpus" else data.tiny_tokenizer())
