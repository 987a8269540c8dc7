"""The committed expert-parallelism benchmark record (``bench/results/moe_ep.json``, written by
``bench/moe_ep.py --write``): its schema and its internal consistency. No timing assertions (DESIGN §8:
step times on a shared machine are noise); what is checked follows from the record's own figures or
from the model's config, not from the script that wrote them:

- the ratios are the ratios of the stored figures;
- the two layouts' losses (and the single-device model's) agree step by step, recomputed from the
  stored loss lists;
- the expert parameters a rank holds are what the config says (every layer's 8 SwiGLU experts,
  3 x dim x ffn fp32 each) at dp=2, and half of that at ep=2;
- the all-to-alls: only ep=2 has them, 5 per MoE layer per step (token counts, dispatch and combine
  forward and backward); their bytes, averaged over the ranks, are what the plan's formulas say;
- ep all-reduces fewer gradient bytes than dp by exactly the expert gradients it no longer reduces.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RECORD = Path(__file__).resolve().parents[1] / "bench" / "results" / "moe_ep.json"
LAYOUTS = ("ep=2", "dp=2")
PER_LAYOUT = ("step_s", "step_s_quartiles", "train_step_s", "first_step_s", "setup_s", "comm_bytes_per_step",
              "comm_bytes_per_step_per_rank", "comm_by_kind_per_rank", "comm_detail_per_rank",
              "expert_param_bytes_per_rank", "param_bytes_per_rank", "peak_memory_bytes", "peak_memory_bytes_per_rank",
              "memory_per_rank", "losses")


@pytest.fixture(scope="module")
def rec() -> dict:
    return json.loads(RECORD.read_text())


@pytest.mark.timeout(30)
def test_record_has_its_fields(rec):
    for key in ("benchmark", "model", "machine", "commit", "date", "method", "layouts", "ratios", "losses_agree",
                "all_to_all_check", "caveat", "steps", "warmup", "load_average_before", "load_average_after"):
        assert key in rec, key
    assert rec["benchmark"] == "moe_ep"
    assert rec["machine"]["cpus"] >= 1 and rec["machine"]["torch"] and rec["machine"]["backend"] == "gloo"
    assert rec["commit"] and rec["commit"] != "unknown"
    assert "NVLink" in rec["caveat"]
    assert set(rec["layouts"]) == set(LAYOUTS)
    for lay in LAYOUTS:
        row = rec["layouts"][lay]
        for key in PER_LAYOUT:
            assert key in row, (lay, key)
        assert row["step_s"] > 0 and row["train_step_s"] > 0
        assert row["step_s_quartiles"][0] <= row["step_s"] <= row["step_s_quartiles"][1]  # a median in range
        ranks = rec["machine"]["ranks"]
        for key in ("comm_bytes_per_step_per_rank", "expert_param_bytes_per_rank", "param_bytes_per_rank",
                    "peak_memory_bytes_per_rank", "comm_by_kind_per_rank"):
            assert len(row[key]) == ranks, (lay, key)
        assert all(p > 0 for p in row["peak_memory_bytes_per_rank"])


@pytest.mark.timeout(30)
def test_ratios_are_the_stored_figures_ratios(rec):
    ep, dp, r = rec["layouts"]["ep=2"], rec["layouts"]["dp=2"], rec["ratios"]
    expect = {
        "step_s_ep_over_dp": ep["step_s"] / dp["step_s"],
        "train_step_s_ep_over_dp": ep["train_step_s"] / dp["train_step_s"],
        "comm_bytes_ep_over_dp": ep["comm_bytes_per_step"] / dp["comm_bytes_per_step"],
        "expert_param_bytes_ep_over_dp": ep["expert_param_bytes_per_rank"][0] / dp["expert_param_bytes_per_rank"][0],
        "param_bytes_ep_over_dp": ep["param_bytes_per_rank"][0] / dp["param_bytes_per_rank"][0],
        "peak_memory_ep_over_dp": ep["peak_memory_bytes"] / dp["peak_memory_bytes"],
    }
    assert set(r) == set(expect)
    for k, v in expect.items():
        assert r[k] == pytest.approx(v, rel=1e-12), k
    for lay in LAYOUTS:  # the per-layout summaries follow from the per-rank figures
        row = rec["layouts"][lay]
        per_rank = row["comm_bytes_per_step_per_rank"]
        assert row["comm_bytes_per_step"] == pytest.approx(sum(per_rank) / len(per_rank), rel=1e-12)
        assert row["peak_memory_bytes"] == max(row["peak_memory_bytes_per_rank"])
        for total, kinds in zip(per_rank, row["comm_by_kind_per_rank"]):
            assert total == sum(k["bytes"] for k in kinds.values())


@pytest.mark.timeout(30)
def test_losses_agree(rec):
    """Same weights, same data, both layouts exact (fp32, dropless): the losses match step by step,
    with each other and with the single-device model — recomputed here from the stored lists."""
    la = rec["losses_agree"]
    ep, dp, ref = rec["layouts"]["ep=2"]["losses"], rec["layouts"]["dp=2"]["losses"], la["single_device_losses"]
    assert len(ep) == len(dp) == len(ref) == rec["loss_steps"] >= rec["steps"] + rec["warmup"]

    def rel(a, b):
        return max(abs(x - y) / abs(y) for x, y in zip(a, b))

    for name, (a, b) in {"ep_vs_dp": (ep, dp), "ep_vs_single_device": (ep, ref),
                         "dp_vs_single_device": (dp, ref)}.items():
        assert rel(a, b) == pytest.approx(la[f"max_rel_diff_{name}"], rel=1e-9, abs=1e-15), name
        assert rel(a, b) <= 1e-5, (name, rel(a, b))
    assert la["agree"] is True
    assert ref[-1] < ref[0]  # the model trained (AdamW): the comparison is not of a constant


@pytest.mark.timeout(30)
def test_expert_bytes_per_rank_halve_under_ep(rec):
    cfg = rec["model"]["config"]
    # every layer's experts: gate, up (dim -> ffn) and down (ffn -> dim), fp32
    full = cfg["n_layers"] * cfg["n_experts"] * 3 * cfg["dim"] * cfg["ffn_hidden"] * 4
    ep, dp = rec["layouts"]["ep=2"], rec["layouts"]["dp=2"]
    assert dp["expert_param_bytes_per_rank"] == [full] * len(dp["expert_param_bytes_per_rank"])
    assert ep["expert_param_bytes_per_rank"] == [full // 2] * len(ep["expert_param_bytes_per_rank"])
    assert rec["ratios"]["expert_param_bytes_ep_over_dp"] == 0.5
    # the dense parameters are replicated under both: the difference is the experts' half
    for a, b in zip(dp["param_bytes_per_rank"], ep["param_bytes_per_rank"]):
        assert a - b == full // 2


@pytest.mark.timeout(30)
def test_all_to_all_bytes_and_gradient_all_reduce(rec):
    cfg = rec["model"]["config"]
    ep, dp = rec["layouts"]["ep=2"], rec["layouts"]["dp=2"]
    for kinds in dp["comm_by_kind_per_rank"]:
        assert "all_to_all" not in kinds
    for kinds in ep["comm_by_kind_per_rank"]:
        assert kinds["all_to_all"]["count"] == 5 * cfg["n_layers"]
    chk = rec["all_to_all_check"]
    assert chk["count_per_step_per_rank"] == [5 * cfg["n_layers"]] * rec["machine"]["ranks"]
    mean = sum(k["all_to_all"]["bytes"] for k in ep["comm_by_kind_per_rank"]) / rec["machine"]["ranks"]
    assert chk["measured_bytes_per_step_mean_over_ranks"] == pytest.approx(mean, rel=1e-12)
    # each rank sends tokens x top_k rows of dim fp32 per dispatch / combine (forward and backward): the
    # ranks' mean of what they receive is the same, whatever the routing
    tokens = rec["model"]["batch"] * rec["model"]["seq"] // rec["machine"]["ranks"]
    rows = 4 * cfg["n_layers"] * tokens * cfg["top_k"] * cfg["dim"] * 4
    counts = cfg["n_layers"] * cfg["n_experts"] * 8  # one int64 per expert, from every rank
    assert mean == rows + counts
    assert chk["planned_bytes_per_step"] == mean
    # gradients: dp reduces every parameter's, ep only the dense ones' (experts are sharded, not replicated)
    full_experts = cfg["n_layers"] * cfg["n_experts"] * 3 * cfg["dim"] * cfg["ffn_hidden"] * 4
    ar_ep = ep["comm_by_kind_per_rank"][0]["all_reduce"]["bytes"]
    ar_dp = dp["comm_by_kind_per_rank"][0]["all_reduce"]["bytes"]
    assert ar_dp - ar_ep == full_experts
