"""Counting host reads of device values: the points where a GPU program would wait for its stream.

On a GPU, every read of a tensor's value by the host (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``) and
every op whose output *size* depends on tensor values (``nonzero``, boolean-mask indexing, ``masked_select``,
``unique``, ``repeat_interleave`` without ``output_size``, ``bincount``) blocks the host until the device has
caught up, so the host can no longer run ahead queueing kernels. ``torch.cuda.set_sync_debug_mode`` reports
such points on a GPU; :func:`count_host_reads` counts the same points on any device, the CPU included, from
the ops themselves — so a CPU test can prove a code path free of them (tests/test_host_reads.py).

Two modes see the reads:

* a ``TorchDispatchMode`` sees aten ops below autograd, the backward's included:
  ``aten._local_scalar_dense`` (what ``.item()``, ``int()``, ``float()``, ``bool()`` of a tensor lower
  to), the data-dependent-shape ops above (boolean-mask ``index`` / ``index_put``, so the backward of
  ``x[mask]`` too), and copies of a non-CPU tensor to the CPU;
* a ``TorchFunctionMode`` sees ``Tensor.tolist`` / ``Tensor.numpy`` (on a CPU tensor they read memory
  without any aten op; each counts once, whatever it lowers to), and everything called from Python
  inside the body of a ``torch.library.custom_op`` (``.item()``, ``int()``, ``x[mask]``, ``nonzero``,
  ``repeat_interleave`` without ``output_size``, ...): a dispatch mode is off while it handles an op,
  and such a body runs then. It stays on through ``backward()`` and custom ops, the only places where
  Python runs inside a torch call. Not seen: C++ autograd formulas run inside a custom op's body
  (``torch.func.vjp`` there) — those of the MoE dispatch (its experts' pointwise ops, views) read nothing.

Op-level counting follows PyTorch's own sync points (``torch.cuda.set_sync_debug_mode``); the custom-op
body runs with the caller's dispatch keys (functorch's included), as it would without the mode.

Usage::

    with count_host_reads() as reads:
        loss = step(); loss.backward()
    assert reads.total == 0, reads.sites()

Modes are thread-local: enter one in each thread (the simulator's ranks are threads).
"""

from __future__ import annotations

import collections
import threading
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# skips one level of __torch_function__ dispatch, so the mode stays on inside a Python-bodied function
# (torch >= 2.12; torch 2.11, the floor pyproject.toml claims, has no way to do it)
_REDISPATCH = getattr(torch.overrides, "redispatch_function", None)

aten = torch.ops.aten
__all__ = ["HostReads", "count_host_reads"]

# ops whose output size is the data's (on CUDA each reads a count back before it can allocate)
_DATA_SHAPED = {
    aten.nonzero.default, aten.nonzero.out, aten.masked_select.default, aten.masked_select.out,
    aten._unique.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
    aten.unique_dim_consecutive.default, aten.bincount.default,
    aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor,
}
_SCALAR = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}


