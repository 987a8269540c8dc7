"""The compiler: one flat, named list of passes from the captured graph to the programs a rank runs
(DESIGN §5, CONVENTIONS 1; issues 13, 39).

Every pass states what it requires and what it ensures, when it runs (``enabled``: the config and mesh, or
for the model scope the :class:`PlanRequest`) and the function that runs it; :func:`pass_table` prints the list
(docs/architecture.md holds that print, checked by a test). Three scopes, in list order:

- **model** (:func:`plan_model`): once per model and mesh — capture, canonical form, blocks, checks, annotation,
  placements per axis, repetition to full depth, the plan, rank 0's collectives, quality, pipeline stages.
  ``compile_plan`` runs all of it; the cost model's ``Workload`` captures once (capture .. annotate) and plans
  per tp (plan_axes .. record_collectives); generation plans its prefill and decode graphs (canonicalize ..
  assemble).
- **rank** (:func:`rank_programs`): the programs of one rank — lower, fuse, fp8, the pipeline split, ZeRO-3's
  gathers, recompute; ``parallelize`` and generation hand the result to the runtime.
- **signature** (:func:`build_joint`): one program's modules for one input signature, on its first call (tracing
  needs the microbatch's shapes) — joint graph, saved set, B/W split, accumulation, bucket launches, prefetch,
  collective matmul, in-place all-reduces, codegen; the runtime's
  :class:`~mcompile.runtime.joint_runner.JointRunner` is given ``build_joint`` and only executes.

Each pass's ``requires`` is checked against what the passes before it ensured. The runtime gets the finished
modules and only executes them.

:func:`show` runs the pipeline up to a named pass for one rank with example inputs and prints every
program at that point as Python — forward and backward, every collective visible
(``mcompile show MODEL --mesh ... --rank R --after PASS``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

__all__ = ["Pass", "PASSES", "RankPrograms", "rank_programs", "pass_names", "pass_table", "show", "UnknownPassError",
           "build_joint", "joint_runner", "ModelState", "PlanRequest", "plan_model"]


@dataclass(frozen=True)
class Pass:
    name: str
    scope: str  # "model" | "rank" | "signature"
    requires: tuple[str, ...]
    ensures: tuple[str, ...]
    enabled: Callable[[object, object], bool]  # (config, mesh) -> whether it may run (show lists these)
    doc: str
    # rank and signature passes: run(state) does the pass on the _RankState / _SignatureState (its call's own
    # conditions inside: a stage that receives nothing has no B/W split); model passes run in compile_plan
    run: Callable | None = None
    what: str = ""  # what it does, in a line (pass_table, docs/architecture.md)


def _always(_cfg, _mesh) -> bool:
    return True


def _joint(c, _m) -> bool:
    return c.execution == "joint"


def _req(flag: str) -> Callable[[object, object], bool]:
    """A model pass the request switches (``PlanRequest.<flag>``)."""
    return lambda r, _m: bool(getattr(r, flag))


PASSES: list[Pass] = [
    # -- model scope: once per model and mesh (compile_plan; the cost model's Workload; generation's graphs)
    Pass("check_mesh", "model", (), ("mesh checked",), lambda r, m: m.size("cp") > 1, "passes/cp/plan.py",
         lambda st: _model_check_mesh(st),
         what="a cp mesh the model cannot use is refused before minutes of capture"),
    Pass("capture", "model", (), ("captured",), _always, "mcompile/capture/export.py", lambda st: _model_capture(st),
         what="torch.export of the model (of two groups of each run of alike blocks while block repetition is on)"),
    Pass("canonicalize", "model", ("captured",), ("canonical",), _always, "passes/canonicalize.py",
         lambda st: _model_canonicalize(st),
         what="decompose / normalise the captured graph"),
    Pass("kv_cache", "model", ("canonical",), ("prefill and decode graphs",), _req("kv_cache"), "passes/kv_cache.py",
         lambda st: _model_kv_cache(st),
         what="generation: the prefill graph (returns its K/V) and the decode graph (reads the cache)"),
    Pass("canonicalize_attention", "model", ("canonical",), ("attention canonical",), _req("attention"),
         "passes/attention.py", lambda st: _model_attention(st),
         what="causal masks made from sizes -> is_causal; under cp GQA's repeat_kv undone"),
    Pass("find_block", "model", ("canonical",), ("blocks located",), _req("repeat_blocks"),
         "mcompile/sharding/repeat.py",
         lambda st: _model_find_block(st),
         what="each run's repeated group located; a run not found is captured whole (capture runs again)"),
    Pass("check_model", "model", ("canonical",), ("model checked",), _req("checks"), "passes/cp/plan.py",
         lambda st: _model_check_model(st),
         what="a loss output (else a warning); what cp needs of the model"),
    Pass("mean_loss", "model", ("canonical",), ("token-weighted loss",), _req("token_weighted_loss"),
         "passes/loss.py", lambda st: _model_mean_loss(st),
         what="a mean loss -> (sum, count) for token weighting"),
    Pass("check_arguments", "model", ("canonical",), ("arguments checked",), _req("checks"),
         "mcompile/sharding/arguments.py", lambda st: _model_check_arguments(st),
         what="op arguments no layout keeps (and, for parallelize, what the runtime cannot run) refused"),
    Pass("annotate", "model", ("canonical",), ("annotated",), _always, "mcompile/ir/annotate.py",
         lambda st: _model_annotate(st),
         what="FLOPs and bytes per node"),
    Pass("plan_axes", "model", ("annotated",), ("placements per axis",), _always, "mcompile/sharding/planner.py",
         lambda st: _model_plan_axes(st),
         what="each mesh axis's placements per node (Megatron's policies, redistribution priced)"),
    Pass("repeat", "model", ("placements per axis",), ("full depth",), _req("repeat_blocks"),
         "mcompile/sharding/repeat.py",
         lambda st: _model_repeat(st),
         what="the short model's capture and placements grown to the real depth"),
    Pass("assemble", "model", ("placements per axis",), ("placements",), _always, "mcompile/sharding/planner.py",
         lambda st: _model_assemble(st),
         what="the plan: parameters' and activations' placements, options, cp attention variant"),
    Pass("record_collectives", "model", ("placements",), ("collectives recorded",), _req("lower"),
         "passes/lower.py", lambda st: _model_record_collectives(st),
         what="rank 0's program lowered, its collectives recorded in the plan"),
    Pass("quality", "model", ("collectives recorded",), ("quality checked",), _req("checks"),
         "mcompile/sharding/quality.py",
         lambda st: _model_quality(st),
         what="Megatron's layout, or a PlanQualityWarning naming what is not"),
    Pass("plan_stages", "model", ("placements",), ("stage partition",),
         lambda r, m: bool(r.stages) and m.size("pp") > 1, "passes/pp/stages.py", lambda st: _model_plan_stages(st),
         what="pipeline stage partition and schedule (a pp axis)"),
    # -- rank scope: the programs of one rank (rank_programs)
    Pass("lower", "rank", ("placements",), ("per-rank program", "collectives explicit"), _always,
         "passes/lower.py", lambda st: _rank_lower(st),
         what="the per-rank program: local shapes, explicit collectives"),
    Pass("fuse", "rank", ("per-rank program",), ("fused kernels",), lambda c, m: bool(c.fuse), "passes/fuse.py",
         lambda st: _rank_fuse(st),
         what="fused RMSNorm / SwiGLU / RoPE / CE kernels (Config(fuse=True))"),
    Pass("fp8", "rank", ("per-rank program",), ("fp8 linears",), lambda c, m: bool(c.fp8), "passes/fp8_linears.py",
         lambda st: _rank_fp8(st),
         what="FP8 linears (Config(fp8=...))"),
    Pass("pipeline_split", "rank", ("per-rank program",), ("stage programs",), lambda c, m: m.size("pp") > 1,
         "passes/pp/pipeline_split.py", lambda st: _rank_pipeline_split(st),
         what="stage programs (a pp axis)"),
    Pass("fsdp", "rank", ("per-rank program",), ("parameters gathered over dp",), lambda c, m: c.zero == 3,
         "passes/dp/fsdp.py", lambda st: _rank_fsdp(st),
         what="ZeRO-3: parameters sharded over dp, gathered before use (in each stage program under pp)"),
    Pass("recompute", "rank", ("per-rank program",), ("recompute recorded",), _always, "passes/recompute.py",
         lambda st: _rank_recompute(st),
         what="a named recompute policy: recorded; applied to the programs under eager execution"),
    Pass("joint", "signature", ("per-rank program",), ("joint graph",), _joint, "passes/joint.py",
         lambda st: _sig_joint(st),
         what="forward + backward traced into one graph"),
    Pass("partition", "signature", ("joint graph",), ("forward module", "backward module", "saved set"), _joint,
         "passes/joint.py, passes/remat.py", lambda st: _sig_partition(st),
         what="the saved set (recompute policy or auto) -> forward / backward modules"),
    Pass("split_weight", "signature", ("backward module",), ("B module", "W module"),
         lambda c, m: c.execution == "joint" and m.size("pp") > 1 and c.schedule == "zbh1", "passes/joint.py",
         lambda st: _sig_split_weight(st),
         what="zero-bubble: backward -> B (input grads) + W (weight grads)"),
    Pass("accumulate", "signature", ("backward module",), ("gradients into buffers",), _joint, "passes/joint.py",
         lambda st: _sig_accumulate(st),
         what="weight gradients added into the caller's fp32 buffers inside backward"),
    Pass("launch_buckets", "signature", ("gradients into buffers",), ("dp buckets launched in backward",),
         lambda c, m: c.execution == "joint" and bool(c.overlap), "passes/dp/overlap.py",
         lambda st: _sig_launch_buckets(st),
         what="dp gradient buckets launched inside backward (overlap)"),
    Pass("prefetch", "signature", ("forward module", "backward module"), ("ZeRO-3 gathers prefetched",),
         lambda c, m: c.execution == "joint" and bool(c.overlap) and c.zero == 3, "passes/dp/fsdp.py",
         lambda st: _sig_prefetch(st),
         what="ZeRO-3's gathers one layer ahead, reduce-scatters behind (overlap)"),
    Pass("collective_matmul", "signature", ("forward module", "backward module"), ("tp collectives chunked",),
         lambda c, m: c.execution == "joint" and bool(c.overlap) and c.tp_overlap != "off" and m.size("tp") > 1,
         "passes/tp/collective_matmul.py", lambda st: _sig_collective_matmul(st),
         what="tp collectives chunked against their matmuls (tp_overlap)"),
    Pass("inplace_all_reduces", "signature", ("forward module", "backward module"), ("all-reduces in place",),
         lambda c, m: c.execution == "joint" and c.codegen == "eager", "passes/dp/overlap.py",
         lambda st: _sig_inplace_all_reduces(st),
         what="all-reduces of values read nowhere else, in place (eager modules)"),
    Pass("codegen", "signature", ("forward module", "backward module"), ("compiled modules",),
         lambda c, m: c.execution == "joint" and c.codegen != "eager", "passes/codegen.py",
         lambda st: _sig_codegen(st),
         what="Config(codegen='inductor'): each module compiled"),
]


def _run_scope(scope: str, st, upto: str | None = None, start: str | None = None) -> None:
    """Run the enabled passes of ``scope`` in list order, from ``start`` (the caller did those before it: a
    capture handed in) up to ``upto`` (included), each checked against what the passes before it ensured
    (``requires``). ``st.ran`` records the passes that ran."""
    mesh = getattr(st, "mesh", None)
    earlier = {"model": (), "rank": ("model",), "signature": ("model", "rank")}[scope]
    started = start is None
    for p in PASSES:
        started = started or p.name == start
        if p.scope in earlier or (p.scope == scope and not started):  # ran before (compile_plan, rank_programs)
            st.have.update(p.ensures)
            continue
        if p.scope != scope:
            continue
        if mesh is None or p.enabled(st.config, mesh):
            missing = set(p.requires) - st.have
            if missing:
                raise AssertionError(f"pass {p.name} requires {sorted(missing)}, which no pass before it ensured")
            p.run(st)
            st.have.update(p.ensures)
            st.ran.append(p.name)
        if p.name == upto:
            return


class UnknownPassError(ValueError):
    pass


def pass_names() -> list[str]:
    return [p.name for p in PASSES]


def pass_table() -> str:
    """The pass list as a Markdown table (pass, scope, requires, ensures, where): what docs/architecture.md prints,
    checked by a test so that the document cannot drift from the list."""
    rows = ["| pass | scope | what it does | requires | ensures | where |", "|---|---|---|---|---|---|"]
    for p in PASSES:
        rows.append(f"| {p.name} | {p.scope} | {p.what} | {', '.join(p.requires) or '-'} | {', '.join(p.ensures)} "
                    f"| {p.doc} |")
    return "\n".join(rows)


def check_order() -> None:
    """Every pass's requirements are ensured by an earlier pass (or are the capture's)."""
    have = {"captured"}
    for p in PASSES:
        missing = set(p.requires) - have
        if missing:
            raise AssertionError(f"pass {p.name} requires {sorted(missing)}, which no earlier pass ensures")
        have.update(p.ensures)


# ---------------------------------------------------------------------------------------------
# the model scope: capture and plan, once per model and mesh
# ---------------------------------------------------------------------------------------------
@dataclass
class PlanRequest:
    """What the model passes are asked to do (``compile_plan``'s keywords; the cost model and generation ask for
    less): each field is read by the pass it names, and the switches at the end select passes."""

    sequence_parallel: bool = False
    overrides: dict | None = None
    seq: int | None = None
    batch: int | None = None
    vocab_pad_multiple: int = 128
    meta_dtype: torch.dtype | None = None
    token_weighted_loss: bool = False  # mean_loss
    schedule: str = "1f1b"  # plan_stages: the pipeline schedule, its interleaving, microbatches, stage cuts
    virtual_stages: int = 1
    microbatches: int = 1
    pipeline_granularity: str = "auto"
    layers_per_stage: tuple | list | None = None
    stage_cuts: tuple | list | None = None
    pipeline_seq: int | None = None
    for_runtime: bool = False  # check_arguments: refuse what the runtime cannot run yet, too
    repeat_blocks: bool = True  # find_block, repeat (mcompile.sharding.repeat)
    capture_cache: bool = False  # capture: through the on-disk cache
    share: Callable | None = None  # capture: share(produce) runs produce on one rank, its result on every rank
    moe_dispatcher: str = "alltoall"
    moe_capacity_factor: float = 0.0
    cp_attention: str = "auto"
    attention: bool = True  # canonicalize_attention
    checks: bool = True  # check_model, check_arguments, quality (a plan to run or to read, not to price)
    lower: bool = True  # record_collectives: rank 0's program lowered, its collectives in the plan
    stages: bool = True  # plan_stages when the mesh has pp (generation partitions its own graphs)
    kv_cache: bool = False  # kv_cache: generation's prefill and decode graphs (mcompile.apps.generate)


@dataclass
class ModelState:
    """What the model passes read and write. ``candidate``: the model with two groups of each run of alike blocks
    and those runs (mcompile.sharding.repeat.truncate_runs), captured instead of ``model`` while block repetition is on;
    find_block narrows it (or drops it) and asks for the capture again (``again``)."""

    model: torch.nn.Module | None
    mesh: object
    example_inputs: tuple | None
    example_kwargs: dict | None
    config: PlanRequest  # (``config``: what every scope's ``enabled`` reads)
    cap: object = None
    canon: dict = field(default_factory=dict)
    candidate: tuple | None = None
    again: bool = False
    blocks: tuple | None = None
    declined: dict = field(default_factory=dict)  # each run captured whole rather than repeated -> why
    annotation: object = None
    hints: dict | None = None
    axes: dict | None = None
    short: object = None  # the short model's capture, when blocks were repeated
    compiled: object = None  # mcompile.sharding.compiled.Compiled
    kv_graphs: object = None  # kv_cache: passes/kv_cache.py's CacheGraphs
    have: set = field(default_factory=set)
    ran: list = field(default_factory=list)

    def replan(self, mesh, **request) -> ModelState:
        """A state for planning this capture again on ``mesh`` (the cost model re-plans one capture per tp):
        the capture, its canonical form and annotation shared, ``request``'s fields changed."""
        return ModelState(self.model, mesh, self.example_inputs, self.example_kwargs,
                          dataclasses.replace(self.config, **request), cap=self.cap, canon=dict(self.canon),
                          annotation=self.annotation, hints=self.hints)


