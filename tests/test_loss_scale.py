"""fp16 compute with dynamic loss scaling (runtime/loss_scale.py; Micikevicius et al. 2018, Megatron-LM's
DynamicGradScaler rule).

- An inf planted in ONE rank's reduced gradients (dp=2 x tp=2, dp=2 x pp=2, ZeRO-1 and ZeRO-2) makes every rank
  skip that step (parameters bit-identical after the user's ordinary ``opt.step()``) and halve the scale; the
  next clean steps update the parameters, and after ``loss_scale_window`` of them the scale doubles back; the
  scaler's state survives a checkpoint round trip exactly.
- A model whose every gradient flushes to zero in a plain fp16 backward trains under the parallel fp16 run:
  its gradients match the fp32 reference, and one step moves every parameter.
- The scaler's rule itself (backoff, growth, floor, hysteresis) and the options' errors, without processes.
"""

from __future__ import annotations

import pytest
import torch

from mcompile.runtime.loss_scale import DynamicLossScaler, nonfinite

from conftest import pool


def test_a_skipped_step_does_not_advance_the_learning_rate_schedule():
    """mcompile train's step s runs at lr_at(s - skipped): an overflowed (skipped) step applies no update and, as
    Megatron's scheduler (advanced only after a successful update), leaves the schedule where it was; the count
    is the scaler's, which a checkpoint saves, so a resumed run is at the same position."""
    from types import SimpleNamespace

    from mcompile.apps.train.loop import applied_updates

    pm = SimpleNamespace(loss_scaler=DynamicLossScaler(2.0**16))
    assert [applied_updates(s, pm) for s in (1, 2)] == [1, 2]
    pm.loss_scaler.update(True)  # step 2 overflowed: skipped
    assert applied_updates(3, pm) == 2  # step 3 takes the update step 2 would have
    resumed = SimpleNamespace(loss_scaler=DynamicLossScaler(2.0**16))
    resumed.loss_scaler.load_state_dict(pm.loss_scaler.state_dict())
    assert applied_updates(3, resumed) == 2
    assert applied_updates(3, SimpleNamespace()) == 3  # bf16 / fp32: no scaler, no skipped step


def test_scaler_rule_backoff_growth_floor_hysteresis():
    s = DynamicLossScaler(2.0**16, growth_interval=3, min_scale=2.0**15)
    s.update(True)
    assert (s.scale, s.skipped_steps) == (2.0**15, 1)
    s.update(True)
    assert s.scale == 2.0**15  # the floor
    for _ in range(2):
        s.update(False)
    assert s.scale == 2.0**15  # 2 clean steps of 3
    s.update(False)
    assert (s.scale, s.clean_steps) == (2.0**16, 0)  # the 3rd doubles it
    s.update(False)
    s.update(True)  # an overflow resets the clean count
    s.update(False), s.update(False)
    assert s.scale == 2.0**15
    h = DynamicLossScaler(8.0, growth_interval=100, hysteresis=2)
    h.update(True)
    assert h.scale == 8.0  # tolerated once
    h.update(True)
    assert h.scale == 4.0
    h.update(True)
    assert h.scale == 2.0  # until the next growth, every overflow halves
    state = h.state_dict()
    fresh = DynamicLossScaler(8.0, growth_interval=100, hysteresis=2)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    # the backward starts from a piece's token-loss sum: its gradient is the scale of the mean over the tokens per
    # piece (a power of two), 1 until a count is known
    t = DynamicLossScaler(2.0**16)
    assert t.sum_scale() == 2.0**16
    t.observe_tokens(4096 * 0.9)  # ignored targets: 3686.4 tokens per piece -> 2^12
    assert (t.tokens_per_piece, t.sum_scale()) == (4096.0, 16.0)
    assert nonfinite([torch.ones(3), torch.tensor([1.0, float("nan")])], "cpu") == 1
    assert nonfinite([torch.ones(3), torch.zeros(0)], "cpu") == 0


