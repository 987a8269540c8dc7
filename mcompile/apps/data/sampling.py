"""Training samples from indexed datasets: windows of a shuffled document stream, blends, packing.

One source (Megatron-LM's GPT dataset, Shoeybi et al., 2019, arXiv:1909.08053, in our own code):

- **split**: the documents of a dataset are divided into ``train`` and ``valid`` by whole documents:
  the ``round(valid_fraction * n)`` documents with the smallest hash of their index (at least one
  when ``valid_fraction > 0``, at most ``n - 1``) are ``valid``. The hash has a fixed key, not the
  seed, so every run validates on the same documents.
- **epoch e** of a split: its documents in an order shuffled for (seed, source, e), concatenated into
  one stream of ``T`` tokens (each document ends in EOS when preprocessed so) and cut into
  ``n = (T - 1) // seq_len`` windows of ``seq_len + 1`` tokens, window ``w`` starting at token
  ``w * seq_len`` (neighbouring windows share one token, so no token is lost as a target; the last
  ``T - 1 - n * seq_len`` tokens of the stream are left out this epoch). The windows are visited in
  an order shuffled again for (seed, source, e).
- **sample j** of the source is window ``perm_e[j mod n]`` of epoch ``e = j // n``; its tokens are
  the window's first ``seq_len`` tokens and its targets the last ``seq_len`` (the next token).

Every shuffle is an argsort of a counter-based hash (SplitMix64's finaliser: Steele, Lea and Flood,
"Fast splittable pseudorandom number generators", OOPSLA 2014) keyed by the seed, the source's
position and the epoch, so sample ``i`` is a pure function of (sources, seq_len, seed, split, i),
computed directly for any ``i`` without producing 0..i-1: a trainer resumes exactly by remembering
how many samples it consumed, and the numbers do not change with numpy's random streams.

A blend of S sources with weights ``w`` (normalised) picks the source of each sample from a fixed
schedule of period ``P = 65536``: source ``s`` gets ``W_s`` slots per period, the ``W_s`` being the
``w_s * P`` rounded to integers that sum to ``P`` (largest remainders first), placed at the "virtual
times" ``(k + 1/2) / W_s`` (k = 0..W_s-1) of every source merged in time order (stride scheduling,
Waldspurger and Weihl, 1995). After any number ``N`` of samples each source's count differs from
``w_s * N`` by less than ``1/2 + S/2`` samples (at a time t between virtual times each source has
``round(t * W_s)`` slots, within 1/2 of ``t * W_s``; their sum N is within S/2 of ``t * P``) plus
``N / (2P)`` from rounding the weights: far within 1%, with no state. The ``c``-th sample a source
contributes is its own sample ``c``, so each source of a blend runs through its epochs independently.

Packing (``packing=True``): a window holds pieces of several documents; the sample then also gives
``segment_ids`` (0 for the window's first piece, +1 at each document start) and ``position_ids``
(0 at the window's start and at each document start, counting up within a piece), and the target of
each document's last token (its EOS: the next token is another document's first) is -100, ignored
by cross-entropy, since a model attending within documents (:func:`document_mask`) cannot predict
it. Without packing, attention runs across the whole window, as in Megatron's default.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from mcompile.apps.data.errors import DataError
from mcompile.apps.data.indexed import IndexedDataset

PERIOD = 1 << 16  # blend schedule period: weights are rounded to multiples of 1/PERIOD
IGNORE = -100  # targets the loss skips (torch's cross_entropy default ignore_index)
_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_SPLIT_KEY = 0x5EED5917  # the train/valid split's hash key: fixed, independent of the seed
_EPOCHS_CACHED = 4


def _mix_int(z: int) -> int:
    """SplitMix64's finaliser on one Python int (64-bit wrap-around)."""
    z &= _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _key(*parts: int) -> int:
    h = 0x243F6A8885A308D3
    for p in parts:
        h = _mix_int(h ^ (int(p) & _M64))
    return h


def _hashes(n: int, key: int) -> np.ndarray:
    """SplitMix64 outputs 1..n of the stream seeded ``key`` (uint64 arrays wrap silently)."""
    z = np.uint64(key) + (np.arange(1, n + 1, dtype=np.uint64) * np.uint64(_GAMMA))
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def permutation(n: int, key: int) -> np.ndarray:
    """A permutation of range(n) determined by ``key`` alone (independent of numpy's RNG streams)."""
    return np.argsort(_hashes(n, key), kind="stable")


