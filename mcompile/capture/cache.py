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

Code the model calls outside its classes' files (``rms(x)`` in ``mypkg/ops.py``, called from
``mypkg/model.py``'s forward) cannot be in the key: the key is computed before anything runs. Each entry
therefore lists the source files the trace ran (``sources``: path -> size, mtime, blake2b of the bytes),
and :func:`load` treats an entry whose files changed (or are gone) as a miss; the caller captures again
and overwrites it. The files are those on the Python stack whenever torch.fx created a node during the
export (:class:`recording`: the graph's own ``stack_trace`` keeps only ``forward`` frames, so it names
``model.py`` but not the ``ops.py`` that made the node), plus those the stored graph's stack traces name,
less torch's own package and the standard library (the torch version is in the key; the Python version
does not change a graph); transformers' files are listed (an upgrade changes them). A tiny Hugging Face
Llama lists 17 files, 0.85 MB (transformers' modeling, masking, cache and utility files, the kernels
hub's layer wrapper, mcompile's capture, the wrapper class); GPT-2 16. Checking them is a stat each
(0.13–0.19 ms for the 17); a file is read and hashed (blake2b) only when its size or mtime differ from
the entry's, so a touched but equal file (a ``git checkout``) still hits (hashed at each lookup,
until the entry is rewritten). Hashing all 17 every time
would cost 4.5–6 ms (2 busy CPU cores); an edit that keeps both size and mtime needs a tool that sets
the mtime back (``rsync -t``), since the capture takes longer than a timestamp tick. Recording costs
a stack walk per node: ~30 ms of a 5 s capture. Not seen: code that ran during the trace but was on no
stack when a node was made (a helper that returns a Python number the forward then uses), and a file
edited after its module was imported but before the capture, in the same process;
``MCOMPILE_CACHE=off`` (or ``Config(capture_cache=False)``) disables the cache.

A corrupt or unreadable entry is ignored and replaced.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import io
import json
import logging
import os
import re
import site
import sys
import sysconfig
import threading
from pathlib import Path

import torch
import torch.fx

from mcompile.ir.patches import Patches

__all__ = ["key", "load", "store", "pack", "unpack", "cache_dir", "enabled", "recording", "sources", "changed"]

log = logging.getLogger("mcompile.capture_cache")
_FORMAT = "4"  # 3: the symbols export found equal (same_sizes); 4: the source files the trace ran (sources)
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


_THREAD = threading.local()
_CREATE_NODE = torch.fx.proxy.TracerBase.create_node


def _create_node_recorded(self, *args, **kwargs):
    files, outside = getattr(_THREAD, "recording", (None, None))
    if files is not None:  # every frame between the capture's call and this node's creation
        f = sys._getframe(1)
        while f is not None and f is not outside:
            files.add(f.f_code.co_filename)
            f = f.f_back
    return _CREATE_NODE(self, *args, **kwargs)


_PATCHES = Patches((torch.fx.proxy.TracerBase, "create_node", _create_node_recorded))  # while any recording runs


class recording:  # noqa: N801 - used as a context manager, like contextlib's
    """``with recording() as files:`` collects in ``files`` the source file of every Python frame on this
    thread's stack, below the ``with``, whenever torch.fx creates a node: the code a trace ran that made the
    graph (the user's helpers included, which the node's own ``stack_trace`` leaves out: torch keeps only
    ``forward`` frames there). Costs a walk of the stack per node (~30 ms of a tiny HF Llama's 5 s capture)."""

    def __enter__(self) -> set[str]:
        self._outside, self._before = sys._getframe(1), getattr(_THREAD, "recording", (None, None))
        self._held = _PATCHES.held()
        self._held.__enter__()
        self.files: set[str] = set()
        _THREAD.recording = (self.files, self._outside)
        return self.files

    def __exit__(self, *exc) -> None:
        _THREAD.recording = self._before
        self._outside = None  # no frame kept alive past the capture
        self._held.__exit__(*exc)


_TRACE_FILE = re.compile(r'File "([^"]+)", line \d+')


