"""The indexed token dataset: documents of token ids in a flat ``.bin``, their boundaries in an ``.idx``.

The idea is Megatron-LM's ``.bin``/``.idx`` pair (Shoeybi et al., 2019, arXiv:1909.08053: a flat
memory-mapped array of tokens plus an index of where each document starts); the format is our own.

``PREFIX.bin``: the tokens of every document, one after the other, little-endian ``uint16`` when the
vocabulary has at most 65536 ids, else ``int32``.

``PREFIX.idx`` (little-endian)::

    offset  size  field
    0       8     magic b"MCTOKIDX"
    8       4     u32 format version (1)
    12      4     u32 token dtype: 1 = uint16, 2 = int32
    16      8     u64 documents (n)
    24      8     u64 tokens (== the .bin's size / the dtype's size)
    32      8     u64 vocabulary size (every token id is below it)
    40      4     u32 meta length m (bytes of UTF-8 JSON)
    44      4     u32 CRC-32 of bytes 0..43 and the meta JSON
    48      m     meta JSON (what made the data: the tokenizer's path and sha256, the inputs, ...)
    ...           zero padding to a multiple of 8
    ...     8n+8  i64 offsets: document i is tokens[offsets[i]:offsets[i+1]]; offsets[0] = 0, offsets[n] = tokens

Both files are memory-mapped on open; the header, the sizes of both files and the offsets
(non-decreasing, from 0 to the token count) are checked first, so a truncated or corrupt pair is a
:class:`DataError` that says to rebuild it rather than garbage tokens later. Writing goes to temporary
files renamed into place, the ``.idx`` last: a killed ``preprocess`` leaves no pair that opens.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from array import array
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from mcompile.apps.data.errors import DataError

MAGIC = b"MCTOKIDX"
VERSION = 1
_HEAD = struct.Struct("<8sIIQQQI")  # magic, version, dtype, docs, tokens, vocab, meta length (44 bytes)
_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<i4")}


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else int32."""
    if not 0 < vocab_size <= 2**31:
        raise DataError(f"vocab_size={vocab_size}: must be between 1 and 2**31")
    return _DTYPES[1] if vocab_size <= 2**16 else _DTYPES[2]


def paths(prefix: str | Path) -> tuple[Path, Path]:
    """(PREFIX.bin, PREFIX.idx); a prefix given with either suffix is taken without it."""
    p = Path(prefix).expanduser()
    if p.suffix in (".bin", ".idx"):
        p = p.with_suffix("")
    return p.with_name(p.name + ".bin"), p.with_name(p.name + ".idx")


class IndexedWriter:
    """Streams documents into PREFIX.bin / PREFIX.idx (``with IndexedWriter(...) as w: w.add(doc)``);
    the pair appears only when the block ends without an exception."""

    def __init__(self, prefix: str | Path, vocab_size: int, meta: dict | None = None):
        self.bin_path, self.idx_path = paths(prefix)
        self.vocab_size, self.meta = int(vocab_size), dict(meta or {})
        self.dtype = token_dtype(self.vocab_size)
        try:
            json.dumps(self.meta)
        except (TypeError, ValueError) as e:
            raise DataError(f"meta must be JSON-serialisable: {e}") from e
        self.offsets = array("q", [0])
        self._file = None

    def __enter__(self):
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp_bin = self.bin_path.with_name(self.bin_path.name + f".tmp{os.getpid()}")
        self._file = open(self._tmp_bin, "wb")
        return self

    def add(self, doc: Sequence[int] | np.ndarray) -> None:
        """Append one document (its token ids, each in [0, vocab_size))."""
        a = np.asarray(doc)
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise DataError(f"document {len(self.offsets) - 1}: expected a flat sequence of integer token ids, "
                            f"got shape {a.shape} dtype {a.dtype}")
        if a.size:
            lo, hi = int(a.min()), int(a.max())
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                raise DataError(f"document {len(self.offsets) - 1}: token id {bad} outside [0, {self.vocab_size}): "
                                f"vocab_size is too small for these ids")
        self._file.write(a.astype(self.dtype, copy=False).tobytes())
        self.offsets.append(self.offsets[-1] + a.size)

    def add_many(self, docs: Iterable[Sequence[int]]) -> None:
        for d in docs:
            self.add(d)

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

    def __exit__(self, kind, value, tb):
        self._file.close()
        if kind is not None:
            self._tmp_bin.unlink(missing_ok=True)
            return False
        meta = json.dumps(self.meta, sort_keys=True).encode()
        head = _HEAD.pack(MAGIC, VERSION, 1 if self.dtype == _DTYPES[1] else 2, self.num_docs, self.num_tokens,
                          self.vocab_size, len(meta))
        crc = zlib.crc32(head + meta)
        pad = b"\0" * (-(len(head) + 4 + len(meta)) % 8)
        tmp_idx = self.idx_path.with_name(self.idx_path.name + f".tmp{os.getpid()}")
        with open(tmp_idx, "wb") as f:
            f.write(head + struct.pack("<I", crc) + meta + pad)
            f.write(np.frombuffer(self.offsets, dtype=np.int64).astype("<i8").tobytes())
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(tmp_idx, self.idx_path)  # last: the pair opens only once both are whole
        return False


