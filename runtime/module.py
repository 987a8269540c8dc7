"""ParallelModule: the per-rank program of a plan, run on torch.distributed (DESIGN §3, §6).

The object ``mcompile.parallelize`` returns, a ``torch.nn.Module`` made of two halves, each in its own module:

- runtime/state.py (:class:`~mcompile.runtime.state.RankState`): what this rank holds — its parameter pieces as
  DTensors with the plan's placements (the optimizer, gradient clipping and torch.distributed.checkpoint see
  ordinary parameters), buffers, gradients; whole-model state dicts, gradients and checkpoints;
- runtime/step.py (:class:`~mcompile.runtime.step.StepRunner`): what runs a step — ``train_step`` and
  ``forward`` on the parameters' local pieces, with mcompile's collective ops bound to the mesh's process groups
  (the step's order is in that module's docstring), and the timeline.

This module builds one from a rank's programs (``__init__``, in named steps: the rank's device and process
groups, its programs and their runner, what the capture says, then the state, the gradient buffers and the step's
own) and sets up the gradient reduction both halves use: the buffers and dp buckets of runtime/leaves.py
(ZeRO-1/2's of runtime/zero.py) and the axes each gradient is summed over.

The halves are mixins of one object rather than two objects the module holds: the parameters must be registered
on the module itself, and the runtime's collaborators (Leaves, ZeroBuffers, Pipeline, runtime/checkpoint.py,
runtime/weights.py) take the module and read both halves' attributes from it.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mcompile.ir.config import Config
from mcompile.runtime.comm import DistCommunicator
from mcompile.runtime.state import RankState
from mcompile.runtime.step import StepRunner

__all__ = ["ParallelModule"]


def _check_ep_config(config: Config, mesh) -> None:
    """What expert parallelism does not combine with yet, refused before anything runs (Config.check_mesh, which
    parallelize calls before planning)."""
    config.check_mesh(mesh)


class ParallelModule(RankState, StepRunner, torch.nn.Module):
    """This rank's part of a parallelized model (module docstring): parameters and state from
    :class:`~mcompile.runtime.state.RankState`, the steps from :class:`~mcompile.runtime.step.StepRunner`."""

    def __init__(self, compiled, device_mesh: DeviceMesh, config: Config, model: torch.nn.Module,
                 weights=None, *, programs=None):
        super().__init__()
        object.__setattr__(self, "_compiled", compiled)
        self.plan = compiled.plan
        self.config = config
        self.mesh = compiled.mesh
        self.device_mesh = device_mesh
        self._init_rank(device_mesh, config)
        self._warn_batch_statistics(compiled, config)
        self._init_programs(programs, config)
        self._init_captured(compiled)
        made_buffers = self._init_parameters(model, compiled.captured, weights)  # runtime/state.py
        self._init_buffers(model, compiled.captured, made_buffers)
        self._build_buckets()
        self._init_step(config)  # runtime/step.py

    # -- construction -----------------------------------------------------------------------------
    def _init_rank(self, device_mesh: DeviceMesh, config: Config) -> None:
        """This rank's place in the mesh, its device and its process groups: one per mesh axis (DistCommunicator,
        its collectives watched for hangs as ``config`` says: runtime/watchdog.py), and the data and batch groups
        over the data-parallel axes."""
        from mcompile.runtime.watchdog import HangSettings

        hang = HangSettings.resolve(config.hang_timeout_s, config.hang_dump_dir, config.hang_abort)
        self._comm = DistCommunicator(device_mesh, hang)
        self._rank = dist.get_rank()
        self._coords = self.mesh.coords(self._rank)
        # the data-parallel ranks: dp, and ep too (Megatron folds expert parallelism into data
        # parallelism: the batch is split over dp x ep, dense gradients are summed over both)
        # Context parallelism (cp) joins them for the reductions (each cp rank's loss and gradients are
        # partial sums over its tokens, Megatron's dp x cp group) but not for the batch split: every cp rank
        # takes the same batch rows, and its program slices its own tokens (mcompile.passes.cp.ops; which positions
        # of the inputs it reads: input_positions, runtime/step.py).
        self._data_axes = tuple(a for a in self.mesh.axis_names if a in ("dp", "cp", "ep") and self.mesh.size(a) > 1)
        self._batch_axes = tuple(a for a in self._data_axes if a != "cp")
        self._cp = self.mesh.size("cp")
        self._data_size, self._data_coord = 1, 0
        for a in self._data_axes:
            self._data_size, self._data_coord = self._data_size * self.mesh.size(a), \
                self._data_coord * self.mesh.size(a) + self._coords[a]
        self._batch_size, self._batch_coord = 1, 0
        for a in self._batch_axes:
            self._batch_size, self._batch_coord = self._batch_size * self.mesh.size(a), \
                self._batch_coord * self.mesh.size(a) + self._coords[a]
        for name, axes in (("data", self._data_axes), ("batch", self._batch_axes)):
            if len(axes) >= 2:
                self._comm.add_group(name, device_mesh[axes]._flatten(name).get_group())
            elif axes:
                self._comm.add_group(name, self._comm.groups[axes[0]])
        self._has_moe_ep = self.mesh.size("ep") > 1
        from mcompile.runtime.launch import rank_device

        self._device = rank_device()  # CUDA (the current device), CPU, or meta for a simulated rank
        # the agreements read on the host (verification's flags and digests): a simulated rank's on CPU
        self._control_device = torch.device("cpu") if self._device.type == "meta" else self._device

    def _warn_batch_statistics(self, compiled, config: Config) -> None:
        """Rank 0 warns when a loss's batch statistics are computed per microbatch rather than over the batch."""
        if config.microbatches > 1 and self._rank == 0 and \
                any(c.purpose == "batch statistic" for c in compiled.plan.collectives):
            warnings.warn(f"the loss uses batch statistics (e.g. a mixture-of-experts load-balancing loss's tokens per "
                          f"expert); with microbatches={config.microbatches} each step's microbatch computes its own, "
                          "over every data rank, as gradient accumulation on one device does (and Megatron), not "
                          "over the global batch: use microbatches=1 for the global batch's", stacklevel=4)

    def _init_programs(self, programs, config: Config) -> None:
        """This rank's programs and what runs them: the pipeline (its stages), the joint program's runner, or the
        executed program; with what the rank passes reported (ZeRO-3's sharded parameters, fusion, FP8, the
        recompute policy)."""
        # the rank passes (mcompile.compiler.rank_programs: lower, fuse, fp8, ZeRO-3's gathers, the pipeline split,
        # a named recompute policy), run by the caller for this rank; the signature passes on each program's first
        # call (runtime/joint_runner.py JointRunner, through programs.build)
        if programs is None:
            raise TypeError("ParallelModule(..., programs=) takes this rank's programs: "
                            "mcompile.compiler.rank_programs(compiled, rank, config, device)")
        self._programs = programs
        program = programs.program
        # ZeRO-3 (passes/dp/fsdp.py): which parameters are sharded over dp; their gathers are in the program (under pp:
        # in each stage program)
        config.check_mesh(self.mesh)  # parallelize checked it before planning: a ParallelModule made otherwise
        self._zero3 = dict(programs.zero3)
        if config.zero == 3:
            self.zero3_replicated = programs.zero3_replicated  # kept whole over dp, and why
        if config.fuse:
            self.fused = programs.fused
        self.fp8 = programs.fp8  # FP8 linears: what was converted / kept and why (passes/fp8_linears.py Fp8Report)
        self.plan.recompute = list(programs.recompute)
        self._pipe = None
        self._runner = None  # the joint program's runner (runtime/joint_runner.py), without pipeline parallelism
        if self.mesh.size("pp") > 1:  # pipeline: this rank runs its stages (recompute applied inside each)
            from mcompile.runtime.pipeline import Pipeline

            self._pipe = Pipeline(self, programs, config)
            object.__setattr__(self, "_program", program)
        elif config.execution == "joint":  # recompute is the joint program's saved set
            from mcompile.runtime.joint_runner import JointRunner

            object.__setattr__(self, "_program", program)
            self._runner = JointRunner(program, config, build=programs.build, name=f"rank {self._rank}",
                                       accumulate=lambda args: self._leaves.targets(args),
                                       grad_buckets=self._grad_bucket)
        else:
            object.__setattr__(self, "_program", programs.executed)

    def _init_captured(self, compiled) -> None:
        """What the capture says that the state and the steps read: whether the program returns a token-weighted
        loss (sum, count), the tied parameters' names, the program's placeholders in order."""
        cap = compiled.captured
        self._token_weighted = bool(compiled.canonical.get("mean_loss_to_sum_count"))
        self._tied = {fqn: ties for fqn, ties in cap.tied.items()}
        self._placeholders = [n.name for n in self._program.graph.nodes if n.op == "placeholder"]

    # -- gradient reduction -----------------------------------------------------------------------
    def _bucket_axes(self, fqn: str) -> tuple[str, ...]:
        """The data axes the step's bucket reductions sum ``fqn``'s gradient over: :meth:`_reduce_axes`, but
        dp for a ZeRO-3 parameter, whose gradient its gather's backward reduce-scatters over dp inside the backward.
        The other data axes stay: under cp each rank's gradient is a partial sum over its tokens, which the dp
        reduce-scatter does not add (Megatron's dp x cp gradient group), so its dp piece is all-reduced over cp."""
        axes = self._reduce_axes(fqn)
        return tuple(a for a in axes if a != "dp") if fqn in self._zero3 else axes

    def _reduce_axes(self, fqn: str) -> tuple[str, ...]:
        """The data-parallel axes (dp, ep) ``fqn``'s gradient is summed over: both for a dense
        parameter, dp only for an expert weight (each ep rank holds other experts)."""
        partial = self.plan.params[fqn].grad_partial_axes
        return tuple(a for a in self._data_axes if a in partial)

    def _reduce_group(self, axes: tuple[str, ...]):
        return self._comm.groups["data"] if axes == self._data_axes else self._comm.groups[axes[0]]

    def _grad_bucket(self, position: int) -> int | None:
        """The dp bucket of the program input at ``position`` (JointRunner ``grad_buckets``)."""
        ph = self._placeholders[position] if position < len(self._placeholders) else None
        return self._leaves.bucket_index(self._param_of_ph.get(ph))

    def _build_buckets(self):
        """Gradient buffers and compute leaves (runtime/leaves.py): dp buckets of ``bucket_mb``
        (reverse registration order, roughly the order backward finishes gradients) reduced during
        the last microbatch's backward; ``Config(zero=1)`` with dp > 1: ZeRO-1's flat buffers,
        reduce-scattered over dp (runtime/zero.py); the parameters whose gradient is Partial over
        tp (sequence-parallel norms) are summed over tp at the end of the step."""
        from mcompile.runtime.leaves import Leaves

        self._zero = None
        if self.config.zero in (1, 2) and self._data_size > 1:
            from mcompile.runtime.zero import ZeroBuffers

            self._zero = ZeroBuffers(self)  # re-registers the parameters as views of flat buffers
        elif self.config.zero == 1:
            import warnings

            warnings.warn("Config(zero=1) with dp=1: there is no data-parallel axis to shard the optimizer over; "
                          "running as zero=0", stacklevel=2)
        self._tp_partial = [] if self._zero is not None else \
            [fqn for fqn in reversed(list(self._params))
             if "tp" in self.plan.params[fqn].grad_partial_axes and self.mesh.size("tp") > 1]
        if self._pipe is not None:  # every parameter of this rank's stages; tied ones counted after their sum
            counted = set(self._params)
        else:
            used = {n.name for n in self._program.graph.nodes if n.op == "placeholder" and n.users}
            counted = {fqn for ph, fqn in self._param_of_ph.items() if ph in used}
        self._leaves = Leaves(self, counted)
        if self._pipe is not None:
            self._leaves.deferred = set(self._pipe.tied_groups)