def plan_model(st: ModelState, *, start: str | None = None, upto: str | None = None) -> ModelState:
    """Run the model passes of PASSES on ``st`` in list order (from ``start``, up to ``upto``): the checks of the
    mesh, the capture, its canonical form and the blocks located in it, the checks of the model and its arguments,
    the annotation, each axis's placements, the repeated blocks, the assembled plan, rank 0's collectives, the
    plan's quality and the pipeline stages. The capture passes run again (capture to find_block) while
    find_block declines a run: it is then captured whole."""
    from mcompile.sharding.repeat import truncate_runs

    names = pass_names()
    first = names.index(start) if start is not None else 0
    last = names.index(upto) if upto is not None else len(names) - 1
    found = names.index("find_block")
    if first <= names.index("capture") and st.config.repeat_blocks and st.model is not None:
        st.candidate = truncate_runs(st.model, keep=2)
    if first <= found:
        _run_scope("model", st, names[min(last, found)], start)
        while st.again:
            st.again, st.ran = False, [n for n in st.ran if names.index(n) < names.index("capture")]
            _run_scope("model", st, "find_block", "capture")
        start = names[found + 1]
    if last > found:
        _run_scope("model", st, upto, start)
    if st.compiled is not None:
        st.compiled.passes = list(st.ran)
    return st


