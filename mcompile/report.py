"""Human-readable views of a Plan: parameters, collectives per layer, memory per rank.

Memory per rank (the convention of Megatron-LM's distributed-optimizer table, Shoeybi et al. /
Korthikanti et al.): parameters in their dtype; gradients in fp32 (Megatron's ``main_grad``;
with fp32 parameters that is the parameter dtype anyway); AdamW's two moments in fp32, plus an
fp32 master copy when the parameters are not fp32. Per parameter: fp32 -> 4 + 4 + 8 = 16 B,
bf16 -> 2 + 4 + 4 + 8 = 18 B; plus AdamW's 4-byte step count per parameter tensor. Sharded
parameters count their local (padded) piece; tied parameters once.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import sympy

from mcompile.placements import format_placement
from mcompile.plan import Plan

_ITEMSIZE = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8}


@dataclass(frozen=True)
class MemoryPerRank:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def memory_per_rank(plan: Plan, dtype: str | None = None) -> MemoryPerRank:
    """Bytes of parameters, gradients and AdamW state that one rank holds (the largest rank: every
    rank holds the same under tp/dp)."""
    p = g = o = 0
    for pp in plan.params.values():
        dt = dtype or pp.dtype
        size = _ITEMSIZE[dt]
        n = pp.local_numel
        p += n * size
        g += n * 4
        o += n * (8 + (4 if size != 4 else 0)) + 4  # + AdamW's 0-d fp32 step count per parameter
    return MemoryPerRank(p, g, o)


def _gib(b: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b} B"


def collective_bytes(expr: str, symbols: dict[str, int]) -> int:
    e = sympy.sympify(expr)
    subs = {s: symbols.get(str(s), 1) for s in e.free_symbols}
    return int(e.subs(subs))


def _group(fqn: str) -> str:
    return re.sub(r"\.(\d+)\.", ".*.", fqn, count=1)


def plan_tables(plan: Plan, sizes: dict[str, int] | None = None, dtype: str | None = None):
    """Rich renderables: parameter table, collectives table, memory table."""
    from rich.table import Table

    axes = list(plan.mesh)
    params = Table(title="Parameters (repeated layers folded to *)", show_lines=False)
    for col in ("parameter", "count", "shape", *axes, "local shape", "grad partial over"):
        params.add_column(col)
    seen: dict[str, list] = {}
    for fqn, pp in plan.params.items():
        key = _group(fqn)
        row = (str(list(pp.shape)), *[format_placement(x) for x in pp.placements], str(list(pp.local_shape)),
               ",".join(pp.grad_partial_axes) or "-")
        if key in seen and seen[key][1] == row:
            seen[key][0] += 1
        else:
            seen[fqn if key in seen else key] = [1, row]
    for key, (count, row) in seen.items():
        params.add_row(key, str(count), *row)

    colls = Table(title="Collectives per step of rank 0 (forward and what each implies in backward)")
    for col in ("layer", "op", "axis", "forward", "backward", "bytes", "purpose"):
        colls.add_column(col)
    by_layer = plan.collectives_by_layer()
    layers = [k for k in by_layer if k is not None]
    sizes = sizes or {}
    shown_layers = layers[:1]
    for layer in [None] + shown_layers:
        for c in by_layer.get(layer, []):
            label = "outside layers" if layer is None else f"{layer} (each of {len(layers)})"
            colls.add_row(label, c.op, c.axis, c.forward, c.backward, _fmt_bytes(c.bytes, sizes), c.purpose)

    mem = memory_per_rank(plan, dtype)
    memt = Table(title="Memory per rank (parameters, fp32 gradients, AdamW state)")
    for col in ("parameters", "gradients", "optimizer state", "total"):
        memt.add_column(col)
    memt.add_row(_gib(mem.params), _gib(mem.grads), _gib(mem.optimizer), _gib(mem.total))
    return params, colls, memt


def _fmt_bytes(expr: str, sizes: dict[str, int]) -> str:
    if not sizes:
        return expr
    b = collective_bytes(expr, sizes)
    return f"{b:,} ({expr})"


def plan_text(plan: Plan, sizes: dict[str, int] | None = None, dtype: str | None = None, width: int = 160) -> str:
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None)
    head = " x ".join(f"{a}={n}" for a, n in plan.mesh.items())
    sp = f"on ({plan.options.sp_variant})" if plan.options.sequence_parallel else "off"
    console.print(f"Plan for {plan.model or 'model'} on mesh {head}; sequence parallel: {sp}")
    if plan.fallbacks:
        console.print(f"Replicated because no sharding rule exists: {', '.join(plan.fallbacks)}")
    for t in plan_tables(plan, sizes, dtype):
        console.print(t)
    return buf.getvalue()


def measure_per_rank(compiled, inputs: tuple, lr: float = 1e-3) -> list[dict[str, int]]:
    """Run one training step of every rank's program together (threads, the simulated
    communicator) under :class:`mcompile.runtime.memory.MemoryTracker`; per rank: the bytes of
    parameters, gradients and AdamW state it then holds, and its peak of activations."""
    import torch

    from mcompile.runtime.memory import MemoryTracker
    from mcompile.runtime.sim import ThreadedWorld, run_threads

    state = compiled.captured.state_values()
    cap = compiled.captured

    def rank_fn(r):
        local = {k: (v.detach().clone().requires_grad_(True) if k in cap.params else v)
                 for k, v in compiled.local_state(r, state).items()}
        params = [local[k] for k in cap.params]
        prog = compiled.program(r)
        names = [n.name for n in prog.graph.nodes if n.op == "placeholder"]
        user = dict(zip(cap.user_inputs, inputs))
        tracker = MemoryTracker()
        tracker.register(params, "parameters")
        opt = torch.optim.AdamW(params, lr=lr)
        with tracker:
            out = prog(*[local[n] if n in local else user[n] for n in names])
            out[0].backward()
            tracker.register([p.grad for p in params], "gradients")
            opt.step()
            tracker.register_optimizer(opt)
        return {"parameters": tracker.current["parameters"], "gradients": tracker.current["gradients"],
                "optimizer": tracker.current["optimizer"], "peak_activations": tracker.max["activations"]}

    return run_threads(ThreadedWorld(compiled.mesh), rank_fn)
