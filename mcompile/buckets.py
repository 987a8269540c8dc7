"""Layout of the data-parallel gradient buckets and of their ZeRO-1 shards (pure arithmetic).

The runtime (:mod:`mcompile.runtime.zero`) lays its flat buffers out with these functions and
:func:`zero1_memory` predicts each rank's bytes from them, so the two cannot drift.

A bucket is a run of parameters, in reverse registration order (roughly the order backward
finishes their gradients), of at most ``bucket_bytes`` of fp32 gradients (at least one parameter).
Its parameters' local pieces are laid end to end in one flat buffer, padded to a multiple of the
data-parallel size ``dp``; dp rank ``r`` owns the contiguous range ``[r * shard, (r + 1) * shard)``
with ``shard = padded / dp`` (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", stage 1; the flat, contiguous ranges are Megatron's distributed
optimizer). A parameter that crosses a range boundary is split: each owner updates its segment.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BucketLayout", "Segment", "bucket_layouts", "zero1_layouts", "zero1_memory"]


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

    @property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for n in self.numels:
            out.append(acc)
            acc += n
        return tuple(out)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def padded(self) -> int:
        """Elements of the flat buffer: the parameters, padded to a multiple of dp."""
        return -(-self.numel // self.dp) * self.dp

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


def bucket_layouts(numels: list[tuple[str, int]], dp: int, bucket_bytes: int) -> list[BucketLayout]:
    """``numels``: (fqn, local elements) in bucket order (reverse registration order); buckets of at
    most ``bucket_bytes`` of fp32 gradients, each holding at least one parameter."""
    if dp < 1:
        raise ValueError(f"dp={dp} must be >= 1")
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
    return [BucketLayout(tuple(f for f, _ in b), tuple(n for _, n in b), dp) for b in out]


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def zero1_layouts(plan, bucket_mb: float = 25.0) -> list[BucketLayout]:
    """The buckets the runtime builds for ``plan`` under ``Config(zero=1, bucket_mb=...)``: every
    parameter whose gradient is reduced over dp, in reverse registration order."""
    dp = plan.mesh.get("dp", 1)
    order = [(fqn, pp.local_numel) for fqn, pp in reversed(plan.params.items()) if "dp" in pp.grad_partial_axes]
    return bucket_layouts(order, dp, int(bucket_mb * 2**20))


def zero1_memory(plan, dtype: str = "bfloat16", bucket_mb: float = 25.0, dp_rank: int = 0):
    """Exact bytes one dp rank holds under ZeRO-1 with AdamW (Megatron's 6 + 12/d per bf16 parameter,
    with the padding and per-segment step counts of the real layout): parameters (``dtype``) and fp32
    gradients over each padded bucket; the fp32 master shard (``padded / dp`` elements per bucket,
    padding included; none when ``dtype`` is fp32: the masters are the parameters), and AdamW's
    two fp32 moments per owned parameter element and one 4-byte step per owned segment."""
    from mcompile.memory_model import MemoryPerRank

    size = _ITEMSIZE[str(dtype).replace("torch.", "")]
    layouts = zero1_layouts(plan, bucket_mb)
    padded = sum(lay.padded for lay in layouts)
    optimizer = 4 * sum(lay.shard for lay in layouts) if size != 4 else 0
    optimizer += sum(8 * seg.numel + 4 for lay in layouts for seg in lay.segments(dp_rank))
    return MemoryPerRank(params=size * padded, grads=4 * padded, optimizer=optimizer)
