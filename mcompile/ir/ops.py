"""mcompile's collective ops: the only form collectives take in a per-rank program (DESIGN §4).

Each is a ``torch.library.custom_op`` with a fake implementation (so programs stay traceable by
export / AOTAutograd, DESIGN §5) and a backward registered explicitly — never the functional
collectives' own autograd, whose all-reduce backward is another all-reduce (tp× gradients for
Megatron's *f*). The pairs (Shoeybi et al. 2019, Korthikanti et al. 2022):

=====================  ======================  =============================================
op                     forward                 backward
=====================  ======================  =============================================
all_reduce             all-reduce (sum)        identity               (Megatron's *g*)
copy_ar_bwd            identity (copy)         all-reduce (sum)       (Megatron's *f*)
all_gather(rs)         all-gather on dim       reduce-scatter on dim  (SP: into a TP region)
all_gather(split)      all-gather on dim       keep the local chunk   (grad already exact)
reduce_scatter         reduce-scatter on dim   all-gather on dim      (SP: out of a TP region)
shard_slice            keep the local chunk    all-gather on dim
all_reduce_max         all-reduce (max)        none (inputs are detached)
=====================  ======================  =============================================

Asynchronous forms, for the overlap passes (passes/dp/overlap.py), which rewrite the forward and
backward modules *after* the joint graph is partitioned, so they need no backward of their own:
``start_all_gather`` / ``start_reduce_scatter`` / ``start_all_reduce`` launch the collective on
dim 0 and return its output buffer at once (on NCCL: the collective is queued on the
communicator's stream; on gloo: running on gloo's thread; in the simulator: already done);
``wait(buf, src)`` is where the program may first read the buffer (on NCCL it orders the compute stream
after the collective and does not block the host); ``all_reduce_inplace(x)`` (mutates ``x``) is
:func:`all_reduce` without its copy, where nothing else reads ``x`` (``passes/dp/overlap.py
inplace_all_reduces``). A pass places each start as early as its input
allows and each wait just before the first reader; :func:`mcompile.passes.dp.overlap.check_waits`
proves every started buffer is waited once, before any other use.

The start's input ``src`` is an argument of the wait, which does nothing with it: the backend reads
``src`` until the collective completes, and a functional start (``mutates_args=()``) would tell a
compiler that ``src`` is dead right after the start. Inductor reuses a dead buffer's memory for the
next kernel's output (``buf24 = buf21; del buf21  # reuse`` in its generated code: the next chunk's
GEMM of a collective matmul written over the partial sums a reduce-scatter is still sending). Read by
the wait, ``src`` stays live, unwritten, until then; the communicator also holds a reference
(:class:`Pending`), which covers Python's and the caching allocator's frees but not a compiler's
reuse of memory it owns.

The ops name a mesh axis; the process group behind it comes from the :class:`Communicator`
bound with :func:`bind` around the program's execution (torch.distributed groups in the runtime,
threads in the single-process simulator). The axis size ``n`` is an explicit argument so fake
implementations need no communicator.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Protocol

import torch

__all__ = ["Communicator", "bind", "current", "OPS", "STARTS", "WAIT", "ALL_REDUCE_INPLACE", "Pending"]


class Communicator(Protocol):
    """What one rank's program needs from the outside: collectives over named mesh axes."""

    def rank(self, axis: str) -> int: ...
    def all_reduce(self, x: torch.Tensor, axis: str, op: str, inplace: bool = False) -> torch.Tensor: ...
    def all_gather(self, x: torch.Tensor, dim: int, axis: str) -> torch.Tensor: ...
    def reduce_scatter(self, x: torch.Tensor, dim: int, axis: str) -> torch.Tensor: ...
    def all_to_all(self, x: torch.Tensor, out_rows: list[int], in_rows: list[int], axis: str) -> torch.Tensor: ...
    def start(self, kind: str, x: torch.Tensor, axis: str) -> torch.Tensor: ...
    def wait(self, buf: torch.Tensor) -> None: ...
    # point-to-point around the ring of an axis (context parallelism's ring attention, mcompile.passes.cp.ops): each
    # tensor to the next rank ((r + 1) % n) of the axis group, the same shapes received from the previous
    # ((r - 1) % n); ``start_`` returns at once a handle whose ``wait()`` gives the received tensors
    def sendrecv_ring(self, tensors: list[torch.Tensor], axis: str) -> list[torch.Tensor]: ...
    def start_sendrecv_ring(self, tensors: list[torch.Tensor], axis: str): ...


