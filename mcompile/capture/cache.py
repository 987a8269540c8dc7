"""Capture once: a cache of exported programs keyed by what the capture depends on (issue 18).

torch.export is most of ``parallelize``'s start-up (~2–5 s for a tiny model, per rank). Two things
remove it:

- **Across ranks** (:func:`share`): rank 0 captures, serialises the exported program
  (``torch.export.save``; captured on the meta device, so no weights are in it) and broadcasts the
  bytes; every rank, rank 0 included, plans from the same deserialised graph. The plan digest check
  in ``parallelize`` still proves the ranks agree.
- **Across runs** (:func:`load` / :func:`store`): the bytes are kept in ``$MCOMPILE_CACHE`` (default
  ``~/.cache/mcompile/captures``) under a key (:func:`key`) of everything the traced graph depends on:
  the source files of every module class in the model, each module's plain attributes and training
  flag, the names, shapes and dtypes of parameters and buffers, the example inputs' shapes and dtypes
  (values of non-tensor inputs), the capture dtype, and the torch / transformers / mcompile versions.
  Code the model calls outside its classes' files (a helper in another package) is not in the key:
  ``MCOMPILE_CACHE=off`` (or ``Config(capture_cache=False)``) disables the cache.

A corrupt or unreadable entry is ignored and replaced.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import logging
import os
import sys
from pathlib import Path

import torch

__all__ = ["key", "load", "store", "pack", "unpack", "cache_dir", "enabled"]

log = logging.getLogger("mcompile.capture_cache")
_FORMAT = "3"  # 3: the symbols export found equal (same_sizes)
_SOURCES: dict[type, str] = {}
_FILES: dict[str | None, str] = {}


def enabled() -> bool:
    return os.environ.get("MCOMPILE_CACHE", "").lower() not in ("off", "0", "false", "no")


def cache_dir() -> Path:
    env = os.environ.get("MCOMPILE_CACHE", "")
    base = Path(env) if env and enabled() and env not in ("on", "1", "true", "yes") else \
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mcompile"
    return base / "captures"


def _class_source(cls: type) -> str:
    """A digest of the source file defining ``cls`` (its module's file; memoised per file)."""
    if cls not in _SOURCES:
        path = getattr(sys.modules.get(cls.__module__), "__file__", None)
        if path is None:
            try:
                path = inspect.getsourcefile(cls)
            except TypeError:
                path = None
        if path not in _FILES:
            try:
                _FILES[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else ""
            except OSError:
                _FILES[path] = ""
        _SOURCES[cls] = _FILES[path] or f"{cls.__module__}.{cls.__qualname__}"
    return _SOURCES[cls]


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"T{tuple(x.shape)}:{x.dtype}"
    if isinstance(x, list | tuple):
        return f"{type(x).__name__}[{','.join(_describe(v) for v in x)}]"
    if isinstance(x, dict):
        return "{" + ",".join(f"{k}={_describe(v)}" for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))) + "}"
    return repr(x)


def key(model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict | None, meta_dtype,
        extra: str = "") -> str:
    """The cache key of capturing ``model`` with these example inputs (module docstring)."""
    import mcompile

    h = hashlib.sha256()
    versions = [torch.__version__, getattr(mcompile, "__version__", ""), _FORMAT]
    try:
        import transformers

        versions.append(transformers.__version__)
    except ImportError:
        pass
    h.update(repr(versions).encode())
    for code in ("export.py", "autograd_fn.py", "loops.py", "checks.py", "values.py"):  # the capture's code
        h.update(hashlib.sha256((Path(__file__).parent / code).read_bytes()).digest())
    for name, mod in model.named_modules(remove_duplicate=False):
        attrs = sorted((k, repr(v)) for k, v in vars(mod).items()
                       if not k.startswith("_") and isinstance(v, bool | int | float | str | type(None) | tuple
                                                              | list | dict | torch.dtype | torch.device))
        h.update(f"{name}|{type(mod).__module__}.{type(mod).__qualname__}|{_class_source(type(mod))}|"
                 f"{mod.training}|{attrs}".encode())
        for kind in ("_parameters", "_buffers"):
            for k, t in getattr(mod, kind).items():
                h.update(f"{kind}{k}:{None if t is None else (tuple(t.shape), t.dtype, t.requires_grad)}".encode())
    h.update(_describe(tuple(example_inputs)).encode())
    h.update(_describe(dict(example_kwargs or {})).encode())
    h.update(f"{meta_dtype}|{extra}".encode())
    return h.hexdigest()[:32]


def pack(ep: torch.export.ExportedProgram, output: str, prints: bool, aliases: dict) -> bytes:
    """An exported program (as export returned it: before mcompile.capture.export edits its graph) and what
    the capture learned about it (what the output is, whether forward prints, which outputs share
    storage with an input: serialisation loses that; which custom autograd.Functions its ``mcompile_fn``
    ops run: a process that loads it defines them first), as bytes."""
    from mcompile.capture import autograd_fn

    buf = io.BytesIO()
    info = {"output": output, "prints": prints, "aliases": aliases, "functions": autograd_fn.manifest(ep),
            "same_sizes": _symbol_replacements(ep)}
    torch.export.save(ep, buf, extra_files={"mcompile.json": json.dumps(info)})
    return buf.getvalue()