def _model_check_mesh(st: ModelState) -> None:
    from mcompile.passes.cp.plan import check_cp_mesh

    check_cp_mesh(st.mesh)  # before minutes of capture


def _run_label(run) -> str:
    return f"{run.list_path}[{run.start}:{run.start + run.reps * run.period}]"


def _model_capture(st: ModelState) -> None:
    """The short model (two groups of each run of alike blocks) while there is one, else the whole model; a short
    model that does not capture (a forward that depends on the depth: a buffer per layer, ``layers[i]``) gives
    way to the whole model. ``share``: every rank, rank 0 included, plans from the same serialised program (a
    fresh capture's graph carries details serialising drops: the ranks' plans must agree to the digest)."""
    import logging

    from mcompile.capture.export import CaptureError, capture, from_packed

    r = st.config

    def captured(mod):
        if r.share is None:
            return capture(mod, st.example_inputs, st.example_kwargs, meta_dtype=r.meta_dtype, cache=r.capture_cache)
        data = r.share(lambda: capture(mod, st.example_inputs, st.example_kwargs, meta_dtype=r.meta_dtype,
                                       cache=r.capture_cache, pack="bytes"))
        return from_packed(data, mod)

    if st.candidate is not None:
        root, runs = st.candidate
        try:
            st.cap = captured(root)
            return
        except CaptureError as e:
            why = f"the model with two groups of each run does not capture ({str(e).splitlines()[0]})"
            logging.getLogger("mcompile.repeat").info("capturing every block: %s", why)
            st.declined.update({_run_label(run): why for run in runs})
            st.candidate = None
    st.cap = captured(st.model)