_CURRENT: contextvars.ContextVar[Communicator | None] = contextvars.ContextVar("mcompile_comm", default=None)
_PROCESS: list[Communicator] = []  # the process-wide binding (see bind)


@contextlib.contextmanager
def bind(comm: Communicator, process_wide: bool = False):
    """Bind ``comm`` for the collectives run inside the block. ``process_wide`` also makes it the
    fallback for threads that do not inherit the context — autograd's device threads run backward
    on CUDA — which is right when the process is one rank (the runtime); the in-process simulator
    runs several ranks in threads and binds per thread only. Restored on exit."""
    token = _CURRENT.set(comm)
    if process_wide:
        _PROCESS.append(comm)
    try:
        yield comm
    finally:
        _CURRENT.reset(token)
        if process_wide:
            _PROCESS.pop()


def current() -> Communicator:
    c = _CURRENT.get() or (_PROCESS[-1] if _PROCESS else None)
    if c is None:
        raise RuntimeError(
            "an mcompile collective ran with no communicator bound: run per-rank programs through "
            "mcompile's runtime (or `with mcompile.ir.ops.bind(comm):`)"
        )
    return c


def _scaled(x: torch.Tensor, dim: int, factor: float) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = int(shape[dim] * factor)
    return x.new_empty(shape)


