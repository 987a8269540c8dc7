"""What would fail inside the training processes, checked in the launching process before any starts.

``mcompile train`` / ``eval`` / ``generate`` / ``export`` read the config (every key and type:
mcompile.apps.train.config), then call :func:`preflight`, which raises a one-line :class:`ConfigError`
saying what to do for:

- an optional package a key needs and that is not installed: ``logging.tensorboard`` (tensorboard),
  ``model.hf`` (transformers) — with the ``pip install`` line, or the key to change; a ``data.tokenize``
  tokenizer of another format (tiktoken, sentencepiece) is loaded, which says the same;
- a ``model.hf`` that is not a Hugging Face config or model folder, or whose Auto class for the
  objective cannot build it; a masked-LM objective without a mask token;
- a ``model.init_from`` that holds no checkpoint, or whose tensors are missing or of other shapes than
  the model's (names and shapes from the headers, against the model built on the meta device);
- a ``data.tokenize`` tokenizer file that cannot be read.

Without it each of these surfaced after the processes had started, as a traceback per rank.
"""

from __future__ import annotations

import dataclasses
import importlib.util

from mcompile.apps.train.config import ConfigError, TrainConfig

__all__ = ["preflight", "required_packages"]

# import name -> what to install, and the extra of mcompile that has it
_PACKAGES = {"tensorboard": ("tensorboard", "data"), "transformers": ("transformers>=5.0", "hf")}


def required_packages(cfg: TrainConfig) -> dict[str, str]:
    """{import name: the config key that needs it} for the optional packages this run imports."""
    need = {}
    if cfg.logging.tensorboard:
        need["tensorboard"] = "logging.tensorboard"
    if cfg.model.hf:
        need["transformers"] = "model.hf"
    return need


def _check_packages(cfg: TrainConfig) -> None:
    for name, key in required_packages(cfg).items():
        if importlib.util.find_spec(name) is None:
            pip, extra = _PACKAGES[name]
            value = getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])
            raise ConfigError(f"{key} = {value!r} needs the {name} package, which is not installed: pip install "
                              f"'{pip}' (or pip install -e '.[{extra}]' in the mcompile checkout)"
                              + (", or remove logging.tensorboard (logging.jsonl keeps the same figures)"
                                 if name == "tensorboard" else ""))


def preflight(cfg: TrainConfig, *, weights: bool = True) -> None:
    """Raise :class:`ConfigError` for what ``cfg`` would fail on after the processes start (see the module
    docstring). ``weights``: also check ``model.init_from`` (``mcompile train``; eval / generate / export read
    a checkpoint of their own)."""
    _check_packages(cfg)
    from mcompile.apps.train.objective import resolve

    if cfg.model.hf:
        from mcompile.apps.train.loop import _hf_config

        _hf_config(cfg.model.hf)  # a config.json or a folder holding one
    resolve(cfg)  # the objective: the mask token of a masked LM
    d = cfg.data
    if d.tokenize and d.tokenizer:
        _check_tokenizer(cfg)
    if weights and cfg.model.init_from:
        _check_init_from(cfg)


def _check_tokenizer(cfg: TrainConfig) -> None:
    from mcompile.apps.data import DataError, IndexedDataset, load_tokenizer
    from mcompile.apps.train.loop import _shipped

    try:
        IndexedDataset(cfg.data.sources)
        return  # written already: the tokenizer is not needed
    except Exception:  # noqa: BLE001 - missing or partial: it will be written with the tokenizer
        pass
    try:
        load_tokenizer(_shipped(cfg.data.tokenizer, "tokenizer"))
    except (DataError, OSError, ValueError) as e:
        raise ConfigError(f"data.tokenizer = {cfg.data.tokenizer!r}: {e}") from None


def _check_init_from(cfg: TrainConfig) -> None:
    from mcompile.apps.train.loop import build_model
    from mcompile.runtime.weights import WeightsError, check_shapes

    meta = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init="meta"))
    model, _, _ = build_model(meta)
    try:
        check_shapes(cfg.model.init_from, model)
    except (WeightsError, OSError) as e:
        raise ConfigError(f"model.init_from = {cfg.model.init_from!r}: {e}") from None