def _model_canonicalize(st: ModelState) -> None:
    from mcompile.passes import canonicalize

    st.canon = canonicalize(st.cap.gm)


def _model_kv_cache(st: ModelState) -> None:
    from mcompile.passes.kv_cache import add_kv_cache

    st.kv_graphs = add_kv_cache(st.cap.gm, st.cap.user_inputs[0], set(st.cap.user_inputs))


def _model_attention(st: ModelState) -> None:
    """On every mesh a causal mask built from sizes becomes ``is_causal=True`` (a flash kernel, no [b,1,s,s]
    tensor); under cp GQA's repeat_kv is undone too. Before the blocks are located: a Block names the nodes of
    the graph it was found in, so a rewrite after find_block that drops or replaces a node of a block (GQA's
    ``repeat_kv`` inside each layer) would leave it naming nodes that no longer exist."""
    from mcompile.passes.attention import canonicalize_attention

    st.canon.update(canonicalize_attention(st.cap, gqa=st.mesh.size("cp") > 1))


def _model_find_block(st: ModelState) -> None:
    """Each run's repeated group in the short model's capture; a run whose group is not found is captured whole
    (never a wrong program): the capture passes run again with the others (``again``)."""
    import logging

    from mcompile.sharding.repeat import find_block, truncate_runs

    if st.candidate is None:
        return  # the whole model was captured: nothing repeats
    _, runs = st.candidate
    found = [find_block(st.cap, run, 2) for run in runs]
    if all(b is not None for b, _ in found):
        st.blocks = tuple(b for b, _ in found)
        return
    for run, (b, why) in zip(runs, found):
        if b is None:
            logging.getLogger("mcompile.repeat").info("capturing all %d blocks of %s from %d: %s",
                                                      run.reps * run.period, run.list_path, run.start, why)
            st.declined[_run_label(run)] = why
    st.candidate = truncate_runs(st.model, keep=2, runs=[run for run, (b, _) in zip(runs, found) if b is not None])
    st.again = True


def _model_check_model(st: ModelState) -> None:
    from mcompile.capture.export import warn_unless_loss

    warn_unless_loss(st.cap)  # a plan of logits or several outputs is no training plan (forward still serves them)
    if st.mesh.size("cp") > 1:
        from mcompile.passes.cp.plan import check_cp_model

        check_cp_model(st.cap, st.mesh)


def _model_mean_loss(st: ModelState) -> None:
    from mcompile.passes import mean_loss_to_sum_count

    st.canon["mean_loss_to_sum_count"] = int(mean_loss_to_sum_count(st.cap.gm))


def _model_check_arguments(st: ModelState) -> None:
    from mcompile.sharding.arguments import check_arguments

    check_arguments(st.cap.gm, st.mesh, st.config.microbatches, runtime=st.config.for_runtime)


def _model_annotate(st: ModelState) -> None:
    from mcompile.ir.annotate import annotate

    st.annotation = annotate(st.cap.gm)


def _model_plan_axes(st: ModelState) -> None:
    """Each mesh axis's placements (mcompile.sharding.planner.plan_axes), redistribution priced at the example sizes (or
    ``seq`` / ``batch``)."""
    from mcompile.sharding.compiled import plan_hints
    from mcompile.sharding.planner import plan_axes

    r = st.config
    if st.hints is None:
        st.hints = plan_hints(st.cap, st.example_inputs or (), st.example_kwargs, r.seq, r.batch)
    st.axes = plan_axes(st.cap, st.mesh, r.sequence_parallel, r.overrides, st.hints)


def _model_repeat(st: ModelState) -> None:
    """The short model's capture and placements grown to the real depth (mcompile.sharding.repeat)."""
    from mcompile.ir.annotate import annotate
    from mcompile.sharding.repeat import repeat_axes, repeat_captured

    if st.blocks is None:
        return
    st.short, (st.cap, copies) = st.cap, repeat_captured(st.cap, st.blocks, st.model)
    repeat_axes(st.axes, copies)
    st.annotation = annotate(st.cap.gm, reuse=True)


def _model_assemble(st: ModelState) -> None:
    from mcompile.ir.plan import PlanOptions, SPVariant, input_specs
    from mcompile.sharding.compiled import Compiled
    from mcompile.sharding.planner import assemble_plan

    r, mesh = st.config, st.mesh
    options = PlanOptions(sequence_parallel=r.sequence_parallel and mesh.size("tp") > 1,
                          sp_variant=SPVariant.SAVE_GATHERED, vocab_pad_multiple=r.vocab_pad_multiple,
                          moe_dispatcher=r.moe_dispatcher, moe_capacity_factor=r.moe_capacity_factor)
    if mesh.size("cp") > 1:
        from mcompile.passes.cp.plan import resolve_cp_attention

        options.cp_attention = resolve_cp_attention(r.cp_attention, st.cap, mesh, st.hints)
    plan = assemble_plan(st.cap, mesh, st.axes, options, r.overrides)
    if st.example_inputs is not None:  # what estimate(plan, model) needs
        plan.inputs = input_specs(st.cap.input_names, st.example_inputs, st.example_kwargs)
    st.compiled = Compiled(st.cap, plan, mesh, st.axes, st.canon, st.annotation, short=st.short,
                           repeat_declined=st.declined)


def _model_record_collectives(st: ModelState) -> None:
    """Rank 0's program lowered (kept: rank_programs' lower pass starts from it) and its collectives recorded in
    the plan (what the cost model and the quality check read)."""
    from mcompile.sharding.compiled import _lower

    gm, specs = _lower(st.compiled, 0)
    st.compiled._programs[(0, None)] = (gm, specs)
    st.compiled.plan.collectives = list(specs)


class SequenceParallelWarning(UserWarning):
    """``sequence_parallel=True`` that splits nothing on the sequence: the plan is plain tensor parallelism."""


