"""Worker functions for tests/test_show_equals_runtime.py (module level: they run in the gloo worker pool)."""

from __future__ import annotations

import re

from kernel_paths import reference_kernels

import mcompile as mc
from mcompile import compiler

from conftest import build


def _code(m) -> str:
    return m.gm.code if hasattr(m, "gm") else m.code


def runtime_modules(pm) -> dict[tuple[str, str], str]:
    """(program label as ``show`` prints it, part) -> the code of each module this rank's runtime executed in its
    last train_step: forward, and backward, or under a zero-bubble schedule B and W where the stage ran them
    (runtime/pipeline.py ``JointStage.backward``)."""
    if pm._pipe is None:
        runners = [("program", pm._runner, False)]
    else:
        split = pm._pipe.schedule == "zbh1"
        runners = [(f"stage {s}", pm._pipe.runners[s], split) for s in pm._pipe.own]
    out = {}
    for label, runner, split in runners:
        jp = runner.last
        out[(label, "forward")] = _code(jp.forward)
        if split and jp.backward_input is not None and jp.input_grads:
            out[(label, "backward B")] = _code(jp.backward_input)
            out[(label, "backward W")] = _code(jp.backward_weight)
        else:
            out[(label, "backward")] = _code(jp.backward)
    return out


_HEADER = re.compile(r"^# ---- (.+?): (forward|backward B|backward W|backward)\b.*----$")


def shown_modules(text: str) -> dict[tuple[str, str], str]:
    """(program label, part) -> the code ``show`` printed under that section's header."""
    out, key = {}, None
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            key = (m.group(1), m.group(2))
            out[key] = []
        elif key is not None:
            out[key].append(line)
    return {k: "\n".join(v) for k, v in out.items()}


def show_and_runtime(rank, world, model, mesh, options, batch):
    """One train_step of ``model`` parallelized on ``mesh`` with ``options``, then ``show`` of this rank on the same
    compiled plan, config and global batch: (the modules the runtime executed, the modules show printed)."""
    m, inputs = build(model, batch=batch)
    with reference_kernels():
        pm = mc.parallelize(m, mc.Mesh.parse(mesh), inputs, **options)
        pm.train_step(*inputs)
    text = compiler.show(pm._compiled, rank, pm.config, inputs, after="codegen")
    return runtime_modules(pm), shown_modules(text)