def _bool_index(args) -> bool:
    """``aten.index`` / ``index_put`` with a boolean (or uint8) mask among its indices: a nonzero inside."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _to_host(func, args, kwargs) -> bool:
    """A copy of a non-CPU tensor into host memory (``.cpu()``, ``.to("cpu")``)."""
    if func is aten._to_copy.default:
        src, dev = args[0], kwargs.get("device")
        return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dev is not None \
            and torch.device(dev).type == "cpu"
    if func in (aten.copy_.default, aten.copy.default):
        dst, src = args[0], args[1]
        return dst.device.type == "cpu" and isinstance(src, torch.Tensor) and src.device.type not in ("cpu", "meta")
    return False


def _repeat_interleave_sized(func, args, kwargs) -> bool:
    return func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor) and \
        kwargs.get("output_size", args[-1] if func is aten.repeat_interleave.Tensor and len(args) > 1 else None) \
        is not None


class HostReads:
    """What :func:`count_host_reads` saw: ``total``, ``by_op`` (op name -> count) and :meth:`sites`."""

    def __init__(self) -> None:
        self.by_op: collections.Counter = collections.Counter()
        self._sites: collections.Counter = collections.Counter()
        self._quiet = threading.local()

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def sites(self) -> list[str]:
        """``"op at file:line (count)"`` per distinct place, the innermost frame outside torch."""
        return [f"{op} at {where} (x{n})" for (op, where), n in self._sites.items()]

    def _record(self, name: str) -> None:
        if getattr(self._quiet, "on", False):
            return
        self.by_op[name] += 1
        frames = [f for f in traceback.extract_stack()
                  if "/torch/" not in f.filename and not f.filename.endswith("host_reads.py")]
        where = f"{'/'.join(frames[-1].filename.split('/')[-2:])}:{frames[-1].lineno}" if frames else "?"
        self._sites[(name, where)] += 1


def _python_bodied(func) -> bool:
    """An op made by ``torch.library.custom_op``: its body is Python, which may read the host."""
    from torch._library.custom_ops import OPDEFS

    return isinstance(func, torch._ops.OpOverload) and f"{func.namespace}::{func._opname}" in OPDEFS


def _read_in_aten(func, args, kwargs) -> str | None:
    """The kind of host read aten op ``func`` makes, None if it makes none."""
    name = f"aten.{func.overloadpacket.__name__}"
    if func in _SCALAR or (func in _DATA_SHAPED and not _repeat_interleave_sized(func, args, kwargs)):
        return name
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                aten._index_put_impl_.default) and _bool_index(args):
        return f"{name} (boolean mask)"
    if _to_host(func, args, kwargs):
        return f"{name} (device to host)"
    return None


class _Dispatch(TorchDispatchMode):
    """Every aten op below autograd, but not inside a custom op's Python body (a dispatch mode is off while
    it handles an op, and the body runs then): the body's reads are the function mode's."""

    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads
        self.body_keys = None

    def __enter__(self):
        if self.body_keys is None:  # what a custom op's body runs under: the caller's keys, autograd's excluded
            keys, exclude = torch._C.DispatchKey, torch._C._dispatch_tls_local_exclude_set()
            for k in (keys.AutogradOther, keys.AutogradNestedTensor, keys.AutogradCPU, keys.AutogradCUDA):
                exclude = exclude.add(k)
            self.body_keys = (torch._C._dispatch_tls_local_include_set(), exclude)
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _read_in_aten(func, args, kwargs)
        if kind is not None:
            self.reads._record(kind)
        if _python_bodied(func):
            # a handler runs with every key above Python excluded, functorch's too: a body that uses torch.func
            # (moe_ep's vjp) runs as it would without the mode
            with torch._C._ForceDispatchKeyGuard(*self.body_keys):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


# Python-level entry points that read the host (inside a custom op's body, where only the function mode sees)
_METHOD_READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
                 torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.masked_select,
                 torch.masked_select, torch.Tensor.unique, torch.unique, torch.unique_consecutive,
                 torch.Tensor.bincount, torch.bincount}
_REPEAT = {torch.repeat_interleave, torch.Tensor.repeat_interleave}
_INDEX = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}
# entry points whose work runs Python (autograd.Function backwards, custom ops' bodies): the mode stays on
_PYTHON_INSIDE = {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad}


def _mask_in(index) -> bool:
    items = index if isinstance(index, tuple | list) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in items)


class _Function(TorchFunctionMode):
    """``Tensor.tolist`` / ``numpy`` everywhere (no aten op on a CPU tensor), and inside our custom ops' bodies
    (``depth`` > 0, where the dispatch mode is off) every Python-level read: ``.item()``, ``int()`` / ``bool()``
    / ``float()``, boolean-mask indexing, ``nonzero``, ``repeat_interleave`` without ``output_size``, ..."""

    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads
        self.depth = threading.local()

    def _kind(self, func, args, kwargs) -> str | None:
        if func in (torch.Tensor.tolist, torch.Tensor.numpy):
            return f"Tensor.{func.__name__}"
        if not getattr(self.depth, "n", 0):
            return None
        if func in _METHOD_READS:
            return f"{func.__name__}"
        if func in _REPEAT and kwargs.get("output_size") is None and not (
                len(args) > 1 and isinstance(args[1], int)):
            return "repeat_interleave"
        if func in _INDEX and len(args) > 1 and _mask_in(args[1]):
            return f"{func.__name__} (boolean mask)"
        if isinstance(func, torch._ops.OpOverload) and func.namespace == "aten":
            return _read_in_aten(func, args, kwargs)
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self._kind(func, args, kwargs)
        if kind is not None:
            self.reads._record(kind)
            self.reads._quiet.on = True  # what it lowers to is this one read
            try:
                return func(*args, **kwargs)
            finally:
                self.reads._quiet.on = False
        ours = _python_bodied(func)
        if ours or func in _PYTHON_INSIDE:
            self.depth.n = getattr(self.depth, "n", 0) + ours
            try:
                with self:  # stays on inside
                    return _REDISPATCH(func, types, args, kwargs)
            finally:
                self.depth.n -= ours
        return func(*args, **kwargs)


class count_host_reads:  # noqa: N801  (a context manager, used like a function)
    """Count, in this thread, the host reads of tensor values and the data-dependent-shape ops run inside
    the ``with`` block, forward and backward (see the module docstring)."""

    def __init__(self) -> None:
        if _REDISPATCH is None:
            raise RuntimeError(
                f"count_host_reads needs torch.overrides.redispatch_function (torch >= 2.12; this is torch "
                f"{torch.__version__}) to keep counting inside a custom op's Python body: without it the reads there "
                "would go uncounted. On a GPU, torch.cuda.set_sync_debug_mode('warn') reports the same points.")
        self.reads = HostReads()
        self._modes = (_Function(self.reads), _Dispatch(self.reads))

    def __enter__(self) -> HostReads:
        for m in self._modes:
            m.__enter__()
        return self.reads

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
