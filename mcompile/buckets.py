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
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ALIGN", "BucketLayout", "Segment", "bucket_layouts", "zero1_layouts", "zero1_memory"]

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
    from mcompile.memory_model import MemoryPerRank

    size = _ITEMSIZE[str(dtype).replace("torch.", "")]
    layouts = zero1_layouts(plan, bucket_mb)
    padded = sum(lay.padded for lay in layouts)
    optimizer = 4 * sum(lay.shard for lay in layouts) if size != 4 else 0
    optimizer += sum(8 * seg.numel + 4 for lay in layouts for seg in lay.segments(dp_rank))
    return MemoryPerRank(params=size * padded, grads=4 * padded, optimizer=optimizer)
