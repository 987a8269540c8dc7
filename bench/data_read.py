"""Read throughput of the data layer: ``SampleDataset.batch`` at seq 2048, sequential and random.

    python bench/data_read.py [--tokens 20000000] [--write] [--out PATH]

A synthetic dataset (``--tokens`` token ids, vocabulary 50257 so uint16 on disk, documents of
log-normal lengths around 600 tokens, like web text) is written to a temporary folder with
``write_indexed``; then, on one process:

- ``sequential``: ``batch(start, 8)`` for start = 0, 8, 16, ... (what a trainer does);
- ``random_in_epoch``: ``batch(start, 8)`` at random starts within one epoch;
- ``random``: ``batch(start, 8)`` at random starts spread over 50 epochs (nearly every call builds
  another epoch's shuffles: the worst case; a trainer builds one per epoch);
- ``blend``: sequential over a blend of two such datasets (weights 0.7 / 0.3);
- ``first_epoch_s``: building one epoch's document and window shuffles (once per epoch);
- ``preprocess``: tokens per second of ``preprocess`` on the shipped tiny corpus with its tokenizer;
- ``per_rank``: what one rank of ``mcompile train`` reads per step of a global batch of 256 samples, counted at
  the ``.bin``'s memory map, at dp = 1, 8, 64: its own rows (``data.read = "local"``, the default) against the
  whole batch every rank read before (``global``, the dp = 1 row's figures at any dp).

The files were just written, so reads come from the page cache: this measures the sampler's own
cost (index arithmetic, gathers, tensor copies), not a disk. samples/s counts samples of 2048 tokens,
tokens/s = samples/s x 2048.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

SEQ, BATCH, VOCAB = 2048, 8, 50257
GLOBAL_BATCH, DPS, STEPS = 256, (1, 8, 64), 4  # per_rank


def make(prefix: Path, tokens: int, seed: int) -> None:
    from mcompile.apps.data import write_indexed

    rng = np.random.default_rng(seed)

    def docs():
        left = tokens
        while left > 0:
            n = int(min(left, max(1, rng.lognormal(np.log(600), 0.8))))
            left -= n
            yield rng.integers(0, VOCAB, n, dtype=np.int64)

    write_indexed(prefix, docs(), VOCAB)


def rate(fn, calls: int) -> dict:
    fn(0)  # warm: the first epoch's shuffles
    t = time.perf_counter()
    for k in range(calls):
        fn(k)
    s = time.perf_counter() - t
    samples = calls * BATCH / s
    return {"calls": calls, "seconds": round(s, 3), "samples_per_s": round(samples, 1),
            "tokens_per_s": round(samples * SEQ)}


def per_rank(sd, ds) -> list[dict]:
    """Per dp: the samples, token ids and bytes one data rank reads per step (the last rank's rows of each of
    STEPS global batches, as mcompile train's loop reads them: ``batch(consumed + first row, rows)``), counted
    through a view over the dataset's memory map, and the seconds per step."""

    class Counted:
        def __init__(self, array):
            self.array, self.ids = array, 0

        def __getitem__(self, index):
            out = self.array[index]
            self.ids += int(np.size(out))
            return out

    memmap, ds.tokens = ds.tokens, Counted(ds.tokens)
    try:
        out = []
        for dp in DPS:
            rows = GLOBAL_BATCH // dp
            first = (dp - 1) * rows
            ds.tokens.ids = 0
            t = time.perf_counter()
            for k in range(STEPS):
                sd.batch(k * GLOBAL_BATCH + first, rows)
            s = time.perf_counter() - t
            ids = ds.tokens.ids // STEPS
            out.append({"dp": dp, "samples": rows, "ids": ids, "bytes": ids * ds.dtype.itemsize,
                        "seconds": round(s / STEPS, 4)})
        return out
    finally:
        ds.tokens = memmap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=20_000_000)
    ap.add_argument("--calls", type=int, default=300)
    _results.add_arguments(ap, "data_read")
    args = ap.parse_args()
    import torch

    from mcompile.apps.data import IndexedDataset, SampleDataset, preprocess, tiny_corpus, tiny_tokenizer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="mcompile-data-read-") as tmp:
        a, b = Path(tmp) / "a", Path(tmp) / "b"
        t = time.perf_counter()
        make(a, args.tokens, 0)
        write_s = time.perf_counter() - t
        make(b, args.tokens // 4, 1)
        ds = IndexedDataset(a)
        t = time.perf_counter()
        sd = SampleDataset(a, SEQ, seed=0)
        sd.batch(0, 1)
        first_epoch_s = time.perf_counter() - t
        rng = np.random.default_rng(0)
        starts = rng.integers(0, 50 * len(sd), args.calls + 1)
        near = rng.integers(0, len(sd) - BATCH, args.calls + 1)
        result = {
            "dataset": {"tokens": ds.num_tokens, "documents": len(ds), "dtype": str(ds.dtype), "vocab": VOCAB,
                        "samples_per_epoch": len(sd), "write_s": round(write_s, 2)},
            "seq_len": SEQ, "batch": BATCH,
            "first_epoch_s": round(first_epoch_s, 3),
            "sequential": rate(lambda k: sd.batch(k * BATCH, BATCH), args.calls),
            "random_in_epoch": rate(lambda k: sd.batch(int(near[k]), BATCH), args.calls),
            "random": rate(lambda k: sd.batch(int(starts[k]), BATCH), args.calls),
        }
        blend = SampleDataset([(a, 0.7), (b, 0.3)], SEQ, seed=0)
        result["blend"] = rate(lambda k: blend.batch(k * BATCH, BATCH), args.calls)
        one = SampleDataset(a, SEQ, seed=0)
        one.batch(0, 1)  # the first epoch's shuffles built
        result["per_rank"] = {"global_batch": GLOBAL_BATCH, "local": per_rank(one, one.datasets[0])}
        stats = preprocess([tiny_corpus()], Path(tmp) / "tiny", tiny_tokenizer(), progress=False)
        result["preprocess"] = {"tokens": stats["tokens"], "seconds": stats["seconds"],
                                "tokens_per_s": stats["tokens_per_s"], "input": "tiny_corpus.jsonl"}
    _results.save("data_read", result, args.write, args.out)


if __name__ == "__main__":
    main()