def _model_quality(st: ModelState) -> None:
    """Megatron's layout, or a PlanQualityWarning naming what is not; a sequence parallelism that splits nothing
    says so. The warnings point at the caller of compile_plan (frames: the pass, its entry, the runner,
    plan_model, compile_plan)."""
    import warnings

    from mcompile.sharding.quality import warn_quality

    st.compiled.quality = warn_quality(st.compiled, stacklevel=7)
    sp = st.config.sequence_parallel and st.mesh.size("tp") > 1
    if sp and not any(c.axis == "tp" and c.forward == "reduce_scatter" for c in st.compiled.plan.collectives):
        warnings.warn("sequence_parallel=True split no activation on its sequence over tp (the token dim is not "
                      "the captured sequence alone, e.g. image patches + text, or there is no row-parallel "
                      "output): the plan runs as plain tensor parallelism", SequenceParallelWarning, stacklevel=6)


def _model_plan_stages(st: ModelState) -> None:
    from mcompile.capture.export import SEQ
    from mcompile.passes.pp.stages import plan_stages

    r = st.config
    plan_stages(st.compiled, r.schedule, r.virtual_stages, r.microbatches, r.pipeline_granularity,
                r.layers_per_stage, r.stage_cuts, r.pipeline_seq or st.hints.get(st.cap.symbols.get(SEQ), 2048))


@dataclass
class RankPrograms:
    """What the rank passes produce for one rank: everything its runtime (``ParallelModule``) executes, built
    here so the runtime imports no pass. The signature passes run later, on each program's first call with an
    input signature, through ``build`` (:func:`build_joint`)."""

    program: fx.GraphModule  # the per-rank program (lower, fuse, fp8; ZeRO-3's gathers without pp)
    fused: dict | None = None  # fuse: counts per fused op
    fp8: object = None  # fp8: mcompile.passes.fp8_linears.Fp8Report
    snapshots: dict[str, str] = field(default_factory=dict)  # pass -> program code after it (show)
    zero3: dict = field(default_factory=dict)  # ZeRO-3: fqn -> ShardSpec of each parameter sharded over dp
    zero3_replicated: list = field(default_factory=list)  # ZeRO-3: the parameters kept whole over dp, and why
    recompute: list = field(default_factory=list)  # the captured nodes a named recompute policy recomputes
    executed: fx.GraphModule | None = None  # without pp, eager execution: the program with recompute applied
    partition: object = None  # pp: the stage partition (mcompile.passes.pp.stages)
    stages: list = field(default_factory=list)  # pp: every stage's program (passes/pp/pipeline_split.py), ZeRO-3's
    #                                             gathers in each; eager execution: recompute applied
    stage_groups: dict = field(default_factory=dict)  # pp: stage -> the recompute groups of its program
    build: Callable = None  # the signature passes: build_joint
    fake_forward: Callable = None  # a program's forward on fake tensors, each repeated layer run once (pp's probe)
    input_columns: Callable = None  # the positions of its inputs' sequences a program reads as a cp rank (loaders)

    def __post_init__(self):
        if self.build is None:
            self.build = build_joint
        if self.fake_forward is None:
            from mcompile.passes.joint_blocks import fake_forward

            self.fake_forward = fake_forward
        if self.input_columns is None:
            from mcompile.passes.cp.reads import input_columns

            self.input_columns = input_columns


@dataclass
class _RankState:
    compiled: object
    rank: int
    config: object
    device: object
    snapshots: bool
    mesh: object = None
    out: RankPrograms | None = None
    have: set = field(default_factory=set)
    ran: list = field(default_factory=list)

    def snap(self, name: str) -> None:
        if self.snapshots:
            self.out.snapshots[name] = self.out.program.code


def rank_programs(compiled, rank: int, config, device=None, *, upto: str | None = None,
                  snapshots: bool = False) -> RankPrograms:
    """Run the rank passes of PASSES for ``rank``, in list order, up to ``upto`` (None: all): lower, fuse, fp8,
    the pipeline split into stage programs, ZeRO-3's gathers (into the program, or each stage), and the named
    recompute policy (under eager execution applied to the programs; joint execution chooses the saved set in
    the signature passes)."""
    st = _RankState(compiled, rank, config, device, snapshots, compiled.mesh)
    _run_scope("rank", st, upto)
    return st.out


def _rank_lower(st: _RankState) -> None:
    # the rank passes rewrite the graph in place: on a copy, not on the compiled plan's cached program
    cached = st.compiled.program(st.rank, st.device)
    from mcompile.passes.nodes import lazy_module

    st.out = RankPrograms(lazy_module(cached, copy.deepcopy(cached.graph), type(cached).__name__))  # rewritten next
    st.snap("lower")


def _rank_fuse(st: _RankState) -> None:
    from mcompile.passes.fuse import fuse

    cap = st.compiled.captured
    st.out.fused = fuse(st.out.program, {n.name: n for n in cap.gm.graph.nodes}, set(cap.params))
    st.snap("fuse")


def _rank_fp8(st: _RankState) -> None:
    from mcompile.passes.fp8_linears import convert_fp8

    cap, config = st.compiled.captured, st.config
    st.out.fp8 = convert_fp8(st.out.program, st.compiled.plan, dict(cap.params), recipe=config.fp8,
                             amax_history_len=config.fp8_amax_history_len, margin=config.fp8_margin,
                             backend=config.fp8_backend, device=st.device or torch.device("cpu"),
                             user_inputs=set(cap.user_inputs))
    st.snap("fp8")


def _rank_pipeline_split(st: _RankState) -> None:
    from mcompile.passes.pp.pipeline_split import split_stages
    from mcompile.passes.pp.stages import partition

    cap, config, out = st.compiled.captured, st.config, st.out
    out.partition = st.compiled.partition or partition(
        cap, st.mesh.size("pp"), config.virtual_stages, granularity=config.pipeline_granularity,
        layers_per_stage=list(config.layers_per_stage) if config.layers_per_stage else None,
        cuts=list(config.stage_cuts) if config.stage_cuts else None, seq=config.pipeline_seq or 2048)
    out.stages = split_stages(out.program, out.partition, cap.params, cap.user_inputs)


