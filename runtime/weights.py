"""Load a checkpoint straight into each rank's pieces: ``parallelize(model, mesh, ..., weights=PATH)``.

With a model built on the meta device, no rank ever holds the model whole: every rank reads, one
tensor at a time, the piece of each parameter it holds (``plan.params[fqn].local_piece``), converts
it to the parameter dtype (fp32; bf16/fp16 -> fp32 is exact) and drops everything else.

``PATH`` is one of

- a Hugging Face checkpoint folder (``save_pretrained``): ``model.safetensors``, or shards listed by
  ``model.safetensors.index.json`` (any single ``*.safetensors.index.json`` / ``*.safetensors`` in the
  folder is taken too);
- a single ``.safetensors`` file;
- a source object with the interface of this module's (``entries``, ``read``, ``sliceable``, ``what``,
  ``path``): :func:`mcompile.apps.hf_io.hf_source` reads a Hugging Face Llama / GPT-2 checkpoint under a
  preset's names and layouts (renamed; GPT-2's Conv1D weights transposed, slices too);
- an mcompile checkpoint folder (``pm.save_checkpoint``: torch.distributed.checkpoint shards and
  ``mcompile_plan.json``): its model parameters and persistent buffers, under any plan (the mesh it was
  saved under need not be this one); its optimizer and FP8 state are not weights and are not read.

Design (and why):

- **Check everything, then read.** The format, every file the index names, every header (safetensors
  checks that its offsets cover the file) or the DCP metadata (every data file present and long
  enough), every key and every shape are checked before any value is read, on every rank (all ranks
  check every tensor, also those of other pipeline stages), and the failures of all ranks are gathered
  (``all_gather_object``) so that every rank raises the same :class:`WeightsError` — a rank that raised
  alone would leave the others waiting in a collective. A read that still fails (an I/O error) is
  gathered the same way. Nothing is half-loaded: ``parallelize`` returns nothing, and the user's model
  is never written to (its meta tensors stay meta).
- **Slices where the format allows.** A parameter whose placements shard each dim over at most one
  mesh axis with a plain contiguous ``Shard(dim)`` is read as exactly its rank's slice
  (``safe_open(...).get_slice(name)[...]``; an mcompile checkpoint: DCP reads that box's overlap
  with each saved chunk: only those bytes are read); a vocabulary padded to a
  multiple of tp (``ParamPlan.padded_shape``) is read up to the true size and zero-padded, as
  ``local_piece`` pads. Anything else — a ``BlockShard`` (k blocks each sharded: a fused QKV, strided
  in the file), a replicated tensor, every tensor of a format-1 mcompile checkpoint with BlockShard
  blocks — is read whole, cut with ``local_piece`` in the stored dtype, converted
  and dropped before the next: a rank holds at most one full tensor at a time besides its pieces.
  safetensors returns views of the memory-mapped file: each piece is copied into memory of its own
  and the file is closed before the next tensor, so no mapping outlives its tensor.
- **Keys.** The checkpoint's keys are the model's ``state_dict()`` keys. A tied weight is found under
  any of its names (HF omits ``lm_head.weight`` when it is tied to the embedding). A model wrapped in
  a module that prefixes every key (``mcompile.models.hf.CausalLMLoss``'s ``m.``, the guide's
  ``WithLoss``) matches a checkpoint of the bare model, and a bare model its wrapper's checkpoint: of the
  prefixes common to every model key (and none), stripped, or common to every checkpoint key, added, the
  one that finds the most parameters is used. Checkpoint keys the model does not
  have are ignored and listed in one warning (rank 0, logger ``mcompile.weights``). Buffers the
  checkpoint lacks (Llama's non-persistent rotary ``inv_freq``) keep the model's values, or are
  initialised as a meta model's are (:mod:`mcompile.runtime.init`).
- **A model with values.** Given ``weights=``, the checkpoint's values replace the model's (nothing is
  broadcast from rank 0).
- **Dtypes.** A floating parameter needs a floating tensor (and an integer one an integer tensor);
  FP8 checkpoints store scales beside their weights that a plain cast would ignore, so they are refused.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

__all__ = ["WeightsError", "open_weights", "check_path", "load"]

log = logging.getLogger("mcompile.weights")

EXPECTED = ("a Hugging Face checkpoint folder (model.safetensors, or model.safetensors.index.json and its "
            "shards), a single .safetensors file, or an mcompile checkpoint folder (mcompile_plan.json and "
            "torch.distributed.checkpoint shards, written by pm.save_checkpoint)")
_LIST = 8  # names listed in an error before "... and N more"

_ST_FLOAT = {"F16", "BF16", "F32", "F64"}
_ST_INT = {"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64"}


class WeightsError(ValueError):
    """``weights=`` cannot be loaded into this model (raised on every rank, before any value is read)."""


@dataclass
class Stored:
    """One tensor of a checkpoint, as its header / metadata describes it."""

    key: str
    shape: tuple[int, ...]
    dtype: str  # as the format names it: "BF16" (safetensors), "torch.bfloat16" (DCP)
    kind: str  # "float", "int" or "other" (FP8, complex: refused for parameters)
    where: object = None  # safetensors: the file; DCP: (the DCP keys, the dim its blocks are joined on)
    padded_ok: bool = False  # DCP stores a padded vocabulary padded: one dim may be longer


def _fmt_names(names: list[str]) -> str:
    more = f", ... and {len(names) - _LIST} more" if len(names) > _LIST else ""
    return ", ".join(names[:_LIST]) + more


# -- formats --------------------------------------------------------------------------------------
@dataclass
class _Safetensors:
    path: Path
    entries: dict[str, Stored]
    sliceable: bool = True
    files: int = 1

    @property
    def what(self) -> str:
        return f"safetensors, {self.files} file{'s' if self.files > 1 else ''}"

    @classmethod
    def open(cls, path: Path, index: Path | None) -> _Safetensors:
        from safetensors import safe_open

        if index is not None:
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not a mapping")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise WeightsError(f"weights={path}: {index.name} is not a safetensors index ({e}); expected "
                                   "{\"weight_map\": {tensor name: shard file}} as save_pretrained writes it") from e
            by_file: dict[str, list[str]] = {}
            for key, name in weight_map.items():
                by_file.setdefault(name, []).append(key)
            root = index.parent
        else:
            by_file, root = {path.name: None}, path.parent
        missing_files = [f for f in by_file if not (root / f).is_file()]
        if missing_files:
            raise WeightsError(f"weights={path}: {len(missing_files)} shard file(s) named by {index.name} are not "
                               f"in {root}: {_fmt_names(sorted(missing_files))}")
        entries = {}
        for name, keys in by_file.items():
            file = root / name
            try:
                with safe_open(str(file), framework="pt") as f:
                    have = set(f.keys())
                    absent = [k for k in keys or () if k not in have]
                    if absent:
                        raise WeightsError(f"weights={path}: {index.name} puts {len(absent)} tensor(s) in {name}, "
                                           f"whose header does not have them: {_fmt_names(absent)}")
                    for key in (keys if keys is not None else sorted(have)):
                        sl = f.get_slice(key)
                        dt = sl.get_dtype()
                        kind = "float" if dt in _ST_FLOAT else "int" if dt in _ST_INT else "other"
                        entries[key] = Stored(key, tuple(sl.get_shape()), dt, kind, where=file)
            except WeightsError:
                raise
            except Exception as e:  # noqa: BLE001 - safetensors' own error, named
                raise WeightsError(f"weights={path}: {file} is not a readable safetensors file ({e}); expected "
                                   f"{EXPECTED}") from e
        return cls(path, entries, files=len(by_file))

    def read(self, stored: Stored, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor (``index``: that slice of it) in the stored dtype — a view of the mapped file:
        copy what you keep; the file is closed here (the mapping lives as long as the view)."""
        from safetensors import safe_open

        with safe_open(str(stored.where), framework="pt") as f:
            if index is None:
                return f.get_tensor(stored.key)
            return f.get_slice(stored.key)[index]


