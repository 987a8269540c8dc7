"""``mcompile show`` prints exactly what runs (issue 39): for the same rank, config and global batch, the forward and
backward modules ``compiler.show`` prints are, to the character, the ones the runtime's joint runners executed in a
real ``parallelize`` + ``train_step`` on gloo workers (B and W where a zero-bubble stage runs them).

What show built differently before (tests/show_cases.py runs both): its backward had none of the dp bucket launches
(``grads_ready``) the runtime's has under ``overlap`` (no ``grad_buckets``); a pipeline stage outside zbh1 added its
received activations' gradient into a buffer instead of returning it (no ``split_inputs``); FP8's delayed scaling
failed (the lifted amax histories not passed to the forward). Both sides now take the buckets from
``mcompile.ir.buckets.grad_buckets``."""

from __future__ import annotations

import pytest
from show_cases import show_and_runtime

from conftest import pool

CASES = {
    # small buckets: several launches inside the backward
    "dp2-overlap": ("dp=2", {"bucket_mb": 0.05}),
    "pp2-zbh1": ("pp=2", {"schedule": "zbh1", "microbatches": 2}),
    "pp2-1f1b": ("pp=2", {"schedule": "1f1b", "microbatches": 2}),  # stage 1 returns its input's gradient
    "dp2-zero3": ("dp=2", {"zero": 3}),
    "dp2-fuse": ("dp=2", {"fuse": True, "bucket_mb": 0.05}),
    "dp2-fp8": ("dp=2", {"fp8": "delayed"}),
}
# 4 ranks (a pool of its own): the launches inside W and the pipeline's counted parameters
SLOW = {"dp2-pp2-zbh1": ("dp=2,pp=2", {"schedule": "zbh1", "microbatches": 2, "bucket_mb": 0.05})}
# dp buckets with overlap: the backward (W) launches them, so the comparison covers the launches
LAUNCHES = {"dp2-overlap", "dp2-fuse", "dp2-fp8", "dp2-pp2-zbh1"}


@pytest.mark.parametrize("case", list(CASES) + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW])
def test_show_prints_the_modules_the_runtime_runs(case):
    mesh, options = {**CASES, **SLOW}[case]
    world = 4 if case in SLOW else 2
    for rank, (ran, shown) in enumerate(pool(world).run(show_and_runtime, "llama3-tiny-deep", mesh, options, 4)):
        assert sorted(shown) == sorted(ran), f"rank {rank}: show printed {sorted(shown)}, the runtime ran {sorted(ran)}"
        for key, code in ran.items():
            assert shown[key] == code, f"rank {rank} {key}: show's module differs from the runtime's"
        if case in LAUNCHES:
            assert any("mcompile.grads_ready" in code for code in ran.values()), f"rank {rank}: no bucket launched"