def split_documents(n_docs: int, valid_fraction: float) -> dict[str, np.ndarray]:
    """{"train": doc indices, "valid": doc indices}, sorted, disjoint, covering range(n_docs)."""
    if not 0.0 <= valid_fraction < 1.0:
        raise DataError(f"valid_fraction={valid_fraction}: must be in [0, 1)")
    k = round(valid_fraction * n_docs)
    if valid_fraction > 0 and n_docs >= 2:
        k = max(k, 1)
    k = min(k, max(n_docs - 1, 0))
    order = permutation(n_docs, _SPLIT_KEY)
    return {"train": np.sort(order[k:]), "valid": np.sort(order[:k])}


def apportion(weights: Sequence[float], total: int) -> np.ndarray:
    """Integers proportional to ``weights`` summing to ``total`` (largest remainders; ties: lower index)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    out = np.floor(exact).astype(np.int64)
    rest = total - int(out.sum())
    order = np.lexsort((np.arange(len(w)), -(exact - out)))  # largest remainder first
    out[order[:rest]] += 1
    return out


def blend_schedule(slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, rank) for each position of one period: ``slots[s]`` positions go to source s, at the
    merged virtual times (k + 1/2) / slots[s]; rank = how many earlier positions have the same source."""
    src = np.repeat(np.arange(len(slots)), slots)
    rank = np.concatenate([np.arange(c) for c in slots])
    times = (rank + 0.5) / slots[src]
    order = np.lexsort((src, times))
    return src[order], rank[order]


class Sample(NamedTuple):
    tokens: torch.Tensor  # int64 [seq_len] (or [n, seq_len] from batch)
    targets: torch.Tensor  # the next token of each


class PackedSample(NamedTuple):
    tokens: torch.Tensor
    targets: torch.Tensor  # -100 where the next token starts another document
    segment_ids: torch.Tensor  # 0, 1, ... per document piece in the window
    position_ids: torch.Tensor  # restart at 0 at the window's start and at each document start


def document_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Attention mask for packed samples: ``[..., s, s]`` bool, True where query q may attend key k
    (k <= q and both in the same document piece)."""
    s = segment_ids.shape[-1]
    same = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    return same & causal


class _Epoch(NamedTuple):
    doc_start: np.ndarray  # int64: where each document (in this epoch's order) starts in the .bin
    ends: np.ndarray  # int64: cumulative lengths, the stream position just past each document
    lengths: np.ndarray
    window: np.ndarray  # int64: the window each position of the epoch reads (the shuffled order)


class _Source:
    """One dataset's split, its epochs and windows."""

    def __init__(self, ds: IndexedDataset, index: int, seq_len: int, seed: int, split: str,
                 valid_fraction: float):
        self.ds, self.index, self.seq_len, self.seed = ds, index, seq_len, seed
        docs = split_documents(len(ds), valid_fraction)[split]
        self.docs = docs[ds.doc_lengths[docs] > 0] if len(docs) else docs  # empty documents add nothing
        self.num_tokens = int(ds.doc_lengths[self.docs].sum()) if len(self.docs) else 0
        self.samples_per_epoch = max(self.num_tokens - 1, 0) // seq_len
        if self.samples_per_epoch == 0:
            raise DataError(
                f"{ds.prefix}: the {split!r} split has {self.num_tokens} tokens in {len(self.docs)} documents, "
                f"fewer than seq_len + 1 = {seq_len + 1}: lower seq_len"
                + (", raise valid_fraction" if split == "valid" else ", lower valid_fraction") + " or add data")
        self._epochs: OrderedDict[int, _Epoch] = OrderedDict()

    def epoch(self, e: int) -> _Epoch:
        got = self._epochs.get(e)
        if got is not None:
            self._epochs.move_to_end(e)
            return got
        order = self.docs[permutation(len(self.docs), _key(self.seed, self.index, e, 0))]
        lengths = self.ds.doc_lengths[order]
        got = _Epoch(np.asarray(self.ds.offsets[:-1])[order], np.cumsum(lengths), lengths,
                     permutation(self.samples_per_epoch, _key(self.seed, self.index, e, 1)))
        self._epochs[e] = got
        if len(self._epochs) > _EPOCHS_CACHED:
            self._epochs.popitem(last=False)
        return got

    def __getstate__(self):
        return {**self.__dict__, "_epochs": OrderedDict()}  # the cache is rebuilt where it is needed

    def windows(self, local: np.ndarray, packing: bool, columns: np.ndarray | None = None):
        """Tokens [m, seq_len + 1] of this source's samples ``local`` (and, packing, the document of
        each token relative to the window's first and each token's offset in its document). ``columns``:
        read only the tokens at these positions of each window (the others are 0); the documents and
        offsets, index arithmetic that reads no token, are given for every position."""
        n, L = self.samples_per_epoch, self.seq_len + 1
        out = np.zeros((len(local), L), dtype=np.int64)
        seg = np.empty((len(local), L), dtype=np.int64) if packing else None
        pos = np.empty((len(local), L), dtype=np.int64) if packing else None
        epochs, r = np.divmod(local, n)
        for e in np.unique(epochs):
            sel = np.nonzero(epochs == e)[0]
            ep = self.epoch(int(e))
            start = ep.window[r[sel]] * self.seq_len
            at = start[:, None] + np.arange(L)  # (k, L): positions in the epoch's stream
            d = np.searchsorted(ep.ends, at, side="right")  # the document each position falls in
            off = at - (ep.ends[d] - ep.lengths[d])  # offset within that document
            where = ep.doc_start[d] + off
            if columns is None:
                out[sel] = self.ds.tokens[where.ravel()].reshape(len(sel), L)
            else:
                out[np.ix_(sel, columns)] = self.ds.tokens[where[:, columns].ravel()].reshape(len(sel), len(columns))
            if packing:
                first = d == d[:, :1]
                seg[sel] = d - d[:, :1]
                pos[sel] = off - np.where(first, off[:, :1], 0)
        return out, seg, pos


