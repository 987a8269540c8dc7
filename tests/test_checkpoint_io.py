"""How runtime/checkpoint.py moves bytes (issue 40 item 7), one process, no process group: DCP's save and load
with ``no_dist`` through mcompile's writer, reader and planners.

- the reader reads a saved box straight into the tensor it loads where that is a contiguous CPU tensor of
  the saved dtype and the part read is contiguous in the saved box (a whole box, a run of rows), and hands
  everything else to DCP's own path (a column slice, another dtype, a non-contiguous target); the values
  are the saved ones either way. A reader that never took the direct path would pass every parity test in
  the repository: the count of what DCP's path read is what can fail here;
- the writer gets boxes of a larger buffer (ZeRO's flat segments) as views over their own bytes, not
  copies, and writes no CRC32 (in the writing thread, the main one or a background one); the setting
  is restored after;
- an async save's staging buffers are reused by the next one of the same layout, and replaced otherwise;
- the runs of an index vector (the boxes' raw material) against a plain loop.
"""

from __future__ import annotations

import io
import pickle
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from mcompile.runtime import checkpoint as C

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # no_dist: meant


def _save(path, state):
    dcp.save(state, storage_writer=C._Writer(str(path)), planner=C._SavePlanner(), no_dist=True)


def _load(path, state, monkeypatch):
    """Load ``state`` from ``path``; the read items DCP's own path got (the ones not read directly)."""
    fallback = []
    original = C.FileSystemReader.read_data

    def read_data(self, plan, planner):
        fallback.extend((it.dest_index.fqn, tuple(it.dest_offsets)) for it in plan.items)
        return original(self, plan, planner)

    monkeypatch.setattr(C.FileSystemReader, "read_data", read_data)
    dcp.load(state, storage_reader=C._Reader(path), planner=C._LoadPlanner(), no_dist=True)
    return fallback


def test_boxes_are_read_straight_into_their_tensors_where_contiguous(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    full = torch.randn(8, 6, generator=g)
    flat = torch.randn(40, generator=g)  # a ZeRO-like flat buffer: two boxes of it are saved
    _save(tmp_path, {"w": C._Pieces((8, 6), [((0, 0), (8, 6), full)]),
                     "v": C._Pieces((40,), [((0,), (25,), flat[:25]), ((25,), (15,), flat[25:])]),
                     "step": torch.tensor(7.0)})
    rows = torch.zeros(3, 6)                     # rows 2..4 of the saved box: contiguous in it
    whole = torch.zeros(8, 6)
    buf = torch.zeros(40)                        # both of v's boxes into one buffer
    cols = torch.zeros(8, 2)                     # columns 1..2: not contiguous in the saved box
    as_bf16 = torch.zeros(8, 6, dtype=torch.bfloat16)  # another dtype: DCP's path casts
    step = torch.tensor(0.0)
    fallback = _load(tmp_path, {"w": C._Pieces((8, 6), [((2, 0), (3, 6), rows)]), "v": C._Pieces(
        (40,), [((0,), (40,), buf)]), "step": step}, monkeypatch)
    assert torch.equal(rows, full[2:5]) and torch.equal(buf, flat)
    assert fallback == [] and step.item() == 7.0  # a 0-d tensor is contiguous: read directly too
    fallback = _load(tmp_path, {"w": C._Pieces((8, 6), [((0, 1), (8, 2), cols)])}, monkeypatch)
    assert torch.equal(cols, full[:, 1:3]) and fallback == [("w", (0, 0))]
    fallback = _load(tmp_path, {"w": C._Pieces((8, 6), [((0, 0), (8, 6), as_bf16)])}, monkeypatch)
    assert torch.equal(as_bf16, full.bfloat16()) and len(fallback) == 1
    target = torch.zeros(6, 8)  # a transposed view: not contiguous, DCP's path
    fallback = _load(tmp_path, {"w": C._Pieces((8, 6), [((0, 0), (8, 6), target.t())])}, monkeypatch)
    assert torch.equal(target.t(), full) and len(fallback) == 1
    fallback = _load(tmp_path, {"w": C._Pieces((8, 6), [((0, 0), (8, 6), whole)])}, monkeypatch)
    assert torch.equal(whole, full) and fallback == []


def _record(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    zf = torch._C.PyTorchFileReader(io.BytesIO(buf.getvalue()))
    return zf.get_record("data.pkl")


def test_a_records_header_is_read_without_its_data():
    base = torch.arange(20, dtype=torch.bfloat16)
    assert C._TensorHeader(io.BytesIO(_record(base[2:14].view(3, 4)))).load() == (
        torch.bfloat16, "0", 20, 2, (3, 4), (4, 1))  # a view: the whole storage is saved, at an offset
    assert C._TensorHeader(io.BytesIO(_record(torch.ones(2, 3).t()))).load()[4:] == ((3, 2), (1, 3))
    assert C._TensorHeader(io.BytesIO(_record(torch.tensor(7.0)))).load() == (torch.float32, "0", 1, 0, (), ())
    for other in ({"a": torch.ones(1)}, [torch.ones(1)], torch.nn.Parameter(torch.ones(2))):
        with pytest.raises(pickle.UnpicklingError):  # anything but a plain tensor: DCP's own path reads it
            C._TensorHeader(io.BytesIO(_record(other))).load()


def test_a_saved_tensor_with_strides_is_read_by_dcps_path(tmp_path, monkeypatch):
    full = torch.randn(6, 8)
    _save(tmp_path, {"t": full.t()})  # a plain tensor whose storage is exactly its bytes: saved transposed
    out = torch.zeros(8, 6)
    fallback = _load(tmp_path, {"t": out}, monkeypatch)
    assert torch.equal(out, full.t()) and fallback == [("t", (0, 0))]


def test_a_box_of_a_larger_buffer_is_written_from_its_own_bytes_without_a_copy(tmp_path, monkeypatch):
    flat = torch.arange(30, dtype=torch.float32)
    box = flat[10:22].view(3, 4)
    exact = C._exact(box)
    assert exact.data_ptr() == box.data_ptr() and exact.untyped_storage().nbytes() == box.nbytes
    assert torch.equal(exact, box)
    assert C._exact(flat) is flat  # its storage is its own already
    strided = flat.view(5, 6)[:, :2]
    assert C._exact(strided) is strided  # not contiguous: DCP's writer copies it (as it must)
    clones = []
    original = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda t, *a, **k: clones.append(t.shape) or original(t, *a, **k))
    _save(tmp_path, {"x": C._Pieces((30,), [((10,), (12,), flat[10:22])])})
    monkeypatch.undo()
    assert clones == []
    out = torch.zeros(12)
    dcp.load({"x": C._Pieces((30,), [((10,), (12,), out)])}, storage_reader=C._Reader(tmp_path),
             planner=C._LoadPlanner(), no_dist=True)
    assert torch.equal(out, flat[10:22])
    assert (tmp_path / "__0_0.distcp").stat().st_size < 30 * 4 + 4096  # 12 floats and a record's headers


def test_no_crc32_while_writing_and_the_setting_restored(tmp_path, monkeypatch):
    seen = []
    original = C.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        seen.append(torch.serialization.get_crc32_options())
        return original(self, plan, planner)

    monkeypatch.setattr(C.FileSystemWriter, "write_data", write_data)
    assert torch.serialization.get_crc32_options()
    _save(tmp_path / "a", {"x": torch.ones(3)})
    assert seen == [False] and torch.serialization.get_crc32_options()
    # in a background thread (an async save's writer) too
    t = threading.Thread(target=_save, args=(tmp_path / "b", {"x": torch.ones(3)}))
    t.start()
    t.join()
    assert seen == [False, False] and torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)  # a user's own setting is what comes back
    try:
        with C._no_crc32():
            pass
        assert not torch.serialization.get_crc32_options()
    finally:
        torch.serialization.set_crc32_options(True)


