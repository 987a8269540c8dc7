"""The pass pipeline: one flat, named list from the captured graph to the programs a rank runs
(DESIGN §5, CONVENTIONS 1; issue 13).

Every pass is a function over a graph (or a rank's programs) that states what it requires and what
it ensures; the config selects which run. In order:

=================  ==========  ===============================================================
pass               scope       what it does
=================  ==========  ===============================================================
canonicalize       model       decompose / normalise the captured graph (passes/canonicalize.py)
mean_loss          model       a mean loss -> (sum, count) for token weighting (passes/loss.py)
plan               model       placements per node and mesh axis (mcompile.planner)
lower              rank        the per-rank program: local shapes, explicit collectives
fuse               rank        fused RMSNorm / SwiGLU / RoPE / CE kernels (``Config(fuse=True)``)
fp8                rank        FP8 linears (``Config(fp8=...)``)
fsdp               rank        ZeRO-3: sharded parameters gathered over dp before use (passes/fsdp.py;
                               under pp into each stage program, after the split)
pipeline_split     rank        stage programs (a ``pp`` axis)
joint              signature   forward + backward traced into one graph (passes/joint.py)
partition          signature   the saved set (recompute policy or ``auto``) -> forward / backward
split_weight       signature   zero-bubble: backward -> B (input grads) + W (weight grads)
codegen            signature   ``Config(codegen="inductor")``: each module compiled
=================  ==========  ===============================================================

"model" passes run once in :func:`mcompile.api.compile_plan`; "rank" passes once per rank
(:func:`rank_programs`, used by the runtime); "signature" passes once per program and input
signature, on the first call (:class:`mcompile.runtime.joint.JointRunner`), since tracing needs the
shapes of the microbatch. The runtime gets the finished modules and only executes them.

:func:`show` runs the pipeline up to a named pass for one rank with example inputs and prints every
program at that point as Python — forward and backward, every collective visible
(``mcompile show MODEL --mesh ... --rank R --after PASS``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

__all__ = ["Pass", "PASSES", "RankPrograms", "rank_programs", "pass_names", "show", "UnknownPassError"]


@dataclass(frozen=True)
class Pass:
    name: str
    scope: str  # "model" | "rank" | "signature"
    requires: tuple[str, ...]
    ensures: tuple[str, ...]
    enabled: Callable[[object, object], bool]  # (config, mesh) -> whether it runs
    doc: str


def _always(_cfg, _mesh) -> bool:
    return True


PASSES: list[Pass] = [
    Pass("canonicalize", "model", ("captured",), ("canonical",), _always, "passes/canonicalize.py"),
    Pass("mean_loss", "model", ("canonical",), ("token-weighted loss",), _always, "passes/loss.py"),
    Pass("plan", "model", ("canonical",), ("placements",), _always, "mcompile/planner.py"),
    Pass("lower", "rank", ("placements",), ("per-rank program", "collectives explicit"), _always,
         "passes/lower.py"),
    Pass("fuse", "rank", ("per-rank program",), ("fused kernels",), lambda c, m: bool(c.fuse), "passes/fuse.py"),
    Pass("fp8", "rank", ("per-rank program",), ("fp8 linears",), lambda c, m: bool(c.fp8), "passes/fp8.py"),
    Pass("fsdp", "rank", ("per-rank program",), ("parameters gathered over dp",),
         lambda c, m: c.zero == 3 and m.size("dp") > 1, "passes/fsdp.py"),
    Pass("pipeline_split", "rank", ("per-rank program",), ("stage programs",), lambda c, m: m.size("pp") > 1,
         "passes/pipeline_split.py"),
    Pass("joint", "signature", ("per-rank program",), ("joint graph",), lambda c, m: c.execution == "joint",
         "passes/joint.py"),
    Pass("partition", "signature", ("joint graph",), ("forward module", "backward module", "saved set"),
         lambda c, m: c.execution == "joint", "passes/joint.py, passes/remat.py"),
    Pass("split_weight", "signature", ("backward module",), ("B module", "W module"),
         lambda c, m: c.execution == "joint" and m.size("pp") > 1 and c.schedule == "zbh1", "passes/joint.py"),
    Pass("codegen", "signature", ("forward module", "backward module"), ("compiled modules",),
         lambda c, m: c.execution == "joint" and c.codegen != "eager", "passes/codegen.py"),
]


class UnknownPassError(ValueError):
    pass


def pass_names() -> list[str]:
    return [p.name for p in PASSES]


def check_order() -> None:
    """Every pass's requirements are ensured by an earlier pass (or are the capture's)."""
    have = {"captured"}
    for p in PASSES:
        missing = set(p.requires) - have
        if missing:
            raise AssertionError(f"pass {p.name} requires {sorted(missing)}, which no earlier pass ensures")
        have.update(p.ensures)


@dataclass
class RankPrograms:
    """What the rank passes produce for one rank."""

    program: fx.GraphModule
    fused: dict | None = None  # fuse: counts per fused op
    fp8: object = None  # fp8: mcompile.passes.fp8.Fp8Report
    snapshots: dict[str, str] = field(default_factory=dict)  # pass -> program code after it (show)


def rank_programs(compiled, rank: int, config, device=None, *, upto: str | None = None,
                  snapshots: bool = False) -> RankPrograms:
    """Run the rank passes (lower, fuse, fp8) for ``rank``; the pipeline split is the runtime's
    (it needs the stage partition), as are the signature passes."""
    # the rank passes rewrite the graph in place: on a copy, not on the compiled plan's cached program
    cached = compiled.program(rank, device)
    program = fx.GraphModule(cached, copy.deepcopy(cached.graph), class_name=type(cached).__name__)
    out = RankPrograms(program)
    if snapshots:
        out.snapshots["lower"] = program.code
    if upto == "lower":
        return out
    cap = compiled.captured
    if config.fuse:
        from mcompile.passes.fuse import fuse

        out.fused = fuse(program, {n.name: n for n in cap.gm.graph.nodes}, set(cap.params))
        if snapshots:
            out.snapshots["fuse"] = program.code
    if upto == "fuse":
        return out
    if config.fp8:
        from mcompile.passes.fp8 import convert_fp8

        out.fp8 = convert_fp8(program, compiled.plan, dict(cap.params), recipe=config.fp8,
                              amax_history_len=config.fp8_amax_history_len, margin=config.fp8_margin,
                              backend=config.fp8_backend, device=device or torch.device("cpu"),
                              user_inputs=set(cap.user_inputs))
        if snapshots:
            out.snapshots["fp8"] = program.code
    if upto == "fp8":
        return out
    mesh = compiled.mesh
    if config.zero == 3 and mesh.size("dp") > 1 and mesh.size("pp") == 1:
        from mcompile.passes.fsdp import insert_gathers

        insert_gathers(program, zero3_placeholders(compiled, cap.params), mesh.size("dp"))
        if snapshots:
            out.snapshots["fsdp"] = program.code
    return out


def zero3_placeholders(compiled, placeholders) -> set[str]:
    """The parameter placeholders among ``placeholders`` (name -> fqn, or names with ``compiled``'s
    captured params) whose parameter ZeRO-3 shards (passes/fsdp.py ``shard_specs``)."""
    from mcompile.passes.fsdp import shard_specs

    specs = shard_specs(compiled.plan, compiled.mesh)
    fqn_of = compiled.captured.params
    return {ph for ph in placeholders if ph in fqn_of and specs[fqn_of[ph]].sharded}


# ---------------------------------------------------------------------------------------------
# show
# ---------------------------------------------------------------------------------------------
def _example_args(compiled, rank: int, names: list[str], inputs: tuple, microbatches: int, mode,
                  zero3: set = frozenset()) -> list:
    """Fake inputs (``mode``) of a program on ``rank`` by placeholder name: local parameter pieces
    that require grad, buffers, this rank's slice of ``inputs`` (dp, then one microbatch)."""
    cap = compiled.captured
    coords = compiled.mesh.coords(rank)
    dp = compiled.mesh.size("dp")
    state = compiled.local_state(rank)
    batch = next((t.shape[0] for t in inputs if isinstance(t, torch.Tensor) and t.ndim), None)
    user = {}
    for name, t in zip(cap.user_inputs, inputs):
        if isinstance(t, torch.Tensor) and t.ndim and t.shape[0] == batch:
            t = t.chunk(dp)[coords.get("dp", 0)].chunk(microbatches)[0]
        user[name] = t
    from mcompile.dropout import RNG_INPUT, rng_state

    user[RNG_INPUT] = rng_state(0, 0)  # a program with dropout reads (seed, step, batch offset) (mcompile.dropout)

    def fake(t, grad: bool):
        if not isinstance(t, torch.Tensor):
            return t
        with mode:
            x = torch.empty(t.shape, dtype=t.dtype)
        return x.requires_grad_() if grad else x

    def piece(n):  # ZeRO-3: this dp rank's piece of the parameter (passes/fsdp.py)
        return state[n].chunk(dp)[coords["dp"]] if n in zero3 else state[n]

    return [fake(piece(n), n in cap.params and state[n].is_floating_point()) if n in state else fake(user[n], False)
            for n in names]