# Deserialising an exported program is most of a warm parallelize's capture step (torch.export.load parses every
# symbolic size with sympy: ~0.4 s for llama3-tiny, ~0.8 s for a tiny HF Llama, on every rank). A process that
# parallelizes the same model again (a test session's worker pools, a trainer's eval, generate) unpacks it once:
# the pristine program is kept per content hash and each caller gets a deep copy (graph, nodes and their meta are
# copied; the fake tensors in node.meta["val"] and their ShapeEnv are shared, never written by the passes). A copy
# is handed out only while that ShapeEnv has no guard, replacement or range added since the load; otherwise the
# bytes are loaded afresh, as without the memo.
_UNPACKED: dict[str, tuple] = {}
_UNPACKED_MAX = 8


def _shape_env_of(ep: torch.export.ExportedProgram):
    for n in ep.graph.nodes:
        mode = getattr(n.meta.get("val"), "fake_mode", None)
        if mode is not None:
            return mode.shape_env
    return None


def _shape_env_state(env) -> tuple:
    if env is None:
        return ()
    return (len(env.guards), tuple(sorted((str(k), str(v)) for k, v in env.replacements.items())),
            tuple(sorted((str(k), str(v)) for k, v in env.var_to_range.items())))


def _symbol_replacements(ep: torch.export.ExportedProgram) -> dict[str, str]:
    """{symbol: symbol} export found equal (two inputs' batch dims, say): the ShapeEnv's replacements of one
    size symbol by another. torch 2.11's serialisation keeps the replaced symbol in an input's size (a capture
    on the meta device: ``tokens`` of sizes (s95, s75), ``targets`` (s24, s13)) without the replacement, so the
    loaded program had two unrelated batch symbols; the batch found on one input was not the one the sizes
    of the rest use (pipeline partitioning: sizes it could not evaluate)."""
    env = _shape_env_of(ep)
    if env is None:
        return {}
    return {str(k): str(v) for k, v in env.replacements.items() if k.is_Symbol and v.is_Symbol and k != v}


def _restore_replacements(ep: torch.export.ExportedProgram, same: dict[str, str]) -> None:
    env = _shape_env_of(ep)
    if env is None or not same:
        return
    import sympy

    from mcompile.ir.compat import size_hints

    known = {str(s): s for s in size_hints(env) if isinstance(s, sympy.Symbol)}
    for a, b in same.items():
        if a in known and b in known and env.replacements.get(known[a], known[a]) != known[b]:
            env._set_replacement(known[a], known[b], "mcompile.capture.cache: equal in the exported program")


def unpack(data: bytes) -> tuple[torch.export.ExportedProgram, str, bool, dict]:
    import copy

    digest = hashlib.sha256(data).hexdigest()
    kept = _UNPACKED.get(digest)
    if kept is not None and _shape_env_state(_shape_env_of(kept[0])) != kept[4]:
        kept = None  # something added to the shared ShapeEnv: no longer the program as loaded
    if kept is None:
        _define_functions(data)
        extra = {"mcompile.json": ""}
        ep = torch.export.load(io.BytesIO(data), extra_files=extra)
        info = json.loads(extra["mcompile.json"] or "{}")
        _restore_replacements(ep, info.get("same_sizes", {}))
        kept = (ep, info.get("output", ""), bool(info.get("prints")), info.get("aliases", {}),
                _shape_env_state(_shape_env_of(ep)))
        _UNPACKED.pop(digest, None)
        _UNPACKED[digest] = kept
        while len(_UNPACKED) > _UNPACKED_MAX:
            _UNPACKED.pop(next(iter(_UNPACKED)))
    ep, output, prints, aliases, _ = kept
    try:
        ep = copy.deepcopy(ep)
    except RuntimeError:  # a constant that is no graph leaf (seen: MoE programs' lifted tensors): not kept, the
        _UNPACKED.pop(digest, None)  # caller takes the loaded program itself (the next unpack loads again)
    return ep, output, prints, copy.deepcopy(aliases)


def functions(data: bytes) -> list[dict]:
    """The custom autograd.Functions (``mcompile_fn`` ops) a packed program runs, read from the archive's
    extra file directly (before torch.export.load, which resolves ops by name)."""
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            name = next((n for n in z.namelist() if n.endswith("extra/mcompile.json")), None)
            info = json.loads(z.read(name) or b"{}") if name else {}
    except (zipfile.BadZipFile, ValueError):
        return []  # torch.export.load reports an unreadable archive itself
    return info.get("functions", [])


def _define_functions(data: bytes) -> None:
    from mcompile.capture import autograd_fn

    autograd_fn.ensure(functions(data))


def load(k: str) -> bytes | None:
    """The stored bytes of key ``k``, or None (absent, disabled or unreadable)."""
    if not enabled():
        return None
    path = cache_dir() / f"{k}.pt2"
    try:
        return path.read_bytes()
    except OSError:
        return None


def store(k: str, data: bytes) -> None:
    """Keep ``data`` under key ``k`` (atomically: a reader never sees half a file); failures to write
    (a read-only home) are logged, not raised."""
    if not enabled():
        return
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{k}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        tmp.replace(d / f"{k}.pt2")
    except OSError as e:
        log.info("capture cache not written (%s)", e)