def write_indexed(prefix: str | Path, docs: Iterable[Sequence[int]], vocab_size: int,
                  meta: dict | None = None) -> None:
    """Write ``docs`` (each a sequence of token ids in [0, vocab_size)) as PREFIX.bin / PREFIX.idx,
    with ``meta`` (a JSON-serialisable dict) stored in the index."""
    with IndexedWriter(prefix, vocab_size, meta) as w:
        w.add_many(docs)


class IndexedDataset:
    """The documents of PREFIX.bin / PREFIX.idx: ``len(ds)`` documents, ``ds[i]`` document i's tokens
    (a read-only memory-mapped numpy view), ``num_tokens``, ``vocab_size``, ``meta`` (a dict),
    ``doc_lengths`` and ``offsets`` (int64 arrays), ``tokens`` (the flat token array)."""

    def __init__(self, prefix: str | Path):
        self.bin_path, self.idx_path = paths(prefix)
        self.prefix = self.bin_path.with_suffix("")
        for p in (self.idx_path, self.bin_path):
            if not p.exists():
                raise DataError(f"no {p.name} at {p.parent}: {self.prefix} is not a dataset prefix "
                                f"(make one with `mcompile preprocess ... --output {self.prefix}`)")
        redo = "rebuild it with `mcompile preprocess` (or write_indexed)"
        size = self.idx_path.stat().st_size
        with open(self.idx_path, "rb") as f:
            head = f.read(_HEAD.size + 4)
            if len(head) < _HEAD.size + 4:
                raise DataError(f"{self.idx_path}: truncated ({size} bytes, shorter than the header); {redo}")
            magic, version, code, n, ntok, vocab, mlen = _HEAD.unpack(head[:_HEAD.size])
            if magic != MAGIC:
                raise DataError(f"{self.idx_path}: not an mcompile token index (magic {magic!r}, expected "
                                f"{MAGIC!r}); {redo}")
            if version != VERSION:
                raise DataError(f"{self.idx_path}: format version {version}, this mcompile reads {VERSION}; "
                                f"use the mcompile that wrote it or {redo}")
            meta_bytes = f.read(mlen)
        (crc,) = struct.unpack("<I", head[_HEAD.size:])
        if code not in _DTYPES or len(meta_bytes) != mlen or zlib.crc32(head[:_HEAD.size] + meta_bytes) != crc:
            raise DataError(f"{self.idx_path}: corrupt header (checksum mismatch); {redo}")
        start = _HEAD.size + 4 + mlen
        start += -start % 8
        if size != start + 8 * (n + 1):
            raise DataError(f"{self.idx_path}: {size} bytes, expected {start + 8 * (n + 1)} for {n} documents "
                            f"(truncated or corrupt); {redo}")
        self.dtype = _DTYPES[code]
        want = ntok * self.dtype.itemsize
        if self.bin_path.stat().st_size != want:
            raise DataError(f"{self.bin_path}: {self.bin_path.stat().st_size} bytes, expected {want} "
                            f"({ntok} {self.dtype.name} tokens, per its .idx): truncated or from another run; {redo}")
        self.offsets = np.memmap(self.idx_path, dtype="<i8", mode="r", offset=start, shape=(n + 1,))
        off = np.asarray(self.offsets)
        if off[0] != 0 or off[-1] != ntok or (n and bool(np.any(off[1:] < off[:-1]))):
            raise DataError(f"{self.idx_path}: corrupt document offsets; {redo}")
        self.meta = json.loads(meta_bytes.decode())
        self.vocab_size, self.num_tokens = int(vocab), int(ntok)
        # np.memmap cannot map an empty file: an empty dataset gets an empty array
        self.tokens = (np.memmap(self.bin_path, dtype=self.dtype, mode="r") if ntok
                       else np.empty(0, dtype=self.dtype))
        self.doc_lengths = np.diff(off)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __reduce__(self):
        # pickled by its prefix and reopened (a DataLoader worker, a spawned process): a memmap would
        # otherwise be pickled as a copy of the whole file
        return (type(self), (str(self.prefix),))

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"document {i} out of range: {self.prefix} has {n} documents")
        i %= n
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    @property
    def tokenizer_sha256(self) -> str | None:
        return (self.meta.get("tokenizer") or {}).get("sha256")

    def verify(self) -> None:
        """Read every token and check it is below vocab_size (the open checks only sizes and offsets)."""
        step = 1 << 24
        for s in range(0, self.num_tokens, step):
            hi = int(self.tokens[s:s + step].max())
            if hi >= self.vocab_size:
                raise DataError(f"{self.bin_path}: token id {hi} >= vocab_size {self.vocab_size}: corrupt data")

    def __repr__(self) -> str:
        return f"IndexedDataset({str(self.prefix)!r}: {len(self)} documents, {self.num_tokens} tokens)"


__all__ = ["IndexedDataset", "IndexedWriter", "paths", "token_dtype", "write_indexed"]
