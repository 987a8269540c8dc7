"""Canonicalisation before planning (passes/canonicalize.py): in-place arithmetic on tensors the model made
becomes functional, and ``x @ W.T`` of a parameter becomes ``linear(x, W)``.

What is isolated: the rewrite keeps the captured program's value (run before and after on the same inputs),
leaves alone the writes it cannot express functionally (into an input, into a tensor a view was taken of,
one whose functional form would promote the dtype), and with both rewrites Falcon's layer in miniature
(``FalconLinear``'s ``input @ weight.T``, ``mlp_output += attention_output``) plans in Megatron's layout
with no op left to run replicated.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mcompile.ir.placements import Shard
from mcompile.passes.canonicalize import functional_inplace, view_as_to_view

aten = torch.ops.aten


class _Writes(torch.nn.Module):
    def forward(self, x, b):
        y = x * 2
        y += x  # a fresh tensor: rewritten
        z = x * 3
        v = z[:, :1]  # a view of z taken before the write: the write must stay (v sees it)
        z.add_(1)
        h = x.to(torch.bfloat16)
        h += x  # bf16 += fp32 stays bf16; add would promote to fp32: stays a write
        b.mul_(2)  # an input: the program's effect, stays
        s = x * 4
        m = (x[:1] > 0).expand_as(s)  # a view of another tensor that reads s's shape (XLM's mask): rewritten
        s.masked_fill_(m, 0.0)
        return y * 5, v * 1, h.float(), z, s


def _ops(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.timeout(60)
def test_functional_inplace_keeps_the_value_and_the_writes_it_cannot_rewrite():
    x, b = torch.randn(3, 4), torch.randn(3, 4)
    gm = torch.export.export(_Writes(), (x, b.clone()), strict=False).module()
    want = gm(x, b.clone())
    writes = [t for t in _ops(gm) if t._schema.is_mutable]
    assert writes.count(aten.add_.Tensor) == 3 and aten.mul_.Tensor in writes
    assert functional_inplace(gm) == 2
    after = _ops(gm)
    assert after.count(aten.add_.Tensor) == 2 and aten.mul_.Tensor in after and aten.add.Tensor in after
    assert aten.masked_fill_.Scalar not in after and aten.masked_fill.Scalar in after
    got = gm(x, b.clone())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


class _FalconLayer(torch.nn.Module):
    """Falcon's new decoder layer in miniature: one norm read by attention and the MLP in parallel, every
    projection ``input @ weight.T``, the two outputs summed in place."""

    def __init__(self, d=16, f=32):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.v, self.o = (torch.nn.Parameter(torch.randn(d, d) / 4) for _ in range(2))
        self.up, self.down = torch.nn.Parameter(torch.randn(f, d) / 4), torch.nn.Parameter(torch.randn(d, f) / 4)

    def forward(self, x):
        h = self.ln(x)
        mlp = torch.nn.functional.gelu(h @ self.up.T) @ self.down.T
        attn = (h @ self.v.T) @ self.o.T
        mlp += attn
        return x + mlp


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_FalconLayer() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


@pytest.mark.timeout(120)
def test_falcon_style_layer_plans_megatron_at_tp2():
    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh

    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = compile_plan(_Model(), Mesh.fake(tp=2), (torch.randn(2, 8, 16),), repeat_blocks=False)
    assert c.plan.fallbacks == [] and not [w for w in caught if "sharding rule" in str(w.message)]
    ops = _ops(c.captured.gm)
    assert aten.add_.Tensor not in ops and aten.numpy_T.default not in ops and aten.matmul.default not in ops
    for i in range(2):
        for name, dim in (("up", 0), ("v", 0), ("down", 1), ("o", 1)):
            assert c.plan.params[f"layers.{i}.{name}"].placements == (Shard(dim),), (i, name)
    forward = [s for s in c.plan.collectives if s.forward != "none"]
    # the two partial sums added before one all-reduce per layer, nothing gathered
    assert sorted(s.forward for s in forward) == ["all_reduce", "all_reduce"], forward


class _TiledWrites(torch.nn.Module):
    """Keys as Hugging Face DeepSeek-V3 builds them (a fresh tensor, ``copy_`` into two slices tiling its last
    dim, then read whole), and writes the rewrite must leave: a slice left unwritten, a source that would be
    broadcast, a read of the tensor before its last write."""

    def forward(self, a, b):
        k = a.new_empty(2, 4, 5, 7)
        k[..., :3].copy_(a)
        k[..., 3:].copy_(b.expand(-1, 4, -1, -1))
        gap = a.new_zeros(2, 4, 5, 8)  # the last feature stays zero
        gap[..., :3].copy_(a)
        gap[..., 3:7].copy_(b.expand(-1, 4, -1, -1))
        wide = a.new_empty(2, 4, 5, 7)
        wide[..., :3].copy_(a)
        wide[..., 3:].copy_(b)  # b is broadcast over the heads by the copy
        early = a.new_zeros(2, 4, 5, 7)
        early[..., :3].copy_(a)
        seen = early.sum()
        early[..., 3:].copy_(b.expand(-1, 4, -1, -1))
        return k * 2, gap * 2, wide * 2, early * 2, seen


@pytest.mark.timeout(60)
def test_tiled_writes_into_a_fresh_tensor_become_a_cat():
    """A fresh tensor whose slices tiling one dim are each written once by ``copy_`` of a value of the slice's
    shape and dtype, then read, is the ``cat`` of those values (the same value; the planner lays a cat out by
    heads, a write through a view it does not follow). Any other fill stays as written."""
    from mcompile.passes.canonicalize import tiled_writes_to_cat

    a, b = torch.randn(2, 4, 5, 3), torch.randn(2, 1, 5, 4)
    gm = torch.export.export(_TiledWrites(), (a, b), strict=False).module()
    want = gm(a, b)
    assert _ops(gm).count(aten.copy_.default) == 8
    assert tiled_writes_to_cat(gm) == 1
    after = _ops(gm)
    assert after.count(aten.copy_.default) == 6 and after.count(aten.cat.default) == 1
    for g, w in zip(gm(a, b), want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_view_as_becomes_a_view_of_the_other_tensors_sizes():
    """``x.view_as(y)`` (Beam's attention) had no rule and ran replicated: it becomes ``view`` with y's sizes,
    a symbolic one read from y (a dynamic batch), and computes the same value."""
    class M(torch.nn.Module):
        def forward(self, x, y):
            return (x * 2).view_as(y) + y

    x, y = torch.randn(4, 6, 8), torch.randn(4, 48)
    gm = torch.export.export(M(), (x, y), dynamic_shapes=({0: torch.export.Dim("b")}, {0: torch.export.Dim("b")}),
                             strict=False).module()
    assert view_as_to_view(gm) == 1
    assert aten.view_as.default not in _ops(gm) and aten.view.default in _ops(gm)
    torch.testing.assert_close(gm(x, y), M()(x, y), rtol=0, atol=0)
    x3, y3 = torch.randn(3, 6, 8), torch.randn(3, 48)
    torch.testing.assert_close(gm(x3, y3), M()(x3, y3), rtol=0, atol=0)
