"""Causal masks become ``is_causal=True`` on every mesh (issue 38, item 3; passes/attention.py).

Hugging Face models build an explicit ``[b, 1, s, s]`` causal mask and pass it to SDPA; with a mask tensor
SDPA cannot take a flash kernel on CUDA. The rewrite ran only when the mesh had cp; now every plan's
programs (one rank, tp=2) call SDPA with ``is_causal=True`` and no mask, and the loss is the model's.
A padding mask (it reads ``attention_mask``'s values) stays a tensor: tests/test_capture_and_errors.py::
test_keyword_inputs. GQA's ``repeat_kv`` is undone under cp only (tp may shard the repeated heads).
"""

from __future__ import annotations

import pytest
import torch

import mcompile as mc
from mcompile.runtime.sim import ThreadedWorld, run_threads

from conftest import build

_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _sdpa_calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _SDPA]


@pytest.mark.parametrize("name", ["hf-llama-4l", "hf-qwen3-4l", "hf-gpt2"])
def test_hf_programs_call_sdpa_with_is_causal_and_no_mask_on_one_rank_and_tp2(name, tmp_path, monkeypatch):
    monkeypatch.setenv("MCOMPILE_CACHE", str(tmp_path))  # the second plan reuses the first one's capture
    model, inputs = build(name)
    ref = model(*inputs)
    for mesh in (mc.Mesh(dp=1), mc.Mesh(tp=2)):
        c = mc.compile_plan(model, mesh, inputs, capture_cache=True)
        assert c.canonical["causal_masks"] >= 1 and "gqa_unrepeated" not in c.canonical, c.canonical
        gm = c.program(0)
        calls = _sdpa_calls(gm)
        assert calls, gm.graph
        for n in calls:
            assert n.kwargs.get("is_causal") is True, n.format_node()
            assert len(n.args) == 3 and n.kwargs.get("attn_mask") is None, n.format_node()
        state = c.captured.state_values()
        losses = run_threads(ThreadedWorld(c.mesh),
                             lambda r, c=c, state=state: c.run_local(r, c.local_state(r, state), inputs)[0])
        for loss in losses:
            assert torch.allclose(loss, ref, rtol=1e-6, atol=0), (mesh, loss.item(), ref.item())
