"""The Megatron-style planner, proven without processes.

What is isolated: capture -> planning -> lowering to per-rank programs. The programs of a mesh run
together in one process (one thread per rank, mcompile.runtime.sim) and must give the
single-device loss; every collective they execute is counted by the simulated communicator, not
taken from the planner's own bookkeeping.
"""

from __future__ import annotations

import collections

import pytest
import torch
from sim_harness import combine_grads, run_sim

from mcompile.ir.ops import OPS
from mcompile.ir.placements import BlockShard, Shard
from mcompile.runtime.sim import ThreadedWorld, run_threads

from conftest import MODELS, compiled

LINEAR_OPS = {torch.ops.aten.linear.default, torch.ops.aten.matmul.default, torch.ops.aten.mm.default,
              torch.ops.aten.embedding.default}

# Megatron's minimum per transformer layer per training step (DESIGN §7), as
# (op, forward collective, backward collective) -> count.
MEGATRON_TP = {("all_reduce", "all_reduce", "none"): 2, ("copy_ar_bwd", "none", "all_reduce"): 2}
MEGATRON_SP = {("all_gather", "all_gather", "reduce_scatter"): 2,
               ("reduce_scatter", "reduce_scatter", "all_gather"): 2}


def _weights(c):
    """FQNs of parameters used as the weight of a linear / matmul / embedding."""
    from mcompile.sharding.propagate import CONTRACTION_WEIGHT_ARGS

    out = set()
    for n in c.captured.gm.graph.nodes:
        for i in CONTRACTION_WEIGHT_ARGS.get(n.target, ()):
            if getattr(n.args[i], "name", None) in c.captured.params:
                out.add(c.captured.params[n.args[i].name])
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_megatron_layout(name, tp, sp):
    model, inputs, c, fallbacks = compiled(name, f"tp={tp}", sp)
    assert not fallbacks, [str(w.message) for w in fallbacks]
    assert c.plan.fallbacks == []
    # every weight of a linear / embedding is sharded: local size = full / tp (padded vocab: ceil)
    weights = _weights(c)
    assert weights
    for fqn in weights:
        pp = c.plan.params[fqn]
        (pl,) = pp.placements
        assert isinstance(pl, Shard | BlockShard), (fqn, pl)
        full = pp.padded_shape or pp.shape
        assert pp.local_numel * tp == torch.Size(full).numel(), fqn
    # per-layer collectives: exactly Megatron's, identical in every layer
    per_layer = collections.defaultdict(collections.Counter)
    outside = []
    for spec in c.plan.collectives:
        if spec.layer is None:
            outside.append(spec)
        else:
            per_layer[spec.layer][(spec.op, spec.forward, spec.backward)] += 1
    assert sorted(per_layer) == [0, 1]
    for layer, counts in per_layer.items():
        assert dict(counts) == (MEGATRON_SP if sp else MEGATRON_TP), (layer, counts)
    # outside the layers: only the vocab-parallel embedding(s) and loss, and the LM head's entry
    n_emb = sum(1 for n in c.captured.gm.graph.nodes if n.target is torch.ops.aten.embedding.default)
    origins = collections.Counter(s.purpose for s in outside)
    assert origins["vocab-parallel loss: max"] == 1
    assert origins["vocab-parallel loss: sum exp"] == 1
    assert origins["vocab-parallel loss: target logit"] == 1
    # the embeddings (GPT-2: token + position, each vocabulary-parallel) are summed as partial sums and
    # reduced once, as Megatron reduces its one vocabulary-parallel embedding
    emb_reductions = [s for s in outside if "partial" in s.purpose]
    assert n_emb >= 1 and len(emb_reductions) == 1, emb_reductions
    head_entry = [s for s in outside if "loss" not in s.purpose and s not in emb_reductions]
    assert len(head_entry) == 1, head_entry
    assert head_entry[0].op == ("all_gather" if sp else "copy_ar_bwd")
    # the program's collective nodes are exactly the plan's
    prog = c.program(0)
    n_nodes = sum(1 for n in prog.graph.nodes if n.target in OPS.values())
    assert n_nodes == len(c.plan.collectives)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_forward_parity_in_one_process(name, tp, sp):
    """The per-rank programs of a tp group, run together, give the single-device loss (≤ 1e-6
    relative: fp32 with a different summation order over tp pieces; measured ~1e-7)."""
    model, inputs, c, _ = compiled(name, f"tp={tp}", sp)
    ref = model(*inputs)
    results = run_sim(c, inputs, backward=False)
    for loss, _, _log in results:
        assert torch.allclose(loss, ref, rtol=1e-6, atol=0), (loss.item(), ref.item())
    # forward collectives executed == the plan's forward collectives (counted at run time)
    executed = collections.Counter(kind for kind, _, _ in results[0][2])
    planned = collections.Counter(
        {"all_reduce": "all_reduce_sum", "all_reduce_max": "all_reduce_max", "all_gather": "all_gather",
         "reduce_scatter": "reduce_scatter"}[s.forward]
        for s in c.plan.collectives if s.forward != "none"
    )
    assert executed == planned


