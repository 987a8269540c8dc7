"""Functions the gloo worker processes run for tests/test_init.py: fn(rank, world, *args).

Models built on the meta device, parallelized and initialised shard by shard (mcompile.runtime.init).
"""

from __future__ import annotations

import math

import torch

import mcompile as mc

MODELS = ["llama3-tiny", "gpt2-tiny", "hf-llama"]


def meta_build(name: str, batch: int = 4):
    """(model on the meta device, (tokens, targets)): the tiny models of conftest.build, never materialised."""
    if name == "hf-llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.utils import logging

        from mcompile.models.hf import CausalLMLoss

        logging.set_verbosity_error()
        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=4)
        with torch.device("meta"):
            model = CausalLMLoss(LlamaForCausalLM(cfg))
        vocab = cfg.vocab_size
    else:
        from mcompile.models import get_preset

        pre = get_preset(name)
        model = pre.build(device="meta")
        vocab = pre.config.vocab_size
    model.eval()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, 16), generator=g)
    targets = torch.randint(0, vocab, (batch, 16), generator=g)
    targets[0, :5] = -100
    return model, (tokens, targets)


def layouts(rank, world, meshes, seed):
    """For each model and mesh: the full state dict and the (replicated) buffers (rank 0), the loss of
    one training step and whether the model given to parallelize is still wholly on meta."""
    out = {}
    for name in MODELS:
        for mesh in meshes:
            model, inputs = meta_build(name)
            pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, init_seed=seed)
            cap = pm._compiled.captured
            sd = {k: v.clone() for k, v in pm.full_state_dict().items()}  # (replicated: the live tensors)
            buffers = {fqn: pm._extra[ph].clone() for ph, fqn in cap.buffers.items()}
            opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
            loss = pm.train_step(*inputs).item()
            opt.step()
            loss2 = pm.train_step(*inputs).item()
            still_meta = all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
            out[(name, mesh)] = {"state": sd if rank == 0 else None, "buffers": buffers if rank == 0 else None,
                                 "losses": (loss, loss2), "still_meta": still_meta,
                                 "finite": math.isfinite(loss) and math.isfinite(loss2)}
    return out


class _Scale(torch.nn.Module):  # owns a parameter, and nothing initialises it
    def __init__(self, dim):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.empty(dim))

    def forward(self, x):
        return x * self.gain


class _NoInit(torch.nn.Module):
    def __init__(self, vocab=64, dim=32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.scale = _Scale(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, labels):
        logits = self.head(self.scale(self.emb(ids)))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


class _Partial(_NoInit):  # an _init_weights that does not know _Scale: it runs, and leaves gain unset
    def _init_weights(self, module):
        if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, std=0.02)


def meta_errors(rank, world, mesh):
    """The errors parallelize gives for meta models that cannot be initialised, and whether the model
    was left as it was (still wholly on meta)."""
    out = {}
    for cls in (_NoInit, _Partial):
        with torch.device("meta"):
            model = cls()
        ids = torch.randint(0, 64, (4, 8))
        try:
            mc.parallelize(model, mc.Mesh.parse(mesh), (ids, ids))
            msg = "no error"
        except Exception as e:  # noqa: BLE001 - the error is the result
            msg = f"{type(e).__name__}: {e}"
        out[cls.__name__] = (msg, all(p.is_meta for p in model.parameters()))
    return out
