"""The façade: ties capture, the planner, the passes and (later) the runtime together (DESIGN §2)."""

from __future__ import annotations

import functools
import warnings

import torch

from mcompile.annotate import annotate
from mcompile.arguments import check_arguments
from mcompile.capture import SEQ, CaptureError, capture, warn_unless_loss
from mcompile.compiled import Compiled, _lower, plan_hints  # noqa: F401  (Compiled: re-exported)
from mcompile.mesh import Mesh
from mcompile.plan import Plan, PlanOptions, SPVariant, input_specs
from mcompile.planner import assemble_plan, plan_axes

__all__ = ["Compiled", "SequenceParallelWarning", "compile_plan", "plan"]


class SequenceParallelWarning(UserWarning):
    """``sequence_parallel=True`` that splits nothing on the sequence: the plan is plain tensor parallelism."""


def _capture(model, example_inputs, example_kwargs, meta_dtype, repeat_blocks: bool, cache: bool = False,
             share=None, rewrite=None):
    """(capture, canonicalize's counts, blocks, declined), canonicalised: the short model's capture and the
    repeated group of each run of alike blocks (mcompile.repeat), else the whole model's capture and
    None; ``declined``: each run captured whole rather than repeated -> why. ``cache``: through the on-disk
    capture cache (mcompile.capture_cache); ``share(produce)``: runs ``produce`` on one rank and returns its result
    on every rank (parallelize: rank 0 captures, every rank plans from the same serialised program).
    ``rewrite(cap) -> counts``: a mesh-dependent rewrite of the canonical graph (the attention
    canonicalisation: causal masks on every mesh, GQA's repeat_kv under cp), applied to every capture
    here, before the blocks are located: a
    :class:`~mcompile.repeat.Block` names the nodes of the graph it was found in, so a rewrite after
    :func:`~mcompile.repeat.find_block` that drops or replaces a node of a block (GQA's ``repeat_kv``
    inside each layer) or one feeding it (the causal mask before the run) would leave the block naming
    nodes that no longer exist, and the graph repeated would not be the graph planned."""
    import logging

    from mcompile.passes import canonicalize
    from mcompile.repeat import find_block, truncate_runs

    def captured(mod):
        if share is None:
            return capture(mod, example_inputs, example_kwargs, meta_dtype=meta_dtype, cache=cache)
        from mcompile.capture import from_packed

        # every rank, rank 0 included, plans from the same serialised program (a fresh capture's graph
        # carries details serialising drops: the ranks' plans must agree to the digest)
        data = share(lambda: capture(mod, example_inputs, example_kwargs, meta_dtype=meta_dtype, cache=cache,
                                     pack="bytes"))
        return from_packed(data, mod)

    log = logging.getLogger("mcompile.repeat")
    declined: dict[str, str] = {}

    def label(run) -> str:
        return f"{run.list_path}[{run.start}:{run.start + run.reps * run.period}]"

    short = truncate_runs(model, keep=2) if repeat_blocks else None
    while short is not None:
        root, runs = short
        try:
            cap = captured(root)
        except CaptureError as e:  # a forward that depends on the depth (a buffer per layer, layers[i])
            why = f"the model with two groups of each run does not capture ({str(e).splitlines()[0]})"
            log.info("capturing every block: %s", why)
            declined.update({label(r): why for r in runs})
            break
        canon = canonicalize(cap.gm)
        canon.update(rewrite(cap) if rewrite is not None else {})
        found = [find_block(cap, run, 2) for run in runs]
        if all(b is not None for b, _ in found):
            return cap, canon, tuple(b for b, _ in found), declined
        for run, (b, why) in zip(runs, found):
            if b is None:  # never a wrong program: the run is captured whole
                log.info("capturing all %d blocks of %s from %d: %s", run.reps * run.period, run.list_path,
                         run.start, why)
                declined[label(run)] = why
        short = truncate_runs(model, keep=2, runs=[r for r, (b, _) in zip(runs, found) if b is not None])
    cap = captured(model)
    canon = canonicalize(cap.gm)
    canon.update(rewrite(cap) if rewrite is not None else {})
    return cap, canon, None, declined


