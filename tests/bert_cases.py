"""Gloo worker functions for tests/test_family_bert.py (fn(rank, world, *args)): the unmodified Hugging Face
``BertForMaskedLM``, built here because tests/conftest.py's ``build`` does not know it. Module-level so the
worker processes can import them by name. Our own BERT presets run through tests/runtime_cases.py."""

from __future__ import annotations

import torch

VOCAB = 128


class MaskedLMLoss(torch.nn.Module):
    """``model(input_ids, attention_mask, token_type_ids, labels).loss`` as a plain positional forward."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.m = model

    def forward(self, ids, attention_mask, token_type_ids, labels):
        return self.m(input_ids=ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                      labels=labels).loss


def build_hf(seed: int = 0, batch: int = 4, seq: int = 16):
    """(model.eval(), (ids, attention_mask, token_type_ids, labels)): HF BERT masked-LM, hidden 64, 2 layers,
    8 heads, intermediate 128, vocabulary 128, dropout 0. The first row's last 3 positions are padding
    (pad_token_id 0, attention_mask 0); masked-LM targets at every third unpadded position, -100 elsewhere."""
    from transformers import BertConfig, BertForMaskedLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=8, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    model = MaskedLMLoss(BertForMaskedLM(cfg)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    ids[0, -3:] = cfg.pad_token_id
    mask[0, -3:] = 0
    token_type = (torch.arange(seq)[None, :] >= seq // 2).long().expand(batch, seq).contiguous()
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    labels[mask == 0] = -100
    return model, (ids, mask, token_type, labels)


def train(rank, world, mesh, options, steps=3, batch=4):
    """runtime_cases.train_model for the HF model: per-step losses, the unclipped full gradients of the last step
    (rank 0), this rank's local parameter sizes, the clip norms."""
    from runtime_cases import train_model

    return train_model(rank, *build_hf(batch=batch), mesh, options, steps)


def reference(steps=3, batch=4):
    """``train`` on one device."""
    from runtime_cases import reference_model

    return reference_model(*build_hf(batch=batch), steps)


def build_hf_dropout(seed: int = 0, batch: int = 4, seq: int = 16):
    """(model in training mode, inputs): HF BERT masked-LM with its default dropout (hidden_dropout_prob and
    attention_probs_dropout_prob 0.1), hidden 64, 4 layers, 4 heads, vocabulary 128; the inputs of
    :func:`build_hf`."""
    from transformers import BertConfig, BertForMaskedLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, max_position_embeddings=64)
    assert cfg.hidden_dropout_prob == cfg.attention_probs_dropout_prob == 0.1  # transformers' defaults
    return MaskedLMLoss(BertForMaskedLM(cfg)).train(), build_hf(seed, batch, seq)[1]


def train_dropout(rank, world, mesh, options, steps=3, batch=4):
    """runtime_cases.train_model of :func:`build_hf_dropout`: masks from mcompile's counter-based generator
    (mcompile/ir/dropout.py), so every layout, one rank included, draws the same ones."""
    from runtime_cases import train_model

    return train_model(rank, *build_hf_dropout(batch=batch), mesh, options, steps)