@dataclass
class _Mcompile:
    path: Path
    entries: dict[str, Stored]
    sliceable: bool = False
    what: str = "mcompile checkpoint"

    @classmethod
    def open(cls, path: Path) -> _Mcompile:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        try:
            json.loads((path / "mcompile_plan.json").read_text())
            md = FileSystemReader(str(path)).read_metadata()
        except Exception as e:  # noqa: BLE001 - named below
            raise WeightsError(f"weights={path}: an mcompile checkpoint folder whose mcompile_plan.json or "
                               f"torch.distributed.checkpoint metadata (.metadata) cannot be read ({e}); "
                               f"expected {EXPECTED}") from e
        tensors = {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        entries: dict[str, Stored] = {}
        blocks: dict[str, dict[int, str]] = {}
        for dkey, tmd in tensors.items():
            head, _, rest = dkey.partition(".")
            if head not in ("model", "buffers"):
                continue  # optimizer / FP8 state: not weights
            base, _, last = rest.rpartition(".")
            if head == "model" and last.startswith("block") and last[5:].isdigit() and f"model.{base}" not in tensors:
                blocks.setdefault(base, {})[int(last[5:])] = dkey  # a BlockShard parameter, saved as k blocks
                continue
            entries[rest] = Stored(rest, tuple(tmd.size), str(tmd.properties.dtype), _torch_kind(tmd.properties.dtype),
                                   where=([dkey], None), padded_ok=head == "model")
        for base, parts in blocks.items():
            keys = [parts[j] for j in sorted(parts)]
            if sorted(parts) != list(range(len(parts))):
                raise WeightsError(f"weights={path}: the blocks of {base} saved are {sorted(parts)}, not 0..k-1")
            first = tensors[keys[0]]
            # the blocks are joined on the dim the model's shape says (checked in _match); shape: k blocks
            entries[base] = Stored(base, tuple(first.size), str(first.properties.dtype),
                                   _torch_kind(first.properties.dtype), where=(keys, len(keys)))
        from mcompile.runtime.checkpoint import short_data

        short = short_data(path, md, {d for e in entries.values() for d in e.where[0]})  # every data file read
        if short:
            raise WeightsError(f"weights={path}: {short}: the checkpoint is incomplete")
        # format 2 stores every tensor unpadded and whole-keyed: any box of it can be read alone; format 1's
        # BlockShard parameters are k block tensors, read whole
        return cls(path, entries, sliceable=not blocks)

    def read(self, stored: Stored, index=None, block_dim: int | None = None) -> torch.Tensor:
        """The tensor, or (``index``: a box of slices, sliceable checkpoints) exactly that box of it:
        DCP reads the overlap of the box with each saved chunk and nothing else."""
        import warnings

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        from mcompile.runtime.checkpoint import _LoadPlanner, _Pieces

        keys, k = stored.where
        dtype = _torch_dtype(stored.dtype)
        if k is None and index is not None:
            starts, sizes = [i.start for i in index], [i.stop - i.start for i in index]
            full = torch.empty(sizes, dtype=dtype)
            state = {keys[0]: _Pieces(stored.shape, [(starts, sizes, full)])}
        elif k is None:
            full = torch.empty(stored.shape, dtype=dtype)
            state = {keys[0]: full}
        else:  # the blocks of a BlockShard parameter (format 1), read into views of the joined tensor
            shape = list(stored.shape)
            shape[block_dim] *= k
            full = torch.empty(shape, dtype=dtype)
            state = dict(zip(keys, full.chunk(k, dim=block_dim)))
        # no_dist: each rank reads alone (no collective), in place into ``state``'s tensors
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=FileSystemReader(str(self.path)), planner=_LoadPlanner(), no_dist=True)
        return full