def compile_plan(
    model: torch.nn.Module,
    mesh: Mesh,
    example_inputs: tuple = (),
    example_kwargs: dict | None = None,
    *,
    sequence_parallel: bool = False,
    overrides: dict | None = None,
    seq: int | None = None,
    batch: int | None = None,
    vocab_pad_multiple: int = 128,
    meta_dtype: torch.dtype | None = None,
    token_weighted_loss: bool = False,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    microbatches: int = 1,
    pipeline_granularity: str = "auto",
    layers_per_stage=None,
    stage_cuts=None,
    pipeline_seq: int | None = None,
    for_runtime: bool = False,
    repeat_blocks: bool = True,
    capture_cache: bool = False,
    share=None,
    moe_dispatcher: str = "alltoall",
    moe_capacity_factor: float = 0.0,
    cp_attention: str = "auto",
) -> Compiled:
    """Capture, plan and lower (rank 0's program; others on demand).

    ``meta_dtype``: capture on the meta device with parameters in this dtype (the runtime's compute
    dtype). ``token_weighted_loss``: rewrite a mean cross-entropy output into (sum, count)
    (:mod:`mcompile.passes.loss`). ``for_runtime``: the programs will run (``parallelize``), so what
    the runtime cannot do yet is refused too (:func:`mcompile.arguments.check_arguments`).
    ``repeat_blocks``: capture, plan and lower two groups of each run of alike blocks and repeat them
    (mcompile.repeat: the same plan and programs as the whole model's capture, at any depth's cost);
    False captures the whole model. ``capture_cache``: look the capture up in / add it to the on-disk
    cache (mcompile.capture_cache); ``share``: see :func:`_capture` (parallelize)."""
    from mcompile.passes import mean_loss_to_sum_count

    if mesh.size("pp") > 1 and set(mesh.axis_names) == {"pp"}:  # a degenerate dp axis carries the stages' params
        mesh = Mesh.fake(dp=1, pp=mesh.size("pp")) if mesh.fake_mesh else Mesh(dp=1, pp=mesh.size("pp"))
    from mcompile.passes.attention import canonicalize_attention

    if mesh.size("cp") > 1:
        from mcompile.cp_plan import check_cp_mesh

        check_cp_mesh(mesh)  # before minutes of capture
    # on every mesh: a causal mask built from sizes becomes is_causal=True (a flash kernel, no [b,1,s,s] tensor);
    # under cp GQA's repeat_kv is undone too. Inside _capture: the blocks are located in the rewritten graph
    rewrite = functools.partial(canonicalize_attention, gqa=mesh.size("cp") > 1)
    cap, canon, blocks, declined = _capture(model, example_inputs, example_kwargs, meta_dtype, repeat_blocks,
                                           capture_cache, share, rewrite)
    warn_unless_loss(cap)  # a plan of logits or several outputs is no training plan (forward still serves them)
    if mesh.size("cp") > 1:
        from mcompile.cp_plan import check_cp_model

        check_cp_model(cap, mesh)
    if token_weighted_loss:
        canon["mean_loss_to_sum_count"] = int(mean_loss_to_sum_count(cap.gm))
    check_arguments(cap.gm, mesh, microbatches, runtime=for_runtime)
    annotation = annotate(cap.gm)
    hints = plan_hints(cap, example_inputs, example_kwargs, seq, batch)
    axes = plan_axes(cap, mesh, sequence_parallel, overrides, hints)
    short = None
    if blocks is not None:
        from mcompile.repeat import repeat_axes, repeat_captured

        short, (cap, copies) = cap, repeat_captured(cap, blocks, model)
        repeat_axes(axes, copies)
        annotation = annotate(cap.gm, reuse=True)
    sp = sequence_parallel and mesh.size("tp") > 1
    options = PlanOptions(sequence_parallel=sp, sp_variant=SPVariant.SAVE_GATHERED,
                          vocab_pad_multiple=vocab_pad_multiple, moe_dispatcher=moe_dispatcher,
                          moe_capacity_factor=moe_capacity_factor)
    if mesh.size("cp") > 1:
        from mcompile.cp_plan import resolve_cp_attention

        options.cp_attention = resolve_cp_attention(cp_attention, cap, mesh, hints)
    plan = assemble_plan(cap, mesh, axes, options, overrides)
    plan.inputs = input_specs(cap.input_names, example_inputs, example_kwargs)  # what estimate(plan, model) needs
    compiled = Compiled(cap, plan, mesh, axes, canon, annotation, short=short, repeat_declined=declined)
    gm, specs = _lower(compiled, 0)
    compiled._programs[(0, None)] = (gm, specs)
    plan.collectives = list(specs)
    from mcompile.quality import warn_quality

    compiled.quality = warn_quality(compiled)  # Megatron's layout, or a PlanQualityWarning naming what is not
    if sp and not any(c.axis == "tp" and c.forward == "reduce_scatter" for c in specs):
        warnings.warn("sequence_parallel=True split no activation on its sequence over tp (the token dim is not "
                      "the captured sequence alone, e.g. image patches + text, or there is no row-parallel "
                      "output): the plan runs as plain tensor parallelism", SequenceParallelWarning, stacklevel=2)
    if mesh.size("pp") > 1:
        _plan_pipeline(compiled, schedule, virtual_stages, microbatches, pipeline_granularity, layers_per_stage,
                       stage_cuts, pipeline_seq or hints.get(cap.symbols.get(SEQ), 2048))
    return compiled


