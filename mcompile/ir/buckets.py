"""Layout of the data-parallel gradient buckets and of their ZeRO-1 shards (pure arithmetic).

The runtime (:mod:`mcompile.runtime.zero`, :mod:`mcompile.runtime.leaves`) lays its flat buffers out
with these functions and :func:`zero1_memory` predicts each rank's bytes from them, so the two cannot
drift.

A bucket is a run of parameters, in reverse registration order (roughly the order backward
finishes their gradients), of at most ``bucket_bytes`` of fp32 gradients (at least one parameter).
Its parameters' local pieces are laid end to end in one flat buffer; dp rank ``r`` owns the
contiguous range ``[r * shard, (r + 1) * shard)`` with ``shard = padded / dp`` (Rajbhandari et al.
2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", stage 1; the flat,
contiguous ranges are Megatron's distributed optimizer). A parameter that crosses a range boundary
is split: each owner updates its segment.

Alignment (``ALIGN`` = 64 elements): every parameter starts at a multiple of 64 elements, and the
buffer is padded to a multiple of ``dp * 64``, so every owned range starts on a multiple of 64 too.
The buffers sharing these offsets are the fp32 gradients and the parameters in their dtype (bf16 or
fp32): 64 elements are 128 B of bf16 and 256 B of fp32, so every parameter, segment and range
starts on a 128-byte boundary of either buffer (the granule NCCL and vectorised kernels read at
full speed). Megatron-Core lays its buffers out the same way (``pad_param_start`` to 64 elements,
``pad_bucket_end`` to a multiple of dp: ``core.optimizer.param_layout``, Megatron-Core developer
guide). Offsets, in elements::

    offset[0] = 0
    offset[i] = ceil((offset[i-1] + numel[i-1]) / 64) * 64
    padded    = ceil((offset[-1] + numel[-1]) / (dp * 64)) * (dp * 64)

Padding elements (between parameters and at the end) are zero, belong to no parameter and to no
segment: they cost memory (under 64 elements per parameter plus ``dp * 64`` per bucket), never
optimizer state beyond the fp32 master shard that covers the owned range.

Which buckets a rank has, and which bucket a backward launches after each gradient it adds
(passes/dp/overlap.py ``launch_buckets``), is :func:`grad_buckets` of parameter metadata alone: the
runtime's buffers (runtime/leaves.py, runtime/zero.py) are laid out from it, and ``mcompile show``
places the same launches in the backward it prints, so the printed backward is the one that runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

__all__ = ["ALIGN", "BucketLayout", "GradBucket", "GradBuckets", "Segment", "bucket_layouts", "data_axes",
           "grad_buckets", "zero1_layouts", "zero1_memory"]

# elements every parameter offset and owned range start is a multiple of: 128 B of bf16 (the
# narrowest buffer dtype), 256 B of fp32
ALIGN = 64


@dataclass(frozen=True)
class Segment:
    """The part of one parameter that a dp rank owns: ``[start, stop)`` in bucket coordinates,
    which is ``[start - offset, stop - offset)`` of the parameter's flattened local piece."""

    fqn: str
    start: int
    stop: int
    offset: int  # where the parameter begins in the bucket

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class BucketLayout:
    fqns: tuple[str, ...]
    numels: tuple[int, ...]  # local (tp-sharded) elements of each parameter
    dp: int
    align: int = ALIGN  # offsets and owned range starts are multiples of this many elements

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each parameter begins in the flat buffer: the end of the previous one, rounded up
        to a multiple of ``align``."""
        out, acc = [], 0
        for n in self.numels:
            acc = _round_up(acc, self.align)
            out.append(acc)
            acc += n
        return tuple(out)

    @property
    def numel(self) -> int:
        """Parameter elements (padding excluded)."""
        return sum(self.numels)

    @property
    def padded(self) -> int:
        """Elements of the flat buffer: the parameters at their aligned offsets, padded to a
        multiple of ``dp * align`` (so that every owned range starts aligned)."""
        end = self.offsets[-1] + self.numels[-1] if self.numels else 0
        return _round_up(end, self.dp * self.align)

    @property
    def shard(self) -> int:
        return self.padded // self.dp

    def owned(self, dp_rank: int) -> tuple[int, int]:
        return dp_rank * self.shard, (dp_rank + 1) * self.shard

    def segments(self, dp_rank: int) -> list[Segment]:
        """The parameter segments dp rank ``dp_rank`` owns, in buffer order (padding excluded)."""
        lo, hi = self.owned(dp_rank)
        out = []
        for fqn, off, n in zip(self.fqns, self.offsets, self.numels):
            start, stop = max(lo, off), min(hi, off + n)
            if start < stop:
                out.append(Segment(fqn, start, stop, off))
        return out


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bucket_layouts(numels: list[tuple[str, int]], dp: int, bucket_bytes: int,
                   align: int = ALIGN) -> list[BucketLayout]:
    """``numels``: (fqn, local elements) in bucket order (reverse registration order); buckets of at
    most ``bucket_bytes`` of fp32 gradients (the parameters' own elements, alignment padding not
    counted), each holding at least one parameter; offsets aligned to ``align`` elements."""
    if dp < 1:
        raise ValueError(f"dp={dp} must be >= 1")
    if align < 1:
        raise ValueError(f"align={align} must be >= 1")
    out, cur = [], []
    size = 0
    for fqn, n in numels:
        if cur and size + 4 * n > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append((fqn, n))
        size += 4 * n
    if cur:
        out.append(cur)
    return [BucketLayout(tuple(f for f, _ in b), tuple(n for _, n in b), dp, align) for b in out]


def data_axes(mesh) -> tuple[str, ...]:
    """The data-parallel axes of ``mesh`` whose ranks sum each other's gradients: dp, cp and ep of size > 1, in
    mesh order (Megatron's dp x cp gradient group, with ep folded into dp: runtime/module.py)."""
    return tuple(a for a in mesh.axis_names if a in ("dp", "cp", "ep") and mesh.size(a) > 1)


@dataclass(frozen=True)
class GradBucket:
    """One flat fp32 gradient buffer of a rank: its layout, and the data axes its gradients are summed over
    (``()``: none, e.g. ZeRO-3's pieces at dp alone, reduce-scattered inside the backward). Under ZeRO-1/2 also
    the communicator group that reduce-scatters it and shards its optimizer state (``"dp"``, ``"data"`` for
    dp x ep, ...; ``""`` for none), the group's size (the layout's ``dp``) and this rank's index in it."""

    layout: BucketLayout
    axes: tuple[str, ...]
    group: str = ""
    size: int = 1
    rank: int = 0


@dataclass(frozen=True)
class GradBuckets:
    """A rank's gradient buckets in their order (the bucket index is the position in ``buckets``), and whether
    they are ZeRO-1/2's sharded ones (``sharded``) or whole all-reduced ones."""

    buckets: tuple[GradBucket, ...]
    sharded: bool

    @cached_property
    def index(self) -> dict[str, int]:
        """fqn -> the index of its bucket."""
        return {f: i for i, b in enumerate(self.buckets) for f in b.layout.fqns}

    def launched(self, fqn: str | None, counted, deferred=frozenset()) -> int | None:
        """The index of ``fqn``'s bucket when a backward may launch it, else None: its gradient counts towards its
        bucket's readiness (``counted``: the parameters whose gradient this rank's programs produce; ``deferred``:
        weights tied across pipeline stages, counted after their cross-stage sum, outside any backward) and the
        bucket is reduced over a data axis (ZeRO-1/2: every bucket, reduce-scattered). What the runtime's
        ``Leaves.bucket_index`` answers and the overlap pass places launches for."""
        i = self.index.get(fqn) if fqn is not None and fqn in counted and fqn not in deferred else None
        if i is None or not (self.sharded or self.buckets[i].axes):
            return None
        return i


def grad_buckets(params: list[tuple[str, int, bool]], plan, mesh, coords: dict[str, int], *, zero: int = 0,
                 bucket_mb: float = 25.0, zero3=frozenset()) -> GradBuckets:
    """The gradient buckets of the rank at ``coords`` of ``mesh`` (an mcompile Mesh): pure, from metadata.

    ``params``: (fqn, elements of the rank's local piece, requires grad) of every parameter the rank holds (under
    pp: its stages'), in registration order; ``plan``: the parameters' placements (``grad_partial_axes``);
    ``zero``, ``bucket_mb``: the Config's; ``zero3``: the parameters ZeRO-3 shards over dp (their dp sum is inside
    the backward: their buckets are reduced over the other data axes only).

    zero=0 (and zero=1 at one data rank, ZeRO-3): the trainable parameters in reverse order (roughly the order
    backward finishes them) grouped by the data axes their gradient is summed over, groups over more axes first,
    each cut into buckets of ``bucket_mb``. ZeRO-1/2 over more than one data rank: every parameter grouped by the
    communicator group of those axes (dp x ep dense weights over "data", routed experts over dp), in the order the
    groups first appear, each cut into buckets of ``bucket_mb`` padded for that group's size. Raises
    NotImplementedError for a trainable parameter no ZeRO group reduces."""
    data = data_axes(mesh)
    limit = int(bucket_mb * 2**20)
    size, coord = 1, 0
    for a in data:
        size, coord = size * mesh.size(a), coord * mesh.size(a) + coords[a]
    out = []
    if zero in (1, 2) and size > 1:
        group_of_axes = {frozenset(data): ("data" if len(data) > 1 else data[0], size, coord)}
        for a in data:
            group_of_axes.setdefault(frozenset([a]), (a, mesh.size(a), coords[a]))
        group_of_axes.setdefault(frozenset(), ("", 1, 0))  # reduced over nothing (experts at dp=1)
        orders: dict[tuple, list] = {}
        axes_of: dict[tuple, tuple[str, ...]] = {}
        for fqn, numel, grad in reversed(params):
            axes = frozenset(a for a in plan.params[fqn].grad_partial_axes if mesh.size(a) > 1 and a in data)
            if axes in group_of_axes and (axes or "ep" in data):
                g = group_of_axes[axes]
                orders.setdefault(g, []).append((fqn, numel))
                axes_of[g] = tuple(a for a in data if a in axes)
            elif grad:
                raise NotImplementedError(f"ZeRO-1: {fqn} has a gradient that is not reduced over the data-parallel "
                                          f"ranks ({', '.join(sorted(axes)) or 'none'})")
        for g, order in orders.items():
            out += [GradBucket(lay, axes_of[g], *g) for lay in bucket_layouts(order, g[1], limit)]
        return GradBuckets(tuple(out), True)
    by_axes: dict[tuple[str, ...], list] = {}  # the data axes a gradient is summed over -> its parameters
    for fqn, numel, grad in reversed(params):
        if grad:
            partial = plan.params[fqn].grad_partial_axes
            axes = tuple(a for a in data if a in partial and not (a == "dp" and fqn in zero3))
            by_axes.setdefault(axes, []).append((fqn, numel))
    for axes, numels in sorted(by_axes.items(), key=lambda kv: -len(kv[0])):
        out += [GradBucket(lay, axes) for lay in bucket_layouts(numels, 1, limit)]
    return GradBuckets(tuple(out), False)


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def zero1_layouts(plan, bucket_mb: float = 25.0) -> list[BucketLayout]:
    """The buckets the runtime builds for ``plan`` under ``Config(zero=1, bucket_mb=...)``: every
    parameter whose gradient is reduced over dp, in reverse registration order."""
    dp = plan.mesh.get("dp", 1)
    order = [(fqn, pp.local_numel) for fqn, pp in reversed(plan.params.items()) if "dp" in pp.grad_partial_axes]
    return bucket_layouts(order, dp, int(bucket_mb * 2**20))


def zero1_memory(plan, dtype: str = "bfloat16", bucket_mb: float = 25.0, dp_rank: int = 0):
    """Exact bytes one dp rank holds under ZeRO-1 with AdamW (Megatron's 6 + 12/d per bf16 parameter,
    with the alignment padding and per-segment step counts of the real layout): parameters
    (``dtype``) and fp32 gradients over each padded bucket; the fp32 master shard (``padded / dp``
    elements per bucket, padding included; none when ``dtype`` is fp32: the masters are the
    parameters), and AdamW's two fp32 moments per owned parameter element and one 4-byte step per
    owned segment."""
    from mcompile.ir.memory_model import MemoryPerRank

    size = _ITEMSIZE[str(dtype).replace("torch.", "")]
    layouts = zero1_layouts(plan, bucket_mb)
    padded = sum(lay.padded for lay in layouts)
    optimizer = 4 * sum(lay.shard for lay in layouts) if size != 4 else 0
    optimizer += sum(8 * seg.numel + 4 for lay in layouts for seg in lay.segments(dp_rank))
    return MemoryPerRank(params=size * padded, grads=4 * padded, optimizer=optimizer)
