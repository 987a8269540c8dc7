"""``preprocess``: JSONL or text files -> a tokenized indexed dataset (PREFIX.bin / PREFIX.idx).

Inputs, in the order given (a folder: its ``*.jsonl``, ``*.json``, ``*.txt`` files, sorted by name;
any of them may be gzip-compressed, ``*.jsonl.gz``):

- ``*.jsonl`` / ``*.json``: one JSON object per line, the document's text under ``text_key``;
- ``*.txt`` (and anything else): ``txt_split="blank"`` (default) makes each run of lines between
  blank lines a document; ``"line"`` makes each line one; ``"file"`` the whole file one.

Each document is tokenized (in batches, through the tokenizer's batch encoder) and, with
``append_eos``, ends with the tokenizer's EOS token, so a model trained on the packed stream sees
where documents end. Empty documents are skipped and counted. A rich progress bar on stderr follows
the bytes read.
"""

from __future__ import annotations

import gzip
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path

from mcompile.apps.data.errors import DataError
from mcompile.apps.data.indexed import IndexedWriter, paths
from mcompile.apps.data.tokenizer import Tokenizer, load_tokenizer

TEXT_SPLITS = ("blank", "line", "file")
_SUFFIXES = (".jsonl", ".json", ".txt", ".text")
_BATCH = 512  # documents per call of the batch encoder


def input_files(inputs) -> list[Path]:
    """The files ``inputs`` names (folders expanded to their data files, sorted), in order."""
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    files: list[Path] = []
    for item in inputs:
        p = Path(item).expanduser()
        if p.is_dir():
            inside = sorted(q for q in p.iterdir() if q.is_file() and _base_suffix(q) in _SUFFIXES)
            if not inside:
                raise DataError(f"{p}: a folder without .jsonl, .json or .txt files (gzip allowed)")
            files.extend(inside)
        elif p.exists():
            files.append(p)
        else:
            raise DataError(f"no input file {p}")
    if not files:
        raise DataError("no input files given")
    return files


def _base_suffix(p: Path) -> str:
    return Path(p.stem).suffix if p.suffix == ".gz" else p.suffix


class _Counted(io.RawIOBase):
    """A binary file that reports the bytes read (on disk) to a callback: the progress bar's source."""

    def __init__(self, f, report):
        self.f, self.report = f, report

    def readable(self):
        return True

    def readinto(self, b):
        n = self.f.readinto(b)
        self.report(n or 0)
        return n


def _open_text(path: Path, report):
    raw = _Counted(open(path, "rb"), report)
    stream = io.BufferedReader(raw, 1 << 20)
    if path.suffix == ".gz":
        stream = gzip.GzipFile(fileobj=stream)
    return io.TextIOWrapper(stream, encoding="utf-8", newline=None)


def _documents(path: Path, text_key: str, txt_split: str, report) -> Iterator[str]:
    kind = _base_suffix(path)
    try:
        with _open_text(path, report) as f:
            if kind in (".jsonl", ".json"):
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{n}: not a JSON line ({e.msg}); JSONL files hold one JSON "
                                        f"object per line") from e
                    if not isinstance(obj, dict) or text_key not in obj:
                        keys = ", ".join(map(repr, obj)) if isinstance(obj, dict) else type(obj).__name__
                        raise DataError(f"{path}:{n}: no {text_key!r} key (found {keys}); name the text's key "
                                        f"with text_key= (--text-key)")
                    text = obj[text_key]
                    if not isinstance(text, str):
                        raise DataError(f"{path}:{n}: {text_key!r} holds a {type(text).__name__}, not a string")
                    yield text
            elif txt_split == "file":
                yield f.read()
            elif txt_split == "line":
                for line in f:
                    yield line.rstrip("\n")
            else:  # blank-line separated
                block: list[str] = []
                for line in f:
                    if line.strip():
                        block.append(line)
                    elif block:
                        yield "".join(block).rstrip("\n")
                        block = []
                if block:
                    yield "".join(block).rstrip("\n")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e})") from e
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read it ({e})") from e


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    return Progress(TextColumn("[bold]preprocess"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), TextColumn("{task.fields[docs]} docs, {task.fields[tokens]} tokens"),
                    console=Console(stderr=True), transient=False)


def preprocess(inputs, output_prefix, tokenizer, text_key: str = "text", append_eos: bool = True,
               progress: bool = True, *, txt_split: str = "blank", meta: dict | None = None) -> dict:
    """Tokenize ``inputs`` (files or folders: JSONL, text; see the module docstring) with
    ``tokenizer`` (a :class:`Tokenizer` or a path for :func:`load_tokenizer`) into
    ``output_prefix``.bin / .idx, one document per JSON line (or text block), each ending in EOS when
    ``append_eos``. The index's meta records the tokenizer (path, kind, sha256, ids), the inputs and
    the options, and ``meta`` (extra JSON-serialisable entries). Returns the stats: documents,
    tokens, skipped (empty) documents, bytes read, seconds, tokens per second, the two paths written."""
    if txt_split not in TEXT_SPLITS:
        raise DataError(f"txt_split={txt_split!r}: choose one of {', '.join(TEXT_SPLITS)}")
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    files = input_files(inputs)
    bin_path, idx_path = paths(output_prefix)
    if any(p.resolve() in (bin_path.resolve(), idx_path.resolve()) for p in files):
        raise DataError(f"the output {output_prefix} would overwrite an input")
    total = sum(p.stat().st_size for p in files)
    meta = {"tokenizer": tok.describe(), "inputs": [str(p.resolve()) for p in files], "text_key": text_key,
            "append_eos": append_eos, "txt_split": txt_split, **(meta or {})}
    skipped = 0
    read = 0
    t0 = time.perf_counter()
    bar = _progress(progress, total)
    task = None

    def report(n: int):
        nonlocal read
        read += n

    def flush(w: IndexedWriter, texts: list[str]):
        nonlocal skipped
        for ids in tok.encode_batch(texts):
            if append_eos:
                ids = [*ids, tok.eos_id]
            w.add(ids)
        if bar is not None:
            bar.update(task, completed=read, docs=w.num_docs, tokens=w.num_tokens)

    with IndexedWriter(output_prefix, tok.vocab_size, meta) as w:
        if bar is not None:
            bar.start()
            task = bar.add_task("preprocess", total=total, docs=0, tokens=0)
        try:
            for path in files:
                texts: list[str] = []
                for text in _documents(path, text_key, txt_split, report):
                    if not text.strip():
                        skipped += 1
                        continue
                    texts.append(text)
                    if len(texts) == _BATCH:
                        flush(w, texts)
                        texts = []
                if texts:
                    flush(w, texts)
        finally:
            if bar is not None:
                bar.stop()
    seconds = time.perf_counter() - t0
    return {"documents": w.num_docs, "tokens": w.num_tokens, "skipped_empty": skipped, "files": len(files),
            "bytes": read, "seconds": round(seconds, 3), "tokens_per_s": round(w.num_tokens / max(seconds, 1e-9)),
            "bin": str(bin_path), "idx": str(idx_path), "vocab_size": tok.vocab_size}


__all__ = ["TEXT_SPLITS", "input_files", "preprocess"]