def _plan_pipeline(compiled: Compiled, schedule, virtual, microbatches, granularity, layers_per_stage, cuts, seq):
    """Stage partition (mcompile.stages) and the schedule, recorded in the plan."""
    from mcompile.runtime.schedules import bubble_fraction, build_schedule
    from mcompile.stages import partition

    pp = compiled.mesh.size("pp")
    build_schedule(schedule, pp, virtual, microbatches)  # validates microbatches / interleaving first
    part = partition(compiled.captured, pp, virtual, granularity=granularity, seq=seq,
                     layers_per_stage=list(layers_per_stage) if layers_per_stage else None,
                     cuts=list(cuts) if cuts else None)
    compiled.partition = part
    plan = compiled.plan
    plan.stage_cuts = part.cut_nodes()
    plan.schedule = schedule
    local = [0] * part.num_stages  # this rank's elements of each stage's parameters (tied: first stage)
    trunk = part.trunk
    param_stages = {}  # fqn -> every stage using it (tied weights: two)
    for ph in compiled.captured.param_nodes:
        uses = [trunk.pos[u.name] for u in ph.users if u.name in trunk.pos]
        if uses:
            fqn = compiled.captured.params[ph.name]
            local[part.stage_of_position(min(uses))] += plan.params[fqn].local_numel
            param_stages[fqn] = sorted({part.stage_of_position(u) for u in uses})
    plan.pipeline = {
        "pp": pp, "virtual": virtual, "microbatches": microbatches, "granularity": part.granularity, "seq": seq,
        "stages": [{"rank": s % pp, "layers": list(part.layers(s)), "params": part.stage_params[s],
                    "local_params": local[s],
                    "cost": part.stage_cost[s], "act_bytes_per_sample": part.stage_act_bytes[s]}
                   for s in range(part.num_stages)],
        "param_stages": param_stages,
        "imbalance": part.imbalance, "optimum": part.optimum, "pinned": part.pinned,
        "bubble": bubble_fraction(schedule, pp, microbatches, virtual),
    }


def plan(
    model: torch.nn.Module,
    mesh: Mesh,
    example_inputs: tuple = (),
    example_kwargs: dict | None = None,
    **options,
) -> Plan:
    """Plan ``model`` over ``mesh`` (no processes, no memory on a meta-device model): DESIGN §3."""
    return compile_plan(model, mesh, example_inputs, example_kwargs, **options).plan




