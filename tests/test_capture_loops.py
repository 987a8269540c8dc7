"""Constructs of eager mixture-of-experts code that torch.export alone refuses, captured with their meaning:
Python loops over the indices a mask selects (``for e in hit.nonzero()``: mcompile/capture/loops.py), a no-op
``module.to(dtype)`` in forward, and a Hugging Face stack that builds its default mask only outside compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mcompile.capture.export import CaptureError, capture

E, D, H = 4, 8, 16


class LoopMoE(nn.Module):
    """The transformers eager dispatch (Mixtral, DBRX, Switch, NLLB-MoE): a loop over the experts that some token
    chose. ``extra`` columns in the dispatch mask that top-k never selects (DBRX one-hots to E + 1 classes), a
    per-expert ``bias`` added once per expert that runs (an update that is not a no-op for an expert without
    tokens: a loop over every expert left unselected would add every bias), and ``cast``: a router cast to the
    dtype it has (Switch Transformers / NLLB-MoE)."""

    def __init__(self, extra: int = 0, scalar: bool = False):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, H, D) * 0.3)
        self.w2 = nn.Parameter(torch.randn(E, D, H) * 0.3)
        self.bias = nn.Parameter(torch.randn(E, D))
        self.extra, self.scalar = extra, scalar

    def forward(self, x):
        h = x.reshape(-1, D)
        self.router = self.router.to(torch.float32)
        w, idx = self.router(h).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(h)
        total = torch.zeros(D)
        with torch.no_grad():
            mask = F.one_hot(idx, E + self.extra).permute(2, 1, 0)
            hit = mask.sum(dim=(-1, -2)) > 0
            experts = torch.where(hit)[0] if self.scalar else hit.nonzero()
        for e in experts:
            with torch.no_grad():
                k, t = torch.where(mask[e].squeeze(0))
            y = F.silu(h[t] @ self.w1[e].squeeze(0).T) @ self.w2[e].squeeze(0).T
            out.index_add_(0, t, y * w[t, k, None])
            total = total + self.bias[e].reshape(D)
        return (out + total).pow(2).mean()


def _grads(loss, params):
    return torch.autograd.grad(loss, params, allow_unused=True)


@pytest.mark.parametrize("extra,scalar", [(0, False), (1, True)])
def test_loop_over_selected_experts_captured_with_its_meaning(extra, scalar):
    """Every expert is unrolled and each iteration's updates (the in-place index_add_, the functional running
    sum) are selected by its mask entry: the program equals eager mode also when an expert gets no token, loss
    and gradients. An index the body cannot run (DBRX's extra column, out of the weights' range: found while
    tracing when the index is 0-d, a select; in the graph when it is 1-d, a gather) is left out."""
    torch.manual_seed(0)
    m = LoopMoE(extra, scalar)
    cap = capture(m, (torch.randn(2, 5, D),))
    prog = cap.ep.module()
    for starve in (None, 3):
        if starve is not None:
            with torch.no_grad():
                m.router.weight[starve] = -50.0  # expert 3 is never chosen
                prog.get_parameter("router.weight").copy_(m.router.weight)
        x = torch.randn(3, 7, D)
        ref, got = m(x), prog(x)
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        names = [n for n, _ in m.named_parameters()]
        want = _grads(ref, [m.get_parameter(n) for n in names])
        have = _grads(got, [prog.get_parameter(n) for n in names])
        for n, a, b in zip(names, want, have):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=n)


def test_loop_refusals_name_the_loop():
    class Appends(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(E, D))

        def forward(self, x):
            hit = (x.sum(0)[:E] > 0).nonzero()
            parts = []
            for e in hit:  # a tensor per selected index, concatenated after the loop: no update to select
                parts.append(self.w[e] * 2)
            return torch.cat(parts).sum() + x.sum()

    class Breaks(nn.Module):
        def forward(self, x):
            hit = (x.sum(0)[:E] > 0).nonzero()
            for e in hit:
                x = x * e
                break
            return x.sum()

    with pytest.raises(CaptureError, match=r"(?s)not an update of one tensor.*for e in hit:  # a tensor per"):
        capture(Appends(), (torch.randn(3, D),))
    with pytest.raises(CaptureError, match=r"(?s)leaves early.*for e in hit:"):
        capture(Breaks(), (torch.randn(3, D),))


def test_hf_stack_without_mask_gets_the_mask_eager_mode_builds():
    """A Hugging Face forward that builds its default all-ones mask only when not compiling (T5-style stacks:
    Switch Transformers, LongT5) is captured with that mask, built from input_ids inside the program."""
    from transformers import PretrainedConfig, PreTrainedModel

    class Cfg(PretrainedConfig):
        model_type = "mc-mask-test"

    class Masked(PreTrainedModel):
        config_class = Cfg

        def __init__(self, config):
            super().__init__(config)
            self.emb = nn.Embedding(32, D)

        def forward(self, input_ids, attention_mask=None, labels=None):
            if attention_mask is None and not torch.compiler.is_compiling():
                attention_mask = torch.ones(input_ids.shape)
            h = self.emb(input_ids) * attention_mask[:, :, None]
            return {"loss": h.pow(2).mean()}

    m = Masked(Cfg())
    ids = torch.randint(0, 32, (2, 6))
    cap = capture(m, (), {"input_ids": ids})
    torch.testing.assert_close(cap.ep.module()(input_ids=ids), m(input_ids=ids)["loss"])
