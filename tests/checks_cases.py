"""Models for tests/test_capture_checks.py, in a module pytest does not rewrite: their ``assert`` statements
compile as in a user's model (pytest rewrites a test module's asserts into other bytecode)."""

from __future__ import annotations

import torch
import torch.nn as nn

V, D = 16, 8


class Checked(nn.Module):
    """Input validation as Hugging Face models write it: an ``assert`` on ``.item()`` (ProphetNet's label shift),
    ``if ...: raise`` (torch.distributions' argument checks), and an ``assert a and b`` over two reductions."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)

    def forward(self, ids):
        assert torch.all(ids >= 0).item(), "ids must be non-negative"
        if (ids >= V).any():
            raise ValueError(f"ids out of the vocabulary ({V})")
        h = self.emb(ids)
        assert h.isnan().sum() == 0 and h.isinf().sum() == 0, "NaN in the embeddings"
        return self.fc2(torch.relu(self.fc1(h))).pow(2).mean()
