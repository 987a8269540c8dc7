"""An unmodified Hugging Face Mamba-2 causal LM at tp=2, its torch path (no CUDA kernels): the nested cut of its
fused in_proj ([z | xBC | dt], then xBC through the depthwise conv into [x | B | C]) found from the graph
(mcompile/sharding/mixer_hints.py), counted per layer, and the single-device loss and gradients.

- ``n_groups`` divisible by tp (2 groups): Megatron Core's MambaMixer layout. in_proj column-parallel as the
  blocks z | x | B | C | dt (each rank its heads of z, x, dt and its groups of B, C), the conv as x | B | C,
  the scan and the grouped gated RMSNorm on each rank's heads and groups, out_proj row-parallel: 1 forward
  all-reduce a layer (the mixer's exit). Before: in_proj's outer cut alone (z | xBC | dt), x, B, C, dt and
  the scan gathered (7 forward collectives a layer).
- ``n_groups = 1`` (HF Bamba's, Falcon-H1's, Zamba2's default): B and C must be whole on every rank (Megatron
  asserts ``ngroups % tp == 0``), so the fused in_proj and its conv stay whole (the reason recorded by the
  quality check) and each rank slices its heads of x, z and dt; the one group is repeated for a rank's heads
  locally; the norm's one group spans the ranks: its statistic is all-reduced (the model's, not counted),
  out_proj row-parallel. Before: B and C split by their state, every scan contraction all-reduced (12 forward
  collectives a layer in Bamba).

Tiny: hidden 32, 2 layers, 4 SSM heads of 16, state 8, chunk 8, 2 sequences of 8 tokens.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from sim_harness import assert_sim_parity

from mcompile.ir.placements import BlockShard, Replicate, Shard


class Mamba2Loss(torch.nn.Module):
    """``model(input_ids, labels, use_cache=False).loss``."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.m = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=ids, labels=labels, use_cache=False).loss


_PLANS: dict = {}


def planned(groups: int):
    import transformers as hf
    from transformers.utils import logging

    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh

    if groups not in _PLANS:
        logging.set_verbosity_error()
        torch.manual_seed(0)
        cfg = hf.Mamba2Config(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
                              expand=2, state_size=8, n_groups=groups, conv_kernel=4, chunk_size=8)
        model = Mamba2Loss(hf.Mamba2ForCausalLM(cfg)).float().train()
        g = torch.Generator().manual_seed(1)
        inputs = (torch.randint(0, 128, (2, 8), generator=g), torch.randint(0, 128, (2, 8), generator=g))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c = compile_plan(model, Mesh.fake(tp=2), inputs)
        _PLANS[groups] = (model, inputs, c, [str(w.message) for w in caught])
    return _PLANS[groups]


def _forward(c) -> dict[int, list]:
    out: dict[int, list] = {}
    for s in c.plan.collectives:
        if s.axis == "tp" and s.forward != "none" and s.layer is not None:
            out.setdefault(s.layer, []).append(s)
    return out


@pytest.mark.timeout(300)
def test_mamba2_groups_divisible_layout_and_parity_tp2():
    model, inputs, c, warned = planned(2)
    assert c.plan.fallbacks == [] and not warned, warned
    # in_proj rows: z 64 | x 64 | B 2 x 8 | C 2 x 8 | dt 4
    want = {"in_proj.weight": BlockShard(0, (64, 64, 16, 16, 4)), "conv1d.weight": BlockShard(0, (64, 16, 16)),
            "conv1d.bias": BlockShard(0, (64, 16, 16)), "out_proj.weight": Shard(1), "norm.weight": Shard(0),
            "A_log": Shard(0), "D": Shard(0), "dt_bias": Shard(0)}
    for i in range(2):
        for name, p in want.items():
            assert c.plan.params[f"m.backbone.layers.{i}.mixer.{name}"].placements == (p,), (i, name)
    nodes = {n.name: n for n in c.captured.gm.graph.nodes}
    for i, specs in sorted(_forward(c).items()):  # out_proj's all-reduce, nothing gathered
        want = [("all_reduce", torch.ops.aten.linear.default)]
        assert [(s.forward, nodes[s.origin].target) for s in specs] == want, i
    assert sorted(_forward(c)) == [0, 1]
    assert c.quality == []
    assert_sim_parity(c, model, inputs, "mamba2 groups=2")


@pytest.mark.timeout(300)
def test_mamba2_one_group_whole_in_proj_and_parity_tp2():
    model, inputs, c, warned = planned(1)
    assert c.plan.fallbacks == [] and not warned, warned
    want = {"in_proj.weight": Replicate(), "conv1d.weight": Replicate(), "out_proj.weight": Shard(1),
            "norm.weight": Shard(0)}
    for i in range(2):
        for name, p in want.items():
            assert c.plan.params[f"m.backbone.layers.{i}.mixer.{name}"].placements == (p,), (i, name)
    nodes = {n.name: n for n in c.captured.gm.graph.nodes}
    for i, specs in sorted(_forward(c).items()):
        # the gated norm's statistic over its one group (all heads: the model's), then out_proj's exit
        assert [s.forward for s in specs] == ["all_reduce", "all_reduce"], (i, [(s.forward, s.origin) for s in specs])
        assert nodes[specs[0].origin].target is torch.ops.aten.mean.dim
        assert nodes[specs[1].origin].target is torch.ops.aten.linear.default
    assert c.quality == []  # in_proj whole with its reason: fewer B/C groups than tp ranks
    assert_sim_parity(c, model, inputs, "mamba2 groups=1")
