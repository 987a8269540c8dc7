"""Placements of a tensor over one mesh axis, and the layout extensions mcompile needs.

For the common case these are torch's own public ``Shard(dim)``, ``Replicate()`` and
``Partial()`` (DESIGN §4). One extension, documented and tested:

- ``BlockShard(dim, blocks)``: dim ``dim`` is made of consecutive blocks (e.g. the fused QKV
  output of GPT-2's ``c_attn``: [q | k | v]) and *each block* is sharded over the axis, so a rank
  holds ``[q_r | k_r | v_r]``. A later ``split`` (or slices) at the block boundaries yields plain
  ``Shard`` pieces. ``blocks`` is a count of equal blocks (what torch's private
  ``_StridedShard(dim, split_factor=blocks)`` describes) or, for blocks of unequal sizes, their
  sizes' ratios: Phi-3's ``qkv_proj`` with 4 query and 2 key/value heads is ``B(0,2:1:1)``, so a
  rank holds its query heads and the key/value heads they attend with (equal blocks would not:
  4 equal blocks give a rank query heads of two different groups). Each block's size must divide
  by the axis size; a rank's share of the dim is then ``size / axis size`` as for ``Shard``.

A dim padded to a multiple of the axis size (a vocabulary of 50257 at tp=2) keeps a plain
``Shard``: the padding lives in the plan's ``ParamPlan.padded_shape`` and in the padded global size
of the activations computed from that parameter.

Text form (plans, CLI): ``R``, ``S(d)``, ``P(sum)``, ``P(max)``, ``B(d,k)``, ``B(d,2:1:1)``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "BlockShard",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "format_placement",
    "parse_placement",
    "is_shard",
    "ShardSpec",
    "dp_placements",
    "local_piece",
    "shard_dim",
    "shard_tensor",
    "unshard_tensors",
]

R = Replicate()
P = Partial()


@dataclass(frozen=True)
class BlockShard:
    """Blocks along ``dim``, each sharded over the axis (see module docstring). ``blocks``: the number of
    equal blocks, or the blocks' size ratios (normalised: divided by their gcd; all equal -> a count)."""

    dim: int
    blocks: int | tuple[int, ...]

    def __post_init__(self):
        if isinstance(self.blocks, tuple | list):
            ratios = tuple(int(r) for r in self.blocks)
            if len(ratios) < 2 or min(ratios) <= 0:
                raise ValueError(f"BlockShard blocks {self.blocks!r}: two or more positive sizes")
            g = math.gcd(*ratios)
            ratios = tuple(r // g for r in ratios)
            object.__setattr__(self, "blocks", len(ratios) if len(set(ratios)) == 1 else ratios)

    @property
    def count(self) -> int:
        """How many blocks."""
        return self.blocks if isinstance(self.blocks, int) else len(self.blocks)

    def sizes(self, n):
        """The blocks' sizes in a dim of ``n`` elements (global, or a rank's share: both are proportional)."""
        if isinstance(self.blocks, int):
            return [n // self.blocks] * self.blocks
        total = sum(self.blocks)
        return [n * r // total for r in self.blocks]

    def divides(self, n, size: int) -> bool:
        """Whether a dim of ``n`` elements is made of these blocks, each divisible by an axis of ``size``."""
        total = self.blocks if isinstance(self.blocks, int) else sum(self.blocks)
        return n % (total * size) == 0

    def __repr__(self) -> str:
        return f"B({self.dim},{_blocks_text(self.blocks)})"


def _blocks_text(blocks) -> str:
    return str(blocks) if isinstance(blocks, int) else ":".join(map(str, blocks))


def is_shard(p) -> bool:
    return isinstance(p, Shard | BlockShard)


def shard_dim(p) -> int | None:
    return p.dim if is_shard(p) else None


def format_placement(p) -> str:
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    if isinstance(p, BlockShard):
        return f"B({p.dim},{_blocks_text(p.blocks)})"
    raise TypeError(f"not a placement: {p!r}")


_PAT = re.compile(r"^(R|S\((-?\d+)\)|P\((\w+)\)|B\((-?\d+),(\d+(?::\d+)+|\d+)\))$")


def parse_placement(text: str):
    m = _PAT.match(text.strip())
    if not m:
        raise ValueError(f"cannot parse placement {text!r}; write R, S(dim), P(sum) or B(dim,blocks)")
    if m.group(1) == "R":
        return Replicate()
    if m.group(2) is not None:
        return Shard(int(m.group(2)))
    if m.group(3) is not None:
        return Partial(m.group(3))
    blocks = m.group(5)
    return BlockShard(int(m.group(4)), tuple(map(int, blocks.split(":"))) if ":" in blocks else int(blocks))


def shard_tensor(full: torch.Tensor, p, rank: int, size: int, padded_size: int | None = None) -> torch.Tensor:
    """The local piece of ``full`` that ``rank`` of an axis of ``size`` holds under placement ``p``.

    ``padded_size``: for a Shard dim padded to a multiple of ``size`` (vocabularies), the full dim is
    zero-padded to it first. Partial values are represented by rank 0 holding everything.
    """
    if isinstance(p, Replicate):
        return full
    if isinstance(p, Partial):
        return full if rank == 0 else torch.zeros_like(full)
    d = p.dim % full.ndim
    if padded_size is not None and padded_size != full.shape[d]:
        pad_shape = list(full.shape)
        pad_shape[d] = padded_size - full.shape[d]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=d)
    n = full.shape[d]
    if isinstance(p, Shard):
        if n % size:
            raise ValueError(f"dim {d} of size {n} does not divide by the axis size {size}")
        return full.narrow(d, rank * (n // size), n // size).clone()
    if not p.divides(n, size):
        raise ValueError(f"dim {d} of size {n} is not {p!r}'s blocks each divisible by the axis size {size}")
    blocks = full.split(p.sizes(n), dim=d)
    return torch.cat([b.narrow(d, rank * (b.shape[d] // size), b.shape[d] // size) for b in blocks], dim=d)


def unshard_tensors(locals_: list[torch.Tensor], p, true_size: int | None = None) -> torch.Tensor:
    """Inverse of :func:`shard_tensor` over all ranks of one axis (``true_size`` drops padding)."""
    if isinstance(p, Replicate):
        return locals_[0]
    if isinstance(p, Partial):
        out = locals_[0]
        for t in locals_[1:]:
            out = torch.maximum(out, t) if p.reduce_op == "max" else out + t
        return out
    d = p.dim % locals_[0].ndim
    if isinstance(p, Shard):
        full = torch.cat(locals_, dim=d)
    else:
        per_rank = [t.split(p.sizes(t.shape[d]), dim=d) for t in locals_]
        full = torch.cat([torch.cat([pr[b] for pr in per_rank], dim=d) for b in range(p.count)], dim=d)
    if true_size is not None and true_size != full.shape[d]:
        full = full.narrow(d, 0, true_size)
    return full


# ---------------------------------------------------------------------------------------------
# ZeRO-3's layout over dp (passes/dp/fsdp.py decides it, the runtime holds the pieces)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardSpec:
    """How ZeRO-3 keeps one parameter over dp (passes/dp/fsdp.py ``shard_specs``)."""

    fqn: str
    placement: object | None  # over dp: Shard(0) | BlockShard(0, tp) | None (replicated)
    reason: str = ""  # why it stays replicated

    @property
    def sharded(self) -> bool:
        return self.placement is not None


def dp_placements(placements: tuple, axis_names: list[str], spec: ShardSpec) -> tuple:
    """The parameter's placements with dp's replaced by the ZeRO-3 one."""
    if not spec.sharded:
        return tuple(placements)
    return tuple(spec.placement if a == "dp" else p for a, p in zip(axis_names, placements))


def local_piece(tp_local: torch.Tensor, dp: int, dp_rank: int) -> torch.Tensor:
    """This dp rank's piece of a tensor-parallel piece (a copy: a view would keep the whole alive)."""
    return tp_local.chunk(dp, dim=0)[dp_rank].clone()
