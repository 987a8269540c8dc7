"""Worker functions for tests/test_family_t5.py: the unmodified Hugging Face ``T5ForConditionalGeneration``
trained on gloo processes and on one device (the same steps as tests/runtime_cases.py's ``train`` and
``reference``, which build their model through conftest.build by preset name).

Module-level so the workers can import them by name.
"""

from __future__ import annotations

import torch
from runtime_cases import reference_model, train, train_model


class Seq2SeqLoss(torch.nn.Module):
    """``model(input_ids=, attention_mask=, labels=).loss`` as a plain three-argument forward."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.m = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss


def hf_t5(seed: int = 0, batch: int = 2, seq: int = 16):
    """(model, (input_ids, attention_mask, labels)): a tiny unmodified HF T5 (d_model 64, d_ff 128, 8 heads of
    d_kv 8, 2 + 2 layers, vocab 128, no dropout) and the inputs of models/t5.py's presets (the first row's last 3
    encoder positions padding, its first 5 labels ignored)."""
    import transformers as hf
    from transformers.utils import logging

    from mcompile.models.t5 import t5_inputs

    logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = hf.T5Config(vocab_size=128, d_model=64, d_ff=128, d_kv=8, num_heads=8, num_layers=2, num_decoder_layers=2,
                      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    model = Seq2SeqLoss(hf.T5ForConditionalGeneration(cfg)).eval()  # dropout off: parity at p = 0
    g = torch.Generator().manual_seed(seed + 1)
    return model, t5_inputs(cfg, batch, seq, torch.device("cpu"), g)


def train_t5(rank, world, name, mesh, options, steps=3, batch=4):
    """runtime_cases.train of a models/t5.py preset, in a worker that has the T5 rules registered."""
    return train(rank, world, name, mesh, options, steps, batch)


def train_hf(rank, world, mesh, options, steps=3, batch=4):
    """runtime_cases.train_model for the HF model: per-step losses, the unclipped full gradients of the last step
    (rank 0), local parameter sizes, the clip norms."""
    return train_model(rank, *hf_t5(batch=batch), mesh, options, steps)


def reference_hf(steps=3, batch=4):
    """``train_hf`` on one device."""
    return reference_model(*hf_t5(batch=batch), steps)
