"""Ops that make tensors from sizes alone: replicated (every rank builds the same values)."""

from __future__ import annotations

import torch

from mcompile.sharding.rules.base import OpInfo, R, Strategy, rule

aten = torch.ops.aten


@rule(
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default, aten.ones.default,
    aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default, aten.tensor.default
    if hasattr(aten, "tensor") else aten.zeros.default, aten._assert_tensor_metadata.default,
    aten._assert_scalar.default,
)
def factory(info: OpInfo) -> list[Strategy]:
    """Sizes in, replicated tensor out."""
    # _assert_tensor_metadata has a tensor input and no output: it accepts the input where it is.
    if info.inputs and not info.outputs:
        return [Strategy(tuple(info.current) or tuple(R for _ in info.inputs), (), name="assert")]
    return [Strategy(tuple(R for _ in info.inputs), tuple(R for _ in info.outputs), name="replicate")]


@rule(aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default)
def new_factory(info: OpInfo) -> list[Strategy]:
    """``x.new_ones(size)``: ``x`` lends only dtype and device, so it is accepted wherever it is."""
    return [Strategy(tuple(info.current) or tuple(R for _ in info.inputs), (R,), name="replicate")]


@rule(aten._assert_async.msg, aten._assert_async.default)
def assert_async(info: OpInfo) -> list[Strategy]:
    """A runtime check of a bool tensor (``mcompile.capture.checks``: a value check of forward): it reads the whole
    value, so the input is replicated (a Partial or a shard would check a piece)."""
    return [Strategy(tuple(R for _ in info.inputs), (), name="assert")]


@rule(aten._is_all_true.default, aten._is_any_true.default)
def is_all_true(info: OpInfo) -> list[Strategy]:
    """``_is_all_true(t)`` / ``_is_any_true(t)``: a 0-d bool of the whole value (torch.export writes a value check
    such as Blt's ``torch._check(bool(t.all()))`` with them): the input is replicated, as a shard or a Partial
    would answer for a piece."""
    return [Strategy((R,), (R,), name="replicate")]