def _torch_kind(dtype: torch.dtype) -> str:
    if dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return "float"
    if not dtype.is_floating_point and not dtype.is_complex:
        return "int"
    return "other"


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def open_weights(path) -> _Safetensors | _Mcompile:
    """The checkpoint at ``path``, its headers / metadata read and checked (no value read). A source
    already open — an object with this module's source interface (``entries``, ``read``, ``sliceable``,
    ``what``, ``path``), such as :func:`mcompile.apps.hf_io.hf_source`'s — is taken as it is."""
    if hasattr(path, "entries") and hasattr(path, "read"):
        return path
    path = Path(os.fspath(path))
    if not path.exists():
        raise WeightsError(f"weights={path}: no such file or folder; expected {EXPECTED}")
    if path.is_file():
        if path.name.endswith(".safetensors.index.json"):
            return _Safetensors.open(path, path)
        return _Safetensors.open(path, None)
    if (path / "mcompile_plan.json").is_file():
        return _Mcompile.open(path)
    if (path / "model.safetensors.index.json").is_file():
        return _Safetensors.open(path, path / "model.safetensors.index.json")
    if (path / "model.safetensors").is_file():
        return _Safetensors.open(path / "model.safetensors", None)
    indexes, files = sorted(path.glob("*.safetensors.index.json")), sorted(path.glob("*.safetensors"))
    if len(indexes) == 1:
        return _Safetensors.open(path, indexes[0])
    if not indexes and len(files) == 1:
        return _Safetensors.open(files[0], None)
    found = sorted(p.name for p in path.iterdir())[:_LIST]
    hint = " (PyTorch .bin / .pt checkpoints are pickles and are not read: save with safetensors)" \
        if any(n.endswith((".bin", ".pt", ".pth")) for n in found) else ""
    raise WeightsError(f"weights={path}: found no checkpoint in this folder (it holds: {', '.join(found) or 'nothing'})"
                       f"{hint}; expected {EXPECTED}")


