"""Unmodified Hugging Face causal LMs of six families plan with no op left to run replicated, and
run at tp=2 with the single-device loss and gradients.

Families: Llama, Qwen3, Mistral, Gemma, GPT-2, GPT-NeoX (partial rotary, ``rotary_pct=0.25``), tiny
(hidden 64, 2 layers, 8 heads, 4 kv heads where the family has GQA, vocabulary 128). Each is called
two ways: ``model(input_ids, labels).loss`` and the same with ``use_cache=False`` (which makes HF
detect packed sequences from the position ids: ``aten.diff``). GPT-NeoX splits its fused QKV with
``aten.chunk``. What is isolated: the op coverage of the rules (no ``FallbackWarning``), and that
the plan those rules give computes the model (parity through the in-process thread simulator,
tests/sim_harness.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from sim_harness import combine_grads, run_sim

from mcompile.models.hf import CausalLMLoss

from conftest import tiered

FAMILIES = ["llama", "qwen3", "mistral", "gemma", "gpt2", "gpt-neox"]


class CausalLMLossNoCache(torch.nn.Module):
    """``model(input_ids, labels, use_cache=False).loss``."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.m = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=ids, labels=labels, use_cache=False).loss


def hf_model(family: str) -> torch.nn.Module:
    import transformers as hf
    from transformers.utils import logging

    logging.set_verbosity_error()
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8)
    if family == "llama":
        return hf.LlamaForCausalLM(hf.LlamaConfig(**common, num_key_value_heads=4))
    if family == "qwen3":
        return hf.Qwen3ForCausalLM(hf.Qwen3Config(**common, num_key_value_heads=4, head_dim=8))
    if family == "mistral":
        return hf.MistralForCausalLM(hf.MistralConfig(**common, num_key_value_heads=4))
    if family == "gemma":
        return hf.GemmaForCausalLM(hf.GemmaConfig(**common, num_key_value_heads=4, head_dim=8))
    if family == "gpt2":
        return hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=8, n_positions=64,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if family == "gpt-neox":
        return hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(**common, rotary_pct=0.25))
    raise ValueError(family)


def build(family: str, call: str, seed: int = 0):
    torch.manual_seed(seed)
    wrap = CausalLMLoss if call == "loss" else CausalLMLossNoCache
    model = wrap(hf_model(family)).eval()  # dropout off: parity at p = 0
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, 128, (2, 16), generator=g)
    labels = torch.randint(0, 128, (2, 16), generator=g)
    labels[0, :5] = -100  # ignored targets
    return model, (ids, labels)


_PLANS: dict = {}


def planned(family: str, call: str, tp: int):
    """compile_plan at tp, with the sharding-rule warnings it raised (cached: planning costs ~1 s)."""
    from mcompile.api import compile_plan
    from mcompile.mesh import Mesh

    key = (family, call, tp)
    if key not in _PLANS:
        model, inputs = build(family, call)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c = compile_plan(model, Mesh.fake(tp=tp), inputs)
        _PLANS[key] = (model, inputs, c, [str(w.message) for w in caught if "sharding rule" in str(w.message)])
    return _PLANS[key]


PLAN_CASES = [(f, call, tp) for tp in ("2", "4") for f in FAMILIES for call in ("loss", "no_cache")]
# the CI tier: every family at tp=2 without the cache (aten.diff), both calls for Llama and GPT-NeoX
PLAN_CI = [c for c in PLAN_CASES if c[2] == "2" and (c[1] == "no_cache" or c[0] in ("llama", "gpt-neox"))]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,call,tp", tiered(PLAN_CASES, PLAN_CI))
def test_no_op_runs_replicated(family, call, tp):
    _, _, c, reported = planned(family, call, int(tp))
    assert not reported, reported
    assert c.plan.fallbacks == []
    ops = {str(n.target) for n in c.captured.gm.graph.nodes}
    if call == "no_cache":  # the cases exist for these ops: they must still be in the graph
        assert "aten.diff.default" in ops
    if family == "gpt-neox":
        assert "aten.chunk.default" in ops


PARITY = [(f, "no_cache") for f in FAMILIES]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,call", tiered(PARITY, [("llama", "no_cache"), ("gpt-neox", "no_cache")]))
def test_parity_tp2(family, call):
    """Loss and every gradient at tp=2 against the single-device model. fp32, a different summation
    order over the tp pieces: ~1e-7 relative measured, so 1e-5 (rtol) with an atol of 1e-5 of the
    gradient's largest entry for entries near zero."""
    model, inputs, c, _ = planned(family, call, 2)
    # the plan shards the layers: a replicated layout would also pass parity
    sharded = [fqn for fqn, pp in c.plan.params.items() if any(not p.__class__.__name__ == "Replicate"
                                                               for p in pp.placements)]
    assert len(sharded) >= 8, sharded
    model.zero_grad()
    ref_loss = model(*inputs)
    ref_loss.backward()
    ref = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    results = run_sim(c, inputs, backward=True)
    for loss, _, _ in results:
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=0)
    full = combine_grads(c, [g for _, g, _ in results])
    assert set(ref) <= set(full)
    for fqn, want in ref.items():
        torch.testing.assert_close(full[fqn], want, rtol=1e-5, atol=1e-5 * float(want.abs().max()),
                                   msg=lambda m, fqn=fqn: f"{family} {fqn}: {m}")
