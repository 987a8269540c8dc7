"""Initialise a model built on the meta device, one module at a time, the same on every layout.

A model built under ``with torch.device("meta"):`` has shapes but no values, so it never exists
whole in memory. :class:`~mcompile.runtime.module.ParallelModule` gives each of its tensors values
here, with **the model's own initialisation**, and keeps only this rank's piece of each.

Design (and why):

- **On the rank's device.** A GPU rank computes each tensor on its GPU with the GPU's generator (seeded
  the same way), so a 70B stage is not drawn element by element on the host; the values are then the same on
  every GPU layout, but not those a CPU run draws (another generator): ``materialize(model, seed,
  device="cuda")`` is the GPU runs' one-process reference. A simulated rank (meta device) computes nothing.
- **Per tensor, seeded by its name.** Before a tensor is computed, the generator is seeded
  from ``(seed, FQN)`` (a SHA-256 of both): never from the rank, the mesh or the order in which
  ranks or stages visit tensors. So a value depends only on the seed, the tensor's name and its
  initialiser, and ``full_state_dict()`` is bit-identical at tp=1, tp=2, dp×tp and pp (and to
  :func:`materialize` in one process). Seeding per tensor rather than per module also keeps a
  weight's values when a sibling (a bias) is added or dropped. The caller's RNG state is restored.
- **One module materialised at a time.** To compute a tensor owned by module ``M``, ``M``'s own
  parameters and buffers (``recurse=False``) are swapped for fresh tensors (on the rank's device), the initialisers
  run, the wanted tensor is taken and ``M`` gets its meta tensors back. Every other module stays on
  meta, so no rank holds more than one module's own tensors in full (plus its local pieces); the
  caller cuts the rank's piece (``plan.params[fqn].local_piece``) and drops the full tensor. No
  weights are broadcast: every rank computes the same values.
- **Whose initialisation.** For each module ``A`` on the path from ``M`` up to the root, in that
  order (post-order, as Hugging Face's ``initialize_weights`` and ``nn.Module.apply`` visit them,
  so a parent's re-initialisation of a child — GPT-2's scaled ``c_proj`` — wins):
  the nearest ancestor-or-self of ``A`` that defines ``_init_weights(module)`` (the Hugging Face
  convention; our presets in ``models/`` follow it) is called with ``A``; without one,
  ``A.reset_parameters()`` (or ``A._reset_parameters()``) runs — torch's own layers. Modules on
  the path other than ``M`` only have meta tensors, on which initialisers are no-ops, so they
  cannot touch anything but the tensor being computed. ``_init_weights`` is called directly, not
  HF's ``_initialize_weights``, whose "already initialised" flags would skip a module the second
  time.
- **Errors, before anything is done.** A tensor whose path has no initialiser at all is refused
  up front, naming every such tensor (its values would be whatever memory held). Tensors are
  materialised filled with a sentinel (NaN for floating ones, the dtype's maximum for integers);
  one still wholly (integers) or partly (floats: any NaN) the sentinel after its initialisers ran
  was not set by them — e.g. an ``_init_weights`` that does not know the module's type — and is an
  error naming it too. A buffer is recreated the same way (RoPE's ``inv_freq`` by the preset's
  ``_init_weights``, HF's rotary buffers by HF's); one that nothing recreates is such an error.
  Boolean buffers cannot carry a sentinel: they are trusted to their initialiser.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

import torch

__all__ = ["MetaInitError", "is_meta", "meta_names", "check_initialisers", "init_tensors", "materialize",
           "tensor_seed", "lookup"]


class MetaInitError(ValueError):
    """A meta-device model whose tensors cannot all be initialised."""


def tensor_seed(seed: int, fqn: str) -> int:
    """The generator seed of one tensor: from the run's seed and the tensor's name only."""
    digest = hashlib.sha256(f"mcompile-init/{int(seed)}/{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def is_meta(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_meta


def meta_names(model: torch.nn.Module, names: Iterable[str]) -> list[str]:
    """Those of ``names`` (parameter / buffer FQNs of ``model``) that are on the meta device."""
    return [n for n in names if is_meta(lookup(model, n))]


def _split(fqn: str) -> tuple[str, str]:
    path, _, attr = fqn.rpartition(".")
    return path, attr


def lookup(model: torch.nn.Module, fqn: str) -> torch.Tensor:
    path, attr = _split(fqn)
    mod = model.get_submodule(path)
    if attr in mod._parameters:
        return mod._parameters[attr]
    if attr in mod._buffers:
        return mod._buffers[attr]
    raise KeyError(f"{fqn} is neither a parameter nor a buffer of the model")


def _chain(model: torch.nn.Module, path: str) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) from the module at ``path`` up to the root."""
    out = [("", model)]
    mod = model
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        mod = mod.get_submodule(part)
        out.append((".".join(parts[:i + 1]), mod))
    return out[::-1]