def show(compiled, rank: int, config, inputs: tuple, after: str = "codegen") -> str:
    """The programs of ``rank`` after pass ``after`` (and every pass before it that ``config``
    enables), as Python: the per-rank program (or, under pp, this rank's stage programs) for rank
    passes; for signature passes the joint graph, or the forward and backward modules (B and W for
    zero-bubble). Traced on fake tensors: no memory, no communication."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mcompile.passes.joint import is_alias
    from mcompile.runtime.joint import JointRunner

    names = pass_names()
    if after not in names:
        raise UnknownPassError(f"no pass named {after!r}; the passes are {', '.join(names)}")
    idx = names.index(after)
    p = PASSES[idx]
    mesh = compiled.mesh
    if p.scope == "model":
        return f"# after {after}: the captured graph (model passes run before any rank program)\n" + \
            compiled.captured.gm.code
    lines = [f"# rank {rank} {mesh.coords(rank)} on {mesh!r}, after pass '{after}'",
             "# passes run: " + ", ".join(q.name for q in PASSES[:idx + 1] if q.enabled(config, mesh))]
    upto = after if after in ("lower", "fuse", "fp8") else None
    rp = rank_programs(compiled, rank, config, torch.device("cpu"), upto=upto)
    if rp.fp8 is not None:
        lines += [f"# {x}" for x in rp.fp8.text().splitlines()]
    pp = mesh.size("pp")
    pp_rank = mesh.coords(rank).get("pp", 0)
    if pp > 1 and idx >= names.index("pipeline_split"):
        from mcompile.partition import partition as stage_partition
        from mcompile.passes.pipeline_split import split_stages

        cap = compiled.captured
        part = compiled.partition or stage_partition(cap, pp, config.virtual_stages)
        stages = split_stages(rp.program, part, cap.params, cap.user_inputs)
        if PASSES[names.index("fsdp")].enabled(config, mesh):  # as runtime/pipeline.py: per stage
            from mcompile.passes.fsdp import insert_gathers

            for st in stages:
                insert_gathers(st.gm, zero3_placeholders(compiled, st.params), mesh.size("dp"))
        programs = [(f"stage {st.index}", st.gm, st.inputs, len(st.received), st.index % pp == pp_rank)
                    for st in stages]
        from mcompile.runtime.pipeline import stage_activation_budget
        from mcompile.runtime.schedules import build_schedule

        actions = build_schedule(config.schedule, pp, config.virtual_stages, config.microbatches)
        budgets = {f"stage {st.index}": stage_activation_budget(config, actions, st.index) for st in stages}
    else:
        phs = [n.name for n in rp.program.graph.nodes if n.op == "placeholder"]
        programs = [("program", rp.program, phs, 0, True)]
        budgets = {}
    if p.scope == "rank":
        for label, gm, _, _, mine in programs:
            if mine:
                lines += [f"# ---- {label} ----", gm.code]
        return "\n".join(lines)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    carried: list = []
    split_w = PASSES[names.index("split_weight")].enabled(config, mesh)
    for label, gm, in_names, n_recv, mine in programs:
        zero3 = zero3_placeholders(compiled, in_names) if PASSES[names.index("fsdp")].enabled(config, mesh) else set()
        args = _example_args(compiled, rank, in_names[:len(in_names) - n_recv], inputs, config.microbatches, mode,
                             zero3)
        args += carried
        split = list(range(len(args) - n_recv, len(args))) if split_w and n_recv else None
        # as the runtime builds it: weight gradients added into their buffers inside backward
        runner = JointRunner(gm, config, split_inputs=split, name=label, accumulate=lambda a: {},
                             budget=budgets.get(label))
        with torch.enable_grad():
            jp = runner.compile(args)
        with mode, torch.no_grad():
            res = jp.forward.gm(*args) if hasattr(jp.forward, "gm") else jp.forward(*args)
        outs = res[:jp.joint.num_outputs]
        carried = [o.detach().requires_grad_() if o.is_floating_point() else o.detach() for o in outs]
        if not mine:
            continue
        if after == "joint":
            lines += [f"# ---- {label}: joint graph (forward + backward) ----", jp.joint.gm.code]
            continue
        nodes = {n.name: n for n in jp.joint.gm.graph.nodes}
        views = sum(is_alias(nodes[r]) for r in jp.recomputed)
        lines.append(f"# ---- {label}: forward ({len(jp.saved)} values saved for backward, {jp.saved_bytes} bytes; "
                     f"{len(jp.recomputed) - views} ops and {views} views recomputed in backward, "
                     f"{jp.recompute_flops:.0f} FLOPs) ----")
        lines.append(_code(jp.forward))
        if jp.backward_input is not None and idx >= names.index("split_weight"):
            lines += [f"# ---- {label}: backward B (input gradients) ----", _code(jp.backward_input),
                      f"# ---- {label}: backward W (weight gradients) ----", _code(jp.backward_weight)]
        else:
            lines += [f"# ---- {label}: backward ----", _code(jp.backward)]
    if after == "codegen" and config.codegen != "eager":
        lines.append(f"# codegen={config.codegen!r}: the modules above are compiled on their first call")
    return "\n".join(lines)


def _code(m) -> str:
    return m.gm.code if hasattr(m, "gm") else m.code
