"""Tokenizers from files: Hugging Face ``tokenizer.json``, tiktoken BPE ranks, sentencepiece models.

:func:`load_tokenizer` picks the kind from the file itself (a JSON object with a ``model`` is a
tokenizers file; lines of ``base64 rank`` are a tiktoken ranks file, whatever its name: Llama 3 ships
one as ``tokenizer.model``; anything else named ``*.model`` is handed to sentencepiece), and every kind
answers the same small interface (:class:`Tokenizer`). Text is encoded as plain text: special-token
strings in the input are not turned into special tokens by tiktoken (``encode_ordinary``) nor by
sentencepiece; Hugging Face tokenizers match their added tokens in text, as they always do.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path

from mcompile.apps.data.errors import DataError

KINDS = "a Hugging Face tokenizer.json, a tiktoken BPE ranks file (*.tiktoken) or a sentencepiece *.model"
# names an EOS / BOS token goes by in the tokenizers people use, tried in this order
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/=]+ [0-9]+\r?$")


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Tokenizer:
    """One tokenizer, whatever its file: ``encode(text) -> list[int]``, ``decode(ids) -> str``,
    ``encode_batch(texts)``; ``vocab_size`` (every id is below it), ``eos_id`` (int), ``bos_id``
    (int or None), ``path``, ``kind`` ("tokenizers" | "tiktoken" | "sentencepiece") and ``sha256``
    (of the file: preprocessed datasets record it, blends check it)."""

    kind: str = ""

    def __init__(self, path: Path, vocab_size: int, eos_id: int, bos_id: int | None):
        self.path, self.vocab_size, self.eos_id, self.bos_id = path, vocab_size, eos_id, bos_id
        self.sha256 = file_sha256(path)

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def describe(self) -> dict:
        """What a preprocessed dataset records of its tokenizer (``IndexedDataset.meta["tokenizer"]``)."""
        return {"path": str(self.path), "kind": self.kind, "sha256": self.sha256, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id, "bos_id": self.bos_id}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({str(self.path)!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id}, "
                f"bos_id={self.bos_id})")


def _ids(ids) -> list[int]:
    return [int(i) for i in ids]  # numpy / torch integers too


class HFTokenizer(Tokenizer):
    kind = "tokenizers"

    def __init__(self, path: Path, eos: str | int | None = None, bos: str | int | None = None):
        from tokenizers import Tokenizer as _Tok

        try:
            self.tok = _Tok.from_file(str(path))
        except Exception as e:  # the library raises a plain Exception on a malformed file
            raise DataError(f"{path}: not a readable Hugging Face tokenizer.json ({e})") from e
        vocab = self.tok.get_vocab(with_added_tokens=True)
        size = max(self.tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        config = _hf_config(path)  # a Hugging Face folder's tokenizer_config.json names its EOS / BOS
        eos = config.get("eos_token") if eos is None else eos
        bos = config.get("bos_token") if bos is None else bos
        super().__init__(path, size, _special(path, vocab, eos, EOS_NAMES, "EOS", "eos"),
                         _special(path, vocab, bos, BOS_NAMES, "BOS", "bos", required=False))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]  # threads in Rust

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(_ids(ids), skip_special_tokens=False)


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE ranks file (``base64(token bytes) rank`` per line). The file holds no special
    tokens and no split pattern: EOS (``eos``, default ``<|endoftext|>``) is added as the id after the
    ranks unless the file's own tokens say otherwise; the pattern defaults to GPT-2's (tiktoken's
    ``r50k_pat_str``); pass ``pattern=`` for another (Llama 3's or cl100k's)."""

    kind = "tiktoken"

    def __init__(self, path: Path, eos: str | int | None = None, bos: str | int | None = None,
                 pattern: str | None = None):
        try:
            import tiktoken
            from tiktoken_ext.openai_public import r50k_pat_str
        except ImportError as e:
            raise DataError(f"{path} is a tiktoken ranks file: install tiktoken (pip install 'mcompile[data]')") from e
        ranks: dict[bytes, int] = {}
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    token, rank = line.split()
                    ranks[base64.b64decode(token, validate=True)] = int(rank)
                except ValueError as e:
                    raise DataError(f"{path}:{n}: not a tiktoken ranks line (base64 token, space, rank): "
                                    f"{line[:60]!r}") from e
        if not ranks:
            raise DataError(f"{path}: an empty tiktoken ranks file")
        n_ranks = max(ranks.values()) + 1
        specials: dict[str, int] = {}
        eos_name = eos if isinstance(eos, str) else "<|endoftext|>"
        eos_id = eos if isinstance(eos, int) else n_ranks
        specials[eos_name] = eos_id
        bos_id = None
        if bos is not None:
            bos_id = bos if isinstance(bos, int) else max(specials.values()) + 1
            specials[bos if isinstance(bos, str) else "<|startoftext|>"] = bos_id
        try:
            self.enc = tiktoken.Encoding(name=path.stem, pat_str=pattern or r50k_pat_str, mergeable_ranks=ranks,
                                         special_tokens=specials)
        except Exception as e:
            raise DataError(f"{path}: tiktoken cannot build an encoding from it ({e})") from e
        super().__init__(path, max(n_ranks, max(specials.values()) + 1), eos_id, bos_id)

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self.enc.decode(_ids(ids))


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, path: Path, eos: str | int | None = None, bos: str | int | None = None):
        try:
            import sentencepiece as spm
        except ImportError as e:
            raise DataError(f"{path} is a sentencepiece model: install sentencepiece "
                            "(pip install 'mcompile[data]')") from e
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise DataError(f"{path}: not a readable sentencepiece model ({e}); accepted: {KINDS}") from e
        size = self.sp.GetPieceSize()

        def pick(given, own, what, required):
            if isinstance(given, int):
                return given
            if isinstance(given, str):
                i = self.sp.PieceToId(given)
                if i == self.sp.unk_id() and given != self.sp.IdToPiece(self.sp.unk_id()):
                    raise DataError(f"{path}: no piece {given!r} for {what}")
                return i
            if own >= 0:
                return own
            if required:
                raise DataError(f"{path}: the model defines no {what} token (trained with eos_id=-1?): "
                                f"pass eos= a piece name or id")
            return None

        super().__init__(path, size, pick(eos, self.sp.eos_id(), "EOS", True),
                         pick(bos, self.sp.bos_id(), "BOS", False))

    def encode(self, text: str) -> list[int]:
        return self.sp.EncodeAsIds(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.sp.Encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.DecodeIds(_ids(ids))


def _hf_config(path: Path) -> dict:
    """eos_token / bos_token / mask_token from a tokenizer_config.json beside the tokenizer.json (strings; {} if
    none)."""
    try:
        config = json.loads((path.parent / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for key in ("eos_token", "bos_token", "mask_token"):
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, dict):  # {"content": "</s>", ...}, older files
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _special(path, vocab: dict, given, names, what: str, arg: str, required: bool = True) -> int | None:
    if isinstance(given, int):
        return given
    if isinstance(given, str):
        if given not in vocab:
            raise DataError(f"{path}: no token {given!r} for {what}")
        return vocab[given]
    for name in names:
        if name in vocab:
            return vocab[name]
    if required:
        raise DataError(f"{path}: no {what} token found (looked for {', '.join(names)}): "
                        f"pass {arg}= its name or id to load_tokenizer")
    return None


def _sniff(path: Path) -> str:
    if path.suffix == ".json":
        return "tokenizers"
    with open(path, "rb") as f:
        head = f.read(4096)
    first = head.split(b"\n", 1)[0]
    if first and _TIKTOKEN_LINE.match(first):
        return "tiktoken"
    if path.suffix == ".model":  # a protobuf: sentencepiece reports it if it is not one
        return "sentencepiece"
    if head.lstrip().startswith(b"{"):
        return "tokenizers"
    raise DataError(f"{path}: cannot tell which tokenizer this is; accepted: {KINDS}")


def load_tokenizer(path: str | Path, *, eos: str | int | None = None, bos: str | int | None = None,
                   pattern: str | None = None) -> Tokenizer:
    """The tokenizer in ``path``: a ``tokenizer.json`` (or a folder holding one), a tiktoken ranks file,
    a sentencepiece ``*.model``. EOS / BOS: ``eos``/``bos`` (a token's name or id) if given; else a
    tokenizer.json's ``tokenizer_config.json`` beside it; else the first of the usual names present
    (``<|endoftext|>``, ``<|end_of_text|>``, ``</s>``, ...); a sentencepiece model's own ids; a tiktoken
    file's EOS is added after its ranks. ``pattern`` is a tiktoken file's split regex. A missing or unreadable
    file is a :class:`DataError` naming the path and the accepted kinds."""
    if isinstance(path, Tokenizer):
        return path
    p = Path(path).expanduser().resolve()
    if p.is_dir():
        inside = p / "tokenizer.json"
        if not inside.exists():
            found = sorted(q.name for q in p.iterdir() if q.suffix in (".json", ".model", ".tiktoken"))
            raise DataError(f"{p} is a folder without a tokenizer.json (found: {', '.join(found) or 'nothing'}); "
                            f"pass the file itself: {KINDS}")
        p = inside
    if not p.exists():
        raise DataError(f"no tokenizer file at {p}; expected {KINDS}")
    kind = _sniff(p)
    if kind == "tokenizers":
        return HFTokenizer(p, eos, bos)
    if kind == "tiktoken":
        return TiktokenTokenizer(p, eos, bos, pattern)
    return SentencePieceTokenizer(p, eos, bos)


__all__ = ["KINDS", "HFTokenizer", "SentencePieceTokenizer", "TiktokenTokenizer", "Tokenizer", "file_sha256",
           "load_tokenizer"]