def _as_sources(sources) -> list[tuple[IndexedDataset, float]]:
    if isinstance(sources, (str, Path, IndexedDataset)):
        sources = [(sources, 1.0)]
    sources = list(sources)
    if not sources:
        raise DataError("no sources: give a dataset prefix or [(prefix, weight), ...]")
    out = []
    for item in sources:
        if isinstance(item, (str, Path, IndexedDataset)):
            item = (item, 1.0)
        try:
            src, weight = item
            weight = float(weight)
        except (TypeError, ValueError) as e:
            raise DataError(f"a blend entry must be (prefix, weight), got {item!r}") from e
        if not weight > 0 or not np.isfinite(weight):
            raise DataError(f"weight {weight} for {src}: weights must be positive and finite (drop the source "
                            f"instead of giving it weight 0)")
        out.append((src if isinstance(src, IndexedDataset) else IndexedDataset(src), weight))
    return out


class SampleDataset:
    """Fixed-length training samples from one dataset or a weighted blend (see the module docstring).

    ``sd[i]`` -> ``Sample(tokens, targets)`` (int64 ``[seq_len]``; targets are the next tokens), for any
    ``i >= 0`` (epochs wrap, reshuffled each epoch): a pure function of (sources, seq_len, seed, split,
    valid_fraction, packing, i). ``sd.batch(start, n)`` stacks samples start..start+n-1 (``[n, seq_len]``).
    With ``packing=True`` both give a :class:`PackedSample` (also ``segment_ids`` and ``position_ids``).
    ``len(sd)``: the samples of one epoch of this split (a blend: summed over its sources); iterating
    yields one such epoch."""

    def __init__(self, sources, seq_len: int, seed: int = 0, split: str = "train", valid_fraction: float = 0.05,
                 *, packing: bool = False):
        if not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
            raise DataError(f"seq_len={seq_len!r}: must be a positive integer")
        if split not in ("train", "valid"):
            raise DataError(f"split={split!r}: choose 'train' or 'valid'")
        pairs = _as_sources(sources)
        shas = {ds.tokenizer_sha256 for ds, _ in pairs} - {None}
        if len(shas) > 1:
            names = ", ".join(f"{ds.prefix} ({(ds.tokenizer_sha256 or 'unknown')[:12]})" for ds, _ in pairs)
            raise DataError(f"the blend's datasets were tokenized with different tokenizers: {names}; "
                            f"preprocess them all with one tokenizer")
        self.seq_len, self.seed, self.split = int(seq_len), int(seed), split
        self.valid_fraction, self.packing = float(valid_fraction), bool(packing)
        self.datasets = [ds for ds, _ in pairs]
        total = sum(w for _, w in pairs)
        self.weights = [w / total for _, w in pairs]
        self.vocab_size = max(ds.vocab_size for ds in self.datasets)
        self._sources = [_Source(ds, s, self.seq_len, self.seed, split, self.valid_fraction)
                         for s, ds in enumerate(self.datasets)]
        if len(pairs) > 1:
            self.slots = apportion(self.weights, PERIOD)
            if (self.slots == 0).any():
                small = [str(ds.prefix) for ds, c in zip(self.datasets, self.slots) if c == 0]
                raise DataError(f"weights below 1/{PERIOD} of the total for {', '.join(small)}: too small to "
                                f"sample; raise them or drop those sources")
            self._schedule, self._rank = blend_schedule(self.slots)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_schedule", "_rank")}  # 1 MB, rebuilt

    def __setstate__(self, state):
        self.__dict__.update(state)
        if len(self._sources) > 1:
            self._schedule, self._rank = blend_schedule(self.slots)

    @property
    def config(self) -> dict:
        """What determines the samples (a trainer can store it with its checkpoint and compare on resume)."""
        return {"sources": [[str(ds.prefix), w] for ds, w in zip(self.datasets, self.weights)],
                "seq_len": self.seq_len, "seed": self.seed, "split": self.split,
                "valid_fraction": self.valid_fraction, "packing": self.packing}

    def __len__(self) -> int:
        return sum(s.samples_per_epoch for s in self._sources)

    @property
    def num_tokens(self) -> int:
        """Tokens in this split (all sources)."""
        return sum(s.num_tokens for s in self._sources)

    def source_of(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """(source position, the source's own sample index) of each global sample index."""
        i = np.asarray(indices, dtype=np.int64)
        if len(self._sources) == 1:
            return np.zeros_like(i), i
        q, r = np.divmod(i, PERIOD)
        src = self._schedule[r]
        return src, q * self.slots[src] + self._rank[r]

    def batch(self, start: int, n: int, columns=None) -> Sample | PackedSample:
        """Samples start .. start+n-1, stacked: tokens and targets ``[n, seq_len]`` (int64).

        ``columns``: read only these positions of each sample's window of ``seq_len + 1`` tokens (token ``t`` is
        window position ``t``, target ``t`` position ``t + 1``); the tokens and targets read from other positions
        are 0 (a context-parallel rank reads only its share of each sequence: mcompile/apps/train/loop.py). Packed
        samples' segment and position ids, and their ignored targets, are whole (they read no token)."""
        start, n = int(start), int(n)
        if start < 0 or n < 0:
            raise IndexError(f"batch({start}, {n}): start and n must be >= 0 (samples are numbered from 0)")
        if columns is not None:
            columns = np.unique(np.asarray(columns, dtype=np.int64))
            if columns.size and (columns[0] < 0 or columns[-1] > self.seq_len):
                raise IndexError(f"batch(columns=...): window positions are 0 .. {self.seq_len} (seq_len + 1 "
                                 f"tokens), got {int(columns[0])} .. {int(columns[-1])}")
        src, local = self.source_of(np.arange(start, start + n, dtype=np.int64))
        L = self.seq_len + 1
        win = np.empty((n, L), dtype=np.int64)
        seg = np.empty((n, L), dtype=np.int64) if self.packing else None
        pos = np.empty((n, L), dtype=np.int64) if self.packing else None
        for s in np.unique(src):
            sel = np.nonzero(src == s)[0]
            w, g, p = self._sources[int(s)].windows(local[sel], self.packing, columns)
            win[sel] = w
            if self.packing:
                seg[sel], pos[sel] = g, p
        tokens = torch.from_numpy(win[:, :-1].copy())
        targets = torch.from_numpy(win[:, 1:].copy())
        if not self.packing:
            return Sample(tokens, targets)
        crosses = seg[:, 1:] != seg[:, :-1]  # the target is the next document's first token
        targets[torch.from_numpy(crosses)] = IGNORE
        return PackedSample(tokens, targets, torch.from_numpy(seg[:, :-1].copy()),
                            torch.from_numpy(pos[:, :-1].copy()))

    def __getitem__(self, i: int) -> Sample | PackedSample:
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"sample index must be an int, got {type(i).__name__} (sd.batch(start, n) for ranges)")
        if i < 0:
            raise IndexError(f"sample {i}: indices start at 0 (the stream is endless: epochs wrap)")
        b = self.batch(int(i), 1)
        return type(b)(*(t[0] for t in b))

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        srcs = ", ".join(f"{ds.prefix.name}:{w:.3g}" for ds, w in zip(self.datasets, self.weights))
        return (f"SampleDataset([{srcs}], seq_len={self.seq_len}, seed={self.seed}, split={self.split!r}: "
                f"{len(self)} samples per epoch)")


__all__ = ["IGNORE", "PERIOD", "PackedSample", "Sample", "SampleDataset", "apportion", "blend_schedule",
           "document_mask", "permutation", "split_documents"]
