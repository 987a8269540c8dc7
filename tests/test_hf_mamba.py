"""An unmodified Hugging Face Mamba (v1) causal LM at tp=2, its torch path (no CUDA kernels): Megatron Core's
MambaMixer layout (mcompile/sharding/mixer_hints.py), counted per layer, and the single-device loss and gradients.

Layout: in_proj column-parallel with its channels-first x | z halves as blocks (each rank its channels of
both), the depthwise conv1d, dt_proj, A_log and D by channel, x_proj and out_proj row-parallel. Mamba v1's
B and C are one vector a token read by every channel: x_proj's output is all-reduced whole, so a layer runs
2 forward all-reduces (x_proj's and out_proj's, the 2 tp region exits the quality check counts) and no
all-gather; the layout before gathered 9 values a layer.

Tiny: hidden 32, 4 layers (block repetition on), state 8, dt rank 4, 2 sequences of 8 tokens.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from sim_harness import assert_sim_parity

from mcompile.ir.placements import BlockShard, Shard


class MambaLoss(torch.nn.Module):
    """``model(input_ids, labels, use_cache=False).loss``."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.m = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=ids, labels=labels, use_cache=False).loss


_PLAN: dict = {}


def planned():
    import transformers as hf
    from transformers.utils import logging

    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh

    if not _PLAN:
        logging.set_verbosity_error()
        torch.manual_seed(0)
        cfg = hf.MambaConfig(vocab_size=128, hidden_size=32, state_size=8, num_hidden_layers=4, expand=2,
                             conv_kernel=4, time_step_rank=4)
        model = MambaLoss(hf.MambaForCausalLM(cfg)).train()
        g = torch.Generator().manual_seed(1)
        inputs = (torch.randint(0, 128, (2, 8), generator=g), torch.randint(0, 128, (2, 8), generator=g))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c = compile_plan(model, Mesh.fake(tp=2), inputs)
        _PLAN.update(model=model, inputs=inputs, c=c, warned=[str(w.message) for w in caught])
    return _PLAN["model"], _PLAN["inputs"], _PLAN["c"], _PLAN["warned"]


# Megatron's MambaMixer placements over tp (x | z blocks: in_proj's 2 * 64 output rows)
LAYOUT = {"in_proj.weight": BlockShard(0, 2), "conv1d.weight": Shard(0), "conv1d.bias": Shard(0),
          "x_proj.weight": Shard(1), "dt_proj.weight": Shard(0), "dt_proj.bias": Shard(0), "A_log": Shard(0),
          "D": Shard(0), "out_proj.weight": Shard(1)}


@pytest.mark.timeout(300)
def test_mamba_megatron_layout_tp2():
    """Every layer's weights by channel, 2 forward all-reduces a layer and no all-gather, no op replicated
    for want of a rule, no quality finding."""
    _, _, c, warned = planned()
    assert c.plan.fallbacks == [] and not warned, warned
    for i in range(4):
        for name, want in LAYOUT.items():
            assert c.plan.params[f"m.backbone.layers.{i}.mixer.{name}"].placements == (want,), (i, name)
    forward = [s for s in c.plan.collectives if s.axis == "tp" and s.forward != "none" and s.layer is not None]
    assert not [s for s in forward if s.forward != "all_reduce"], [(s.forward, s.origin) for s in forward]
    nodes = {n.name: n for n in c.captured.gm.graph.nodes}
    for i in range(4):
        mine = [s for s in forward if s.layer == i]
        # x_proj's and out_proj's outputs: the linears reading the conv's channels and the scan's
        assert len(mine) == 2 and all(nodes[s.origin].target is torch.ops.aten.linear.default for s in mine), mine
    assert c.quality == []


@pytest.mark.timeout(300)
def test_mamba_parity_tp2():
    """Loss and every gradient against the single-device model (tolerances: sim_harness.assert_sim_parity)."""
    model, inputs, c, _ = planned()
    assert_sim_parity(c, model, inputs, "mamba")
