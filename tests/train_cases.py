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
