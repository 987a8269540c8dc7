"""Ops that make tensors from sizes alone: replicated (every rank builds the same values)."""

from __future__ import annotations

import torch

from mcompile.rules import OpInfo, R, Strategy, rule

aten = torch.ops.aten


@rule(
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default, aten.ones.default,
    aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default, aten.tensor.default
    if hasattr(aten, "tensor") else aten.zeros.default, aten._assert_tensor_metadata.default,
    aten._assert_scalar.default,
)
def factory(info: OpInfo) -> list[Strategy]:
    # _assert_tensor_metadata has a tensor input and no output: it accepts the input where it is.
    if info.inputs and not info.outputs:
        return [Strategy(tuple(info.current) or tuple(R for _ in info.inputs), (), name="assert")]
    return [Strategy(tuple(R for _ in info.inputs), tuple(R for _ in info.outputs), name="replicate")]