def test_async_staging_buffers_are_reused_for_the_same_layout():
    pm = SimpleNamespace()
    live = torch.arange(12, dtype=torch.float32)
    state = {"x": C._Pieces((12,), [((0,), (5,), live[:5]), ((5,), (7,), live[5:])]), "step": torch.tensor(3.0),
             "opts": {"lr": 0.1}}
    first = C._stage(pm, state)
    kept = first["x"].shard((5,))
    assert kept.data_ptr() != live[5:].data_ptr() and torch.equal(kept, live[5:])
    live += 100  # training goes on
    second = C._stage(pm, state)
    assert second["x"].shard((5,)) is kept and torch.equal(kept, live[5:])  # the same buffer, the new values
    assert second["step"] is first["step"] and second["opts"] == {"lr": 0.1}
    other = {"x": C._Pieces((12,), [((0,), (12,), live)])}  # another layout: new buffers
    third = C._stage(pm, other)
    assert third["x"].shard((0,)) is not kept and torch.equal(third["x"].shard((0,)), live)
    assert pm._checkpoint_staging is third


def _runs_by_loop(g: list[int]) -> list[tuple[int, int, int]]:
    runs: list[list[int]] = []
    for i, x in enumerate(g):
        if x < 0:
            continue
        if runs and runs[-1][0] + runs[-1][2] == i and runs[-1][1] + runs[-1][2] == x:
            runs[-1][2] += 1
        else:
            runs.append([i, x, 1])
    return [tuple(r) for r in runs]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=6), max_size=8), st.randoms())
def test_index_runs_are_the_loops_runs(blocks, rnd):
    """Blocks of consecutive global indices in any order, with padding (-1) between some: BlockShard's
    k blocks, a padded vocabulary, a shard's cut."""
    g, nxt = [], 0
    for b in blocks:
        run = list(range(nxt, nxt + len(b)))
        nxt += len(b)
        g.append(run + [-1] * (b[0] % 3 == 0))
    rnd.shuffle(g)
    flat = [x for run in g for x in run]
    assert C._index_runs(torch.tensor(flat, dtype=torch.long)) == _runs_by_loop(flat)


@pytest.mark.parametrize("n", [0, 1])
def test_index_runs_of_empty_and_single(n):
    assert C._index_runs(torch.arange(n)) == _runs_by_loop(list(range(n)))
    assert C._index_runs(torch.full((3,), -1)) == []
