"""Functions the gloo worker processes run for tests/test_train.py, and a stand-in dataset.

``RandomSamples`` has SampleDataset's interface (``batch(start, n)``: samples start..start+n-1, the
same for the same arguments in any process and any order), from random tokens with a learnable
rule (each target is its token plus one, modulo the vocabulary), for tests that must not depend on
the data layer.
"""

from __future__ import annotations

import torch


class RandomSamples:
    def __init__(self, seq_len: int, seed: int = 0, split: str = "train", vocab: int = 256):
        self.seq_len, self.seed, self.vocab = seq_len, seed, vocab
        self.offset = 0 if split == "train" else 1 << 20  # valid: other samples

    def __len__(self) -> int:
        return 1 << 20

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.offset + i)
        tokens = torch.randint(0, self.vocab, (self.seq_len,), generator=g)
        return tokens, (tokens + 1) % self.vocab

    def batch(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self.sample(i) for i in range(start, start + n)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def random_samples(seq_len: int, seed: int, split: str) -> RandomSamples:
    """``data.factory = "train_cases:random_samples"``."""
    return RandomSamples(seq_len, seed, split)


def tiny_tree(steps: int, *overlays: dict, **sections) -> dict:
    """The tests' ``mcompile train`` config: the tiny Llama at dp=2 x tp=2 with SP, fp32 (set: the default is bf16;
    the resumed, other-layout and other-node runs are compared exactly / at 1e-5), random samples with a learnable
    rule, ``steps`` steps; each of ``overlays`` (a tree), then ``sections``, update its sections key by key."""
    tree = {
        "model": {"preset": "llama3-tiny"},
        "data": {"factory": "train_cases:random_samples"},
        "parallel": {"mesh": "dp=2,tp=2", "sequence_parallel": True},
        "optimizer": {"lr": 3e-3},
        "schedule": {"kind": "cosine", "warmup": 2, "min_lr": 1e-4},
        "train": {"steps": steps, "global_batch": 8, "seq_len": 16, "seed": 3, "dtype": "fp32"},
        "logging": {"interval": 1, "progress": "off"},
    }
    for layer in (*overlays, sections):
        for k, v in layer.items():
            tree[k] = {**tree.get(k, {}), **v}
    return tree


def toml_text(tree: dict) -> str:
    """A config tree ({table: {key: value}}) as TOML text, for runs of the ``mcompile train`` command."""
    import json

    def value(v):
        return json.dumps(v) if not isinstance(v, bool) else str(v).lower()

    return "\n".join(f"[{name}]\n" + "\n".join(f"{k} = {value(v)}" for k, v in table.items())
                     for name, table in tree.items()) + "\n"


def run_train(rank, world, tree: dict):
    """mcompile.apps.train.loop.train on a pool worker (its process group already initialised)."""
    from mcompile.apps.train.config import parse_config
    from mcompile.apps.train.loop import train

    return train(parse_config(tree, "test"))


def run_train_counting(rank, world, tree: dict):
    """:func:`run_train`, counting what this rank reads: (summary, calls), a call per ``SampleDataset.batch``
    (``{"split", "start", "n", "tokens", "targets", "read", "columns"}``: its first sample, its number of samples, the
    tokens and targets it returned, the token ids it read from the dataset's ``.bin`` through a counting view over
    every opened dataset's memory map, and the window positions asked for, None for all). The patches are undone
    after the run (the pool's workers live on)."""
    import numpy as np

    from mcompile.apps.data import indexed, sampling

    tally, calls = [0], []

    class Counted:  # the .bin memory map, counting the ids each index reads
        def __init__(self, array):
            self.array = array

        def __getitem__(self, index):
            out = self.array[index]
            tally[0] += int(np.size(out))
            return out

        def __len__(self):
            return len(self.array)

    init, batch = indexed.IndexedDataset.__init__, sampling.SampleDataset.batch

    def counting_init(self, prefix):
        init(self, prefix)
        self.tokens = Counted(self.tokens)

    def counting_batch(self, start, n, columns=None):
        before = tally[0]
        out = batch(self, start, n, columns)
        calls.append({"split": self.split, "start": int(start), "n": int(n), "tokens": out.tokens.clone(),
                      "targets": out.targets.clone(), "read": tally[0] - before,
                      "columns": None if columns is None else [int(c) for c in columns]})
        return out

    indexed.IndexedDataset.__init__, sampling.SampleDataset.batch = counting_init, counting_batch
    try:
        return run_train(rank, world, tree), calls
    finally:
        indexed.IndexedDataset.__init__, sampling.SampleDataset.batch = init, batch
