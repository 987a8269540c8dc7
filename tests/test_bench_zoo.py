"""bench/hf_zoo.py's record for one architecture (the unmodified Hugging Face Llama at the tiny size): the script
runs end to end in its subprocess-per-architecture mode and writes the record the docs table and the summary are
made from. What is isolated: the record's shape (every stage with an outcome, a reason on failure, the summary's
fractions), not the zoo's results (those are bench/results/hf_zoo.json's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("builds", "captures", "plans_tp2", "megatron_layout", "parity_tp2")


@pytest.mark.timeout(300)
def test_zoo_record_of_llama(tmp_path):
    out = tmp_path / "zoo.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "hf_zoo.py"), "--only", "LlamaForCausalLM", "--out",
                           str(out), "--timeout", "280"], capture_output=True, text=True, timeout=290, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    for key in ("benchmark", "transformers", "machine", "commit", "tiny", "runs", "total_in_zoo", "skipped",
                "architectures", "summary", "failures"):
        assert key in rec, key
    assert rec["benchmark"] == "hf_zoo" and rec["commit"] != "unknown"
    llama = rec["architectures"]["LlamaForCausalLM"]
    assert llama["kind"] == "decoder" and llama["seconds"] > 0
    assert llama["config"]["hidden_size"] == 64 and llama["config"]["num_key_value_heads"] == 2
    assert set(llama["stages"]) == set(STAGES)
    for name, st in llama["stages"].items():
        assert st["outcome"] in ("pass", "fail", "skipped"), (name, st)
        assert st["outcome"] != "fail" or st["reason"], (name, st)
    # Llama is the reference family: every stage passes (parity judged at 1e-5 inside the script)
    assert all(st["outcome"] == "pass" for st in llama["stages"].values()), llama["stages"]
    assert llama["stages"]["parity_tp2"]["max_grad_rel"] <= 1e-5
    assert len(llama["stages"]["parity_tp2"]["losses"]) == 3
    # the fp32 floor beside the tp error (information): the single-device fp32 model against its float64 copy
    assert rec["dtype"] == llama["dtype"] == "float32"
    assert 0 < llama["stages"]["parity_tp2"]["fp32_floor_grad_rel"] <= 1e-5
    assert rec["summary"]["decoder"] == {"run": 1, **{s: 1.0 for s in STAGES}, "all_stages": 1.0}
    table = subprocess.run([sys.executable, str(ROOT / "bench" / "hf_zoo.py"), "--table", "--out", str(out)],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path).stdout
    assert "| LlamaForCausalLM | decoder | ✓ | ✓ | ✓ | ✓ | ✓ |" in table


def test_tiny_config_shrinks_by_introspection():
    """bench/hf_zoo.tiny_config's rules on families whose size hid under a name or a structure it once missed (they
    failed at ``builds``): a sub-config, a role's own field that is also an attribute_map alias, a partial rotary
    width, a per-layer list that is not called layer_types and layer-index lists, a vocabulary-sized attribute."""
    import importlib.util

    import transformers as hf

    spec = importlib.util.spec_from_file_location("hf_zoo_under_test", ROOT / "bench" / "hf_zoo.py")
    zoo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zoo)
    dbrx, _ = zoo.tiny_config(hf.DbrxConfig, "decoder")  # attn_config / ffn_config
    ffn, attn = dbrx.ffn_config, dbrx.attn_config
    assert (ffn.ffn_hidden_size, ffn.moe_num_experts, attn.kv_n_heads) == (128, 4, 2)
    bailing, _ = zoo.tiny_config(hf.BailingHybridConfig, "decoder")  # field num_local_experts -> num_experts
    assert bailing.num_local_experts == 4
    codegen, _ = zoo.tiny_config(hf.CodeGenConfig, "decoder")
    assert codegen.rotary_dim <= codegen.n_embd // codegen.n_head
    zamba2, _ = zoo.tiny_config(hf.Zamba2Config, "decoder")  # layers_block_type, one entry per layer
    assert len(zamba2.layers_block_type) == 4
    kolibri, _ = zoo.tiny_config(hf.Kolibri1_1Config, "decoder")  # kv_source_layers / index_layers remapped
    assert len(kolibri.kv_source_layers) == 4 and max(kolibri.index_layers) < 4
    luke, _ = zoo.tiny_config(hf.LukeConfig, "encoder")
    assert luke.entity_vocab_size == 128
    assert "ViltForMaskedLM" in zoo.NOT_TEXT_ONLY


def test_tiny_config_shrinks_sizes_by_the_shape_of_their_name():
    """Size attributes under names no ROLES entry lists are shrunk by what their name says (hf_zoo._sized_role):
    a further FFN width, head width, head count (a key count to the kv-head count, so the value-per-key ratio
    stays whole), a low-rank width; a Mamba head count, which its validator ties to the hidden size, is not.
    Before, these kept their full sizes: Kimi-Linear's linear attention built at 6.9M parameters, Kolibri-1.1's
    dense MLP at 3584 wide."""
    import importlib.util

    import transformers as hf

    spec = importlib.util.spec_from_file_location("hf_zoo_under_test", ROOT / "bench" / "hf_zoo.py")
    zoo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zoo)
    assert zoo._sized_role("mlp_only_intermediate_size", 3584) == 128
    assert zoo._sized_role("linear_head_dim", 128) == 16
    assert zoo._sized_role("linear_num_key_heads", 16) == 2 and zoo._sized_role("linear_num_value_heads", 32) == 4
    assert zoo._sized_role("mamba_n_heads", 128) is None and zoo._sized_role("heads_per_ngram", 8) is None
    assert zoo._sized_role("intermediate_size", 64) is None  # already tiny: left as the family has it
    kolibri, _ = zoo.tiny_config(hf.Kolibri1_1Config, "decoder")
    assert kolibri.mlp_only_intermediate_size == 128
    kimi, _ = zoo.tiny_config(hf.KimiLinearConfig, "decoder")
    assert (kimi.linear_head_dim, kimi.linear_num_heads) == (16, 4)
    granite, _ = zoo.tiny_config(hf.GraniteMoeHybridConfig, "decoder")
    assert granite.shared_intermediate_size == 128
    qwen, _ = zoo.tiny_config(hf.Qwen3NextConfig, "decoder")
    assert (qwen.linear_num_key_heads, qwen.linear_num_value_heads, qwen.linear_key_head_dim) == (2, 4, 16)
    longcat, _ = zoo.tiny_config(hf.LongcatFlashConfig, "decoder")  # a query/key head width of nope + rope stays so
    assert longcat.qk_head_dim == longcat.qk_nope_head_dim + longcat.qk_rope_head_dim
    assert longcat.zero_expert_num == 4  # an expert count under its own name


def test_a_capture_refusal_in_the_record_names_the_models_line():
    """bench/hf_zoo._why keeps, within the record's 400 characters, the model's line a capture failed at and
    torch's message beside the failure's explanation (FSMT's ``if not padding_mask.any():`` was cut off behind a
    first line longer than the whole reason)."""
    import importlib.util

    from mcompile.capture.export import CaptureError

    spec = importlib.util.spec_from_file_location("hf_zoo_under_test", ROOT / "bench" / "hf_zoo.py")
    zoo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zoo)
    e = CaptureError("cannot capture M with torch.export: a tensor's value is used as a Python bool " + "x" * 500 +
                     "\n  at /venv/lib/python3.11/site-packages/transformers/models/m/modeling_m.py:266: "
                     "if not padding_mask.any():\n  torch says: Could not guard on data-dependent expression"
                     "\n  fix: compute both branches")
    why = zoo._why(e)
    assert len(why) <= 400, len(why)
    assert why.startswith("CaptureError: cannot capture M with torch.export: a tensor's value")
    assert "| at transformers/models/m/modeling_m.py:266: if not padding_mask.any():" in why, why
    assert why.endswith("| torch says: Could not guard on data-dependent expression"), why
    assert zoo._why(ValueError("plain")) == "ValueError: plain"


def _empty_param_lm(vocab=32, dim=16):
    """A masked LM whose output projection is a cat with a parameter of no elements (MobileBert's
    ``cls.predictions.dense``, [hidden - embedding_size, vocab] = [0, vocab] when the two widths are equal)."""
    import torch
    from transformers.modeling_outputs import MaskedLMOutput

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, dim)
            self.up, self.down = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)
            self.decoder, self.dense = torch.nn.Linear(dim, vocab), torch.nn.Linear(vocab, 0)

        def forward(self, input_ids, labels):
            h = self.emb(input_ids)
            h = h + self.down(torch.relu(self.up(h)))
            logits = h.matmul(torch.cat([self.decoder.weight.t(), self.dense.weight], dim=0))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            return MaskedLMOutput(loss=loss, logits=logits)

    return LM()


def _zoo_parity_tp2(model):
    """bench/hf_zoo's parity stage on ``model`` planned at tp=2 (inputs: 2 x 8 ids and labels of 32 classes):
    (the harness module, the worst errors, the losses)."""
    import importlib.util
    import warnings

    import torch

    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh

    spec = importlib.util.spec_from_file_location("hf_zoo_under_test", ROOT / "bench" / "hf_zoo.py")
    zoo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zoo)
    g = torch.Generator().manual_seed(1)
    kw = {"input_ids": torch.randint(0, 32, (2, 8), generator=g), "labels": torch.randint(0, 32, (2, 8), generator=g)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = compile_plan(model, Mesh.fake(tp=2), (), kw)
        worst, losses = zoo._parity(c, model, kw)
    return zoo, worst, losses


def test_parity_stage_passes_a_parameter_with_no_elements():
    """The parity stage compares every gradient but one of no elements (MobileBert's cls.predictions.dense at the
    tiny size): ``max()`` of it raised and failed MobileBertForMaskedLM's parity_tp2 before."""
    import torch

    torch.manual_seed(0)
    zoo, worst, losses = _zoo_parity_tp2(_empty_param_lm())
    assert len(losses) == zoo.STEPS and worst["loss"] <= zoo.RTOL and worst["grad"] <= zoo.RTOL, worst
    assert "dense.weight" not in worst["noise_level"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zoo_float64_diagnostic_of_llama(tmp_path):
    """``--dtype float64`` (the diagnostic: model and plan in float64 on both sides, the model's own fp32 casts kept
    float64) records its dtype and passes at ~1e-12: an exact program agrees there. (1.5e-7 on a gradient before
    the casts were kept: Hugging Face's Llama computes its RMSNorm and rotary tables in fp32 in a float64 model.)"""
    zoo = _zoo()
    path = tmp_path / "progress.json"
    zoo.run_one("LlamaForCausalLM", "decoder", path, "float64")
    rec = json.loads(path.read_text())
    assert rec["dtype"] == "float64"
    parity = rec["stages"]["parity_tp2"]
    assert parity["outcome"] == "pass", parity
    assert parity["max_grad_rel"] <= 1e-10 and parity["max_loss_rel"] <= 1e-12, parity
    assert "fp32_floor_grad_rel" not in parity  # the floor is the fp32 run's


@pytest.mark.timeout(60)
def test_float64_casts_keep_a_models_fp32_islands_float64():
    """Hugging Face's RMSNorm upcasts to fp32 inside (``hidden_states.to(torch.float32)``), so a ``.double()`` model
    still rounds there: a float64 diagnostic run of BailingHybrid differed by 9.6e-6 between two exact programs, and
    the fp32 floor was measured against such a partly-fp32 copy. Under ``float64_casts`` the norm is float64 to the
    last bit; outside it (and after) the model's casts are its own again."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    zoo = _zoo()
    torch.manual_seed(0)
    norm, x = LlamaRMSNorm(64).double(), torch.randn(4, 64, dtype=torch.float64) * 3
    with torch.no_grad():
        norm.weight.add_(torch.randn(64, dtype=torch.float64))
        exact = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))

        def err():
            return float((norm(x) - exact).abs().max() / exact.abs().max())

        assert err() > 1e-9  # rounded to fp32 inside
        with zoo.float64_casts():
            assert err() < 1e-14
            assert torch.ones(2, dtype=torch.int64).float().dtype == torch.float64
        assert err() > 1e-9 and torch.ones(2).double().float().dtype == torch.float32


def _zoo():
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_zoo_under_test", ROOT / "bench" / "hf_zoo.py")
    zoo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zoo)
    return zoo


def test_parity_stage_records_a_model_that_will_not_run_in_float64_and_still_judges_fp32():
    """The fp32 floor runs a float64 copy of the reference (information only). A model that casts to fp32 inside
    where ``float64_casts`` does not reach (Inkling2's experts once; here a module outside transformers) fails there:
    the stage records why, and still compares the plan with the fp32 model (it crashed the parity stage of Inkling2
    and Inkling2Loop before)."""
    import torch
    from transformers.modeling_outputs import MaskedLMOutput

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.up, self.down = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
            self.decoder = torch.nn.Linear(16, 32)

        def forward(self, input_ids, labels):
            h = self.emb(input_ids)
            h = h + self.down(torch.relu(self.up(h)))
            logits = h.to(torch.float32) @ self.decoder.weight.t()  # fp32 on purpose: a float64 copy cannot run it
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            return MaskedLMOutput(loss=loss, logits=logits)

    torch.manual_seed(0)
    zoo, worst, losses = _zoo_parity_tp2(LM())
    assert "dtype" in worst["floor_failed"], worst
    assert len(losses) == zoo.STEPS and worst["loss"] <= zoo.RTOL and worst["grad"] <= zoo.RTOL, worst
