"""What a context-parallel rank must read of its inputs' sequences (passes/cp/reads.py, issue 40 #3).

A cp rank's program takes every input whole and keeps its own tokens with ``cp_slice``; ``input_columns`` follows
each input's values (as codes) through the ops that only move them to the ``cp_slice`` calls, and says which
positions the program reads. Checked against the layout written out here (chunks ``r`` and ``2 cp - 1 - r`` of
``2 cp``), not against mcompile's own helper:

- our Llama preset (targets as given): the ids and the targets at the rank's positions, for cp=2, cp=4 and
  cp=2 x tp=2 (sequence parallelism), and on a pipeline rank only what its stage reads;
- a 4-layer Hugging Face Llama (labels shifted inside the model: ``pad`` then ``[:, 1:]``): the ids at the rank's
  positions and the labels one position on, the last rank's shift falling on the pad; over the cp ranks the
  labels read partition the positions the model scores;
- on graphs written by hand: a use that computes with the values reads the input whole, one that reads only its
  shape reads nothing, a cast that cannot hold the codes and a value inside a list read it whole.

The data side: ``SampleDataset.batch(columns=)`` reads only those window positions (counted on the ``.bin``) and
equals the whole batch there; ``Objective.window_columns`` maps each kind's input positions to window positions.
The training loop's reads under dp x cp, with the losses bit for bit against whole reads: tests/test_train_reads.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.fx as fx

from mcompile.passes.cp.reads import input_columns

from conftest import build

SEQ = 16
aten = torch.ops.aten


def _positions(cp: int, rank: int) -> list[int]:
    c = SEQ // (2 * cp)
    return [p for j in (rank, 2 * cp - 1 - rank) for p in range(j * c, (j + 1) * c)]


def _program(name: str, mesh: str, **plan_kw):
    from mcompile.api import compile_plan
    from mcompile.compiler import rank_programs
    from mcompile.ir.config import Config
    from mcompile.ir.mesh import Mesh

    model, inputs = build(name, batch=2)
    c = compile_plan(model, Mesh.parse(mesh), inputs, for_runtime=True, token_weighted_loss=True, **plan_kw)
    return c, rank_programs(c, 0, Config(microbatches=plan_kw.get("microbatches", 1)), torch.device("cpu")), inputs


def _reads(gm, names, inputs, cp):
    named = dict(zip(names, (t[:1] for t in inputs)))  # one row: the positions do not depend on the rows
    return [input_columns(gm, names, named, r) for r in range(cp)]


@pytest.mark.parametrize("mesh,cp", [("cp=2", 2), ("cp=4", 4), ("cp=2,tp=2", 2)])
def test_a_cp_rank_of_our_llama_reads_its_tokens_and_their_targets(mesh, cp):
    c, rp, inputs = _program("llama3-tiny", mesh, cp_attention="allgather", sequence_parallel="tp" in mesh)
    names = list(c.captured.user_inputs)
    for r, got in enumerate(_reads(rp.program, names, inputs, cp)):
        for n in names:
            assert got[n].tolist() == sorted(_positions(cp, r)), (n, r)


def test_a_loss_on_the_gathered_sequence_reads_the_targets_whole():
    """A mean loss kept as the model wrote it (not rewritten into (sum, count), which parallelize does): its logits
    are gathered over cp and the loss is computed on the whole sequence, which reads every target."""
    from mcompile.api import compile_plan
    from mcompile.compiler import rank_programs
    from mcompile.ir.config import Config
    from mcompile.ir.mesh import Mesh

    model, inputs = build("llama3-tiny", batch=2)
    c = compile_plan(model, Mesh.parse("cp=2"), inputs, for_runtime=True, cp_attention="allgather")
    rp = rank_programs(c, 0, Config(), torch.device("cpu"))
    ids, targets = c.captured.user_inputs
    for r, got in enumerate(_reads(rp.program, [ids, targets], inputs, 2)):
        assert got[ids].tolist() == sorted(_positions(2, r)) and got[targets] is None


def test_a_cp_rank_of_a_hugging_face_llama_reads_the_next_position_of_the_labels_it_shifts():
    c, rp, inputs = _program("hf-llama-4l-nocache", "cp=2", cp_attention="ring")
    ids, labels = c.captured.user_inputs
    reads = _reads(rp.program, [ids, labels], inputs, 2)
    for r, got in enumerate(reads):
        own = sorted(_positions(2, r))
        assert got[ids].tolist() == own
        assert got[labels].tolist() == [p + 1 for p in own if p + 1 < SEQ]  # position 16 is the model's pad
    together = sorted(p for got in reads for p in got[labels].tolist())
    assert together == list(range(1, SEQ))  # a partition of what the model scores (labels[:, 1:])


def test_a_pipeline_stage_reads_only_the_inputs_it_takes():
    c, rp, inputs = _program("llama3-tiny", "pp=2,cp=2", cp_attention="allgather", microbatches=2)
    first, last = rp.stages[0], rp.stages[-1]
    ids, targets = c.captured.user_inputs
    for st, reads, skips in ((first, ids, targets), (last, targets, ids)):
        for r, got in enumerate(_reads(st.gm, st.user_inputs, inputs, 2)):
            assert got[reads].tolist() == sorted(_positions(2, r))
            assert got.get(skips) is None or got[skips].numel() == 0  # not a placeholder, or its shape only


def _graph(body) -> fx.GraphModule:
    """ids [2, 16] -> body(graph, ids) -> output; a cp_slice(axis cp, n=2) of what body returns, if it returns one."""
    g = fx.Graph()
    x = g.placeholder("ids")
    out = body(g, x)
    g.output(out)
    return fx.GraphModule(torch.nn.Module(), g)


def _cp_slice(g, v, dim=1):
    return g.call_function(torch.ops.mcompile.cp_slice.default, (v, dim, "cp", 2, SEQ))


@pytest.mark.parametrize("body,want", [
    # moves: the positions the slice keeps, through HF's label shift (a pad, then [:, 1:]: the pad's position 16
    # is no input's) and through an exact cast and a flatten (the slice on dim 0 of [32], the sequence innermost)
    (lambda g, x: _cp_slice(g, g.call_function(aten.slice.Tensor, (g.call_function(
        aten.pad.default, (x, [0, 1], "constant", -100.0)), 1, 1, 2**63 - 1))), [p + 1 for p in _positions(2, 0)
                                                                                if p + 1 < SEQ]),
    (lambda g, x: _cp_slice(g, g.call_function(aten.view.default, (g.call_function(
        aten._to_copy.default, (x,), {"dtype": torch.float32}), [-1])), 0), _positions(2, 0)),
    # computing with the values: everything
    (lambda g, x: _cp_slice(g, g.call_function(aten.ne.Scalar, (x, 0))), None),
    (lambda g, x: _cp_slice(g, g.call_function(aten._to_copy.default, (x,), {"dtype": torch.bfloat16})), None),
    (lambda g, x: _cp_slice(g, g.call_function(aten.to.device, (x, torch.device("cpu"), torch.float16))), None),
    (lambda g, x: _cp_slice(g, g.call_function(aten.cat.default, ([x, x], 1))), None),
    (lambda g, x: x, None),  # returned as it is
    (lambda g, x: _cp_slice(g, g.call_function(aten.view.default, (x, [3, 16]))), None),  # a size for other shapes
    # the shape only: nothing
    (lambda g, x: g.call_function(aten.new_zeros.default, (x, [g.call_function(aten.sym_size.int, (x, 1))])), []),
])
def test_what_counts_as_a_read(body, want):
    got = input_columns(_graph(body), ["ids"], {"ids": torch.zeros(2, SEQ, dtype=torch.int64)}, 0)["ids"]
    assert (None if got is None else sorted(got.tolist())) == (None if want is None else sorted(want))


class _Counted:
    def __init__(self, array, read: list):
        self.array, self.read = array, read

    def __getitem__(self, index):
        out = self.array[index]
        self.read.append(int(np.size(out)))
        return out

    def __len__(self):
        return len(self.array)


def test_batch_columns_reads_only_those_window_positions(tmp_path):
    from mcompile.apps.data import SampleDataset, write_indexed

    rng = np.random.default_rng(1)
    write_indexed(tmp_path / "c", [rng.integers(0, 200, rng.integers(5, 40)) for _ in range(60)], vocab_size=200)
    for packing in (False, True):
        sd = SampleDataset(str(tmp_path / "c"), SEQ, seed=2, packing=packing)
        whole = sd.batch(7, 5)
        cols = np.array(sorted(set(_positions(2, 1)) | {p + 1 for p in _positions(2, 1)}))
        read = []
        for src in sd._sources:  # count the ids read from the memory map
            src.ds.tokens = _Counted(src.ds.tokens, read)
        part = sd.batch(7, 5, columns=cols)
        assert sum(read) == 5 * len(cols)
        tok, tgt = cols[cols < SEQ], cols[cols >= 1] - 1
        assert torch.equal(part.tokens[:, tok], whole.tokens[:, tok])
        assert torch.equal(part.targets[:, tgt], whole.targets[:, tgt])
        rest = np.setdiff1d(np.arange(SEQ), tok)
        assert not part.tokens[:, rest].any()  # the rest was not read
        if packing:  # index arithmetic, whole
            assert torch.equal(part.segment_ids, whole.segment_ids) and torch.equal(part.position_ids,
                                                                                    whole.position_ids)
        with pytest.raises(IndexError, match="window positions are 0 .. 16"):
            sd.batch(0, 1, columns=[0, SEQ + 1])


@pytest.mark.parametrize("kind,shift", [("next-token", (0, 1)), ("causal-lm", (0, 0)), ("masked-lm", (0, 0)),
                                        ("seq2seq", (0, SEQ // 2))])
def test_each_objective_says_which_window_positions_fill_its_inputs(kind, shift):
    """Checked on the data itself: inputs made from a window holding only those positions (the rest -1) equal the
    whole window's inputs at the asked positions."""
    from mcompile.apps.train.objective import Objective

    obj = Objective(kind, seed=1, mask_token_id=3, vocab_size=50)
    window = torch.arange(10, 10 + SEQ + 1).repeat(2, 1)
    whole = obj.inputs(window[:, :-1], window[:, 1:], 0)
    asked = [torch.tensor([0, 2, 3]), torch.tensor([1, 4])]
    cols = obj.window_columns(asked, SEQ)
    assert cols.tolist() == sorted({int(p) + k for p, k in zip(torch.cat(asked), (0, 0, 0, shift[1], shift[1]))})
    holes = torch.full_like(window, -1)
    holes[:, cols] = window[:, cols]
    part = obj.inputs(holes[:, :-1], holes[:, 1:], 0)
    for a, b, p in zip(part, whole, asked):
        assert torch.equal(a[:, p], b[:, p]), kind
    assert obj.window_columns([None, asked[1]], SEQ) is None
    scored = [1] if kind == "causal-lm" else [0, 1]  # HF's decoder scores no label at position 0
    assert obj.counted(whole, torch.tensor([0, 1])) == int((whole[1][:, scored] != -100).sum())
