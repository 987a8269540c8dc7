"""Options of a parallel run, typed and validated on construction (CONVENTIONS 6)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

import torch


class Choice(StrEnum):
    """A string switch of :class:`Config`: a member compares, hashes, formats and serialises (JSON) as its value, and
    its repr is the value's, so ``Config(schedule="1f1b")`` and ``Config(schedule=PipelineSchedule.ONE_F_ONE_B)`` are
    the same config and messages read as before."""

    def __repr__(self) -> str:
        return repr(self.value)


class Inputs(Choice):
    GLOBAL = "global"  # every rank passes the whole batch (single-device semantics); the default
    LOCAL = "local"  # every rank passes its own data-parallel slice, as a data loader does


class RecomputePolicy(Choice):
    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"  # the attention core
    AUTO = "auto"  # by cost under activation_budget (passes/remat.py)


class RecomputeMethod(Choice):
    UNIFORM = "uniform"  # groups of layers
    BLOCK = "block"  # the first layers


class Execution(Choice):
    JOINT = "joint"  # forward + backward modules run without autograd (passes/joint.py)
    AUTOGRAD = "autograd"  # the fallback: forward under autograd


class Codegen(Choice):
    EAGER = "eager"  # fx-generated Python
    INDUCTOR = "inductor"  # TorchInductor (passes/codegen.py)


class PipelineSchedule(Choice):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZBH1 = "zbh1"  # zero-bubble: backward split into B (inputs) and W (weights)


class PipelineGranularity(Choice):
    LAYER = "layer"
    SUBLAYER = "sublayer"
    AUTO = "auto"


class Fp8Recipe(Choice):
    CURRENT = "current"
    DELAYED = "delayed"


class Fp8Backend(Choice):
    MCOMPILE = "mcompile"
    TE = "te"  # Transformer Engine (optional)


class MoeDispatcher(Choice):
    ALLTOALL = "alltoall"
    ALLGATHER = "allgather"


class CpAttention(Choice):
    AUTO = "auto"
    RING = "ring"
    ALLGATHER = "allgather"
    A2A = "a2a"


# Config field -> its switch (values accepted as strings; fp8 also None: off)
_CHOICES = {"recompute": RecomputePolicy, "recompute_method": RecomputeMethod, "execution": Execution,
            "codegen": Codegen, "schedule": PipelineSchedule, "pipeline_granularity": PipelineGranularity,
            "fp8": Fp8Recipe, "fp8_backend": Fp8Backend, "moe_dispatcher": MoeDispatcher, "cp_attention": CpAttention}


# what a bad value's error offers, where it says more than the values
_OFFERED = {"execution": "'joint' (default) or 'autograd' (the fallback)",
            "fp8": "None (off), 'current' or 'delayed' (per-tensor scaling recipes)",
            "fp8_backend": "'mcompile' or 'te' (Transformer Engine)",
            "pipeline_granularity": "'auto', 'layer' or 'sublayer'",
            "schedule": "one of gpipe, 1f1b, interleaved, zbh1"}


def _options(name: str, choice: type[Choice]) -> str:
    if name in _OFFERED:
        return _OFFERED[name]
    vals = [repr(v.value) for v in choice]
    return ", ".join(vals[:-1]) + " or " + vals[-1]


@dataclass(kw_only=True, frozen=True)
class Config:
    sequence_parallel: bool = False
    microbatches: int = 1  # gradient accumulation steps inside one train_step
    dtype: torch.dtype = torch.float32  # compute dtype; parameters, gradients and their reduction stay fp32
    # fp16 compute only (runtime/loss_scale.py): dynamic loss scaling, Megatron's DynamicGradScaler rule. The scale
    # starts at initial_loss_scale, doubles after loss_scale_window clean steps in a row, and an inf/NaN gradient on
    # any rank skips the step on every rank and halves it (after loss_scale_hysteresis overflows in a row since the
    # last growth), never below min_loss_scale. bf16 and fp32 need no scaling and ignore these
    initial_loss_scale: float = 2.0**16
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    loss_scale_hysteresis: int = 1
    inputs: Inputs = Inputs.GLOBAL
    overrides: dict = field(default_factory=dict)  # placement overrides, see mcompile.sharding.planner
    bucket_mb: float = 25.0  # data-parallel gradient buckets (MB of fp32 gradients)
    # a vocabulary that tp does not divide is padded to a multiple of tp * this, so each rank's slice is a
    # multiple of it (Megatron's --make-vocab-size-divisible-by 128): GPT-2's 50257 at tp=8 -> 51200
    vocab_pad_multiple: int = 128
    fuse: bool = False  # run RMSNorm / SwiGLU through mcompile's fused kernels (mcompile.passes.fuse)
    # "none" | "full" | "selective" (attention core) | "auto" (by cost under activation_budget: mcompile.passes.remat);
    # on the joint graph (passes/joint.py)
    recompute: RecomputePolicy = RecomputePolicy.NONE
    recompute_method: RecomputeMethod = RecomputeMethod.UNIFORM  # full recompute: "uniform" or "block" (first layers)
    recompute_num_layers: int = 1
    # recompute="auto": bytes of saved activations one rank holds at its peak. Without pp that is one program
    # call's (microbatches run one at a time); under pp a stage's forwards share it with the others its rank
    # holds in flight under the schedule (1F1B: p on stage 0, 1 on the last; runtime/pipeline.py
    # stage_activation_budget), each getting budget // in-flight
    activation_budget: int | None = None
    # "joint": each program traced into forward + backward modules run without autograd (passes/joint.py);
    # "autograd": the fallback for programs whose backward cannot be traced: forward under autograd
    execution: Execution = Execution.JOINT
    codegen: Codegen = Codegen.EAGER  # "eager" (fx-generated Python) | "inductor" (TorchInductor: passes/codegen.py)
    # pipeline parallelism (a "pp" mesh axis): mcompile.passes.pp.stages, mcompile.runtime.schedules
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B  # "gpipe" | "1f1b" | "interleaved" | "zbh1"
    virtual_stages: int = 1  # stages per pipeline rank (interleaved schedule)
    # "layer" boundaries, "sublayer" (also between attention and MLP), or "auto": inside layers only where that lowers
    # the slowest stage
    pipeline_granularity: PipelineGranularity = PipelineGranularity.AUTO
    layers_per_stage: tuple | None = None  # pin the split: layers of each stage, in order
    stage_cuts: tuple | None = None  # pin the split: captured node names where stages 1..K-1 begin
    pipeline_seq: int | None = None  # sequence length at which stage costs are balanced (default: the example's)
    # FP8 linears (mcompile.passes.fp8_linears): None (off) | "current" | "delayed" per-tensor scaling
    fp8: Fp8Recipe | None = None
    fp8_amax_history_len: int = 16  # delayed scaling: steps of amax history behind each scale
    fp8_margin: int = 0  # scale = fp8_max / amax / 2**margin
    fp8_backend: Fp8Backend = Fp8Backend.MCOMPILE  # "mcompile" (our kernels) | "te" (Transformer Engine, optional)
    # ZeRO stage (Rajbhandari et al. 2020), over the dp axis: 0 off; 1 optimizer state and fp32 master weights
    # sharded, gradients reduce-scattered (mcompile.runtime.zero; create the optimizer with its
    # DistributedOptimizer); 2 also the gradients: each bucket reduce-scattered after every microbatch into an
    # fp32 shard, the full buffer freed; 3 also the parameters: DTensors sharded over dp (any torch optimizer on
    # pm.parameters(), as FSDP2), gathered per layer just before use, freed after, gathered again in backward
    # (passes/dp/overlap.py). 1 with dp=1 warns and runs as 0; 2 and 3 with dp=1 are errors.
    zero: int = 0
    # the overlap passes (passes/dp/overlap.py): dp gradient buckets launched inside the backward as soon as their
    # last gradient is added, ZeRO-3 parameter gathers prefetched one layer ahead; False: every collective
    # where the program first needs it, the dp buckets reduced after the backward (for measuring what it saves)
    overlap: bool = True
    # tensor-parallel collective matmul (passes/tp/collective_matmul.py): "auto" (per op, where the cost model of this
    # machine's profile says chunks pay), "off", a number of chunks for every eligible all-gather -> matmul /
    # matmul -> reduce-scatter, or "symm_mem" (torch's fused async-TP ops: not emitted yet; warns and runs "auto")
    tp_overlap: str | int = "auto"
    # how long a collective may wait before the process group gives up, when parallelize initialises
    # torch.distributed itself: planning, the first step's compilation and checkpoint I/O happen between
    # collectives, so it is long (torch's NCCL default is 10 minutes)
    collective_timeout_s: float = 1800.0
    # the hang watchdog (mcompile.runtime.watchdog): a collective or message of this rank still unfinished after
    # hang_timeout_s makes every rank report what it waits in, and the waiting ranks which ranks have not arrived
    # (rank, op, group, sequence number), long before collective_timeout_s. None: $MCOMPILE_HANG_TIMEOUT, else
    # 300; 0: off. Reports go to stderr and to hang_dump_dir/rank<r>.txt (None: $MCOMPILE_HANG_DIR, else
    # mcompile-hangs in the temporary folder); hang_abort: a waiting rank then exits (code 75) instead of waiting
    # on. One watchdog per process: the latest parallelize's settings apply
    hang_timeout_s: float | None = None
    hang_dump_dir: str | None = None
    hang_abort: bool = False
    # a model built on the meta device is initialised with its own initialisation, each tensor's generator
    # seeded from (init_seed, its name): the same values on every layout (mcompile.runtime.init)
    init_seed: int = 0
    # training-mode dropout's masks are a function of (dropout_seed, the step, the dropout node, each element's
    # index in the single-device tensor): the same on every layout (mcompile/ir/dropout.py); < 2**32
    dropout_seed: int = 0
    # parallelize captures once: rank 0 runs torch.export (or finds the capture in the on-disk cache,
    # $MCOMPILE_CACHE, default ~/.cache/mcompile/captures) and broadcasts it (mcompile.capture.cache);
    # False: rank 0 still captures for all, but neither reads nor writes the on-disk cache
    capture_cache: bool = True
    # mixture-of-experts layers over an "ep" axis (mcompile.ir.moe): "alltoall" (Megatron's all-to-all token
    # dispatcher: each routed slot moves to its expert's rank and back) or "allgather" (every rank gathers
    # all tokens and runs its experts on theirs: no data-dependent sizes, ep times the bytes; for small ep)
    moe_dispatcher: MoeDispatcher = MoeDispatcher.ALLTOALL
    # 0: dropless; > 0: each expert takes at most ceil(factor * local slots / experts) slots per rank, the
    # rest dropped (counted: pm.moe_dropped)
    moe_capacity_factor: float = 0.0
    # attention over a "cp" axis (mcompile.passes.cp.ops): "ring" (K/V passed around the ring, overlapped with the block
    # computed), "allgather" (K/V gathered: good with few kv heads; the one that takes an arbitrary mask),
    # "a2a" (Ulysses: heads <-> sequence all-to-alls; heads must divide by cp), or "auto": the cost model's pick
    cp_attention: CpAttention = CpAttention.AUTO

    def __post_init__(self):
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"microbatches={self.microbatches!r} must be a positive integer")
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype={self.dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
        object.__setattr__(self, "inputs", Inputs(self.inputs))
        for name, choice in _CHOICES.items():  # the string switches as their StrEnums (a bad value: its field named)
            value = getattr(self, name)
            if name == "fp8" and value is None:
                continue
            try:
                object.__setattr__(self, name, choice(value))
            except ValueError:
                raise ValueError(f"{name}={value!r}: use {_options(name, choice)}") from None
        check_loss_scale(self.initial_loss_scale, self.loss_scale_window, self.min_loss_scale,
                         self.loss_scale_hysteresis)  # (an error names the bad option)
        if self.recompute == "auto" and (self.activation_budget is None or self.activation_budget < 0):
            raise ValueError("recompute='auto' needs activation_budget=<bytes of saved activations per rank at its "
                             "peak, shared by the microbatches a pipeline stage holds in flight> (>= 0)")
        if not isinstance(self.moe_capacity_factor, int | float) or isinstance(self.moe_capacity_factor, bool) \
                or self.moe_capacity_factor < 0:
            raise ValueError(f"moe_capacity_factor={self.moe_capacity_factor!r}: use 0 (dropless) or a factor > 0 "
                             "(1.0: each expert takes its even share of the routed slots)")
        if self.recompute == "auto" and self.execution != "joint":
            raise ValueError("recompute='auto' chooses on the joint graph: use execution='joint'")
        if self.codegen != "eager" and self.execution != "joint":
            raise ValueError("codegen='inductor' compiles the joint program's modules: use execution='joint'")
        if self.recompute_num_layers < 1:
            raise ValueError(f"recompute_num_layers={self.recompute_num_layers} must be >= 1")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise ValueError(f"zero={self.zero!r}: use 0 (off), 1 (optimizer state and fp32 masters sharded over dp), "
                             "2 (and gradients) or 3 (and parameters)")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap={self.overlap!r} must be True or False")
        if not (self.tp_overlap in ("auto", "off", "symm_mem") or (isinstance(self.tp_overlap, int)
                                                          and not isinstance(self.tp_overlap, bool)
                                                          and self.tp_overlap >= 2)):
            raise ValueError(f"tp_overlap={self.tp_overlap!r}: use 'auto', 'off', 'symm_mem' or a number of "
                             "chunks >= 2")
        if self.zero >= 2 and self.execution != "joint":
            raise ValueError(f"zero={self.zero} is built as passes on the joint program: use execution='joint'")
        if not isinstance(self.virtual_stages, int) or self.virtual_stages < 1:
            raise ValueError(f"virtual_stages={self.virtual_stages!r} must be a positive integer")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ValueError(f"virtual_stages={self.virtual_stages} needs schedule='interleaved'")
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb={self.bucket_mb} must be positive")
        if not isinstance(self.vocab_pad_multiple, int) or isinstance(self.vocab_pad_multiple, bool) \
                or self.vocab_pad_multiple < 1:
            raise ValueError(f"vocab_pad_multiple={self.vocab_pad_multiple!r} must be a positive integer (1: pad "
                             "only to a multiple of tp; 128, the default: each tp rank's vocabulary slice a multiple "
                             "of 128)")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s={self.collective_timeout_s!r} must be a positive number of seconds")
        if self.hang_timeout_s is not None:
            h = self.hang_timeout_s
            if isinstance(h, bool) or not isinstance(h, int | float) or not h >= 0:
                raise ValueError(f"hang_timeout_s={h!r}: use a number of seconds >= 0 (0: no hang watchdog; None: "
                                 "$MCOMPILE_HANG_TIMEOUT, else 300)")
            if 0 < self.collective_timeout_s <= self.hang_timeout_s:
                raise ValueError(f"hang_timeout_s={self.hang_timeout_s!r} must be below collective_timeout_s="
                                 f"{self.collective_timeout_s!r}: the watchdog reports a hang before the process "
                                 "group gives up on it")
        if not isinstance(self.hang_abort, bool):
            raise ValueError(f"hang_abort={self.hang_abort!r} must be True or False")
        if not isinstance(self.init_seed, int) or isinstance(self.init_seed, bool) or self.init_seed < 0:
            raise ValueError(f"init_seed={self.init_seed!r} must be an integer >= 0")
        if not isinstance(self.dropout_seed, int) or isinstance(self.dropout_seed, bool) or \
                not 0 <= self.dropout_seed < 2**32:
            raise ValueError(f"dropout_seed={self.dropout_seed!r} must be an integer in [0, 2**32)")
        self._check_fp8()

    def check_mesh(self, mesh) -> None:
        """Refuse the options this ``mesh`` cannot run, naming both and what to use instead. ``parallelize``
        calls it before capturing and planning: every rank gets the same error, and no minutes are spent first.
        The data-parallel ranks a ZeRO stage shards over are dp x cp x ep (runtime/module.py)."""
        size = lambda ax: mesh.size(ax) if ax in mesh.axis_names else 1  # noqa: E731
        if self.zero >= 2 and size("dp") * size("cp") * size("ep") == 1:
            raise ValueError(f"Config(zero={self.zero}) shards over the data-parallel axis, and this mesh has no dp "
                             f"(or ep) axis > 1 ({mesh!r}): add one (e.g. dp=2) or use zero=0")
        if self.zero == 3 and size("ep") > 1:
            raise ValueError(f"Config(zero=3) with ep={size('ep')}: ZeRO-3 (parameters sharded, gathered per layer) "
                             "over the expert-parallel data ranks is not supported yet; use zero=1 or zero=2")

    def _check_fp8(self):
        if not isinstance(self.fp8_amax_history_len, int) or self.fp8_amax_history_len < 1:
            raise ValueError(f"fp8_amax_history_len={self.fp8_amax_history_len!r} must be a positive integer")
        if not isinstance(self.fp8_margin, int) or self.fp8_margin < 0:
            raise ValueError(f"fp8_margin={self.fp8_margin!r} must be an integer >= 0 (powers of 2 of headroom)")


def check_loss_scale(initial: float, growth_interval: int, min_scale: float, hysteresis: int, growth: float = 2.0,
                     backoff: float = 0.5) -> None:
    """The dynamic loss scaler's options (runtime/loss_scale.py), checked where they are given: ``Config`` and the
    scaler itself; the error names the option."""
    if not (initial > 0 and math.isfinite(initial)):
        raise ValueError(f"initial_loss_scale={initial!r} must be a finite number > 0 (2**16 is Megatron's "
                         "usual start)")
    if not 0 < min_scale <= initial:
        raise ValueError(f"min_loss_scale={min_scale!r} must be > 0 and at most initial_loss_scale={initial}")
    if not isinstance(growth_interval, int) or isinstance(growth_interval, bool) or growth_interval < 1:
        raise ValueError(f"loss_scale_window={growth_interval!r} must be a positive integer "
                         "(clean steps before the scale doubles; 1000 by default)")
    if not isinstance(hysteresis, int) or isinstance(hysteresis, bool) or hysteresis < 1:
        raise ValueError(f"loss_scale_hysteresis={hysteresis!r} must be a positive integer (1: every overflow "
                         "halves the scale)")
    if not growth > 1 or not 0 < backoff < 1:
        raise ValueError(f"growth {growth!r} must be > 1 and backoff {backoff!r} in (0, 1)")