# ---- all_reduce (g) -------------------------------------------------------------------------
@torch.library.custom_op("mcompile::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, axis: str, n: int) -> torch.Tensor:
    return current().all_reduce(x.contiguous(), axis, "sum")


@all_reduce.register_fake
def _(x, axis, n):
    return torch.empty_like(x)


torch.library.register_autograd(
    "mcompile::all_reduce", lambda ctx, g: (g, None, None), setup_context=lambda ctx, inputs, output: None
)


@torch.library.custom_op("mcompile::all_reduce_inplace", mutates_args=("x",))
def all_reduce_inplace(x: torch.Tensor, axis: str, n: int) -> None:
    """:func:`all_reduce` into ``x`` itself (no copy): put by ``passes/dp/overlap.py inplace_all_reduces`` in a
    partitioned module where ``x`` is read by nothing else, so it needs no backward."""
    current().all_reduce(x, axis, "sum", inplace=True)


@all_reduce_inplace.register_fake
def _(x, axis, n):
    return None


# ---- copy_ar_bwd (f) ------------------------------------------------------------------------
@torch.library.custom_op("mcompile::copy_ar_bwd", mutates_args=())
def copy_ar_bwd(x: torch.Tensor, axis: str, n: int) -> torch.Tensor:
    return x.clone()


@copy_ar_bwd.register_fake
def _(x, axis, n):
    return torch.empty_like(x)


def _f_setup(ctx, inputs, output):
    ctx.axis, ctx.n = inputs[1], inputs[2]


torch.library.register_autograd(
    "mcompile::copy_ar_bwd", lambda ctx, g: (all_reduce(g, ctx.axis, ctx.n), None, None), setup_context=_f_setup
)


# ---- all_reduce_max -------------------------------------------------------------------------
@torch.library.custom_op("mcompile::all_reduce_max", mutates_args=())
def all_reduce_max(x: torch.Tensor, axis: str, n: int) -> torch.Tensor:
    return current().all_reduce(x.contiguous(), axis, "max")


@all_reduce_max.register_fake
def _(x, axis, n):
    return torch.empty_like(x)


# ---- reduce_scatter ---------------------------------------------------------------------------
@torch.library.custom_op("mcompile::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, dim: int, axis: str, n: int) -> torch.Tensor:
    return current().reduce_scatter(x.contiguous(), dim, axis)


@reduce_scatter.register_fake
def _(x, dim, axis, n):
    return _scaled(x, dim, 1 / n)


def _dim_setup(ctx, inputs, output):
    ctx.dim, ctx.axis, ctx.n = inputs[1], inputs[2], inputs[3]


torch.library.register_autograd(
    "mcompile::reduce_scatter",
    lambda ctx, g: (all_gather(g, ctx.dim, ctx.axis, ctx.n, "split"), None, None, None),
    setup_context=_dim_setup,
)


# ---- all_gather -------------------------------------------------------------------------------
@torch.library.custom_op("mcompile::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, axis: str, n: int, grad: str) -> torch.Tensor:
    return current().all_gather(x.contiguous(), dim, axis)


@all_gather.register_fake
def _(x, dim, axis, n, grad):
    return _scaled(x, dim, n)


def _ag_setup(ctx, inputs, output):
    ctx.dim, ctx.axis, ctx.n, ctx.grad = inputs[1], inputs[2], inputs[3], inputs[4]


def _ag_backward(ctx, g):
    if ctx.grad == "reduce_scatter":
        gi = reduce_scatter(g, ctx.dim, ctx.axis, ctx.n)
    else:
        gi = shard_slice_nograd(g, ctx.dim, ctx.axis, ctx.n)
    return gi, None, None, None, None


torch.library.register_autograd("mcompile::all_gather", _ag_backward, setup_context=_ag_setup)


# ---- shard_slice ------------------------------------------------------------------------------
def _chunk(x: torch.Tensor, dim: int, axis: str, n: int) -> torch.Tensor:
    size = x.shape[dim] // n
    return x.narrow(dim, current().rank(axis) * size, size).clone()


@torch.library.custom_op("mcompile::shard_slice", mutates_args=())
def shard_slice(x: torch.Tensor, dim: int, axis: str, n: int) -> torch.Tensor:
    return _chunk(x, dim, axis, n)


@shard_slice.register_fake
def _(x, dim, axis, n):
    return _scaled(x, dim, 1 / n)


torch.library.register_autograd(
    "mcompile::shard_slice",
    lambda ctx, g: (all_gather(g, ctx.dim, ctx.axis, ctx.n, "split"), None, None, None),
    setup_context=_dim_setup,
)


@torch.library.custom_op("mcompile::shard_slice_nograd", mutates_args=())
def shard_slice_nograd(x: torch.Tensor, dim: int, axis: str, n: int) -> torch.Tensor:
    """The local chunk, used as a backward (of all_gather(split)); its own backward is not needed."""
    return _chunk(x, dim, axis, n)


@shard_slice_nograd.register_fake
def _(x, dim, axis, n):
    return _scaled(x, dim, 1 / n)


# ---- asynchronous forms (dim 0; module docstring) -----------------------------------------------
@torch.library.custom_op("mcompile::start_all_gather", mutates_args=())
def start_all_gather(x: torch.Tensor, axis: str, n: int) -> torch.Tensor:
    return current().start("all_gather", x.contiguous(), axis)


@start_all_gather.register_fake
def _(x, axis, n):
    return x.new_empty((n * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("mcompile::start_reduce_scatter", mutates_args=())
def start_reduce_scatter(x: torch.Tensor, axis: str, n: int) -> torch.Tensor:
    return current().start("reduce_scatter", x.contiguous(), axis)


@start_reduce_scatter.register_fake
def _(x, axis, n):
    return x.new_empty((x.shape[0] // n, *x.shape[1:]))


@torch.library.custom_op("mcompile::start_all_reduce", mutates_args=())
def start_all_reduce(x: torch.Tensor, axis: str, n: int) -> torch.Tensor:
    return current().start("all_reduce", x.contiguous(), axis)


@start_all_reduce.register_fake
def _(x, axis, n):
    return torch.empty_like(x)


@torch.library.custom_op("mcompile::wait", mutates_args=("buf",))
def wait(buf: torch.Tensor, src: torch.Tensor) -> None:
    """``buf`` (a start's output) holds the collective's result from here on. ``src`` is the start's
    input, passed only so that it is read here: a compiler (Inductor's buffer reuse, its in-place
    kernels) then keeps its memory unwritten until the wait, while the backend still reads it."""
    current().wait(buf)


@wait.register_fake
def _(buf, src):
    return None


STARTS = {"all_gather": torch.ops.mcompile.start_all_gather.default,
          "reduce_scatter": torch.ops.mcompile.start_reduce_scatter.default,
          "all_reduce": torch.ops.mcompile.start_all_reduce.default}
WAIT = torch.ops.mcompile.wait.default
ALL_REDUCE_INPLACE = torch.ops.mcompile.all_reduce_inplace.default


class Pending:
    """The started collectives of one communicator: output buffer -> (handle, input kept alive).
    Keyed by the output's data pointer (a compiled module may hand wait another tensor object over
    the same storage)."""

    def __init__(self):
        self._work: dict[int, tuple] = {}

    def put(self, out: torch.Tensor, handle, keep: torch.Tensor) -> torch.Tensor:
        key = out.data_ptr()
        if key in self._work:
            raise RuntimeError("mcompile: a collective was started into a buffer that is still in flight")
        self._work[key] = (handle, keep)
        return out

    def pop(self, buf: torch.Tensor):
        item = self._work.pop(buf.data_ptr(), None)
        if item is None:
            raise RuntimeError("mcompile.wait on a buffer no collective was started into (or waited twice): "
                               "an overlap pass placed a wait without its start")
        return item[0]

    def __len__(self) -> int:
        return len(self._work)


OPS = {
    "all_reduce": torch.ops.mcompile.all_reduce.default,
    "copy_ar_bwd": torch.ops.mcompile.copy_ar_bwd.default,
    "all_reduce_max": torch.ops.mcompile.all_reduce_max.default,
    "reduce_scatter": torch.ops.mcompile.reduce_scatter.default,
    "all_gather": torch.ops.mcompile.all_gather.default,
    "shard_slice": torch.ops.mcompile.shard_slice.default,
}


# ---------------------------------------------------------------------------------------------
# dp gradient buckets: the op a backward module signals a bucket's gradients with (placed by
# passes/dp/overlap.py launch_buckets; counted by the runtime's Leaves, bound with grad_sink)
# ---------------------------------------------------------------------------------------------
_SINK: contextvars.ContextVar = contextvars.ContextVar("mcompile_grad_sink", default=None)


@contextlib.contextmanager
def grad_sink(sink):
    """Bind the object whose ``grads_ready(bucket, count)`` the ``grads_ready`` op calls (the
    runtime's :class:`mcompile.runtime.leaves.Leaves`) around a program's backward."""
    token = _SINK.set(sink)
    try:
        yield sink
    finally:
        _SINK.reset(token)


@torch.library.custom_op("mcompile::grads_ready", mutates_args=())
def grads_ready(grads: list[torch.Tensor], bucket: int) -> None:
    """``grads`` (their accumulations into the bucket's buffer) are done: the bucket counts them and,
    when every gradient of the step's last microbatch is in, launches its dp reduction
    asynchronously (all-reduce, or ZeRO's reduce-scatter). Unbound (a fake trace, show): nothing."""
    sink = _SINK.get()
    if sink is not None:
        sink.grads_ready(bucket, len(grads))


@grads_ready.register_fake
def _(grads, bucket):
    return None


torch.fx.node.has_side_effect(torch.ops.mcompile.grads_ready.default)  # no output, but never dead code