def _rank_fsdp(st: _RankState) -> None:
    """ZeRO-3: which parameters are sharded over dp (the runtime holds those as dp pieces), and a gather before
    each one's first use: in each stage program under pp, else in the program when dp > 1."""
    from mcompile.passes.dp import fsdp

    out, dp = st.out, st.mesh.size("dp")
    specs = fsdp.shard_specs(st.compiled.plan, st.mesh)
    out.zero3 = {f: sp for f, sp in specs.items() if sp.sharded}
    out.zero3_replicated = fsdp.replicated_reasons(specs)  # kept whole over dp, and why
    fqn_of = st.compiled.captured.params
    sharded = lambda phs: {ph for ph in phs if fqn_of.get(ph) in out.zero3}  # noqa: E731  (the specs just made)
    if out.stages:
        if out.zero3:
            for stage in out.stages:
                fsdp.insert_gathers(stage.gm, sharded(stage.params), dp)
    elif dp > 1:
        fsdp.insert_gathers(out.program, sharded(fqn_of), dp)
        st.snap("fsdp")


def _rank_recompute(st: _RankState) -> None:
    """The captured nodes a named recompute policy recomputes (the plan's record; recompute="auto" chooses on the
    joint graph), and under eager execution the policy applied inside the programs (every stage: as its owner
    runs it). Under joint execution it only records: the saved set is the signature passes' choice."""
    from mcompile.ir import meta as M
    from mcompile.passes.recompute import apply_recompute, recompute_nodes

    config, out = st.config, st.out

    def groups_of(gm):
        return {} if config.recompute == "auto" else \
            recompute_nodes(gm, config.recompute, config.recompute_method, config.recompute_num_layers)

    groups = groups_of(out.program)
    out.recompute = sorted({n.meta.get(M.ORIGIN, n.name) for n in out.program.graph.nodes if n.name in groups})
    out.stage_groups = {stage.index: groups_of(stage.gm) for stage in out.stages}
    if config.execution != "joint":
        if out.stages:
            for stage in out.stages:
                stage.gm = apply_recompute(stage.gm, out.stage_groups[stage.index])
        else:
            out.executed = apply_recompute(out.program, groups)


def zero3_placeholders(compiled, placeholders) -> set[str]:
    """The parameter placeholders among ``placeholders`` (name -> fqn, or names with ``compiled``'s
    captured params) whose parameter ZeRO-3 shards (passes/dp/fsdp.py ``shard_specs``)."""
    from mcompile.passes.dp.fsdp import shard_specs

    specs = shard_specs(compiled.plan, compiled.mesh)
    fqn_of = compiled.captured.params
    return {ph for ph in placeholders if ph in fqn_of and specs[fqn_of[ph]].sharded}


# ---------------------------------------------------------------------------------------------
# the signature passes: one program's modules for one input signature (run by the runtime's JointRunner
# on the first call with that signature, through the ``build`` it is given: the runtime imports no pass)
# ---------------------------------------------------------------------------------------------
@dataclass
class _SignatureState:
    program: fx.GraphModule
    args: list
    config: object
    name: str = ""
    split_inputs: list | None = None
    accumulate: bool = False
    grad_buckets: Callable | None = None
    budget: object = None
    jg: object = None  # the joint graph (passes/joint.py JointGraph)
    gathered: set = field(default_factory=set)  # ZeRO-3's gathered parameters and values of them alone
    jp: object = None  # the JointProgram
    have: set = field(default_factory=set)
    ran: list = field(default_factory=list)

    def parts(self) -> list[str]:
        return [p for p in ("forward", "backward", "backward_input", "backward_weight")
                if getattr(self.jp, p) is not None]


def build_joint(program: fx.GraphModule, args: list, config, *, name: str = "", split_inputs=None,
                accumulate: bool = False, grad_buckets=None, budget=None):
    """The signature passes of PASSES, in list order, for ``program`` called with ``args``: the joint graph, its
    saved set by the recompute policy (``auto``: by cost under ``budget``, passes/remat.py; ZeRO-3's gathered
    parameters never saved) and the forward / backward partition, the zero-bubble split of backward
    (``split_inputs``: the received activations' positions), weight gradients added into the caller's buffers
    inside backward (``accumulate``), the dp bucket launches inside it (``grad_buckets``, with ``overlap``),
    ZeRO-3's prefetch, collective matmul on the tp collectives (``tp_overlap``), in-place all-reduces (eager) or
    each module handed to the code generator on its first call. Returns the
    :class:`~mcompile.passes.joint.JointProgram` the runtime executes."""
    st = _SignatureState(program, args, config, name, split_inputs, accumulate, grad_buckets, budget)
    _run_scope("signature", st)
    return st.jp


def _sig_joint(st: _SignatureState) -> None:
    from mcompile.passes import joint as J
    from mcompile.passes.dp import fsdp

    st.jg = J.trace_joint(st.program, st.args)
    st.gathered = fsdp.gathered_values(st.jg.gm)  # ZeRO-3: gathered parameters are gathered again, never saved


def _sig_partition(st: _SignatureState) -> None:
    from mcompile.passes import joint as J

    config, jg = st.config, st.jg
    if config.recompute == "auto":
        saved = _solve_auto(jg.gm, st.gathered, config, st.budget, st.name)
    else:
        saved = J.saved_for_policy(jg, config.recompute, config.recompute_method, config.recompute_num_layers)
    if st.gathered:
        saved = [n for n in saved if n not in st.gathered]
    st.jp = J.partition(jg, saved)
    nodes = {n.name: n for n in jg.gm.graph.nodes}
    st.jp.recomputed_ops = sum(not J.is_alias(nodes[r]) and r not in st.gathered for r in st.jp.recomputed)


def _sig_split_weight(st: _SignatureState) -> None:
    from mcompile.passes import joint as J

    if st.split_inputs is not None:  # a stage that receives activations: their gradients (B) apart (W)
        J.split_weight(st.jp, [st.jg.grad_primals.index(i) for i in st.split_inputs if i in st.jg.grad_primals])


def _sig_accumulate(st: _SignatureState) -> None:
    """Gradients into the caller's buffers, inside the graph: every gradient but the received activations' (a
    pipeline stage's), i.e. the weights' (the arguments may be fake here, traced by the pipeline's probe:
    positions, not identities)."""
    from mcompile.passes import joint as J

    if not st.accumulate:
        return
    jg, jp = st.jg, st.jp
    acc = [j for j, i in enumerate(jg.grad_primals) if i not in (st.split_inputs or ())]
    if jp.backward_weight is not None:
        jp.acc_positions = J.accumulate_outputs(jp.backward_weight, [jp.weight_grads.index(j) for j in acc
                                                                      if j in jp.weight_grads])
        jp.acc_positions = [jg.grad_primals[jp.weight_grads[k]] for k in jp.acc_positions]
    jp.acc_full = [jg.grad_primals[j] for j in J.accumulate_outputs(jp.backward, acc)]


