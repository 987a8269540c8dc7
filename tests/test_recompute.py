"""Activation recompute (mcompile.passes.recompute) on per-rank programs, in one process.

Parity of the trained numbers with recompute is in tests/test_runtime.py; here: recompute costs
exactly the FLOPs of what it recomputes, and it shrinks what forward saves for backward.
"""

from __future__ import annotations

import pytest
import sympy
import torch
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from mcompile import meta as M
from mcompile.annotate import MATMUL_CATEGORIES, node_cost
from mcompile.passes.recompute import apply_recompute, recompute_nodes
from mcompile.runtime.sim import ThreadedWorld, run_threads

from conftest import compiled


def _run(c, inputs, mode, measure):
    state = c.captured.state_values()

    def fn(r):
        prog = c.program(r)
        groups = recompute_nodes(prog, mode)
        gm = apply_recompute(prog, groups)
        local = {k: v.detach().clone().requires_grad_(k in c.captured.params)
                 for k, v in c.local_state(r, state).items()}
        names = [n.name for n in prog.graph.nodes if n.op == "placeholder"]
        user = dict(zip(c.captured.user_inputs, inputs))
        return measure(lambda: gm(*[local[n] if n in local else user[n] for n in names])[0], groups, prog)

    return run_threads(ThreadedWorld(c.mesh), fn)


# FlopCounterMode has no formula for the CPU flash-attention kernel SDPA dispatches to: give it
# torch's own SDPA formula (the one the annotation uses), for this counter only.
def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(query_shape, key_shape, value_shape)


_CPU_SDPA = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_costs_the_annotated_flops_of_the_recomputed_nodes(mode):
    """Backward with recompute runs exactly the recomputed nodes' forward FLOPs more (torch's
    FlopCounterMode: matmuls and attention), and those equal the annotation of the recomputed
    nodes' captured origins divided by tp (each rank computes 1/tp of each).

    Measured with checkpoint early-stop off, so that the whole region is recomputed. The runtime
    keeps torch's default (early stop on), which also skips the region's tail that backward does
    not need (the MLP down-projection of a fully recomputed layer): that is checked to cost less."""
    model, inputs, c, _ = compiled("llama3-tiny", "tp=2", True)

    def backward_flops(forward, groups, prog):
        loss = forward()
        with FlopCounterMode(display=False, custom_mapping=_CPU_SDPA) as counter:
            loss.backward()
        origins = {n.meta.get(M.ORIGIN) for n in prog.graph.nodes if n.name in groups}
        return counter.get_total_flops(), origins

    base = _run(c, inputs, "none", backward_flops)
    early = _run(c, inputs, mode, backward_flops)
    with set_checkpoint_early_stop(False):
        rc = _run(c, inputs, mode, backward_flops)
    extra = rc[0][0] - base[0][0]
    assert 0 < early[0][0] - base[0][0] <= extra
    assert extra > 0
    b, s = c.captured.symbols["batch"], c.captured.symbols["seq"]
    annotated = 0
    for node in c.captured.gm.graph.nodes:
        if node.name in rc[0][1]:
            cost = node_cost(node)
            if cost.category in MATMUL_CATEGORIES:
                annotated += sympy.sympify(cost.flops).subs({b: inputs[0].shape[0], s: inputs[0].shape[1]})
    assert extra * 2 == annotated, (extra, annotated)


def _saved_bytes(forward, groups, prog):
    """Bytes of the distinct storages autograd keeps for backward after the forward."""
    storages = {}

    def pack(t):
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(storages.values())


def test_recompute_saves_less_for_backward():
    """Full per-layer recompute keeps only each layer's (sequence-sharded) input; selective keeps
    the linears' inputs and drops the attention core's."""
    model, inputs, c, _ = compiled("llama3-tiny", "tp=2", True)
    saved = {mode: _run(c, inputs, mode, _saved_bytes)[0] for mode in ("none", "selective", "full")}
    assert saved["full"] < saved["selective"] < saved["none"], saved
