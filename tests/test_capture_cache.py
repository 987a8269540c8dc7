"""Capture once (mcompile.capture.cache): across runs through the on-disk cache, across ranks by
broadcasting rank 0's capture."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcompile.capture import cache as capture_cache
from mcompile.capture.export import capture
from mcompile.models import get_preset

pytestmark = pytest.mark.timeout(300)


def _structure(gm):
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    arg = lambda a: ("node", index[a]) if isinstance(a, torch.fx.Node) else a  # noqa: E731
    return [(n.name, n.op, str(n.target), torch.fx.node.map_aggregate(n.args, arg), str(n.meta.get("val")))
            for n in gm.graph.nodes]


def test_a_cached_capture_is_the_capture_and_needs_no_export(tmp_path, monkeypatch):
    monkeypatch.setenv("MCOMPILE_CACHE", str(tmp_path))
    pre = get_preset("llama3-tiny")
    model, inputs = pre.build(), pre.example_inputs(batch=2, seq=16)
    first = capture(model, inputs, meta_dtype=torch.float32, cache=True)
    assert len(list((tmp_path / "captures").glob("*.pt2"))) == 1

    def no_export(*a, **k):
        raise AssertionError("torch.export ran although the capture is cached")

    monkeypatch.setattr(torch.export, "export", no_export)
    again = capture(model, inputs, meta_dtype=torch.float32, cache=True)
    assert _structure(again.gm) == _structure(first.gm)
    assert (again.params, again.buffers, again.user_inputs, again.input_names, again.tied, again.output) == \
        (first.params, first.buffers, first.user_inputs, first.input_names, first.tied, first.output)
    assert set(map(str, again.symbols.values())) == set(map(str, first.symbols.values()))


def test_the_key_follows_what_the_graph_depends_on():
    pre = get_preset("llama3-tiny")
    model, inputs = pre.build(), pre.example_inputs(batch=2, seq=16)
    k = capture_cache.key(model, inputs, None, torch.float32)
    assert capture_cache.key(model, inputs, None, torch.float32) == k  # deterministic
    assert capture_cache.key(model, pre.example_inputs(batch=2, seq=16), None, torch.float32) == k  # values don't
    assert capture_cache.key(model, inputs, None, torch.bfloat16) != k
    assert capture_cache.key(model, (inputs[0][:, :8], inputs[1][:, :8]), None, torch.float32) != k
    model.layers[0].attention.n_heads = 4  # a plain attribute the forward reads
    assert capture_cache.key(model, inputs, None, torch.float32) != k
    model.layers[0].attention.n_heads = 8
    model.train(not model.training)
    assert capture_cache.key(model, inputs, None, torch.float32) != k  # dropout, batch norm: another graph
    other = dataclasses.replace(pre.config, ffn_hidden=pre.config.ffn_hidden * 2)
    from mcompile.models.llama import Llama

    assert capture_cache.key(Llama(other), inputs, None, torch.float32) != k


def test_a_corrupt_entry_is_captured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("MCOMPILE_CACHE", str(tmp_path))
    pre = get_preset("llama3-tiny")
    model, inputs = pre.build(), pre.example_inputs(batch=2, seq=16)
    capture(model, inputs, meta_dtype=torch.float32, cache=True)
    (entry,) = (tmp_path / "captures").glob("*.pt2")
    entry.write_bytes(b"not a program")
    cap = capture(model, inputs, meta_dtype=torch.float32, cache=True)
    assert cap.packed is not None and entry.read_bytes() == cap.packed


def test_off_means_off(tmp_path, monkeypatch):
    monkeypatch.setenv("MCOMPILE_CACHE", "off")
    pre = get_preset("llama3-tiny")
    cap = capture(pre.build(), pre.example_inputs(batch=2, seq=16), meta_dtype=torch.float32, cache=True)
    assert cap.packed is not None and capture_cache.load(capture_cache.key(pre.build(), (), None, None)) is None


def test_parallelize_captures_on_rank_0_only_and_reuses_the_cache(tmp_path):
    """4 ranks: the first parallelize runs torch.export once, on rank 0 (the others plan from its
    broadcast program); the second runs it nowhere (rank 0 reads the cache). Both train alike."""
    from cache_cases import parallelize_counting_exports

    from conftest import pool

    first = pool(4).run(parallelize_counting_exports, str(tmp_path))
    again = pool(4).run(parallelize_counting_exports, str(tmp_path))
    assert [c for c, _, _ in first] == [1, 0, 0, 0]
    assert [c for c, _, _ in again] == [0, 0, 0, 0]
    assert len({loss for _, loss, _ in first + again}) == 1


def test_unpacking_the_same_bytes_again_is_a_fresh_copy_of_the_program():
    """capture_cache.unpack keeps each program it deserialised (a warm parallelize's costliest step) and hands out
    deep copies: equal graphs, no shared nodes, an edit to one copy is not in the next; once anything is added to
    the ShapeEnv the copies share (a guard), the bytes are loaded afresh, with a ShapeEnv of their own."""
    pre = get_preset("llama3-tiny")
    model, inputs = pre.build(), pre.example_inputs(batch=2, seq=16)
    data = capture(model, inputs, meta_dtype=torch.float32, pack="bytes")
    capture_cache._UNPACKED.clear()
    loads = []
    load = torch.export.load

    def counted(*a, **k):
        loads.append(1)
        return load(*a, **k)

    torch.export.load = counted
    try:
        a, *rest_a = capture_cache.unpack(data)
        b, *rest_b = capture_cache.unpack(data)
        assert len(loads) == 1 and rest_a == rest_b
        assert _structure(a.graph_module) == _structure(b.graph_module)
        assert not {id(n) for n in a.graph.nodes} & {id(n) for n in b.graph.nodes}
        victim = next(n for n in a.graph.nodes if n.op == "call_function")
        victim.meta["edited"] = True
        c, *_ = capture_cache.unpack(data)
        assert len(loads) == 1 and not any(n.meta.get("edited") for n in c.graph.nodes)
        env = capture_cache._shape_env_of(c)
        sym = next(iter(env.var_to_range))
        env.guards.append(env.guards[0] if env.guards else object())  # anything added since the load
        d, *_ = capture_cache.unpack(data)
        assert len(loads) == 2 and capture_cache._shape_env_of(d) is not env
        assert _structure(d.graph_module) == _structure(b.graph_module) and sym in capture_cache._shape_env_of(
            d).var_to_range
    finally:
        torch.export.load = load
        capture_cache._UNPACKED.clear()