def _sig_launch_buckets(st: _SignatureState) -> None:
    if st.accumulate and st.grad_buckets is not None and getattr(st.config, "overlap", False):
        _launch_buckets(st.jp, st.grad_buckets)


def _sig_prefetch(st: _SignatureState) -> None:
    from mcompile.passes.dp import fsdp

    if st.gathered and getattr(st.config, "overlap", False):  # ZeRO-3 gathers one layer ahead, reduce-scatters behind
        st.jp.prefetch = {part: fsdp.prefetch(getattr(st.jp, part), f"{st.name} {part}") for part in st.parts()}


def _sig_collective_matmul(st: _SignatureState) -> None:
    tp_overlap = getattr(st.config, "tp_overlap", "off")
    if not getattr(st.config, "overlap", False) or tp_overlap == "off":
        return
    from mcompile.passes.tp.collective_matmul import rewrite

    hw = runtime_hardware(st.args)
    st.jp.tp_overlap = []
    for part in st.parts():
        st.jp.tp_overlap += rewrite(getattr(st.jp, part), tp_overlap=tp_overlap, hardware=hw,
                                    where="forward" if part == "forward" else "backward")


def _sig_inplace_all_reduces(st: _SignatureState) -> None:
    """All-reduces of values read nowhere else: in place, without the runtime's copy (the eager modules)."""
    if getattr(st.config, "codegen", "eager") != "eager":
        return
    from mcompile.passes.dp.overlap import inplace_all_reduces

    for part in st.parts():
        inplace_all_reduces(getattr(st.jp, part))


def _sig_codegen(st: _SignatureState) -> None:
    codegen = getattr(st.config, "codegen", "eager")
    if codegen != "eager":
        for part in st.parts():
            setattr(st.jp, part, _Compiled(getattr(st.jp, part), codegen))


def joint_runner(program: fx.GraphModule, config, **kwargs):
    """A :class:`~mcompile.runtime.joint_runner.JointRunner` of ``program`` whose modules :func:`build_joint` builds."""
    from mcompile.runtime.joint_runner import JointRunner

    return JointRunner(program, config, build=build_joint, **kwargs)


def _solve_auto(joint: fx.GraphModule, gathered: set[str], config, budget, name: str) -> list[str]:
    """The saved set of ``recompute="auto"`` under ``budget`` (an ActivationBudget; None: all of
    ``config.activation_budget``); an infeasible budget names the program, its share of ``activation_budget``
    and how far below the least it can save it is. ``gathered``: ZeRO-3's gathered parameters (and values of
    them alone), which are never saved: the solver is told so (must_recompute), else it would spend budget on
    values dropped from its saved set afterwards and recompute activations it had room to keep."""
    from mcompile.passes import remat
    from mcompile.runtime.joint_runner import ActivationBudget

    budget = budget or ActivationBudget(config.activation_budget)
    forward, _ = remat.classify(joint)
    try:
        sol = remat.solve(joint, budget.per_call, must_save=set(), must_recompute=gathered & forward)
    except remat.BudgetError as e:
        short = e.minimum - e.budget
        share = (f"activation_budget={budget.total} bytes shared by the {budget.in_flight} forwards in flight at "
                 f"once on {budget.where or 'this rank'}, {budget.per_call} bytes each"
                 if budget.in_flight > 1 else f"activation_budget={budget.total} bytes")
        raise remat.BudgetError(e.budget, e.minimum, (
            f"recompute='auto' on {name or 'this program'}: {share}, is {short} bytes below the least it "
            f"can save for backward ({e.minimum} bytes per microbatch, recomputing all it can); raise "
            f"activation_budget by {e.minimum * budget.in_flight - budget.total} bytes, to at least "
            f"{e.minimum * budget.in_flight}")) from None
    return [n.name for n in joint.graph.nodes if n.name in sol.saved]


def _launch_buckets(jp, grad_buckets) -> None:
    """The dp bucket launches inside the backward (or W) module: jp.launches, and the input positions whose
    readiness those count (jp.ready_positions: the caller must not count them). ``grad_buckets(position)``:
    the bucket of an accumulated input reduced over dp, or None."""
    from mcompile.passes.dp.overlap import launch_buckets

    gp = jp.joint.grad_primals
    whole = {j: grad_buckets(gp[j]) for j in range(len(gp))}
    jp.launches = launch_buckets(jp.backward, {j: b for j, b in whole.items() if b is not None})
    acc = _acc_outputs(jp.backward)
    jp.ready_positions = {gp[j] for j, b in whole.items() if b is not None and j in acc}
    if jp.backward_weight is not None:
        wpos = {k: grad_buckets(gp[j]) for k, j in enumerate(jp.weight_grads)}
        jp.launches_w = launch_buckets(jp.backward_weight, {k: b for k, b in wpos.items() if b is not None})
        acc_w = _acc_outputs(jp.backward_weight)
        jp.ready_positions_w = {gp[jp.weight_grads[k]] for k, b in wpos.items() if b is not None and k in acc_w}


def _acc_outputs(gm: fx.GraphModule) -> set[int]:
    from mcompile.ir.meta import ACC_OUTPUT

    return {n.meta[ACC_OUTPUT] for n in gm.graph.nodes if ACC_OUTPUT in n.meta}


def runtime_hardware(args: list) -> str:
    """The hardware profile (mcompile.cost.hardware) the overlap passes price this machine with: the GPU's,
    by its name, or the CPU/gloo one."""
    dev = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    if dev.type != "cuda":
        return "cpu-gloo"
    name = torch.cuda.get_device_name(dev).lower()
    return next((k for k in ("h200", "h100", "a100", "b200") if k in name), "h100")


class _Compiled:
    """A module handed to the code generator on its first call (its inputs' shapes are known then)."""

    def __init__(self, gm: fx.GraphModule, codegen: str):
        self.gm, self.codegen, self.fn = gm, codegen, None
        self.meta = gm.meta

    def __call__(self, *args):
        if self.fn is None:
            from mcompile.passes.codegen import compile_graph

            self.fn = compile_graph(self.gm, list(args), self.codegen)
        return self.fn(*args)

    @property
    def code(self) -> str:
        return self.gm.code


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
    from mcompile.ir.dropout import RNG_INPUT, rng_state

    user[RNG_INPUT] = rng_state(0, 0)  # a program with dropout reads (seed, step, batch offset) (mcompile.ir.dropout)

    def fake(t, grad: bool):
        if not isinstance(t, torch.Tensor):
            return t
        with mode:
            x = torch.empty(t.shape, dtype=t.dtype)
        return x.requires_grad_() if grad else x

    def piece(n):  # ZeRO-3: this dp rank's piece of the parameter (passes/dp/fsdp.py)
        return state[n].chunk(dp)[coords["dp"]] if n in zero3 else state[n]

    return [fake(piece(n), n in cap.params and state[n].is_floating_point()) if n in state else fake(user[n], False)
            for n in names]