# -- matching the model's tensors with the checkpoint's -------------------------------------------
@dataclass
class _Match:
    prefix: str  # stripped from the model's keys to find the checkpoint's
    params: dict[str, Stored] = field(default_factory=dict)  # canonical FQN -> its stored tensor
    buffers: dict[str, Stored] = field(default_factory=dict)  # buffer FQN -> its stored tensor (if any)
    block_dims: dict[str, int] = field(default_factory=dict)  # FQN -> the dim DCP blocks are joined on
    extra: list[str] = field(default_factory=list)  # checkpoint keys the model does not have


def _common_prefixes(names: list[str]) -> list[str]:
    parts = [n.split(".")[:-1] for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return [""] + [".".join(common[:i]) + "." for i in range(1, len(common) + 1)]


def _prefix_pair(model_keys: list[str], groups: list[tuple[str, ...]], stored) -> tuple[str, str]:
    """(the prefix stripped from the model's keys, the prefix put before them) under which the checkpoint holds the
    most parameters (``groups``: each parameter's names, tied ones together): a wrapped model reads its bare
    model's checkpoint (``m.``stripped), a bare model its wrapper's (``m.`` added); the shortest pair on a tie."""
    def found(pq):
        p, q = pq
        return sum(any(n.startswith(p) and q + n[len(p):] in stored for n in ns) for ns in groups)

    pairs = [(p, q) for p in _common_prefixes(model_keys) for q in _common_prefixes(list(stored)) if not (p and q)]
    return max(pairs, key=lambda pq: (found(pq), -len(pq[0]) - len(pq[1])))


def check_shapes(path, model: torch.nn.Module) -> None:
    """Every parameter of ``model`` (on meta is enough) in the checkpoint at ``path``, in its shape — the names
    and shapes only, from the headers, in this process (no collective): what ``mcompile train`` checks before it
    starts any process. Raises :class:`WeightsError` naming what is missing or misshapen."""
    src = open_weights(path)
    stored = src.entries
    groups: dict[int, list[str]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(n)
        shapes[n] = tuple(p.shape)
    model_keys = list(model.state_dict().keys())
    prefix, theirs = _prefix_pair(model_keys, [tuple(ns) for ns in groups.values()], stored)
    key = lambda n: theirs + n[len(prefix):]  # noqa: E731
    missing, bad = [], []
    for ns in groups.values():
        hit = next((stored[key(n)] for n in ns if key(n) in stored), None)
        if hit is None:
            missing.append(key(ns[0]))
            continue
        k = hit.where[1] if isinstance(hit.where, tuple) else None
        problem, _ = _shape_problem(ns[0], hit, shapes[ns[0]], k)
        if problem:
            bad.append(problem)
    _raise_problems(src, missing, bad, [], "", "change the model's config to the checkpoint's")


def _raise_problems(src, missing: list[str], shapes: list[str], dtypes: list[str], how: str, fix: str) -> None:
    """One WeightsError naming every missing, misshapen and unconvertible tensor (nothing if there is none)."""
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) of the model are missing from it{how}: {_fmt_names(missing)}")
    if shapes:
        problems.append(f"{len(shapes)} tensor(s) have another shape there than in the model: {_fmt_names(shapes)}")
    if dtypes:
        problems.append(f"{len(dtypes)} tensor(s) have a dtype that cannot be converted: {_fmt_names(dtypes)}")
    if problems:
        raise WeightsError(f"weights={src.path} ({src.what}): " + "; ".join(problems)
                           + f". Pass the checkpoint of this model (the same config), or {fix}")


def _shape_problem(fqn: str, s: Stored, want: tuple[int, ...], k: int | None) -> tuple[str | None, int | None]:
    """(a message if the stored shape cannot hold the model's tensor, the dim DCP blocks join on)."""
    have = tuple(s.shape)
    if k is not None:  # k blocks: joined on the one dim where k * block == the model's
        dims = [d for d in range(len(want)) if len(have) == len(want) and have[d] * k == want[d]
                and all(have[e] == want[e] for e in range(len(want)) if e != d)]
        if dims:
            return None, dims[0]
        return (f"{s.key}: {k} blocks of {list(have)} in the checkpoint, {list(want)} in the model"), None
    if have == want:
        return None, None
    if s.padded_ok and len(have) == len(want) and sum(h != w for h, w in zip(have, want)) == 1 \
            and all(h >= w for h, w in zip(have, want)):
        return None, None  # an mcompile checkpoint's padded vocabulary: the rows past the model's are padding
    return f"{s.key}: {list(have)} in the checkpoint, {list(want)} in the model", None


def _match(src, model: torch.nn.Module, cap, plan) -> _Match:
    """Find every parameter (and the buffers present) in the checkpoint; raise naming everything wrong."""
    params = list(cap.params.values())
    names = {fqn: tuple(cap.tied.get(fqn, (fqn,))) for fqn in params}
    buffer_fqns = list(dict.fromkeys(cap.buffers.values()))
    model_keys = list(model.state_dict().keys()) + [n for n, _ in model.named_buffers()]
    model_keys += [n for ns in names.values() for n in ns]
    stored = src.entries

    prefix, theirs = _prefix_pair(model_keys, list(names.values()), stored)
    m = _Match(prefix)
    key = lambda n: theirs + n[len(prefix):]  # noqa: E731
    missing, shapes, dtypes = [], [], []
    model_tensors = dict(model.named_parameters(remove_duplicate=False))
    model_tensors.update(dict(model.named_buffers(remove_duplicate=False)))
    for fqn in params:
        hit = next((stored[key(n)] for n in names[fqn] if key(n) in stored), None)
        if hit is None:
            missing.append(key(fqn) + (f" (or {', '.join(key(n) for n in names[fqn][1:])})" if len(names[fqn]) > 1
                                       else ""))
            continue
        blocks = hit.where[1] if isinstance(hit.where, tuple) else None
        problem, dim = _shape_problem(fqn, hit, tuple(plan.params[fqn].shape), blocks)
        if problem:
            shapes.append(problem)
            continue
        if dim is not None:
            m.block_dims[fqn] = dim
        want = "float" if model_tensors[fqn].is_floating_point() else "int"
        if hit.kind != want:
            dtypes.append(f"{hit.key}: {hit.dtype} in the checkpoint, {model_tensors[fqn].dtype} in the model"
                          + (" (FP8 weights carry scales that a cast would drop: dequantise the checkpoint first)"
                             if hit.dtype.upper().startswith(("F8", "TORCH.FLOAT8")) else ""))
            continue
        m.params[fqn] = hit
    for fqn in buffer_fqns:
        hit = stored.get(key(fqn))
        if hit is None:
            continue
        problem, _ = _shape_problem(fqn, hit, tuple(model_tensors[fqn].shape), None)
        if problem:
            shapes.append(problem)
        elif hit.kind != ("float" if model_tensors[fqn].is_floating_point() else "int"):
            dtypes.append(f"{hit.key}: {hit.dtype} in the checkpoint, {model_tensors[fqn].dtype} in the model")
        else:
            m.buffers[fqn] = hit
    how = (f" (keys looked up without the model's prefix {prefix!r})" if prefix
           else f" (keys looked up with the checkpoint's prefix {theirs!r})" if theirs else "")
    _raise_problems(src, missing, shapes, dtypes, how, "build the model that matches the checkpoint")
    known = {key(n) for n in model_keys if n.startswith(prefix)}
    m.extra = sorted(k for k in stored if k not in known)
    return m


# -- reading one rank's pieces --------------------------------------------------------------------
def slice_of(pplan, mesh, coords: dict[str, int]):
    """``(index, local_shape)`` of the rank's piece when it is one contiguous box of the unpadded tensor
    (each dim sharded over at most one axis by a plain ``Shard``; a padded dim's box stops at the true
    size, the rest is zeros), else None (read the whole tensor and cut it with ``local_piece``)."""
    shape = tuple(pplan.shape)
    index = [slice(0, s) for s in shape]
    local = list(shape)
    sharded = set()
    for ax, p in zip(mesh.axis_names, pplan.placements):
        if isinstance(p, Replicate):
            continue
        if type(p) is not Shard:  # BlockShard (strided), Partial
            return None
        d = p.dim % len(shape)
        n = pplan.padded_shape[d] if pplan.padded_shape else shape[d]
        if d in sharded or n % mesh.size(ax):
            return None  # local_piece decides (and names the error)
        sharded.add(d)
        step = n // mesh.size(ax)
        lo = coords[ax] * step
        index[d] = slice(min(lo, shape[d]), min(lo + step, shape[d]))
        local[d] = step
    return (tuple(index), tuple(local)) if sharded else None


def _read_piece(src, s: Stored, pplan, mesh, coords, block_dim) -> torch.Tensor:
    """This rank's piece in the stored dtype (may be a view of a mapped file: copy it)."""
    box = slice_of(pplan, mesh, coords) if src.sliceable else None
    if box is None:
        full = src.read(s, None, block_dim) if block_dim is not None else src.read(s, None)
        if tuple(full.shape) != tuple(pplan.shape):  # an mcompile checkpoint's padding: drop it
            for d, (h, w) in enumerate(zip(full.shape, pplan.shape)):
                if h != w:
                    full = full.narrow(d, 0, w)
        return pplan.local_piece(full, mesh, coords)
    index, local = box
    got = tuple(i.stop - i.start for i in index)
    piece = src.read(s, index) if all(got) else torch.empty(got, dtype=_torch_dtype_of(s))
    for d, (g, want) in enumerate(zip(got, local)):
        if g < want:  # past the true vocabulary: zeros, as local_piece pads
            pad = list(piece.shape)
            pad[d] = want - g
            piece = torch.cat([piece, piece.new_zeros(pad)], dim=d)
    return piece


_ST_TORCH = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
             "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
             "I64": torch.int64}