def _initialisers(model: torch.nn.Module, path: str) -> list:
    """The initialiser calls for a tensor of the module at ``path``, in the order they run."""
    chain = _chain(model, path)
    calls = []
    for i, (_, mod) in enumerate(chain):
        provider = next((a for _, a in chain[i:] if callable(getattr(a, "_init_weights", None))), None)
        if provider is not None:
            calls.append(lambda p=provider, m=mod: p._init_weights(m))
        elif callable(getattr(mod, "reset_parameters", None)):
            calls.append(mod.reset_parameters)
        elif callable(getattr(mod, "_reset_parameters", None)):
            calls.append(mod._reset_parameters)
    return calls


def check_initialisers(model: torch.nn.Module, names: Iterable[str]) -> None:
    """Raise :class:`MetaInitError` naming every tensor of ``names`` that nothing would initialise."""
    missing = []
    for fqn in names:
        path, _ = _split(fqn)
        if not _initialisers(model, path):
            missing.append(f"{fqn} ({type(model.get_submodule(path)).__name__})")
    if missing:
        raise MetaInitError(
            f"the model was built on the meta device, but nothing initialises {len(missing)} tensor(s): "
            f"{', '.join(missing)}. Give the module a reset_parameters() (torch's convention) or the model an "
            "_init_weights(module) method (Hugging Face's), or build the model with real values")


def _sentinel(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    out = torch.empty_like(t, device=device)
    if out.is_floating_point() or out.is_complex():
        out.fill_(float("nan"))
    elif out.dtype != torch.bool:
        out.fill_(torch.iinfo(out.dtype).max)
    return out


def _unset(t: torch.Tensor) -> bool:
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    return bool((t == torch.iinfo(t.dtype).max).all())


def _compute(model: torch.nn.Module, fqn: str, seed: int, device: torch.device) -> torch.Tensor:
    """The full value of one meta tensor (on ``device``, its own dtype), by its module's initialisation."""
    path, attr = _split(fqn)
    mod = model.get_submodule(path)
    saved_p, saved_b = dict(mod._parameters), dict(mod._buffers)
    try:
        with torch.no_grad():
            for k, p in saved_p.items():
                if p is not None:
                    mod._parameters[k] = torch.nn.Parameter(_sentinel(p, device), requires_grad=p.requires_grad)
            for k, b in saved_b.items():
                if b is not None:
                    mod._buffers[k] = _sentinel(b, device)
            cuda = [device.index if device.index is not None else torch.cuda.current_device()] \
                if device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda), torch.device(device):
                torch.default_generator.manual_seed(tensor_seed(seed, fqn))
                if cuda:  # the GPU's own generator draws what is made on it
                    torch.cuda.manual_seed(tensor_seed(seed, fqn))
                for call in _initialisers(model, path):
                    call()
            value = mod._parameters[attr] if attr in mod._parameters else mod._buffers[attr]
            value = value.detach()
            if value.is_meta or value.device.type != device.type:
                raise MetaInitError(f"the initialiser of {fqn} replaced it by a tensor on {value.device}")
            if _unset(value):
                raise MetaInitError(
                    f"{fqn} ({type(mod).__name__}): its initialisers ran but left it (partly) unset — "
                    "the model's _init_weights / reset_parameters does not handle this module; give it one")
            return value
    finally:
        mod._parameters.clear()
        mod._parameters.update(saved_p)
        mod._buffers.clear()
        mod._buffers.update(saved_b)


def init_tensors(model: torch.nn.Module, names: Iterable[str], seed: int = 0, device=None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(fqn, full value)`` for each meta tensor of ``names``, one at a time (take what you need of
    each before asking for the next: the previous one is not kept), computed on ``device`` (default CPU).
    Checks every initialiser first."""
    names = list(names)
    device = torch.device(device if device is not None else "cpu")
    check_initialisers(model, names)
    for fqn in names:
        yield fqn, _compute(model, fqn, seed, device)


def materialize(model: torch.nn.Module, seed: int = 0, device=None) -> torch.nn.Module:
    """Give every meta parameter and buffer of ``model`` its values, in place, on ``device`` (default CPU),
    exactly as ``parallelize`` computes them on any layout on that kind of device (the one-process
    reference). Tied parameters stay tied. Returns the model."""
    names = [n for n, t in model.named_parameters(remove_duplicate=True) if t.is_meta]
    names += [n for n, t in model.named_buffers(remove_duplicate=True) if t.is_meta]
    values = dict(init_tensors(model, names, seed, device))
    old = [lookup(model, fqn) for fqn in names]  # alive until replaced: their ids stay theirs
    by_id = {}
    for fqn in names:
        by_id.setdefault(id(lookup(model, fqn)), values[fqn])
    for mod in model.modules():  # every alias of a tied parameter gets the same new Parameter
        for k, p in list(mod._parameters.items()):
            if p is not None and id(p) in by_id:
                new = by_id[id(p)]
                if not isinstance(new, torch.nn.Parameter):
                    new = by_id[id(p)] = torch.nn.Parameter(new, requires_grad=p.requires_grad)
                mod._parameters[k] = new
        for k, b in list(mod._buffers.items()):
            if b is not None and id(b) in by_id:
                mod._buffers[k] = by_id[id(b)]
    del old
    return model