def parallelize(
    model: torch.nn.Module,
    mesh: Mesh | None = None,
    example_inputs: tuple = (),
    example_kwargs: dict | None = None,
    *,
    config=None,
    plan: str | None = None,
    hardware=None,
    global_batch: int | None = None,
    weights=None,
    distributed_optimizer: bool = False,
    **options,
):
    """Plan ``model`` over ``mesh`` and return a :class:`~mcompile.runtime.module.ParallelModule`
    that trains it on this process's rank (DESIGN §3). Call it on every rank with the same model
    (rank 0's weights are broadcast; a model built on the meta device is initialised piece by piece on
    every rank by its own initialisers, seeded per tensor name from ``init_seed``: the same values at
    every layout, :mod:`mcompile.runtime.init`) and the same arguments; options are
    :class:`mcompile.Config` fields, as keywords or one ``config=``.

    ``plan="auto"`` (no mesh): :func:`mcompile.search.search` picks the mesh and the options for the
    world size on ``hardware`` (default "cpu-gloo" on CPU, "h100" on GPU) at ``global_batch`` (default:
    the example inputs' batch); rank 0 logs the choice and why (logger ``mcompile.search``). The search
    picks ZeRO 0 (any torch optimizer over ``pm.parameters()``) unless ``distributed_optimizer=True`` says
    the optimizer will be a :class:`~mcompile.runtime.zero.DistributedOptimizer` (then ZeRO 0/1), or
    ``zero=`` is given.

    ``weights=PATH``: every rank reads the pieces of the parameters it holds straight from a checkpoint,
    one tensor at a time — a Hugging Face folder (``model.safetensors`` or a sharded
    ``model.safetensors.index.json``), a ``.safetensors`` file, or a folder written by
    ``pm.save_checkpoint`` under any plan (:mod:`mcompile.runtime.weights`). With a model built on the
    meta device no rank ever holds the whole model; a model with values gets the checkpoint's values
    (they win; nothing is broadcast). Keys are the model's ``state_dict()`` keys (a tied weight under
    any of its names; a wrapper's common prefix such as ``m.`` is matched); a missing tensor, another
    shape or no checkpoint at ``PATH`` is a :class:`~mcompile.runtime.weights.WeightsError` raised on
    every rank before any value is read. Buffers the checkpoint lacks are initialised as without it."""
    import datetime
    import hashlib

    import torch.distributed as dist

    from mcompile.config import Config
    from mcompile.runtime.launch import device_mesh, init_distributed, rank_device
    from mcompile.runtime.module import ParallelModule

    if config is not None and options:
        raise TypeError("pass options either as keywords or as config=, not both")
    if plan not in (None, "auto") or (plan is None) == (mesh is None):
        raise ValueError("parallelize() takes a mesh, or plan='auto' (no mesh) to search one")
    config = config or Config(**options)
    init_distributed(timeout=datetime.timedelta(seconds=config.collective_timeout_s))
    world = dist.get_world_size()
    if plan == "auto":
        mesh, config = _auto_plan(model, world, example_inputs, example_kwargs, config, options, hardware,
                                  global_batch, distributed_optimizer)
    if mesh.size() != world:
        raise ValueError(
            f"{mesh!r} has {mesh.size()} ranks but the world has {world} processes: make the product of "
            f"the mesh axes equal the number of processes (launch {mesh.size()} processes, or change the mesh)"
        )
    config.check_mesh(mesh)  # options this mesh cannot run (ZeRO without dp, ZeRO-3 with ep): before planning
    if weights is not None:  # no checkpoint there: the same error on every rank before minutes of planning
        from mcompile.runtime.weights import check_path

        check_path(weights)
    device = rank_device()  # also the current CUDA device on NCCL (LOCAL_RANK)
    device_type = device.type
    shape, names = mesh.shape, mesh.axis_names
    if mesh.size("pp") > 1 and len(names) == 1:  # stage parameters live on the other axes: give them one
        shape, names = (1, *shape), ("dp", *names)
    dmesh = device_mesh(device_type, shape, names)  # made once per process and mesh: reused by later calls
    compiled = compile_plan(
        model, mesh, example_inputs, example_kwargs, sequence_parallel=config.sequence_parallel,
        overrides=config.overrides or None, vocab_pad_multiple=config.vocab_pad_multiple,
        meta_dtype=config.dtype, token_weighted_loss=True, schedule=config.schedule,
        virtual_stages=config.virtual_stages, microbatches=config.microbatches,
        pipeline_granularity=config.pipeline_granularity, layers_per_stage=config.layers_per_stage,
        stage_cuts=config.stage_cuts, pipeline_seq=config.pipeline_seq, for_runtime=True,
        capture_cache=config.capture_cache, share=_from_rank0 if world > 1 else None,
        moe_dispatcher=config.moe_dispatcher, moe_capacity_factor=config.moe_capacity_factor,
        cp_attention=config.cp_attention,
    )
    # every rank planned on its own: they must agree, or collectives would not match (a hang)
    digest = hashlib.sha256(compiled.plan.to_json().encode()).hexdigest()
    digests = [None] * world
    dist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        bad = [r for r, d in enumerate(digests) if d != digests[0]]
        raise RuntimeError(f"ranks {bad} planned differently from rank 0: build the same model with the same "
                           "example inputs and options on every rank")
    from mcompile.compiler import rank_programs

    programs = rank_programs(compiled, dist.get_rank(), config, device)  # the rank passes, for this rank
    return ParallelModule(compiled, dmesh, config, model, weights=weights, programs=programs)


def _from_rank0(produce):
    """``produce()`` run on rank 0 and its result (or its exception, raised on every rank rather than
    leaving them waiting) broadcast to every rank."""
    import torch.distributed as dist

    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = produce()
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            box[0] = e
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def _auto_plan(model, world, example_inputs, example_kwargs, config, options, hardware, global_batch,
               distributed_optimizer=False):
    """``parallelize(plan="auto")``: rank 0 searches (mcompile.search.auto_layout) and broadcasts its
    choice (or its error: every rank raises it rather than waiting); the mesh and the Config."""
    import dataclasses
    import logging

    import torch.distributed as dist

    from mcompile.config import Config
    from mcompile.runtime.launch import uses_nccl
    from mcompile.search import auto_layout

    if not options:  # given as config=: its non-default fields are the user's choices
        default = Config()
        options = {f.name: getattr(config, f.name) for f in dataclasses.fields(Config)
                   if getattr(config, f.name) != getattr(default, f.name)}
    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = auto_layout(model, world, tuple(example_inputs), example_kwargs, dict(options), hardware=hardware,
                                 global_batch=global_batch, distributed_optimizer=distributed_optimizer,
                                 device_type="cuda" if uses_nccl(dist.get_backend()) else "cpu")
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            box[0] = e
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    axes, chosen, why = box[0]
    if dist.get_rank() == 0:
        logging.getLogger("mcompile.search").info(why)
    return Mesh(**axes), Config(**chosen)