def _torch_dtype_of(s: Stored) -> torch.dtype:
    return _ST_TORCH[s.dtype] if s.dtype in _ST_TORCH else _torch_dtype(s.dtype)


def _owned(t: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """A copy in memory of its own (never a view of a mapped file) in ``dtype`` on ``device``."""
    out = torch.empty(t.shape, dtype=dtype, device=device)
    out.copy_(t)
    return out


def _agree(error: BaseException | None, path) -> None:
    """Every rank raises the same WeightsError if any rank failed (collective)."""
    msg = None if error is None else (str(error) if isinstance(error, WeightsError)
                                      else f"{type(error).__name__}: {error}")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, msg)
    bad = [(r, m) for r, m in enumerate(everyone) if m is not None]
    if not bad:
        return
    r, first = bad[0]
    if isinstance(error, WeightsError) and all(m == first for _, m in bad) and str(error) == first:
        raise error
    text = first if first.startswith("weights=") else f"weights={path}: reading failed on rank {r}: {first}"
    raise WeightsError(text) from error


def check_path(path) -> None:
    """Open ``path``'s headers on every rank before anything is planned (no value read): a path with no checkpoint
    is the same :class:`WeightsError` on every rank in a second, not after the capture and the plan. Collective."""
    error = None
    try:
        open_weights(path)
    except Exception as e:  # noqa: BLE001 - gathered, raised on every rank
        error = e
    _agree(error, path)


