"""What the capture changes in torch while it traces, and how it refuses.

:class:`Patches` replaces attributes (``Function.apply``, ``Tensor.nonzero``, ``Module._apply``, ...) while any
thread of the process is capturing and restores them after the last capture leaves: a count under a lock, since
captures may run on several threads at once (the in-process rank simulator); :meth:`Patches.active` says whether
*this* thread is inside one, so a patched function leaves other threads' calls as torch does them.

:class:`Refused` is what our own checks raise inside the trace (an output that cannot be a loss, an autograd
Function that cannot be wrapped, a loop that cannot be unrolled): a cause, a fix and the user's line, which
``mcompile.capture.export`` turns into one CaptureError.
"""

from __future__ import annotations

import contextlib
import threading

__all__ = ["Patches", "Refused", "exception_chain"]

_MISSING = object()


class Refused(Exception):  # noqa: N818 - turned into a CaptureError by mcompile.capture.export
    def __init__(self, cause: str, fix: str, where: str | None = None):
        super().__init__(cause)
        self.cause, self.fix, self.where = cause, fix, where


def exception_chain(e: BaseException | None):
    """``e``, then its cause or context, and so on (each once)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


class Patches:
    """``(owner, name, replacement)`` triples set while :meth:`held` is entered on any thread."""

    def __init__(self, *targets: tuple[object, str, object]):
        self._targets = targets
        self._saved: list = []
        self._lock = threading.Lock()
        self._count = 0
        self._local = threading.local()

    def active(self) -> bool:
        """Whether this thread is inside :meth:`held`."""
        return getattr(self._local, "depth", 0) > 0

    @contextlib.contextmanager
    def held(self):
        with self._lock:
            if self._count == 0:  # the owner's own entry (a classmethod, an inherited method: _MISSING)
                self._saved = [vars(owner).get(name, _MISSING) for owner, name, _ in self._targets]
                for owner, name, new in self._targets:
                    setattr(owner, name, new)
            self._count += 1
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1
            with self._lock:
                self._count -= 1
                if self._count == 0:
                    for (owner, name, _), old in zip(self._targets, self._saved, strict=True):
                        if old is _MISSING:
                            delattr(owner, name)
                        else:
                            setattr(owner, name, old)
