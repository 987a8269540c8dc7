"""Views under tensor parallelism: ops that read memory, not values (``as_strided``), and in-place writes
through a view whose destination the plan moves.

``as_strided``'s strides are the capture's layout of its input (Hugging Face Longformer / LED build overlapping
attention chunks so, from a view of a projection held in (seq, batch, hidden) order: strides in ``batch``).
A rank's program holds the same values in other layouts (an all-gathered value is contiguous in its own order):
run there as captured, the strides read other elements — before passes/canonicalize.py
``as_strided_of_storage``, LED's gradients at tp=2 were 2.5x off with a right loss, and the miniature below
has a wrong loss. The rewrite reads a contiguous copy of the storage's owner; one it cannot prove is refused.

An in-place op run on a copy of its destination (an op with no rule runs replicated: its sharded destination is
all-gathered into a temporary) wrote the temporary only, so the tensor the destination views never saw it (a
wrong loss). passes/lower.py puts the written value back into the rank's piece of the destination; in-place
arithmetic has a rule that writes each rank's piece where it lies (mcompile/sharding/rules/pointwise.py).
"""

from __future__ import annotations

import pytest
import torch
from sim_harness import assert_sim_parity

aten = torch.ops.aten


class _Chunks(torch.nn.Module):
    """Longformer's ``_chunk`` in miniature: heads of a projection computed in (seq, batch, hidden) order,
    viewed to (batch x heads, chunks, 2w, head_dim) and cut into overlapping chunks by ``as_strided``."""

    def __init__(self, owner_contiguous: bool = True, h: int = 16, heads: int = 4, w: int = 2):
        super().__init__()
        self.q, self.o = torch.nn.Linear(h, h), torch.nn.Linear(h, h)
        self.heads, self.w, self.owner_contiguous = heads, w, owner_contiguous

    def forward(self, x):
        b, h, s, d = x.shape[0], x.shape[2], 8, x.shape[2] // self.heads
        q = self.q(x.transpose(0, 1))  # (s, b, h), contiguous
        if not self.owner_contiguous:  # a copy that keeps the transposed layout: no contiguous owner to read
            q = q.transpose(0, 1).clone().transpose(0, 1)
        q = q.view(s, b, self.heads, d).transpose(0, 1).transpose(1, 2).reshape(b * self.heads, s, d)  # a view
        q = q.view(q.size(0), s // (2 * self.w), 2 * self.w, d)
        size, stride = list(q.size()), list(q.stride())
        size[1], stride[1] = size[1] * 2 - 1, stride[1] // 2
        chunks = q.as_strided(size=size, stride=stride)
        y = (chunks * torch.arange(1.0, size[1] + 1).view(1, -1, 1, 1)).sum(1)
        y = y.reshape(b, self.heads, 2 * self.w, d).transpose(1, 2).reshape(b, 2 * self.w, h)
        return self.o(y).square().mean()


@pytest.mark.timeout(120)
def test_as_strided_over_a_view_of_a_sharded_projection_keeps_parity_at_tp2():
    """The query projection is column-parallel (split by features); the chunks are cut from a contiguous copy
    of its whole output, so every rank reads the elements the single-device model reads: loss and gradients."""
    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh

    torch.manual_seed(0)
    model, x = _Chunks(), torch.randn(2, 8, 16)
    c = compile_plan(model, Mesh.fake(tp=2), (x,), repeat_blocks=False)
    reads = [n for n in c.captured.gm.graph.nodes if n.target is aten.as_strided.default]
    assert len(reads) == 1 and reads[0].args[0].target is aten.clone.default, reads
    assert_sim_parity(c, model, (x,), "as_strided chunks")


@pytest.mark.timeout(120)
def test_as_strided_whose_layout_cannot_be_proved_is_refused_under_tp():
    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh
    from mcompile.sharding.propagate import PlanError

    torch.manual_seed(0)
    with pytest.raises(PlanError, match=r"reads the memory of .*Tensor.unfold"):
        compile_plan(_Chunks(owner_contiguous=False), Mesh.fake(tp=2), (torch.randn(2, 8, 16),), repeat_blocks=False)


class _WriteThroughView(torch.nn.Module):
    """``scores.transpose(..) += mask``-style: an in-place op on a view of a column-parallel projection, the
    projection read after the write. ``lerp_`` has no sharding rule (it runs on a gathered copy); ``add_`` has."""

    def __init__(self, op: str, h: int = 16):
        super().__init__()
        self.a, self.o = torch.nn.Linear(h, h), torch.nn.Linear(h, h)
        self.op = op

    def forward(self, x, m):
        y = self.a(x)
        v = y.transpose(1, 2)
        if self.op == "lerp_":
            v.lerp_(m, 0.5)
        else:
            v.add_(m)
        return self.o(torch.relu(y)).square().mean()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["lerp_", "add_"])
def test_a_write_into_a_view_of_a_split_tensor_reaches_the_viewed_tensor(op):
    """``lerp_`` runs replicated on an all-gathered copy of its split destination: the written value is put
    back into each rank's piece (before, the loss was 68% off). ``add_`` has a rule that writes each rank's
    piece where it lies: no fallback, nothing gathered."""
    import warnings

    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh
    from mcompile.ir.placements import Shard

    torch.manual_seed(0)
    model, inputs = _WriteThroughView(op), (torch.randn(2, 8, 16), torch.randn(2, 16, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = compile_plan(model, Mesh.fake(tp=2), inputs, repeat_blocks=False)
    assert c.plan.activations["linear_default"] == (Shard(2),)  # the destination's base is split
    assert c.plan.fallbacks == (["aten.lerp_.Scalar"] if op == "lerp_" else [])
    if op == "add_":
        assert c.plan.activations["add_"] == (Shard(1),) and not [s for s in c.plan.collectives
                                                                  if s.forward == "all_gather"]
    assert_sim_parity(c, model, inputs, f"{op} through a view")