@pytest.mark.parametrize("mesh,sp", [("tp=2", False), ("tp=2", True), ("dp=2,tp=2", True)])
@pytest.mark.parametrize("name", ["llama3-tiny", "hf-gpt2"])
def test_backward_parity_and_counts(name, mesh, sp):
    """Beyond forward: backward through the plan-registered collectives gives the single-device
    gradients, and the collectives run in backward are the ones the plan states."""
    model, inputs, c, _ = compiled(name, mesh, sp)
    model.zero_grad()
    ref_loss = model(*inputs)
    if "dp" in mesh:  # dp ranks average their own batch means: equal token counts per rank needed
        inputs = (inputs[0], torch.where(inputs[1] < 0, inputs[1].abs() % 7, inputs[1]))
        model.zero_grad()
        ref_loss = model(*inputs)
    ref_loss.backward()
    ref = {k: p.grad for k, p in model.named_parameters()}
    results = run_sim(c, inputs, backward=True)
    full = combine_grads(c, [g for _, g, _ in results])
    for fqn, g in full.items():
        # fp32, different reduction order over tp pieces: measured <= 3e-7 relative
        assert torch.allclose(g, ref[fqn], rtol=1e-5, atol=1e-7), (fqn, (g - ref[fqn]).abs().max())
    log = collections.Counter(kind for kind, axis, _ in results[0][2] if axis == "tp")
    fwd = collections.Counter(s.forward for s in c.plan.collectives if s.axis == "tp" and s.forward != "none")
    bwd = collections.Counter(s.backward for s in c.plan.collectives if s.axis == "tp" and s.backward != "none")
    total = fwd + bwd
    expect = collections.Counter({{"all_reduce": "all_reduce_sum"}.get(k, k): v for k, v in total.items()})
    assert log == expect


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["llama3-tiny", "hf-gpt2"])
def test_per_rank_matmul_flops_are_one_tp_th(name, tp):
    """Guard against a replicated layout passing parity: each rank's program does 1/tp of the
    single-device matmul and attention FLOPs (torch's FlopCounterMode, an independent counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    model, inputs, c, _ = compiled(name, f"tp={tp}", False)
    with FlopCounterMode(display=False) as ref_counter:
        model(*inputs)
    state = c.captured.state_values()
    counters = []

    def rank_fn(r):
        with FlopCounterMode(display=False) as counter:
            c.run_local(r, c.local_state(r, state), inputs)
        counters.append(counter.get_total_flops())

    run_threads(ThreadedWorld(c.mesh), rank_fn)
    # a padded vocabulary (HF GPT-2 here: 129 -> 256 or 512, tp x 128) costs its padded LM-head rows
    padding = 0
    for pp in c.plan.params.values():
        if pp.padded_shape is not None:
            tokens = inputs[0].numel()
            padding += 2 * tokens * pp.shape[1] * (pp.padded_shape[0] - pp.shape[0])
    assert all(f * tp == ref_counter.get_total_flops() + padding for f in counters), (
        counters, ref_counter.get_total_flops(), padding)
