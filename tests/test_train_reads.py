"""``mcompile train`` reads on each rank only the samples it uses (``data.read = "local"``, issue 40 #3).

- On 4 gloo processes (the pool's workers) with a real indexed dataset whose ``.bin`` memory map counts the ids
  read (tests/train_cases.py ``run_train_counting``), each mesh trains 4 steps with 2 evaluations twice: reading
  each rank's rows (the default) and reading the whole batch on every rank (``data.read = "global"``: the loop as
  it was, ``pm.train_step`` picking the rows). What is checked:

  - the losses and the eval losses are equal bit for bit (the same tensors reach every rank's programs, in the
    same order), and so are the eval's token counts (each rank counts its rows; one all-reduce sums them);
  - dp=2 x cp=2: the data ranks' reads, concatenated in dp order, are the whole batch of the global run, step by
    step (train and valid): the same samples in the same order; each rank reads half the samples and half the
    ids of the global run (1/dp); the two cp ranks of one dp rank read the same rows (whole sequences: cp's
    programs slice their tokens, so 1/(dp x cp) would need programs that take a slice);
  - pp=4 (4 layers, one a stage): the middle pipeline ranks, whose stages take no input, read nothing; the first
    and last read the whole batch (dp=1).

- The masked-LM objective draws its masks for the whole batch's shape: a rank's rows of the draws equal the
  rows of the whole batch's inputs (no processes).

Exact resume with per-rank reads: tests/test_train.py (dp=2 x tp=2 cut and resumed bit for bit; a killed rank
restarted by the elastic agent at dp=2), which run with the default ``data.read = "local"``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from train_cases import run_train_counting

from mcompile.apps.data import write_indexed
from mcompile.apps.train.objective import Objective
from mcompile.ir.mesh import Mesh

from conftest import pool

GLOBAL_BATCH, SEQ, STEPS, EVAL_BATCHES = 8, 16, 4, 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """Random documents of 20-120 ids over a vocabulary of 256 (llama3-tiny's): ~21k tokens, uint16 on disk."""
    rng = np.random.default_rng(0)
    prefix = tmp_path_factory.mktemp("reads") / "corpus"
    write_indexed(prefix, [rng.integers(0, 256, rng.integers(20, 120)) for _ in range(300)], vocab_size=256)
    return str(prefix)


def _tree(corpus: str, mesh: str, read: str, parallel: dict, overrides: dict, jsonl: Path) -> dict:
    return {
        "model": {"preset": "llama3-tiny", "overrides": overrides},
        "data": {"sources": corpus, "valid_fraction": 0.1, "read": read},
        "parallel": {"mesh": mesh, **parallel},
        "optimizer": {"lr": 3e-3},
        "schedule": {"kind": "constant", "warmup": 1},
        # fp32 (the default is bf16): the model as written, no compute-dtype copies
        "train": {"steps": STEPS, "global_batch": GLOBAL_BATCH, "seq_len": SEQ, "seed": 3, "dtype": "fp32"},
        "eval": {"interval": 2, "batches": EVAL_BATCHES},
        "logging": {"interval": 1, "progress": "off", "jsonl": str(jsonl)},
    }


def _runs(corpus: str, tmp_path: Path, mesh: str, parallel: dict, overrides: dict):
    """(local, global): per rank (summary, calls) of each way of reading; checks that both trained alike (the
    losses and eval losses bit for bit, the eval's token count: each batch's, summed over the ranks' rows)."""
    runs = {}
    for read in ("local", "global"):
        runs[read] = pool(4).run(run_train_counting, _tree(corpus, mesh, read, parallel, overrides,
                                                           tmp_path / f"{read}.jsonl"))
    for (a, _), (b, _) in zip(runs["local"], runs["global"]):
        assert a["losses"] == b["losses"] and len(a["losses"]) == STEPS  # bit for bit
        assert a["eval_loss"] == b["eval_loss"] and a["consumed_samples"] == b["consumed_samples"]
    evals = {read: [r["eval_tokens"] for r in map(json.loads, (tmp_path / f"{read}.jsonl").read_text().splitlines())
                    if "eval_tokens" in r] for read in runs}
    assert evals["local"] == evals["global"] == [EVAL_BATCHES * GLOBAL_BATCH * SEQ] * 2, evals
    return runs["local"], runs["global"]


def _batches(calls, split: str) -> list:
    return [c for c in calls if c["split"] == split]


def test_dp_cp_ranks_read_their_rows(corpus, tmp_path):
    mesh = Mesh.parse("dp=2,cp=2")
    local, whole = _runs(corpus, tmp_path, "dp=2,cp=2", {}, {})
    reference = whole[0][1]  # every rank of the global run reads the whole batch
    for _, calls in whole[1:]:
        assert [(c["start"], c["n"]) for c in calls] == [(c["start"], c["n"]) for c in reference]
    by_dp = {}
    for rank, (_, calls) in enumerate(local):
        by_dp.setdefault(mesh.coords(rank)["dp"], []).append(calls)
    for split, batches in (("train", STEPS), ("valid", EVAL_BATCHES * 2)):
        want = _batches(reference, split)
        assert len(want) == batches and all(c["n"] == GLOBAL_BATCH for c in want)
        for dp, ranks in by_dp.items():
            for calls in ranks:  # each cp rank of the dp rank: the same rows, half the batch
                got = _batches(calls, split)
                assert [(c["start"], c["n"]) for c in got] == [(w["start"] + dp * GLOBAL_BATCH // 2,
                                                                 GLOBAL_BATCH // 2) for w in want]
                assert all(torch.equal(g["tokens"], h["tokens"]) for g, h in zip(got, _batches(ranks[0], split)))
                assert sum(c["read"] for c in got) * 2 == sum(c["read"] for c in want)  # 1/dp of the ids
        # the union, in dp order, is the global batch, step by step
        for k, w in enumerate(want):
            joined = torch.cat([_batches(by_dp[dp][0], split)[k]["tokens"] for dp in sorted(by_dp)])
            assert torch.equal(joined, w["tokens"])
    # the ids read: windows of SEQ + 1 (the targets' last), per sample
    assert sum(c["read"] for c in _batches(local[0][1], "train")) == STEPS * GLOBAL_BATCH // 2 * (SEQ + 1)


def test_middle_pipeline_ranks_read_nothing(corpus, tmp_path):
    local, whole = _runs(corpus, tmp_path, "pp=4", {"microbatches": 2}, {"n_layers": 4})
    reads = [sum(c["read"] for c in calls) for _, calls in local]
    full = sum(c["read"] for c in whole[0][1])
    assert reads == [full, 0, 0, full], reads  # the first stage takes the tokens, the last the targets
    assert [len(calls) for _, calls in local] == [STEPS + 2 * EVAL_BATCHES, 0, 0, STEPS + 2 * EVAL_BATCHES]


@pytest.mark.parametrize("kind", ["next-token", "causal-lm", "seq2seq", "masked-lm"])
def test_objective_rows_are_rows_of_the_whole_batch(kind):
    objective = Objective(kind, seed=5, mask_token_id=3, vocab_size=50)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 50, (8, 12), generator=g)
    targets = torch.randint(4, 50, (8, 12), generator=g)
    whole = objective.inputs(tokens, targets, 40)
    for rows in (range(0, 2), range(2, 4), range(4, 8)):
        part = objective.inputs(tokens[rows.start:rows.stop], targets[rows.start:rows.stop], 40, rows=rows, batch=8)
        for a, b in zip(part, whole):
            assert torch.equal(a, b[rows.start:rows.stop]), (kind, rows)
    if kind == "masked-lm":  # the draw is not one made for the rows' own shape
        alone = objective.inputs(tokens[4:8], targets[4:8], 40)
        assert not torch.equal(alone[1], whole[1][4:8])
    with pytest.raises(ValueError, match="rows"):
        objective.inputs(tokens[:2], targets[:2], 40, rows=range(0, 3), batch=8)
