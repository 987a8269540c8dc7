"""The programs run on plain local leaves; gradients accumulate in flat fp32 buffers (runtime/leaves.py).

- Gradients accumulate over microbatches in fp32 whatever the compute dtype, on every path: a
  model whose weight gradients are sums of integers that bf16 cannot hold (256 + 7 x 1: bf16 keeps
  256) gives the exact fp32 sum under bf16 compute with 8 microbatches, at dp=2 x pp=2 with ZeRO-1
  (where the pipeline's bf16 leaves used to accumulate in bf16: 264/16 instead of 271/16) and
  without, and at dp=2 without pipeline.
- The programs see no DTensor; every ``.grad`` is a view of a flat buffer; the bf16 compute copies
  follow the parameters after an optimizer step.
"""

from __future__ import annotations

import pytest
import torch

from conftest import pool

EXACT = 271 / 16  # (256 + 7 + 8 ones) over 16 microbatches (a scalar loss counts 1 per microbatch)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh,options", [
    ("dp=2,pp=2", {"zero": 1, "stage_cuts": ["linear_1"]}),
    ("dp=2,pp=2", {"zero": 0, "stage_cuts": ["linear_1"]}),
    ("dp=2,pp=2", {"zero": 1, "stage_cuts": ["linear_1"], "schedule": "zbh1"}),
    ("dp=4", {"zero": 1}),
    # the eager fallback: autograd leaves each bf16 microbatch gradient in .grad, handed to the fp32 buffer (the
    # joint path above adds into the buffer inside its backward graph and never reads .grad)
    ("dp=4", {"zero": 0, "execution": "autograd"}),
], ids=["pp-zero1", "pp-zero0", "pp-zero1-zbh1", "dp-zero1", "dp-autograd"])
def test_microbatch_gradients_accumulate_in_fp32(mesh, options):
    from leaves_cases import accumulate_grads

    m = 8 if "pp" in mesh else 4
    opts = {"dtype": torch.bfloat16, "microbatches": m, **options}
    grads = pool(4).run(accumulate_grads, mesh, opts)[0]
    expected = EXACT if "pp" in mesh else (256 + 15) / 16
    for name, g in grads.items():
        assert torch.tensor(g).eq(expected).all(), (name, g[0][0], expected)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh,options", [
    ("dp=2,tp=2", {"microbatches": 2}),
    ("dp=2,tp=2", {"microbatches": 2, "dtype": torch.bfloat16, "sequence_parallel": True}),
], ids=["fp32", "bf16-sp"])
def test_programs_run_on_plain_leaves_and_grads_live_in_flat_buffers(mesh, options):
    from leaves_cases import leaves_are_plain

    for r in pool(4).run(leaves_are_plain, "hf-llama", mesh, options):
        assert r["dtensors"] == []
        assert r["outside"] == []
        assert r["with_grad"] == r["params"]
        if options.get("dtype") == torch.bfloat16:
            assert r["stale_before_refresh"] > 0  # the optimizer moved the fp32 parameters...
        assert r["stale_after"] == []  # ...and the next run sees them


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh,options", [
    ("dp=2,tp=2", {"microbatches": 2}),
    ("dp=2,pp=2", {"microbatches": 4}),
    ("dp=2,pp=2", {"microbatches": 4, "zero": 1}),
    ("dp=2,pp=2", {"microbatches": 4, "schedule": "zbh1"}),
    ("dp=2,pp=2", {"microbatches": 4, "schedule": "interleaved", "virtual_stages": 2, "zero": 1}),
], ids=["dp-tp", "pp", "pp-zero1", "pp-zbh1", "pp-interleaved-zero1"])
def test_data_parallel_buckets_reduce_during_the_last_backward(mesh, options):
    """Every dp bucket is reduced inside the last microbatch's backward (under pp: each stage's own
    last backward, W under zero-bubble), except those holding a weight tied across stages, which
    wait for the cross-stage sum; none is left to the end of the step. Small buckets: several."""
    from leaves_cases import launches

    for r in pool(4).run(launches, "gpt2-tiny", mesh, {"bucket_mb": 0.02, **options}):
        assert r["buckets"] >= 2, r
        assert r["launched"] == r["buckets"], r
        assert r["in_backward"] == r["buckets"] - r["tied"], r


@pytest.mark.timeout(300)
def test_without_overlap_the_buckets_wait_for_the_backward_to_return():
    """Config(overlap=False): the backward module has no launches; every dp bucket is reduced after
    the last microbatch's backward returned (the counterfactual the overlap bench measures)."""
    from leaves_cases import launches

    for r in pool(4).run(launches, "gpt2-tiny", "dp=2,tp=2", {"bucket_mb": 0.02, "microbatches": 2,
                                                               "overlap": False}):
        assert r["buckets"] >= 2, r
        assert r["launched"] == r["buckets"], r
        assert r["in_backward"] == 0, r
