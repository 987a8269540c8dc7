"""Functions the gloo worker processes run for tests/test_evaluate.py: fn(rank, world, *args), and the
stand-ins they share with the test: a byte-level tokenizer and a held-out split with the interface of
``mcompile.apps.data.SampleDataset(..., split="valid")`` (``len``, ``batch(first, n) -> (tokens, targets)``)."""

from __future__ import annotations

import torch

import mcompile as mc
from mcompile.apps.evaluate import last_word_accuracy, perplexity


class Bytes:
    """A tokenizer: one token per UTF-8 byte (vocabulary 256), 0 as end of text."""

    eos_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class Split:
    """``n`` samples of ``seq`` tokens; each ignores a random number (0 .. seq - 1) of its first targets
    (-100), so the batches, and the data-parallel halves of a batch, count different numbers of tokens."""

    def __init__(self, vocab: int, n: int, seq: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (n, seq), generator=g)
        self.targets = torch.randint(0, vocab, (n, seq), generator=g)
        for i, k in enumerate(torch.randint(0, seq, (n,), generator=g).tolist()):
            self.targets[i, :k] = -100

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, first: int, n: int):
        return self.tokens[first:first + n].clone(), self.targets[first:first + n].clone()


def preset(seed: int = 0, state=None, sharp: bool = False):
    """llama3-tiny; ``sharp``: its output projection scaled by 30, so that its logits are far from uniform
    and the cross-entropy differs from token to token (at init every token costs ~log 256)."""
    from mcompile.models import get_preset

    torch.manual_seed(seed)
    model = get_preset("llama3-tiny").build()
    if state is not None:
        model.load_state_dict(torch.load(state))
    if sharp:
        with torch.no_grad():
            model.output.weight.mul_(30.0)
    return model.eval()


def evaluate(rank, world, mesh, ppl_args, state, jsonl, export_to):
    """Perplexity of a llama3-tiny loss program and the last-word accuracy of a memorising one, both
    parallelized over ``mesh``: every rank's numbers. The first is also exported to ``export_to``
    (mcompile.apps.hf_io.export_hf under data parallelism)."""
    from mcompile.apps.hf_io import export_hf

    model = preset(seed=1, sharp=True)
    tokens, targets = Split(256, 4, 16).batch(0, 4)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), (tokens, targets))
    ppl = perplexity(pm, Split(*ppl_args["split"]), batch_size=ppl_args["batch_size"])
    # each rank reading only its rows (the halves of a batch count different numbers of targets): the same numbers
    local = mc.parallelize(model, mc.Mesh.parse(mesh), (tokens, targets), inputs="local")
    assert perplexity(local, Split(*ppl_args["split"]), batch_size=ppl_args["batch_size"]) == ppl
    del local
    export_hf(pm, export_to, model)
    acc = last_word_accuracy(preset(state=state), Bytes(), jsonl, mesh=mesh, batch_size=8)
    return {"ppl": ppl, "acc": acc}