def load(pm, model: torch.nn.Module, cap, path) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Read ``path`` into ``pm`` (a ParallelModule being built): registers this rank's parameters
    (under pp: its stages'), returns the buffers found (placeholder -> tensor) and the FQNs of every
    parameter and buffer the checkpoint provided (on all ranks: nothing else initialises them).
    Collective; raises the same :class:`WeightsError` on every rank."""
    error, src, m = None, None, None
    try:
        src = open_weights(path)
        m = _match(src, model, cap, pm.plan)
    except Exception as e:  # noqa: BLE001 - gathered, raised on every rank
        error = e
    _agree(error, path)
    if m.extra and pm._rank == 0:
        log.warning("weights=%s: %d tensor(s) of the checkpoint are not in the model and were ignored: %s",
                    path, len(m.extra), _fmt_names(m.extra))
    mine = [f for f in m.params if pm._pipe is None or f in pm._pipe.own_params]
    model_tensors = dict(model.named_parameters(remove_duplicate=False))
    model_tensors.update(dict(model.named_buffers(remove_duplicate=False)))
    buffers = {}
    try:
        with torch.no_grad():
            for fqn in mine:
                pplan = pm.plan.params[fqn]
                dtype = torch.float32 if model_tensors[fqn].is_floating_point() else model_tensors[fqn].dtype
                piece = _read_piece(src, m.params[fqn], pplan, pm.mesh, pm._coords, m.block_dims.get(fqn))
                piece = _owned(piece, dtype, pm._device)  # the file's view (or the full tensor) goes here
                pm._register(fqn, pm._make_param(fqn, local=piece))
                del piece
            for ph, fqn in cap.buffers.items():
                if fqn in m.buffers:
                    buffers[ph] = _owned(src.read(m.buffers[fqn]), model_tensors[fqn].dtype, pm._device)
    except Exception as e:  # noqa: BLE001 - gathered, raised on every rank
        error = e
    _agree(error, path)
    return buffers, set(m.params) | set(m.buffers)
