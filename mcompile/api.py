"""The façade: ties capture, the planner, the passes and (later) the runtime together (DESIGN §2)."""

from __future__ import annotations

import torch

from mcompile.compiler import SequenceParallelWarning  # noqa: F401  (re-exported)
from mcompile.ir.mesh import Mesh
from mcompile.ir.plan import Plan
from mcompile.sharding.compiled import Compiled  # noqa: F401  (re-exported)

__all__ = ["Compiled", "SequenceParallelWarning", "compile_plan", "plan"]


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
    the runtime cannot do yet is refused too (:func:`mcompile.sharding.arguments.check_arguments`).
    ``repeat_blocks``: capture, plan and lower two groups of each run of alike blocks and repeat them
    (mcompile.sharding.repeat: the same plan and programs as the whole model's capture, at any depth's cost);
    False captures the whole model. ``capture_cache``: look the capture up in / add it to the on-disk
    cache (mcompile.capture.cache); ``share(produce)``: runs ``produce`` on one rank and returns its result
    on every rank (parallelize: rank 0 captures, every rank plans from the same serialised program). The model passes of
    :data:`mcompile.compiler.PASSES` do the work (:func:`mcompile.compiler.plan_model`)."""
    from mcompile.compiler import ModelState, PlanRequest, plan_model

    if mesh.size("pp") > 1 and set(mesh.axis_names) == {"pp"}:  # a degenerate dp axis carries the stages' params
        mesh = Mesh.fake(dp=1, pp=mesh.size("pp")) if mesh.fake_mesh else Mesh(dp=1, pp=mesh.size("pp"))
    request = PlanRequest(
        sequence_parallel=sequence_parallel, overrides=overrides, seq=seq, batch=batch,
        vocab_pad_multiple=vocab_pad_multiple, meta_dtype=meta_dtype, token_weighted_loss=token_weighted_loss,
        schedule=schedule, virtual_stages=virtual_stages, microbatches=microbatches,
        pipeline_granularity=pipeline_granularity, layers_per_stage=layers_per_stage, stage_cuts=stage_cuts,
        pipeline_seq=pipeline_seq, for_runtime=for_runtime, repeat_blocks=repeat_blocks,
        capture_cache=capture_cache, share=share, moe_dispatcher=moe_dispatcher,
        moe_capacity_factor=moe_capacity_factor, cp_attention=cp_attention)
    st = ModelState(model, mesh, tuple(example_inputs), example_kwargs, request)
    return plan_model(st).compiled


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

    from mcompile.ir.config import Config
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

    from mcompile.ir.config import Config
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