def _bucket_launches(compiled, rank: int, config, rp: RankPrograms, own: set[str]):
    """What ``rank``'s runtime gives each of its joint runners as ``grad_buckets``: ``of(input names)`` is the
    ``grad_buckets(position)`` of a program with those inputs, the dp bucket its backward launches after adding the
    gradient of the parameter fed there (mcompile.ir.buckets ``grad_buckets``, by which runtime/leaves.py and
    runtime/zero.py lay their buffers out, on the parameters the rank holds: its stages' under pp, ``own``; in
    capture order, the runtime's registration order for a model built with its weights). The counted parameters
    are runtime/module.py's: the ones the program reads, or under pp every one of its stages', less the weights
    tied across pipeline ranks (runtime/pipeline.py ``tied_groups``: counted after their cross-stage sum)."""
    from mcompile.ir.buckets import grad_buckets

    cap, mesh = compiled.captured, compiled.mesh
    coords, dp = mesh.coords(rank), mesh.size("dp")
    state = compiled.local_state(rank)
    ph_of = {}
    for ph, fqn in cap.params.items():
        ph_of.setdefault(fqn, ph)
    held = [f for f in ph_of if not rp.stages or f in own]
    pieces = {f: state[ph_of[f]].chunk(dp)[coords["dp"]] if f in rp.zero3 else state[ph_of[f]] for f in held}
    layout = grad_buckets([(f, pieces[f].numel(), pieces[f].is_floating_point()) for f in held], compiled.plan, mesh,
                          coords, zero=config.zero, bucket_mb=config.bucket_mb, zero3=set(rp.zero3))
    if rp.stages:
        pp = mesh.size("pp")
        ranks: dict[str, set] = {}
        for st in rp.stages:
            for ph in st.params:
                ranks.setdefault(cap.params[ph], set()).add(st.index % pp)
        counted, deferred = set(held), {f for f in held if len(ranks.get(f, ())) > 1}
    else:
        used = {n.name for n in rp.program.graph.nodes if n.op == "placeholder" and n.users}
        counted, deferred = {fqn for ph, fqn in cap.params.items() if ph in used}, set()

    def of(names: list[str]):
        return lambda pos: layout.launched(cap.params.get(names[pos]) if pos < len(names) else None, counted, deferred)
    return of


def show(compiled, rank: int, config, inputs: tuple, after: str = "codegen") -> str:
    """The programs of ``rank`` after pass ``after`` (and every pass before it that ``config``
    enables), as Python: the per-rank program (or, under pp, this rank's stage programs) for rank
    passes; for signature passes the joint graph, or the forward and backward modules (B and W for
    zero-bubble). Traced on fake tensors: no memory, no communication."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mcompile.passes.joint import is_alias

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
             "# passes run: " + ", ".join(list(compiled.passes) + [q.name for q in PASSES[:idx + 1]
                                                                  if q.scope != "model" and q.enabled(config, mesh)])]
    rp = rank_programs(compiled, rank, config, torch.device("cpu"), upto=after if p.scope == "rank" else None)
    if rp.fp8 is not None:
        lines += [f"# {x}" for x in rp.fp8.text().splitlines()]
    pp = mesh.size("pp")
    pp_rank = mesh.coords(rank).get("pp", 0)
    if rp.stages:
        programs = [(f"stage {st.index}", st.gm, st.inputs, len(st.received), st.index % pp == pp_rank)
                    for st in rp.stages]
        from mcompile.runtime.pipeline import stage_activation_budget
        from mcompile.runtime.schedules import build_schedule

        actions = build_schedule(config.schedule, pp, config.virtual_stages, config.microbatches)
        budgets = {f"stage {st.index}": stage_activation_budget(config, actions, st.index) for st in rp.stages}
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
    own = {compiled.captured.params[ph] for st in rp.stages if st.index % pp == pp_rank for ph in st.params}
    launches = _bucket_launches(compiled, rank, config, rp, own)
    for label, gm, in_names, n_recv, mine in programs:
        zero3 = {ph for ph in in_names if compiled.captured.params.get(ph) in rp.zero3}  # the runtime's dp pieces
        args = _example_args(compiled, rank, in_names[:len(in_names) - n_recv], inputs, config.microbatches, mode,
                             zero3)
        args += carried
        # as the runtime builds it (runtime/module.py, runtime/pipeline.py Pipeline._make_runner): weight gradients
        # added into their buffers inside backward, a stage's received inputs apart (their gradients B's, whatever
        # the schedule), and in the rank's own programs the dp bucket launches after their last gradient
        split = list(range(len(in_names) - n_recv, len(in_names))) if rp.stages else None
        runner = joint_runner(gm, config, split_inputs=split, name=label, accumulate=lambda a: {},
                              grad_buckets=launches(in_names) if mine else None, budget=budgets.get(label))
        with torch.enable_grad():
            jp = runner.compile(args)
        with mode, torch.no_grad():  # the program's module constants lifted after its inputs, as JointRunner.forward
            fwd_args = list(args) + jp.joint.constants
            res = jp.forward.gm(*fwd_args) if hasattr(jp.forward, "gm") else jp.forward(*fwd_args)
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
        if split_w and jp.backward_input is not None and jp.input_grads and idx >= names.index("split_weight"):
            lines += [f"# ---- {label}: backward B (input gradients) ----", _code(jp.backward_input),
                      f"# ---- {label}: backward W (weight gradients) ----", _code(jp.backward_weight)]
        else:
            lines += [f"# ---- {label}: backward ----", _code(jp.backward)]
    if after == "codegen" and config.codegen != "eager":
        lines.append(f"# codegen={config.codegen!r}: the modules above are compiled on their first call")
    return "\n".join(lines)


def _code(m) -> str:
    return m.gm.code if hasattr(m, "gm") else m.code