@functools.cache
def _dirs() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(torch's package: its version is in the key; site-packages; the standard library, which may hold them)."""
    paths = sysconfig.get_paths()
    sites = {paths.get("purelib"), paths.get("platlib"), *site.getsitepackages(), site.getusersitepackages()}
    stdlib = {paths.get("stdlib"), paths.get("platstdlib")}
    under = lambda ds: tuple(os.path.join(os.path.abspath(d), "") for d in ds if d)  # noqa: E731
    return under([os.path.dirname(torch.__file__)]), under(sites), under(stdlib)


def _listed(path: str) -> bool:
    """Whether an entry lists ``path``: not torch's own files, nor the standard library's (the Python version
    does not change a graph)."""
    torch_dir, sites, stdlib = _dirs()
    if not os.path.isabs(path) or path.startswith(torch_dir):
        return False
    return path.startswith(sites) or not path.startswith(stdlib)


def _digest(path: str) -> str:
    return hashlib.blake2b(Path(path).read_bytes(), digest_size=16).hexdigest()


def sources(ep: torch.export.ExportedProgram, ran=()) -> dict[str, list]:
    """{path: [size, mtime_ns, blake2b]} of the source files ``ran`` (from :class:`recording`) and those the
    stack traces of ``ep``'s nodes name, less torch, the standard library and names that are no file
    (``<string>``, torch's relative ``torch/fx/passes/...``)."""
    named = set(ran)
    for gm in ep.graph_module.modules():
        if isinstance(gm, torch.fx.GraphModule):
            for n in gm.graph.nodes:
                named.update(_TRACE_FILE.findall(n.meta.get("stack_trace") or ""))
    out = {}
    for path in sorted(filter(_listed, named)):
        try:
            st = os.stat(path)
            out[path] = [st.st_size, st.st_mtime_ns, _digest(path)]
        except OSError:
            continue  # not a file (<frozen ...>, <eval_with_key>)
    return out


def changed(listed: dict[str, list] | None) -> str | None:
    """What makes an entry's ``sources`` stale (a file changed or gone; no list at all), or None.
    A file whose size and mtime are the entry's is taken as unchanged without reading it (an edit keeps
    both only within the filesystem's timestamp tick); otherwise its bytes are hashed."""
    if listed is None:
        return "the entry lists no source files (an older mcompile wrote it)"
    for path, (size, mtime_ns, digest) in listed.items():
        try:
            st = os.stat(path)
            if (st.st_size, st.st_mtime_ns) == (size, mtime_ns) or _digest(path) == digest:
                continue
        except OSError:
            return f"{path} is gone"
        return f"{path} changed"
    return None


def pack(ep: torch.export.ExportedProgram, output: str, prints: bool, aliases: dict, ran=()) -> bytes:
    """An exported program (as export returned it: before mcompile.capture.export edits its graph) and what
    the capture learned about it (what the output is, whether forward prints, which outputs share
    storage with an input: serialisation loses that; which custom autograd.Functions its ``mcompile_fn``
    ops run: a process that loads it defines them first; the source files it ran, :func:`sources` of
    ``ep`` and ``ran``: :func:`load` checks them), as bytes."""
    from mcompile.capture import autograd_fn

    buf = io.BytesIO()
    info = {"output": output, "prints": prints, "aliases": aliases, "functions": autograd_fn.manifest(ep),
            "same_sizes": _symbol_replacements(ep), "sources": sources(ep, ran)}
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


def _info(data: bytes) -> dict | None:
    """What :func:`pack` recorded beside the program, read from the archive's extra file directly (without
    torch.export.load); None for bytes that are no archive."""
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            name = next((n for n in z.namelist() if n.endswith("extra/mcompile.json")), None)
            return json.loads(z.read(name) or b"{}") if name else {}
    except (zipfile.BadZipFile, ValueError):
        return None


def functions(data: bytes) -> list[dict]:
    """The custom autograd.Functions (``mcompile_fn`` ops) a packed program runs, read from the archive's
    extra file directly (before torch.export.load, which resolves ops by name)."""
    return (_info(data) or {}).get("functions", [])  # torch.export.load reports an unreadable archive itself


def _define_functions(data: bytes) -> None:
    from mcompile.capture import autograd_fn

    autograd_fn.ensure(functions(data))


def load(k: str) -> bytes | None:
    """The stored bytes of key ``k``, or None (absent, disabled or unreadable, or a source file it lists
    changed: :func:`changed`; the caller captures again and :func:`store` replaces it)."""
    if not enabled():
        return None
    path = cache_dir() / f"{k}.pt2"
    try:
        data = path.read_bytes()
    except OSError:
        return None
    info = _info(data)
    try:
        why = "unreadable" if info is None else changed(info.get("sources"))
    except (TypeError, ValueError, AttributeError):  # a source list of another shape
        why = "unreadable source list"
    if why is not None:
        log.info("capture cache entry %s not used (%s): capturing again", k, why)
        return None
    return data


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