@pytest.mark.parametrize("dp,cp,microbatches", [(2, 1, 1), (4, 2, 2)])
def test_first_step_estimate_is_the_same_for_local_and_global_inputs(dp, cp, microbatches):
    """Before the first step's count, the tokens per piece come from the batch's shapes: a rank's rows under
    ``inputs="local"`` (1/dp of the batch, what ``mcompile train`` passes) give the estimate the whole batch gives,
    so the first step's sum scale is the same (with no estimate it was tokens-per-piece times the global run's: an
    overflow, a skipped step, the global run does not have)."""
    from types import SimpleNamespace

    from mcompile.ir.config import Inputs
    from mcompile.runtime.step import StepRunner

    tokens = torch.zeros(16, 64, dtype=torch.int64)
    got = {}
    for inputs, rows in ((Inputs.GLOBAL, 16), (Inputs.LOCAL, 16 // dp)):
        rank = SimpleNamespace(_token_weighted=True, _batch_size=dp, _data_size=dp * cp,
                               config=SimpleNamespace(inputs=inputs, microbatches=microbatches),
                               loss_scaler=DynamicLossScaler(2.0**16))
        StepRunner._first_tokens_per_piece(rank, (tokens[:rows], tokens[:rows]), {})
        got[inputs] = rank.loss_scaler.tokens_per_piece
    assert got[Inputs.LOCAL] == got[Inputs.GLOBAL] == 16 * 64 / (dp * cp * microbatches), got


@pytest.mark.parametrize("options,message", [
    ({"initial_loss_scale": 0.0}, "initial_loss_scale=0.0"),
    ({"min_loss_scale": 2.0**20}, "min_loss_scale"),
    ({"loss_scale_window": 0}, "loss_scale_window=0"),
    ({"loss_scale_hysteresis": 0}, "loss_scale_hysteresis=0"),
])
def test_loss_scale_options_are_checked(options, message):
    import mcompile as mc

    with pytest.raises(ValueError, match=message):
        mc.Config(dtype=torch.float16, **options)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh,options,plant", [
    ("dp=2,tp=2", {}, 3),
    ("dp=2,pp=2", {"stage_cuts": ["linear_default_2"]}, 3),
    ("dp=2,tp=2", {"zero": 1}, 1),
    ("dp=2,tp=2", {"zero": 2}, 2),
], ids=["dp-tp", "dp-pp", "dp-tp-zero1", "dp-tp-zero2"])
def test_overflow_on_one_rank_skips_the_step_on_every_rank(mesh, options, plant, tmp_path):
    from loss_scale_cases import overflow_on_one_rank

    runs = pool(4).run(overflow_on_one_rank, mesh, {"loss_scale_window": 2, **options}, plant, str(tmp_path / "c"))
    for rank, r in enumerate(runs):
        assert r["skipped"] == [True, False, False, False], (rank, r)
        assert r["moved"] == [False, True, True, True], (rank, r)  # parameters bit-identical on the skipped step
        assert r["scale"] == [2.0**15, 2.0**15, 2.0**16, 2.0**16], (rank, r)  # halved; doubled after 2 clean
        assert all(torch.isfinite(torch.tensor(r["loss"]))), (rank, r)
        assert r["loaded_state"] == r["saved_state"] == {"scale": 2.0**16, "clean_steps": 1, "hysteresis_left": 1,
                                                         "skipped_steps": 1, "tokens_per_piece": 1.0}, (rank, r)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh,options", [
    ("dp=2", {}),
    ("dp=2", {"execution": "autograd"}),  # the loss scaled before loss.backward()
    ("pp=2", {"stage_cuts": ["linear_default_2"]}),  # the last stage's loss gradient is the scale
], ids=["joint", "autograd", "pp"])
def test_gradients_that_underflow_in_fp16_train_with_loss_scaling(mesh, options):
    from loss_scale_cases import underflow

    runs = pool(2).run(underflow, mesh, options, 1e-6)
    r = runs[0]
    assert all(g.eq(0).all() for g in r["half"].values())  # plain fp16: every gradient flushed to zero
    assert not r["skipped"] and r["scale"] == 2.0**16
    for f, ref in r["ref"].items():
        got = r["scaled"][f]
        err = float((got - ref).norm() / ref.norm())
        assert err < 1e-2, (f, err)  # fp16 compute's rounding, not lost gradients
    for run in runs:
        assert all(run["moved"].values()), run["moved"]


@pytest.mark.slow  # ~70 s on 2 shared cores: three runs of the loop (the scaler's pieces are in CI above)
@pytest.mark.timeout(600)
def test_mcompile_train_fp16_scales_and_resumes_exactly(tmp_path):
    """``train.dtype = "fp16"`` through ``mcompile train``: the tiny Llama takes no skipped step at 2^16 (the scale
    of the mean: on the sum its first 3 steps overflowed), the scale doubles after ``loss_scale_window`` clean
    steps and is logged, and a run cut at step 2 resumes with the scaler's state: the losses and weights of the
    uninterrupted run, exactly."""
    import json

    from train_cases import run_train

    def tree(name, **train):
        return {"model": {"preset": "llama3-tiny"}, "data": {"factory": "train_cases:random_samples"},
                "parallel": {"mesh": "dp=2", "sequence_parallel": False}, "optimizer": {"lr": 3e-3},
                "train": {"steps": 4, "global_batch": 4, "seq_len": 16, "dtype": "fp16", "loss_scale_window": 2,
                          **train},
                "checkpoint": {"dir": str(tmp_path / name / "ckpt"), "final_state_dict": str(tmp_path / name / "f.pt")},
                "logging": {"interval": 1, "progress": "off", "jsonl": str(tmp_path / name / "m.jsonl")}}

    full = pool(2).run(run_train, tree("full"))[0]
    rows = [json.loads(line) for line in (tmp_path / "full" / "m.jsonl").read_text().splitlines()]
    assert [(r["loss_scale"], r["skipped_steps"]) for r in rows] == [(2.0**16, 0), (2.0**17, 0), (2.0**17, 0),
                                                                       (2.0**18, 0)]
    pool(2).run(run_train, tree("cut", stop_at=2))
    second = pool(2).run(run_train, tree("cut"))[0]
    assert second["start_step"] == 2 and second["losses"] == full["losses"][2:]
    a, b = torch.load(tmp_path / "cut" / "f.pt"), torch.load(tmp_path / "full" / "f.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
