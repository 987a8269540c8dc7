"""Live tensor memory per rank, by category, with its peak (DESIGN §11: CPU has no peak counter).

:class:`MemoryTracker` is a ``TorchDispatchMode``: every storage an op creates while it is active
is counted, and uncounted when the storage is freed (a weak reference to the storage; storages
keep their Python object, so this sees exactly what autograd still holds). Tensors that exist
before tracking starts (parameters, optimizer state) are registered with their category;
re-registering a tracked storage moves it to the new category (the gradients backward creates).
Categories: ``parameters``, ``gradients``, ``optimizer``, ``activations`` (everything an op makes
that is not registered otherwise: saved activations and temporaries).

On a GPU, ``torch.cuda.max_memory_allocated`` gives the true allocator peak; this tracker is the
CPU stand-in and the per-category view on both.
"""

from __future__ import annotations

import collections
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["MemoryTracker", "OpenOpsTracker", "CATEGORIES"]

CATEGORIES = ("parameters", "gradients", "optimizer", "activations")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class MemoryTracker(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self._live: dict[int, tuple[int, str]] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.current: collections.Counter = collections.Counter()
        self.peak_total = 0
        self.peak: dict[str, int] = {c: 0 for c in CATEGORIES}  # by category, at the moment of the peak
        self.max: collections.Counter = collections.Counter()  # each category's own maximum

    # -- bookkeeping ------------------------------------------------------------------------------
    def _free(self, key: int) -> None:
        nbytes, cat = self._live.pop(key, (0, None))
        self._refs.pop(key, None)
        if cat is not None:
            self.current[cat] -= nbytes

    def track(self, t: torch.Tensor, category: str = "activations") -> None:
        t = _local(t)
        # a fake tensor (a joint program traced during the step: runtime/joint_runner.py) holds no memory; its
        # storage would otherwise stay "live" for as long as the traced graph's node meta keeps it
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" or isinstance(t, FakeTensor):
            return
        st = t.untyped_storage()
        key = id(st)
        if key in self._live:
            nbytes, old = self._live[key]
            if old != category and category != "activations":
                self.current[old] -= nbytes
                self.current[category] += nbytes
                self._live[key] = (nbytes, category)
            return
        nbytes = st.nbytes()
        self._live[key] = (nbytes, category)
        self._refs[key] = weakref.ref(st, lambda _, k=key: self._free(k))
        self.current[category] += nbytes
        self._update()

    def resync(self) -> None:
        """Re-read the size of every live storage: a buffer released by resizing its storage to 0
        (ZeRO-2's full gradient buffers between backwards, runtime/zero.py) holds nothing now, and a
        resize is not an op this mode sees."""
        for key, (nbytes, cat) in list(self._live.items()):
            st = self._refs[key]()
            if st is not None and st.nbytes() != nbytes:
                self._live[key] = (st.nbytes(), cat)
                self.current[cat] += st.nbytes() - nbytes

    def register(self, tensors, category: str) -> None:
        self.resync()
        if category not in CATEGORIES:
            raise ValueError(f"unknown memory category {category!r}; use one of {CATEGORIES}")
        for t in tensors:
            if t is not None:
                self.track(t, category)
        self._update()

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        for state in optimizer.state.values():
            self.register([v for v in state.values() if isinstance(v, torch.Tensor)], "optimizer")

    def _update(self) -> None:
        total = sum(self.current.values())
        for c, v in self.current.items():
            self.max[c] = max(self.max[c], v)
        if total > self.peak_total:
            self.peak_total = total
            self.peak = {c: self.current.get(c, 0) for c in CATEGORIES}

    def reset_peak(self) -> None:
        self.peak_total = sum(self.current.values())
        self.peak = {c: self.current.get(c, 0) for c in CATEGORIES}
        self.max = collections.Counter(self.current)

    # -- the mode -------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


class OpenOpsTracker(MemoryTracker):
    """A :class:`MemoryTracker` that also counts what mcompile's own custom ops (``torch.library.custom_op``
    in the ``mcompile`` namespace: ``cp_attention``, its backward, ...) allocate inside themselves: a
    dispatch mode sees such an op as one call and only its outputs, so here the op's Python body runs under
    the mode instead (the same computation; its temporaries, score blocks and received buffers counted).
    Scratch an aten kernel allocates inside itself stays unseen. For measuring an op's peak memory
    (``bench/cp_memory.py``); the plain tracker stays what the memory model is compared with."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._library.custom_ops import OPDEFS

        name = func.name() if hasattr(func, "name") else ""
        opdef = OPDEFS.get(name.split(".")[0]) if name.startswith("mcompile::") else None
        if opdef is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        with self:  # the body's ops come back through this mode
            out = opdef._init_fn(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out
