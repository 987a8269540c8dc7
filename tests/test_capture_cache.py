"""Capture once (mcompile.capture.cache): across runs through the on-disk cache, across ranks by
broadcasting rank 0's capture."""

from __future__ import annotations

import dataclasses
import io

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


def _helper_package(root, scale: str) -> str:
    """A user's package in ``root``: ``model.py``'s forward calls ``scaled`` from ``ops.py`` (outside the
    model's class file, so outside the cache key); its name, unique to this test."""
    import uuid

    name = f"mc_cache_helpers_{uuid.uuid4().hex[:8]}"
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("")
    (root / name / "ops.py").write_text(f"def scaled(x):\n    return x * {scale}\n")
    (root / name / "model.py").write_text(
        "import torch\n\n"
        f"from {name}.ops import scaled\n\n\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(4, 4)\n\n"
        "    def forward(self, x):\n"
        "        return scaled(self.lin(x)).sum()\n")
    return name


def _import_net(name: str):
    """``Net()`` from the package's current source (its modules imported afresh)."""
    import importlib
    import sys

    for mod in (f"{name}.model", f"{name}.ops", name):
        sys.modules.pop(mod, None)
    importlib.invalidate_caches()
    return importlib.import_module(f"{name}.model").Net()


def _scales(cap) -> set:
    return {a for n in cap.gm.graph.nodes if n.target == torch.ops.aten.mul.Tensor for a in n.args
            if isinstance(a, float | int)}


@pytest.mark.timeout(180)
def test_an_edited_helper_outside_the_models_classes_is_captured_again(tmp_path, monkeypatch, caplog):
    """The key cannot see ``ops.py`` (only the model's class file, ``model.py``); the entry lists the files the
    trace ran, and an entry whose ``ops.py`` changed is a miss: captured again, with the edit, and replaced.
    Unchanged, the next capture is a hit; a file touched but equal is still a hit."""
    import logging
    import sys

    monkeypatch.setenv("MCOMPILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # an edit in the same second: no stale .pyc read
    name = _helper_package(tmp_path, "2.0")
    exports = []
    real = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exports.append(1) or real(*a, **k))
    x = torch.randn(2, 4)
    try:
        first = capture(_import_net(name), (x,), meta_dtype=torch.float32, cache=True)
        (entry,) = (tmp_path / "cache" / "captures").glob("*.pt2")
        listed = capture_cache._info(entry.read_bytes())["sources"]
        assert str(tmp_path / name / "ops.py") in listed and str(tmp_path / name / "model.py") in listed
        assert not any("/torch/" in p for p in listed)  # torch's files: its version is in the key
        per = len(exports)  # torch.export calls of one capture
        assert per >= 1 and _scales(first) == {2.0}
        capture(_import_net(name), (x,), meta_dtype=torch.float32, cache=True)
        assert len(exports) == per  # unchanged: a hit

        ops = tmp_path / name / "ops.py"
        ops.write_text(ops.read_text().replace("2.0", "3.0"))
        with caplog.at_level(logging.INFO, logger="mcompile.capture_cache"):
            edited = capture(_import_net(name), (x,), meta_dtype=torch.float32, cache=True)
        assert len(exports) == 2 * per and _scales(edited) == {3.0}
        assert f"{ops} changed" in caplog.text
        assert list((tmp_path / "cache" / "captures").glob("*.pt2")) == [entry]  # the same key, replaced
        again = capture(_import_net(name), (x,), meta_dtype=torch.float32, cache=True)
        assert len(exports) == 2 * per and _scales(again) == {3.0}

        stat = ops.stat()
        import os

        os.utime(ops, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched, equal bytes: hashed, a hit
        capture(_import_net(name), (x,), meta_dtype=torch.float32, cache=True)
        assert len(exports) == 2 * per
    finally:
        for mod in (f"{name}.model", f"{name}.ops", name):
            sys.modules.pop(mod, None)


def test_a_changed_or_missing_listed_file_makes_an_entry_stale(tmp_path):
    f = tmp_path / "helper.py"
    f.write_text("x = 1\n")
    st = f.stat()
    listed = {str(f): [st.st_size, st.st_mtime_ns, capture_cache._digest(str(f))]}
    assert capture_cache.changed(listed) is None
    f.write_text("x = 22\n")
    assert capture_cache.changed(listed) == f"{f} changed"
    f.unlink()
    assert capture_cache.changed(listed) == f"{f} is gone"
    assert "older mcompile" in capture_cache.changed(None)


@pytest.mark.timeout(180)
def test_an_entry_from_before_the_source_list_is_captured_again(tmp_path, monkeypatch):
    """An entry written without ``sources`` (mcompile's format 3, or any writer that did not list them) could be
    stale in a way no one can tell now: it is a miss, captured again and replaced by one that lists them."""
    import json
    import sys
    import zipfile

    monkeypatch.setenv("MCOMPILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path))
    name = _helper_package(tmp_path, "2.0")
    try:
        model, x = _import_net(name), torch.randn(2, 4)
        capture(model, (x,), meta_dtype=torch.float32, cache=True)
        (entry,) = (tmp_path / "cache" / "captures").glob("*.pt2")
        new, old = zipfile.ZipFile(io.BytesIO(entry.read_bytes())), io.BytesIO()
        with zipfile.ZipFile(old, "w") as z:
            for item in new.infolist():
                body = new.read(item)
                if item.filename.endswith("extra/mcompile.json"):
                    body = json.dumps({k: v for k, v in json.loads(body).items() if k != "sources"}).encode()
                z.writestr(item, body)
        entry.write_bytes(old.getvalue())
        capture_cache.unpack(old.getvalue())  # a program that would load: served, were it not for the check
        k = entry.stem
        assert capture_cache.load(k) is None
        exports = []
        real = torch.export.export
        monkeypatch.setattr(torch.export, "export", lambda *a, **kw: exports.append(1) or real(*a, **kw))
        capture(model, (x,), meta_dtype=torch.float32, cache=True)
        assert exports and "sources" in capture_cache._info(entry.read_bytes())
        assert capture_cache.load(k) is not None
    finally:
        for mod in (f"{name}.model", f"{name}.ops", name):
            sys.modules.pop(mod, None)
