"""Checkpoints that reshard (runtime/checkpoint.py): save under one layout, load under another.

Parity is the proof: llama3-tiny (eval, fp32) trained 5 AdamW steps at dp=2 x tp=2 with sequence
parallelism, saved, then resumed by a fresh module from *other* initial weights with a fresh
optimizer at pp=2 x tp=2, at tp=4 (no SP) and at dp=4 with ZeRO-1: the next 5 steps' losses and the
final full state dict equal an uninterrupted single-device run of 10 steps (the plain model and
torch AdamW, the same fixed batch per step) to 1e-5 relative — the bound the repository's fp32
parity tests use (DESIGN §7): the layouts sum in other orders, nothing else differs. A load that
dropped the optimizer moments, the step count or a shard's piece would move the next losses by far
more (the fresh weights differ everywhere); the weights alone load into a meta model at tp=4
(``weights=``). Then the other direction: ZeRO-1 at dp=4 saved, resumed at dp=2 x tp=2 with SP under
ZeRO-0; that save is asynchronous while its run goes on. Slow tier: ZeRO-3 and ZeRO-1 under pp saved,
resumed under ZeRO-3, ZeRO-2, ZeRO-1 under pp and tp x pp.

Bad input (another model, an incomplete or corrupt folder, another optimizer): the same error on
every rank, naming the cause, and the model's parameters unchanged.
"""

from __future__ import annotations

import pytest
import torch

from conftest import pool

REL = 1e-5  # fp32 parity bound (see the module docstring)


@pytest.fixture(scope="module")
def single_device():
    from reshard_cases import reference

    return reference()


def _assert_close(state, ref_state):
    assert list(state) == list(ref_state)
    for k, v in ref_state.items():
        err = ((state[k] - v).norm() / v.norm()).item()
        assert err <= REL, (k, err)


def _assert_resumed(results, ref_losses, ref_state):
    for r in results:
        assert r["extra"] == {"step": 5, "data": {"batch": 5}}
        assert r["losses"] == pytest.approx(ref_losses[5:], rel=REL, abs=0), (r["losses"], ref_losses[5:])
    _assert_close(results[0]["state"], ref_state)


@pytest.mark.timeout(600)
def test_save_dp2_tp2_resume_pp_tp_and_zero1(tmp_path, single_device):
    from reshard_cases import resume, train_and_save, weights_from

    ref_losses, ref_state, ref_saved = single_device
    path = str(tmp_path / "ckpt")
    full = pool(4).run(train_and_save, "dp=2,tp=2", {"sequence_parallel": True}, path)
    for losses in full:  # the saving run itself is the single-device run
        assert losses == pytest.approx(ref_losses, rel=REL, abs=0)
    for mesh, options in [("pp=2,tp=2", {"microbatches": 2}), ("tp=4", {}), ("dp=4", {"zero": 1})]:
        _assert_resumed(pool(4).run(resume, mesh, options, path), ref_losses, ref_state)
    # the weights alone into a meta model at tp=4: each rank reads exactly its slices
    _assert_close(pool(4).run(weights_from, "tp=4", path)[0], ref_saved)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary folder left


@pytest.mark.timeout(600)
def test_zero1_async_save_resumes_under_zero0_with_sp(tmp_path, single_device):
    from reshard_cases import resume, train_and_save

    ref_losses, ref_state, _ = single_device
    path = str(tmp_path / "ckpt")
    full = pool(4).run(train_and_save, "dp=4", {"zero": 1}, path, True)
    for losses in full:
        assert losses == pytest.approx(ref_losses, rel=REL, abs=0)
    _assert_resumed(pool(4).run(resume, "dp=2,tp=2", {"sequence_parallel": True}, path), ref_losses, ref_state)


@pytest.mark.slow  # the CI tier keeps ZeRO 0 <-> 1 above; the other levels and ZeRO under pp here
@pytest.mark.timeout(900)
@pytest.mark.parametrize("saved", [("dp=4", {"zero": 3}), ("dp=2,pp=2", {"zero": 1, "microbatches": 2})],
                         ids=["zero3-dp4", "zero1-dp2-pp2"])
def test_other_zero_levels_reshard(tmp_path, single_device, saved):
    from reshard_cases import resume, train_and_save

    ref_losses, ref_state, _ = single_device
    path = str(tmp_path / "ckpt")
    for losses in pool(4).run(train_and_save, *saved, path):
        assert losses == pytest.approx(ref_losses, rel=REL, abs=0)
    for mesh, options in [("dp=2,tp=2", {"zero": 3, "sequence_parallel": True}), ("dp=4", {"zero": 2}),
                          ("dp=2,pp=2", {"zero": 1, "microbatches": 2}), ("tp=2,pp=2", {"microbatches": 2})]:
        _assert_resumed(pool(4).run(resume, mesh, options, path), ref_losses, ref_state)


@pytest.mark.timeout(600)
def test_bad_checkpoints_are_refused_before_anything_loads(tmp_path):
    from reshard_cases import bad_inputs

    from mcompile.runtime.checkpoint import is_complete, verify

    ranks = pool(2).run(bad_inputs, str(tmp_path))
    for case in ranks[0]:
        msgs = [r[case][0] for r in ranks]
        assert len(set(msgs)) == 1, msgs  # the same error everywhere: no rank left waiting
        assert msgs[0] is not None and msgs[0].startswith("CheckpointError: "), msgs[0]
        assert all(r[case][1] for r in ranks), case  # parameters unchanged
    out = {case: err for case, (err, _) in ranks[0].items()}
    assert "tok_embeddings.weight is [256, 64] in the checkpoint and [128, 64] in this model" in out["other_model"]
    assert "no mcompile_plan.json" in out["no_meta"]
    assert "which is missing" in out["no_data"] and "incomplete" in out["no_data"]
    assert "too short" in out["truncated"]
    assert ".metadata" in out["bad_metadata"] and "cannot be read" in out["bad_metadata"]
    assert "torch.optim.AdamW optimizer, and this one is torch.optim.SGD" in out["sgd"]
    assert "older mcompile (checkpoint format 1" in out["old_format"] and "weights=" in out["old_format"]
    assert is_complete(tmp_path / "good") and verify(tmp_path / "good")["extra"] == {"step": 1}
    assert not any(is_complete(tmp_path / how) for how in ("no_meta", "no_data", "truncated", "bad_metadata"))


def test_flat_ranges_are_contiguous_boxes():
    """A flat range of a row-major array as boxes: they cover exactly the range, each contiguous."""
    import itertools
    import math

    from mcompile.runtime.checkpoint import _flat_boxes

    for shape in [(5,), (3, 4), (2, 3, 4), (4, 1, 3), ()]:
        n = math.prod(shape)
        for a, b in itertools.combinations(range(n + 1), 2):
            got = []
            for starts, sizes in _flat_boxes(a, b, shape):
                t = torch.arange(n).view(shape)
                box = t[tuple(slice(s, s + z) for s, z in zip(starts, sizes))]
                flat = box.reshape(-1).tolist()
                assert flat == list(range(flat[0], flat[0] + len(flat))), (shape, a, b, starts, sizes)
                got += flat
            assert got == list(range(a, b)), (shape, a, b)
