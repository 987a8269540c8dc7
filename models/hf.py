"""Hugging Face causal LMs as ``forward(ids, labels) -> loss`` — the model itself unmodified.

A bare ``PreTrainedModel`` works too: mcompile reads its positional example inputs as
``(input_ids, labels)`` and captures its ``ModelOutput``'s loss with ``use_cache=False``
(mcompile/capture/export.py); this wrapper keeps the model's own ``use_cache`` default.
"""

from __future__ import annotations

import torch


class CausalLMLoss(torch.nn.Module):
    """``model(input_ids=ids, labels=labels).loss`` as a plain two-argument forward."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.m = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=ids, labels=labels).loss
