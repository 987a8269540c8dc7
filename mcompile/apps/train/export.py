"""A run's model as a Hugging Face ``from_pretrained`` folder, with the run's tokenizer.

Used by ``mcompile export CONFIG --hf OUT`` (any checkpoint of the run, under any mesh) and by
``checkpoint.export_hf`` at the end of ``mcompile train``. The weights go through
:func:`mcompile.apps.hf_io.export_hf` (a Hugging Face model keeps its names and config; the llama3-* /
gpt2-* presets are renamed to ``LlamaForCausalLM`` / ``GPT2LMHeadModel``); the tokenizer files are
the Hugging Face folder's own (``model.hf``) when it has them, else the run's tokenizer
(``data.tokenizer``, or the one the dataset was preprocessed with): a ``tokenizer.json`` is copied
with a ``tokenizer_config.json`` naming its EOS, so ``AutoTokenizer.from_pretrained(OUT)`` loads it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

__all__ = ["export_run", "tokenizer_path"]

# what a Hugging Face model folder may hold of its tokenizer
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
                       "merges.txt", "spiece.model", "tokenizer.model", "added_tokens.json")


def tokenizer_path(cfg) -> str | None:
    """The run's tokenizer file: ``data.tokenizer`` (``tiny``: the shipped one), else the path the dataset
    records; None when neither says."""
    from mcompile.apps.train.model import _shipped

    if cfg.data.tokenizer:
        return _shipped(cfg.data.tokenizer, "tokenizer")
    sources = cfg.data.sources
    if not sources:
        return None
    first = sources if isinstance(sources, str) else sources[0] if isinstance(sources[0], str) else sources[0][0]
    try:
        from mcompile.apps.data import IndexedDataset

        return IndexedDataset(first).meta.get("tokenizer", {}).get("path")
    except Exception:  # noqa: BLE001 - no dataset yet: no recorded tokenizer
        return None


def _write_tokenizer(cfg, folder: Path) -> list[str]:
    """Rank 0: the tokenizer files into ``folder``; the names written."""
    if cfg.model.hf:
        src = Path(cfg.model.hf)
        src = src.parent if src.is_file() else src
        found = [n for n in _HF_TOKENIZER_FILES if (src / n).is_file()]
        if found:
            for n in found:
                shutil.copyfile(src / n, folder / n)
            return found
    path = tokenizer_path(cfg)
    if not path or not Path(path).is_file():
        return []
    from mcompile.apps.data import load_tokenizer

    tok = load_tokenizer(path)
    if tok.kind != "tokenizers":  # a tiktoken / sentencepiece file: copied, for the user's own tokenizer class
        shutil.copyfile(path, folder / Path(path).name)
        return [Path(path).name]
    shutil.copyfile(path, folder / "tokenizer.json")
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(str(path)).id_to_token(tok.eos_id) if tok.eos_id is not None else None
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.train.seq_len}
    if eos is not None:
        config["eos_token"] = eos
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ["tokenizer.json", "tokenizer_config.json"]


def export_run(cfg, pm, folder, dtype=None) -> Path:
    """Write ``pm`` (built from ``cfg``'s model) to ``folder`` as ``from_pretrained`` reads it, with the run's
    tokenizer. Collective: every rank of ``pm`` calls it; rank 0 writes."""
    import torch.distributed as dist

    from mcompile.apps.hf_io import export_hf
    from mcompile.apps.train.model import build_model

    meta_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init="meta"))
    model, _, _ = build_model(meta_cfg)  # names and config only: on the meta device
    out = export_hf(pm, folder, model, dtype=dtype)
    error = [None]
    if dist.get_rank() == 0:
        try:
            _write_tokenizer(cfg, out)
        except Exception as e:  # noqa: BLE001 - raised on every rank
            error[0] = f"{type(e).__name__}: {e}"
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise RuntimeError(f"export to {out}: the weights are written, the tokenizer files failed: {error[0]}")
    return out
