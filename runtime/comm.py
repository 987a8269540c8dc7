"""The communicator of a real run: mcompile's collective ops on torch.distributed process groups.

One process group per mesh axis, from a torch ``DeviceMesh`` (NCCL on CUDA, gloo on CPU; the same
programs run on both). Bound around each program run with :func:`mcompile.ops.bind`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DistCommunicator"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
# torch 2.13 renames the single-tensor collectives; torch 2.11 (our GPU machine) has the old names only
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class DistCommunicator:
    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        self.groups = {name: mesh.get_group(name) for name in mesh.mesh_dim_names}
        self.ranks = {name: mesh.get_local_rank(name) for name in mesh.mesh_dim_names}
        self.sizes = {name: mesh.size(i) for i, name in enumerate(mesh.mesh_dim_names)}

    def rank(self, axis: str) -> int:
        return self.ranks[axis]

    def all_reduce(self, x: torch.Tensor, axis: str, op: str) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=_OPS[op], group=self.groups[axis])
        return out

    def all_gather(self, x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
        n = self.sizes[axis]
        src = x.movedim(dim, 0).contiguous()
        out = src.new_empty((n * src.shape[0], *src.shape[1:]))
        _ALL_GATHER(out, src, group=self.groups[axis])
        return out.movedim(0, dim).contiguous()

    def reduce_scatter(self, x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
        n = self.sizes[axis]
        src = x.movedim(dim, 0).contiguous()
        out = src.new_empty((src.shape[0] // n, *src.shape[1:]))
        _REDUCE_SCATTER(out, src, group=self.groups[axis])
        return out.movedim(0, dim).contiguous()
