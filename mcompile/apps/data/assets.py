"""The tiny corpus, tokenizer and last-word set shipped in ``mcompile/apps/data/assets/`` (made by
``scripts/make_tiny_corpus.py``: synthetic stories from a template grammar; nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"


def _asset(name: str) -> Path:
    p = ASSETS / name
    if not p.exists():
        from mcompile.apps.data.errors import DataError

        raise DataError(f"{p} is missing from this install: run `python scripts/make_tiny_corpus.py` in "
                        f"a checkout, or reinstall mcompile with its package data")
    return p


def tiny_corpus() -> Path:
    """The shipped JSONL corpus: 1400 ``{"text": ...}`` documents, ~380 KiB, ~140k tokens with
    :func:`tiny_tokenizer`."""
    return _asset("tiny_corpus.jsonl")


def tiny_tokenizer() -> Path:
    """The shipped ``tokenizer.json``: a BPE of exactly 256 ids (llama3-tiny's vocabulary) trained on the
    tiny corpus; ``<|endoftext|>`` = 0 is its EOS, ``<unk>`` = 1."""
    return _asset("tokenizer.json")


def tiny_lambada() -> Path:
    """The shipped LAMBADA-style JSONL: ``{"text": ...}`` held-out stories whose last word (a name, a
    thing or an animal named earlier) is predictable from the context."""
    return _asset("tiny_lambada.jsonl")


def tiny_dataset(folder: str | Path) -> Path:
    """The tiny corpus preprocessed with the tiny tokenizer into ``folder/tiny.bin`` / ``.idx`` (made once;
    remade when the shipped corpus or tokenizer changed): the prefix, for :class:`SampleDataset`."""
    from mcompile.apps.data.indexed import IndexedDataset, paths
    from mcompile.apps.data.preprocessing import preprocess
    from mcompile.apps.data.tokenizer import file_sha256

    prefix = Path(folder) / "tiny"
    want = {"tokenizer": file_sha256(tiny_tokenizer()), "corpus": file_sha256(tiny_corpus())}
    if all(p.exists() for p in paths(prefix)):
        try:
            if IndexedDataset(prefix).meta.get("tiny") == want:
                return prefix
        except ValueError:  # a DataError: a broken pair is remade
            pass
    preprocess([tiny_corpus()], prefix, tiny_tokenizer(), progress=False, meta=dict(tiny=want))
    return prefix


__all__ = ["ASSETS", "tiny_corpus", "tiny_dataset", "tiny_lambada", "tiny_tokenizer"]
