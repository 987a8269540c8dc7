"""``mcompile train`` reads on each rank only the samples it uses (``data.read = "local"``, issue 40 #3).

- On 4 gloo processes (the pool's workers) with a real indexed dataset whose ``.bin`` memory map counts the ids
  read (tests/train_cases.py ``run_train_counting``), each mesh trains 4 steps with 2 evaluations twice: reading
  each rank's rows (the default) and reading the whole batch on every rank (``data.read = "global"``: the loop as
  it was, ``pm.train_step`` picking the rows). What is checked:

  - the losses and the eval losses are equal bit for bit (the same tensors reach every rank's programs, in the
    same order), and so are the eval's token counts (each rank counts its rows; one all-reduce sums them);
  - dp=2 x cp=2: each data rank reads its half of the samples, step by step (train and valid), and each of its two
    cp ranks only the window positions its program reads (its two load-balanced chunks of the tokens and their
    targets, the next position: 10 and 9 of the 17 positions of a window of SEQ + 1, about 1/(dp x cp) of the
    ids of the global run); what each reads equals the global batch there, and the two together read every
    position;
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


def _tree(corpus: str, mesh: str, read: str, parallel: dict, overrides: dict, jsonl: Path, model=None) -> dict:
    return {
        "model": model or {"preset": "llama3-tiny", "overrides": overrides},
        "data": {"sources": corpus, "valid_fraction": 0.1, "read": read},
        "parallel": {"mesh": mesh, **parallel},
        "optimizer": {"lr": 3e-3},
        "schedule": {"kind": "constant", "warmup": 1},
        # fp32 (the default is bf16): the model as written, no compute-dtype copies
        "train": {"steps": STEPS, "global_batch": GLOBAL_BATCH, "seq_len": SEQ, "seed": 3, "dtype": "fp32"},
        "eval": {"interval": 2, "batches": EVAL_BATCHES},
        "logging": {"interval": 1, "progress": "off", "jsonl": str(jsonl)},
    }


def _runs(corpus: str, tmp_path: Path, mesh: str, parallel: dict, overrides: dict, model=None, scored: int = SEQ):
    """(local, global): per rank (summary, calls) of each way of reading; checks that both trained alike (the
    losses and eval losses bit for bit, the eval's token count: each batch's, summed over the ranks' rows, of
    ``scored`` targets per sample)."""
    runs = {}
    for read in ("local", "global"):
        runs[read] = pool(4).run(run_train_counting, _tree(corpus, mesh, read, parallel, overrides,
                                                           tmp_path / f"{read}.jsonl", model))
    for (a, _), (b, _) in zip(runs["local"], runs["global"]):
        assert a["losses"] == b["losses"] and len(a["losses"]) == STEPS  # bit for bit
        assert a["eval_loss"] == b["eval_loss"] and a["consumed_samples"] == b["consumed_samples"]
    evals = {read: [r["eval_tokens"] for r in map(json.loads, (tmp_path / f"{read}.jsonl").read_text().splitlines())
                    if "eval_tokens" in r] for read in runs}
    assert evals["local"] == evals["global"] == [EVAL_BATCHES * GLOBAL_BATCH * scored] * 2, evals
    return runs["local"], runs["global"]


def _batches(calls, split: str) -> list:
    return [c for c in calls if c["split"] == split]


def _cp_own(cp: int, rank: int) -> list[int]:
    """A cp rank's positions of a sequence: chunks rank and 2 cp - 1 - rank of 2 cp (the load-balanced layout).
    Written out here, not asked of mcompile."""
    c = SEQ // (2 * cp)
    return [p for j in (rank, 2 * cp - 1 - rank) for p in range(j * c, (j + 1) * c)]


def _cp_window(cp: int, rank: int) -> list[int]:
    """The window positions a cp rank of a next-token model must read: its tokens and their targets (the next
    position)."""
    own = _cp_own(cp, rank)
    return sorted(set(own) | {p + 1 for p in own})


def test_dp_cp_ranks_read_their_rows_and_their_share_of_each_sequence(corpus, tmp_path):
    mesh = Mesh.parse("dp=2,cp=2")
    local, whole = _runs(corpus, tmp_path, "dp=2,cp=2", {}, {})
    reference = whole[0][1]  # every rank of the global run reads the whole batch
    for _, calls in whole[1:]:
        assert [(c["start"], c["n"]) for c in calls] == [(c["start"], c["n"]) for c in reference]
    assert all(c["columns"] is None for _, calls in whole for c in calls)
    by_dp = {}
    for rank, (_, calls) in enumerate(local):
        by_dp.setdefault(mesh.coords(rank)["dp"], {})[mesh.coords(rank)["cp"]] = calls
    for split, batches in (("train", STEPS), ("valid", EVAL_BATCHES * 2)):
        want = _batches(reference, split)
        assert len(want) == batches and all(c["n"] == GLOBAL_BATCH for c in want)
        for dp, ranks in by_dp.items():
            rows = slice(dp * GLOBAL_BATCH // 2, (dp + 1) * GLOBAL_BATCH // 2)
            seen = torch.zeros(SEQ + 1, dtype=torch.bool)
            for cp, calls in ranks.items():  # the dp rank's rows (1/dp), and of each sequence the cp rank's share
                got = _batches(calls, split)
                assert [(c["start"], c["n"]) for c in got] == [(w["start"] + rows.start, GLOBAL_BATCH // 2)
                                                               for w in want]
                window = _cp_window(2, cp)
                assert all(c["columns"] == window for c in got), (cp, got[0]["columns"])
                assert len(window) <= SEQ // 2 + 2  # 1/cp of the positions, and a target past each of 2 chunks
                # the ids read: exactly the window positions of each sample (the counting memory map)
                assert all(c["read"] == GLOBAL_BATCH // 2 * len(window) for c in got)
                tok = [p for p in window if p < SEQ]
                tgt = [p - 1 for p in window if p >= 1]
                for g, w in zip(got, want):  # what was read is the global batch's there
                    assert torch.equal(g["tokens"][:, tok], w["tokens"][rows, tok])
                    assert torch.equal(g["targets"][:, tgt], w["targets"][rows, tgt])
                seen[window] = True
            assert seen.all()  # together the cp ranks read every position of the window
    # the ids one cp rank reads: its share of windows of SEQ + 1, of half the samples (dp=2)
    assert sum(c["read"] for c in _batches(local[0][1], "train")) == STEPS * GLOBAL_BATCH // 2 * len(_cp_window(2, 0))
    assert sum(c["read"] for c in _batches(reference, "train")) == STEPS * GLOBAL_BATCH * (SEQ + 1)


def test_the_cp_ranks_of_a_hugging_face_decoder_read_its_tokens_and_the_labels_it_shifts(corpus, tmp_path):
    """causal-lm: labels = the tokens, shifted by the model (pad, then [:, 1:]); a cp rank's program reads the ids at
    its positions and the labels one on, so it reads those window positions (9 of 17 each); the two cp ranks' labels
    partition the positions the model scores, which the eval's token count (each rank counting its share) needs.
    cp=2 x tp=2: the tp ranks of a cp rank read the same."""
    from train_hf_cases import save_hf

    hf = save_hf("llama", tmp_path / "hf")
    mesh = Mesh.parse("cp=2,tp=2")
    local, _ = _runs(corpus, tmp_path, "cp=2,tp=2", {}, {}, model={"hf": str(hf), "init_from": str(hf)},
                      scored=SEQ - 1)  # HF scores labels[:, 1:]
    for rank, (_, calls) in enumerate(local):
        # the ids' positions and the next ones (labels c is window position c), but not 16: HF scores no label there
        own = [p for p in _cp_window(2, mesh.coords(rank)["cp"]) if p < SEQ]
        assert calls and all(c["columns"] == own for c in calls), (rank, calls[0]["columns"], own)
        assert all(c["read"] == c["n"] * len(own) for c in calls)


def test_under_pp_x_cp_the_first_stage_reads_its_tokens_and_the_last_its_targets(corpus, tmp_path):
    """pp=2 x cp=2: the first stage's programs read the ids and the last stage's the targets, each at its cp rank's
    positions: 8 of the 17 window positions per sample (the ids' own, or the targets' one on), counted in the
    eval by the last stage alone."""
    mesh = Mesh.parse("pp=2,cp=2")
    local, whole = _runs(corpus, tmp_path, "pp=2,cp=2", {"microbatches": 2}, {"n_layers": 4})
    for rank, (_, calls) in enumerate(local):
        c = mesh.coords(rank)
        own = sorted(p + (c["pp"] == 1) for p in _cp_own(2, c["cp"]))
        assert len(own) == SEQ // 2 and all(x["columns"] == own for x in calls), (rank, calls[0]["columns"])
        assert sum(x["read"] for x in calls) * 17 == sum(x["read"] for x in whole[0][1]) * 8


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
