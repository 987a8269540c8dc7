"""Data: tokenizers, the indexed token dataset, blends and deterministic sampling (`mcompile preprocess`).

    from mcompile.apps.data import load_tokenizer, preprocess, SampleDataset, tiny_corpus, tiny_tokenizer
    preprocess([tiny_corpus()], "/tmp/tiny", tiny_tokenizer())       # -> /tmp/tiny.bin, /tmp/tiny.idx
    sd = SampleDataset("/tmp/tiny", seq_len=128, seed=0)             # or [("/tmp/a", 0.7), ("/tmp/b", 0.3)]
    tokens, targets = sd.batch(step * 8, 8)                          # [8, 128] each; resumes exactly

The names below are imported on first use, so ``import mcompile.apps.data.cli`` (the ``mcompile preprocess``
command's ``--help``) imports neither torch nor numpy.
"""

import importlib

# module names differ from the names they define: a submodule imported as an attribute would shadow them
_WHERE = {
    "DataError": "errors",
    "Tokenizer": "tokenizer", "load_tokenizer": "tokenizer",
    "IndexedDataset": "indexed", "IndexedWriter": "indexed", "write_indexed": "indexed",
    "preprocess": "preprocessing", "input_files": "preprocessing",
    "SampleDataset": "sampling", "Sample": "sampling", "PackedSample": "sampling", "document_mask": "sampling",
    "tiny_corpus": "assets", "tiny_tokenizer": "assets", "tiny_lambada": "assets", "tiny_dataset": "assets",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_WHERE})
