"""ParallelModule: the per-rank program of a plan, run on torch.distributed (DESIGN §3, §6).

Holds the model's parameters as DTensors with the plan's placements (the optimizer, gradient
clipping and torch.distributed.checkpoint see ordinary parameters), and runs the rank's program
on their local pieces with mcompile's collective ops bound to the mesh's process groups.

One ``train_step``:

1. split the global batch: this rank's data-parallel slice (``inputs="local"``: already sliced),
   then ``microbatches`` pieces;
2. per piece: forward and backward of the *summed* token loss on plain local leaves (the
   parameters' storage in fp32, or one compute-dtype copy per step), each piece's gradients added
   in fp32 into flat bucket buffers (runtime/leaves.py);
3. gradient reduction: every gradient that the plan marks Partial over an axis is all-reduced over
   it — over dp per bucket of ``bucket_mb``, in place, launched from post-accumulate-grad hooks
   during the last piece's backward (overlapped with the rest of backward), over tp
   (sequence-parallel norm weights) in one coalesced all-reduce; in fp32;
4. the token count of the global batch is summed and every new gradient divided by it, so the
   gradients and the returned loss are the single-device mean over the whole batch (labels -100
   ignored), however the batch was split. Gradients that were already in ``.grad`` are kept and
   added to, as ``loss.backward()`` does.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from mcompile import ops
from mcompile.config import Config, Inputs
from mcompile.dropout import RNG_INPUT, rng_state
from mcompile.ops import grad_sink
from mcompile.placements import BlockShard, Partial, unshard_tensors
from mcompile.runtime.comm import DistCommunicator

__all__ = ["ParallelModule"]


def _check_ep_config(config: Config, mesh) -> None:
    """What expert parallelism does not combine with yet, refused before anything runs (Config.check_mesh, which
    parallelize calls before planning)."""
    config.check_mesh(mesh)


def _torch_placement(p):
    """The DTensor placement of a parameter's piece. Equal blocks are torch's ``_StridedShard``. Blocks of
    unequal sizes (Phi-3's fused q/k/v with fewer key/value heads) have no torch placement: the DTensor
    says ``Shard(dim)``, which is right for everything the runtime does with it (elementwise optimizer
    steps, norms, local shapes) but orders the dim's elements differently from the parameter in a global
    view (``DTensor.full_tensor``): whole parameters come from :meth:`ParallelModule.full_state_dict`,
    checkpoints from mcompile's own index runs (runtime/checkpoint.py), both of which use the plan's
    ``BlockShard``."""
    if isinstance(p, BlockShard):
        return _StridedShard(p.dim, split_factor=p.blocks) if isinstance(p.blocks, int) else Shard(p.dim)
    return p


class ParallelModule(torch.nn.Module):
    def __init__(self, compiled, device_mesh: DeviceMesh, config: Config, model: torch.nn.Module,
                 weights=None, *, programs=None):
        super().__init__()
        object.__setattr__(self, "_compiled", compiled)
        self.plan = compiled.plan
        self.config = config
        self.mesh = compiled.mesh
        self.device_mesh = device_mesh
        self._comm = DistCommunicator(device_mesh)
        self._rank = dist.get_rank()
        self._coords = self.mesh.coords(self._rank)
        # the data-parallel ranks: dp, and ep too (Megatron folds expert parallelism into data
        # parallelism: the batch is split over dp x ep, dense gradients are summed over both)
        # Context parallelism (cp) joins them for the reductions (each cp rank's loss and gradients are
        # partial sums over its tokens, Megatron's dp x cp group) but not for the batch split: every cp rank
        # takes the same batch rows, and its program slices its own tokens (mcompile.cp).
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
        self.moe_dropped = 0  # routed slots dropped by capacity on this rank in the last step (moe_capacity_factor)
        if config.microbatches > 1 and self._rank == 0 and \
                any(c.purpose == "batch statistic" for c in compiled.plan.collectives):
            warnings.warn(f"the loss uses batch statistics (e.g. a mixture-of-experts load-balancing loss's tokens per "
                          f"expert); with microbatches={config.microbatches} each step's microbatch computes its own, "
                          "over every data rank, as gradient accumulation on one device does (and Megatron), not "
                          "over the global batch: use microbatches=1 for the global batch's", stacklevel=3)
        self._device = torch.device("cuda", torch.cuda.current_device()) if device_mesh.device_type == "cuda" \
            else torch.device("cpu")
        # the rank passes (mcompile.compiler.rank_programs: lower, fuse, fp8, ZeRO-3's gathers, the pipeline split,
        # a named recompute policy), run by the caller for this rank; the signature passes on each program's first
        # call (runtime/joint_runner.py JointRunner, through programs.build)
        if programs is None:
            raise TypeError("ParallelModule(..., programs=) takes this rank's programs: "
                            "mcompile.compiler.rank_programs(compiled, rank, config, device)")
        self._programs = programs
        program = programs.program
        # ZeRO-3 (passes/fsdp.py): which parameters are sharded over dp; their gathers are in the program (under pp:
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
        cap = compiled.captured
        self._token_weighted = bool(compiled.canonical.get("mean_loss_to_sum_count"))
        self._tied = {fqn: ties for fqn, ties in cap.tied.items()}
        self._placeholders = [n.name for n in self._program.graph.nodes if n.op == "placeholder"]
        # training-mode dropout (mcompile/dropout.py): the programs read (seed, step, batch offset) from an input;
        # the step counts train_step and forward calls, and is saved in checkpoints
        self._uses_rng = RNG_INPUT in self._placeholders
        self.dropout_step = 0
        # parameters: rank 0's values, broadcast (never trust that every rank built the same weights);
        # those of a model built on the meta device: computed on every rank, piece by piece (runtime/init.py);
        # with ``weights=``: every rank reads its pieces from the checkpoint (runtime/weights.py), which wins
        full = {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()}
        self._param_of_ph: dict[str, str] = dict(cap.params)
        self._params: dict[str, torch.nn.Parameter] = {}
        self._extra: dict[str, torch.Tensor] = {}  # buffers and lifted constants, replicated
        made_buffers, loaded = {}, set()
        if weights is not None:
            from mcompile.runtime import weights as W

            made_buffers, loaded = W.load(self, model, cap, weights)
        made_buffers.update(self._init_meta(model, cap, skip=loaded))
        for fqn in cap.params.values():
            if full[fqn].is_meta or fqn in loaded:  # initialised or loaded above (if this rank holds it)
                continue
            t = full[fqn].to(self._device, torch.float32 if full[fqn].is_floating_point() else full[fqn].dtype)
            t = t.contiguous().clone()
            dist.broadcast(t, src=0)
            if self._pipe is None or fqn in self._pipe.own_params:  # under pp: the parameters of our stages
                self._register(fqn, self._make_param(fqn, t))
        named_buffers = dict(model.named_buffers())
        for ph, fqn in {**cap.buffers, **cap.constants}.items():
            if ph in made_buffers:
                self._extra[ph] = made_buffers[ph]
                continue
            if ph in cap.buffers:
                t = named_buffers[fqn].detach().to(self._device).clone()
            else:
                t = cap.ep.constants[fqn]
                if t.is_meta:  # captured on meta: a constant made inside forward lost its values
                    if t.numel():
                        raise NotImplementedError(
                            f"the model creates a tensor constant {fqn} {list(t.shape)} inside forward; "
                            "meta-device capture cannot see its values: make it a buffer of the module")
                    t = torch.empty(t.shape, dtype=t.dtype)  # empty (a KV cache placeholder): exact
                t = t.to(self._device).clone()
            dist.broadcast(t, src=0)
            self._extra[ph] = t
        self._persistent_buffers = [k for k in model.state_dict() if k in named_buffers]
        self._buffer_ph = {fqn: ph for ph, fqn in cap.buffers.items()}
        self._state_keys = list(model.state_dict().keys())
        self._build_buckets()
        # fp16 compute: dynamic loss scaling (runtime/loss_scale.py); bf16 and fp32 need none
        self.loss_scaler = None
        if config.dtype == torch.float16:
            from mcompile.runtime.loss_scale import DynamicLossScaler

            self.loss_scaler = DynamicLossScaler.from_config(config)
        self.step_skipped = False  # the last train_step's gradients overflowed (fp16): its optimizer step is skipped

    # -- parameters -----------------------------------------------------------------------------
    def _init_meta(self, model: torch.nn.Module, cap, skip=frozenset()) -> dict[str, torch.Tensor]:
        """The parameters and buffers the model has on the meta device, initialised by the model's own
        initialisation seeded from ``(config.init_seed, name)`` (runtime/init.py): every rank computes
        the full value of one tensor at a time and keeps its piece; no broadcast. Registers this rank's
        parameters; returns the buffers (placeholder -> tensor). A failure on any rank (e.g. a module
        without initialiser, named) is raised on every rank, before anything else is communicated.
        ``skip``: names already loaded from ``weights=`` (runtime/weights.py), neither initialised nor
        checked for an initialiser."""
        from mcompile.runtime import init

        params = init.meta_names(model, [f for f in cap.params.values() if f not in skip])
        buffers = {fqn: ph for ph, fqn in cap.buffers.items() if fqn not in skip and init.meta_names(model, [fqn])}
        if not params and not buffers:
            return {}
        mine = [f for f in params if self._pipe is None or f in self._pipe.own_params]
        made, error = {}, None
        try:
            init.check_initialisers(model, params + list(buffers))  # every rank: the same answer
            for fqn, t in init.init_tensors(model, mine + list(buffers), self.config.init_seed):
                if fqn in buffers:
                    made[buffers[fqn]] = t.to(self._device).clone()
                    continue
                t = t.to(self._device, torch.float32 if t.is_floating_point() else t.dtype)
                self._register(fqn, self._make_param(fqn, t))  # the piece is a copy: the full tensor goes
                del t
        except Exception as e:  # noqa: BLE001 - raised below, on every rank
            error = e
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        bad = [(r, e) for r, e in enumerate(errors) if e is not None]
        if bad:
            raise init.MetaInitError(f"initialising the meta-device model failed on rank {bad[0][0]}: {bad[0][1]}")
        return made

    def _make_param(self, fqn: str, full: torch.Tensor | None = None, *, local: torch.Tensor | None = None
                    ) -> torch.nn.Parameter:
        """The DTensor parameter of ``fqn`` from its full value, or from this rank's piece (``local=``)."""
        pp = self.plan.params[fqn]
        if local is None:
            local = pp.local_piece(full, self.mesh, self._coords)
            if local.numel() < full.numel() and \
                    local.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
                local = local.clone()  # a view of a shard would keep the whole tensor alive
        if fqn in self._zero3 and tuple(local.shape) == tuple(pp.local_shape):  # ZeRO-3: this dp rank's piece
            from mcompile.placements import local_piece

            local = local_piece(local, self.mesh.size("dp"), self._coords["dp"])
        shape = torch.Size(pp.padded_shape or pp.shape)
        mesh, placements = self.device_mesh, list(self._placements(fqn))
        if self._pipe is not None:  # a stage's parameters live on the mesh of the other axes
            keep = [a for a in self.device_mesh.mesh_dim_names if a != "pp"]
            mesh = self.device_mesh[tuple(keep)] if len(keep) > 1 else self.device_mesh[keep[0]]
            names = self.mesh.axis_names
            placements = [placements[names.index(a)] if a in names else Replicate() for a in keep]
        dt = DTensor.from_local(local.contiguous(), mesh, [_torch_placement(p) for p in placements],
                                run_check=False, shape=shape, stride=_contiguous_stride(shape))
        return torch.nn.Parameter(dt, requires_grad=local.is_floating_point())

    def _placements(self, fqn: str) -> tuple:
        """``fqn``'s placements per mesh axis as this module holds it: the plan's, with ZeRO-3's over dp."""
        pp = self.plan.params[fqn]
        if fqn not in self._zero3:
            return tuple(pp.placements)
        from mcompile.placements import dp_placements

        return dp_placements(pp.placements, list(self.mesh.axis_names), self._zero3[fqn])

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

    def _local_of(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the full tensor ``fqn`` as this module holds it."""
        local = self.plan.params[fqn].local_piece(full, self.mesh, self._coords)
        if fqn in self._zero3:
            from mcompile.placements import local_piece

            local = local_piece(local, self.mesh.size("dp"), self._coords["dp"])
        return local

    def _register(self, fqn: str, param: torch.nn.Parameter):
        *path, name = fqn.split(".")
        mod: torch.nn.Module = self
        for part in path:
            if part not in mod._modules:
                mod.add_module(part, torch.nn.Module())
            mod = mod._modules[part]
        mod.register_parameter(name, param)
        self._params[fqn] = param

    def _local_inputs(self) -> dict[str, torch.Tensor]:
        """placeholder -> tensor: buffers and constants, and each parameter's compute leaf (a plain
        local tensor, runtime/leaves.py)."""
        out = dict(self._extra)
        compute = self._leaves.compute
        for ph, fqn in self._param_of_ph.items():
            out[ph] = compute[fqn]
        return out

    # -- running --------------------------------------------------------------------------------
    def _split(self, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
        dp = self._batch_size
        m = self.config.microbatches
        flat = list(args) + list(kwargs.values())
        batch = next((t.shape[0] for t in flat if isinstance(t, torch.Tensor) and t.ndim > 0), None)
        if batch is None:
            return [(args, kwargs)]
        if self.config.inputs == Inputs.GLOBAL:
            if batch % (dp * m):
                raise ValueError(
                    f"the global batch of {batch} does not divide by dp={dp} x microbatches={m}; use a batch "
                    f"that is a multiple of {dp * m}"
                )
            pick = lambda t: t.chunk(dp)[self._batch_coord] if _batched(t, batch) else t  # noqa: E731
            args = tuple(pick(a) for a in args)
            kwargs = {k: pick(v) for k, v in kwargs.items()}
            batch //= dp
        elif batch % m:
            raise ValueError(f"the local batch of {batch} does not divide by microbatches={m}")
        if self._cp > 1:
            from mcompile.mesh import check_sequence

            for t in flat:
                if _batched(t, batch) and t.ndim >= 2:
                    check_sequence(int(t.shape[1]), self._cp)
        if self._device.type == "cuda":  # this rank's slice pinned once: the copies below overlap the host
            pin = lambda t: t.contiguous().pin_memory() if isinstance(t, torch.Tensor) and t.device.type == "cpu" \
                else t  # noqa: E731
            args = tuple(pin(a) for a in args)
            kwargs = {k: pin(v) for k, v in kwargs.items()}
        move = lambda t: t.to(self._device, non_blocking=True) if isinstance(t, torch.Tensor) else t  # noqa: E731
        pieces = []
        for i in range(m):
            cut = lambda t: t.chunk(m)[i] if _batched(t, batch) else t  # noqa: E731, B023
            pieces.append((tuple(move(cut(a)) for a in args), {k: move(cut(v)) for k, v in kwargs.items()}))
        return pieces

    def _rng_states(self, pieces: list) -> list:
        """Per piece of this step's batch, the dropout program input (mcompile/dropout.py): the seed, this step,
        and the piece's first row in the global batch — this data rank's slice (dp x ep, in rank order; a
        ``inputs="local"`` slice counts as one of equal slices), then the microbatch within it. Advances the
        step. Empty when no program draws dropout masks."""
        if not self._uses_rng:
            return [None] * len(pieces)
        step, self.dropout_step = self.dropout_step, self.dropout_step + 1
        out = []
        for i, (a, k) in enumerate(pieces):
            rows = next((int(t.shape[0]) for t in list(a) + list(k.values()) if isinstance(t, torch.Tensor)
                         and t.ndim), 0)
            out.append(rng_state(self.config.dropout_seed, step, (self._batch_coord * len(pieces) + i) * rows,
                                 self._device))
        return out

    def _call_args(self, args: tuple, kwargs: dict, local: dict | None = None, rng=None) -> list:
        """The program's positional inputs for one piece of the batch (``rng``: its dropout input)."""
        local = local if local is not None else self._local_inputs()
        cap = self._compiled.captured
        user = list(args) + [kwargs[n] for n in cap.input_names[len(args):]]
        by_name = dict(zip(cap.user_inputs, user))
        by_name[RNG_INPUT] = rng
        return [local[n] if n in local else by_name[n] for n in self._placeholders]

    def _run(self, args: tuple, kwargs: dict, local: dict | None = None, rng=None):
        call = self._call_args(args, kwargs, local, rng)
        with ops.bind(self._comm):
            return self._program(*call)

    def _joint_step(self, args: tuple, kwargs: dict, local: dict, rng=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one piece on the joint program; weight gradients added into the
        fp32 buffers. Returns (loss sum, token count)."""
        call = self._call_args(args, kwargs, local, rng)
        runner = self._runner
        rec = self._comm.recorder  # the timeline (start_timeline): this call's F and B intervals
        t0 = rec.mark() if rec is not None else None
        outs, ctx = runner.forward(call)
        if rec is not None:
            rec.compute("F", t0)
        loss_sum, c = self._loss_parts(outs)
        jp = ctx.jp
        self._leaves.before_backward()
        t0 = rec.mark() if rec is not None else None
        grads = runner.backward(ctx, runner.tangents(ctx, outs, scale=self._loss_scale()))
        self._leaves.add_grads(call, jp.joint.grad_primals, grads, jp.ready_positions)
        if rec is not None:
            rec.compute("B", t0)
        self._leaves.after_backward()
        return loss_sum, c

    def _grad_bucket(self, position: int) -> int | None:
        """The dp bucket of the program input at ``position`` (JointRunner ``grad_buckets``)."""
        ph = self._placeholders[position] if position < len(self._placeholders) else None
        return self._leaves.bucket_index(self._param_of_ph.get(ph))

    def _loss_parts(self, out) -> tuple[torch.Tensor, torch.Tensor]:
        if self._token_weighted:
            loss_sum, count = out
            return loss_sum.float(), count.to(torch.float32)
        outs = out if isinstance(out, tuple | list) else (out,)
        if len(outs) != 1 or outs[0].ndim != 0:
            raise TypeError(f"train_step needs forward to return one scalar loss; the model's output is "
                            f"{getattr(self._compiled.captured, 'output', '') or 'not one'}: return the loss "
                            "from forward, or pass labels")
        (loss,) = outs
        return loss.float(), torch.ones((), dtype=torch.float32, device=loss.device)

    def _loss_scale(self) -> float:
        """The gradient the backward of a piece's loss sum starts from: 1, or under fp16 the loss scale over the
        tokens per piece (runtime/loss_scale.py: the scale of the mean, as Megatron's), else 1."""
        return self.loss_scaler.sum_scale() if self.loss_scaler is not None else 1.0

    def _backward_root(self, out) -> torch.Tensor:
        """The tensor an autograd backward starts from: the loss sum, times the loss scale under fp16."""
        loss_sum = self._loss_parts(out)[0]
        return loss_sum * self.loss_scaler.sum_scale() if self.loss_scaler is not None else loss_sum

    def _first_tokens_per_piece(self, args: tuple, kwargs: dict) -> None:
        """fp16, the first step (no count seen yet): the tokens per piece of a token-weighted loss estimated
        from the shapes of the global batch, the same on every rank — the largest integer input (token ids,
        labels) over data ranks x microbatches, ignored targets included; 1 for a mean loss or local inputs."""
        if not self._token_weighted or self.config.inputs != Inputs.GLOBAL:
            self.loss_scaler.tokens_per_piece = 1.0
            return
        ints = [t.numel() for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)
                and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool]
        self.loss_scaler.observe_tokens(max(ints, default=0) / (self._data_size * self.config.microbatches))

    @torch.no_grad()
    def _check_overflow(self, count: torch.Tensor) -> bool:
        """fp16: whether any gradient of this step is inf or NaN on ANY rank of the job — the flag reduced
        with MAX over every rank (dp, tp, pp, ep, cp), so all skip together —; on an overflow every gradient
        is set to None (any optimizer's step then leaves the parameters and its state as they are). Updates
        the scale, and the tokens per piece from this step's global token count ``count`` (the same on every
        rank). One host read per step."""
        zero = self._zero
        grads = [b.owned_grad for b in zero.buckets if b.valid] if zero is not None else \
            [b.buf for b in self._leaves.buckets]
        from mcompile.runtime.loss_scale import nonfinite

        found = nonfinite(grads, self._device)
        if dist.get_world_size() > 1:
            with self._comm.timed("all_reduce", "world", found, "overflow"):
                dist.all_reduce(found, op=dist.ReduceOp.MAX)
        flag, tokens = torch.stack([found, count.float()]).tolist()
        overflow = bool(flag)
        if overflow:
            if zero is not None:
                zero.zero_grad(set_to_none=True)
            for p in self._params.values():
                p.grad = None
        self.loss_scaler.update(overflow)
        self.loss_scaler.observe_tokens(tokens / (self._data_size * self.config.microbatches))
        return overflow

    def train_step(self, *args, **kwargs) -> torch.Tensor:
        """Forward + backward of the global batch; gradients accumulate into ``.grad``; returns the
        single-device loss of the global batch (detached 0-d tensor, no host sync)."""
        pieces = self._split(args, kwargs)
        rngs = self._rng_states(pieces)
        if self.loss_scaler is not None and self.loss_scaler.tokens_per_piece is None:
            self._first_tokens_per_piece(args, kwargs)
        if self._has_moe_ep:
            from mcompile.moe import clear_stash

            clear_stash(self._comm)  # what a forward without backward (evaluation) left
        leaves = self._leaves
        leaves.begin()  # compute copies refreshed, main gradients cleared (earlier ones kept aside)
        rec = self._comm.recorder  # the timeline (start_timeline): this step's events replace the last one's
        if rec is not None:
            rec.begin_step()
        total = torch.zeros((), dtype=torch.float32, device=self._device)
        count = torch.zeros((), dtype=torch.float32, device=self._device)
        # backward: collectives, bucket launches; FP8 weights cast once for all microbatches of the step
        with ops.bind(self._comm, process_wide=True), grad_sink(leaves), self._fp8_step():
            if self._pipe is not None:  # the schedule's microbatches through this rank's stages
                pipe_stats = self._pipe.reduce_results(self._pipe.run(pieces, rngs=rngs))
                self._pipe.push_grads()  # weights tied across stages: summed, then their buckets reduce
                total, count = pipe_stats[0], pipe_stats[1]
            local = self._local_inputs() if self._pipe is None else None
            for i, (a, k) in enumerate(pieces if self._pipe is None else ()):
                leaves.armed = i == len(pieces) - 1
                if self._runner is not None:
                    loss_sum, c = self._joint_step(a, k, local, rngs[i])
                else:
                    t0 = rec.mark() if rec is not None else None
                    out = self._run(a, k, local, rngs[i])
                    loss_sum, c = self._loss_parts(out)
                    if rec is not None:
                        rec.compute("F", t0)
                        t0 = rec.mark()
                    self._backward_root(out).backward()
                    if rec is not None:
                        rec.compute("B", t0)
                total += loss_sum.detach()
                count += c
        leaves.armed = False
        stats = torch.stack([total, count])
        if self._data_size > 1:
            with self._comm.timed("all_reduce", "dp", stats):
                dist.all_reduce(stats, group=self._comm.groups["data"])
        # the gradients are sums over the tokens, times the loss scale (fp16): both divided out here, before any
        # clipping
        leaves.finish(1.0 / (stats[1] * self._loss_scale()), self._tp_partial)
        if self.loss_scaler is not None:
            self.step_skipped = self._check_overflow(stats[1])
        if self._has_moe_ep:
            from mcompile.moe import MoEStats

            self.moe_dropped = MoEStats.of(self._comm)  # routed slots this rank's capacity dropped in this step
        return (stats[0] / stats[1]).detach()

    def _fp8_step(self):
        """FP8 linears: each weight's cast cached over this step's microbatches (kernels/fp8.py step_cache)."""
        if self.fp8 is None or not self.fp8.converted:
            return contextlib.nullcontext()
        from mcompile.kernels.fp8 import step_cache

        return step_cache()

    @torch.no_grad()
    def forward(self, *args, **kwargs):
        """Forward only: the model's own output for the global batch (a loss: the global mean)."""
        self._leaves.refresh()
        if self._pipe is not None:
            return self._pipe_forward(args, kwargs)
        pieces = self._split(args, kwargs) if self.config.microbatches == 1 else None
        if pieces is None:
            raise ValueError("forward runs the whole local batch at once: use a Config with microbatches=1")
        out = self._run(*pieces[0], rng=self._rng_states(pieces)[0])
        loss_like = self._token_weighted or (isinstance(out, tuple | list) and len(out) == 1 and out[0].ndim == 0)
        if loss_like:
            total, count = self._loss_parts(out)
            stats = torch.stack([total, count])
            if self._data_size > 1:
                dist.all_reduce(stats, group=self._comm.groups["data"])
            return stats[0] / stats[1]
        outs = out if isinstance(out, tuple | list) else (out,)
        if self._batch_size > 1:  # the batch dim of each output, gathered over dp (and ep; cp's are whole)
            outs = tuple(self._comm.all_gather(o.contiguous(), 0, "batch") if o.ndim else o for o in outs)
        return outs[0] if len(outs) == 1 else outs

    def _pipe_forward(self, args, kwargs):
        """Forward through the pipeline: every microbatch, outputs from the last stage to all ranks.

        The last stage concatenates its microbatches' outputs and broadcasts them over pp as tensors
        (nothing pickled): an int64 header (the number of outputs, then per output its dtype code,
        ndim and shape) sized by a one-element broadcast before it, then each output into a buffer
        the others allocate from the header."""
        with ops.bind(self._comm, process_wide=True):
            pieces = self._split(args, kwargs)
            results = self._pipe.run(pieces, forward_only=True, rngs=self._rng_states(pieces))
        if self._token_weighted:
            stats = self._pipe.reduce_results(results)
            if self._data_size > 1:  # every data rank's tokens: dp, cp (each rank's share of a sequence) and ep
                dist.all_reduce(stats, group=self._comm.groups["data"])
            return stats[0] / stats[1]
        dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                  torch.int16, torch.int8, torch.uint8, torch.bool)  # the wire codes: indices here
        src, group = self._pipe.peer_of_stage(self._pipe.k - 1), self._comm.groups["pp"]
        i64 = {"dtype": torch.int64, "device": self._device}
        if results:  # the last stage's rank
            per_mb = [o if isinstance(o, tuple | list) else (o,) for o in (results[i] for i in sorted(results))]
            # batch dims concatenated; a scalar (the pipeline's last stage returns one: its loss) is the
            # mean over the equal microbatches, as the single-device model's mean over the whole batch
            outs = tuple(torch.cat([mb[j] for mb in per_mb]) if per_mb[0][j].ndim else
                         torch.stack([mb[j] for mb in per_mb]).mean(0) for j in range(len(per_mb[0])))
            bad = [f"output #{j} is {o.dtype if isinstance(o, torch.Tensor) else type(o).__name__}"
                   for j, o in enumerate(outs) if not isinstance(o, torch.Tensor) or o.dtype not in dtypes]
            header = torch.tensor([len(outs)] + [x for o in outs for x in (dtypes.index(o.dtype), o.ndim, *o.shape)],
                                  **i64) if not bad else None
            size = torch.tensor([-1 if bad else header.numel()], **i64)
        else:
            bad, size = [], torch.zeros(1, **i64)
        dist.broadcast(size, src=src, group=group)
        if int(size) < 0:  # every rank raises, none waits for a broadcast that will not come
            raise TypeError(f"forward under pipeline parallelism: {'; '.join(bad) or 'an output (see the last rank)'}"
                            f" of the model; outputs are broadcast as tensors of {', '.join(map(str, dtypes))}")
        if not results:
            header = torch.empty(int(size), **i64)
        dist.broadcast(header, src=src, group=group)
        spec, at, bufs = header.tolist(), 1, []
        for j in range(spec[0]):
            code, ndim = spec[at], spec[at + 1]
            shape, at = spec[at + 2:at + 2 + ndim], at + 2 + ndim
            buf = outs[j].to(self._device).contiguous() if results else \
                torch.empty(shape, dtype=dtypes[code], device=self._device)
            dist.broadcast(buf, src=src, group=group)
            bufs.append(buf)
        outs = tuple(bufs)
        if self.mesh.size("dp") > 1 and len(outs) == 1 and outs[0].ndim == 0:  # a loss: the mean over dp too
            loss = outs[0].float().clone()
            dist.all_reduce(loss, group=self._comm.groups["dp"])
            return loss / self.mesh.size("dp")
        if self.mesh.size("dp") > 1:
            outs = tuple(self._comm.all_gather(o.contiguous(), 0, "dp") if o.ndim else o for o in outs)
        return outs[0] if len(outs) == 1 else outs

    # -- gradient reduction -----------------------------------------------------------------------
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

    # -- state ------------------------------------------------------------------------------------
    def _gather_full(self, fqn: str, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor ``fqn`` from this rank's piece, on the CPU (collective over the axes it is
        sharded on). Gathered axis by axis; the last gather's pieces go to the CPU before they are
        joined, so the device holds at most one full tensor's worth (its pieces) besides ``local``.
        An unsharded tensor comes back as ``local.cpu()``: itself when on the CPU."""
        pp = self.plan.params[fqn]
        if any(isinstance(p, Partial) for p in pp.placements):
            raise NotImplementedError(f"{fqn}: Partial parameters")
        sharded = [(ax, p) for ax, p in zip(self.mesh.axis_names, pp.placements) if isinstance(p, Shard | BlockShard)]
        t = local
        if fqn in self._zero3:  # ZeRO-3: the dp pieces of the tensor-parallel piece, first
            pieces = [torch.empty_like(t) for _ in range(self.mesh.size("dp"))]
            dist.all_gather(pieces, t.contiguous(), group=self._comm.groups["dp"])
            t = torch.cat(pieces, dim=0)
            if not sharded:
                return t.cpu()
        for i, (ax, p) in enumerate(sharded):
            pieces = [torch.empty_like(t) for _ in range(self.mesh.size(ax))]
            dist.all_gather(pieces, t.contiguous(), group=self._comm.groups[ax])
            if i == len(sharded) - 1:
                pieces = [x.cpu() for x in pieces]
            t = unshard_tensors(pieces, p, true_size=pp.shape[p.dim % len(pp.shape)])
        return t.cpu()

    def full_state_dict(self, rank: int | None = None) -> dict[str, torch.Tensor]:
        """Same keys and values as ``model.state_dict()`` (tied keys both present, persistent buffers
        included), as CPU tensors, on every rank (``rank``: on that global rank only; the others
        return ``{}``). Collective: call it on every rank.

        Memory: the tensors are gathered one at a time and moved to the CPU at once, so a device
        holds at most one full tensor beyond its own shards at any time; the host holds the whole
        model on every rank that receives it (pass ``rank`` to keep it on one). A replicated
        parameter on a CPU rank is returned as its live storage, as ``model.state_dict()`` does."""
        out = {}
        pieces = {fqn: p.detach().to_local() for fqn, p in self._params.items()}
        for fqn, full in self._across_stages(pieces, rank=rank).items():
            for name in self._tied.get(fqn, (fqn,)):
                out[name] = full
        if rank is not None and rank != self._rank:
            return {}
        for fqn in self._persistent_buffers:
            out[fqn] = self._extra[self._buffer_ph[fqn]].cpu()
        return {k: out[k] for k in self._state_keys if k in out}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = [k for k in self._params if k not in state]
        if missing:
            raise KeyError(f"load_full_state_dict: missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}")
        for fqn, p in self._params.items():
            local = self._local_of(fqn, state[fqn].to(self._device, torch.float32))
            p.to_local().copy_(local)
            if self._zero is not None:  # bf16 parameters: their fp32 masters too
                self._zero.set_master(fqn, local)
        for fqn in self._persistent_buffers:
            if fqn in state:
                self._extra[self._buffer_ph[fqn]].copy_(state[fqn])

    def full_grads(self, rank: int | None = None) -> dict[str, torch.Tensor]:
        """Unsharded gradients, keys as ``named_parameters()``, as CPU tensors: copies, every one (a
        replicated parameter's local gradient is the whole one; returned as itself, a later in-place
        clip or ``zero_grad`` would change what the caller holds, while a sharded one's would not).
        On every rank (``rank``: on that global rank only; the others return ``{}``). Collective.

        Memory: as :meth:`full_state_dict`: one full gradient at a time on a device, the whole set
        on the host of every rank that receives it."""
        if self._zero is not None:  # ZeRO-1: the gradients live in the dp-sharded buffers
            locals_ = self._zero.local_grads()
        else:
            locals_ = {fqn: p.grad.to_local() for fqn, p in self._params.items() if p.grad is not None}
        return self._across_stages(locals_, rank=rank, held=True, copy=True)

    # -- pipeline timeline -------------------------------------------------------------------------
    def start_timeline(self):
        """Record the timeline of the following steps (mcompile.timeline), on any layout: per rank each
        forward and backward (under pp: every pipeline action and message wait), every collective
        (the programs', the dp gradient buckets', ZeRO's parameter all-gathers, the step's own) and
        every wait for a started one; the latest step is kept. Returns this rank's
        :class:`mcompile.timeline.Recorder` (``.events()``: its events in seconds, e.g. for
        :func:`mcompile.timeline.overlap_stats`). Recording stays on for this module's life."""
        from mcompile.timeline import Recorder, clock_for

        rec = Recorder(self._rank, clock_for(self._device))
        self._comm.recorder = rec
        if self._pipe is not None:
            self._pipe.record = True
            self._pipe.events = []
        return rec

    def save_timeline(self, path) -> dict | None:
        """Gather every rank's recorded events; rank 0 writes a Chrome trace to ``path`` and returns
        it (other ranks return None). Collective: call it on every rank."""
        from mcompile import timeline

        rec = self._comm.recorder
        if rec is None and self._pipe is None:
            raise ValueError("save_timeline: nothing was recorded; call pm.start_timeline() before the steps")
        mine = rec.events() if rec is not None else []
        if self._pipe is not None:
            mine += [dict(e.__dict__) for e in self._pipe.events if e.cat != "step"]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if self._rank != 0:
            return None
        meta = {"layout": self.mesh.spec(), "overlap": self.config.overlap, "zero": self.config.zero,
                "tp_overlap": self.config.tp_overlap, "microbatches": self.config.microbatches}
        if self._pipe is not None:
            meta.update({"schedule": self._pipe.schedule, "pp": self._pipe.pp, "virtual": self._pipe.virtual,
                         "microbatches": self._pipe.m, "bubble_formula": self.plan.pipeline.get("bubble")})
        timeline.save_trace(path, [e for r in everyone for e in r], meta)
        return timeline.load_trace(path)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model, on every layout: each gradient
        element is counted once (replicas over dp, tp-replicated weights and tied weights on two
        pipeline stages are not counted twice). Under pipeline parallelism use this one: a rank's
        ``parameters()`` are its stages' only. Returns the total norm."""
        if norm_type != 2.0:
            raise NotImplementedError("clip_grad_norm_: only the 2-norm")
        total = torch.zeros((), dtype=torch.float64, device=self._device)
        grads = []
        for fqn, p in self._params.items():
            if p.grad is None:
                continue
            g = p.grad.to_local()
            grads.append(g)
            counted = all(self._coords[a] == 0 for a, pl in zip(self.mesh.axis_names, self._placements(fqn))
                          if a != "pp" and not isinstance(pl, Shard | BlockShard))
            if self._pipe is not None and self._pipe.owner[fqn] != self._pipe.pp_rank:
                counted = False  # a tied weight: its owner stage counts it
            if counted:
                total += g.double().pow(2).sum()
        dist.all_reduce(total)
        norm = total.sqrt().float()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return norm

    def _across_stages(self, pieces: dict[str, torch.Tensor], rank: int | None = None, held: bool = False,
                       copy: bool = False) -> dict[str, torch.Tensor]:
        """The whole tensors of which ``pieces`` holds this rank's pieces (fqn -> piece), one at a
        time, as CPU tensors (:meth:`_gather_full`): returned on every rank, or only on global rank
        ``rank`` ({} elsewhere; every rank still takes part in the gathers).

        Under pipeline parallelism a rank holds its stages' tensors only: the pipeline rank that owns
        each one (``self._pipe.owner``) gathers it and broadcasts it over pp (``rank`` given: sends
        it to ``rank`` alone, when ``rank`` is in this pipeline group and is not the owner). Which
        tensors exist, and their dtypes, come from the plan; with ``held`` (gradients: a parameter
        may have none) the owners say which they hold in one int32 vector over the model's
        parameters, summed over pp. ``copy``: never return a piece itself (it may change later)."""
        keep = rank is None or rank == self._rank
        out = {}

        def deliver(fqn, t):
            if keep:
                out[fqn] = t.clone() if copy and t is pieces.get(fqn) else t

        if self._pipe is None:
            for fqn, local in pieces.items():
                deliver(fqn, self._gather_full(fqn, local))
            return out if keep else {}
        pipe, group = self._pipe, self._comm.groups["pp"]
        order = list(dict.fromkeys(self._compiled.captured.params.values()))
        codes = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool)
        if held:  # per parameter: 0 (no tensor) or 1 + its dtype's code, from its owner
            have = torch.zeros(len(order), dtype=torch.int32, device=self._device)
            for i, fqn in enumerate(order):
                if pipe.owner[fqn] == pipe.pp_rank and fqn in pieces:
                    have[i] = 1 + codes.index(pieces[fqn].dtype)
            dist.all_reduce(have, group=group)
            dtypes = {fqn: codes[c - 1] for fqn, c in zip(order, have.tolist()) if c}
        else:
            dtypes = {fqn: getattr(torch, self.plan.params[fqn].dtype.removeprefix("torch.")) for fqn in order}
        target_here = rank is not None and all(
            v == self._coords[a] for a, v in self.mesh.coords(rank).items() if a != "pp")
        for fqn in (f for f in order if f in dtypes):
            owner = pipe.peer_of_stage(pipe.owner[fqn])
            full = self._gather_full(fqn, pieces[fqn]) if owner == self._rank else None
            shape = self.plan.params[fqn].shape
            if rank is None:
                buf = full.to(self._device) if full is not None else \
                    torch.empty(shape, dtype=dtypes[fqn], device=self._device)
                dist.broadcast(buf, src=owner, group=group)
                deliver(fqn, full if full is not None else buf.cpu())
            elif target_here and owner != rank:
                if owner == self._rank:
                    dist.send(full.to(self._device), dst=rank, group=group)
                elif self._rank == rank:
                    buf = torch.empty(shape, dtype=dtypes[fqn], device=self._device)
                    dist.recv(buf, src=owner, group=group)
                    deliver(fqn, buf.cpu())
            elif full is not None:
                deliver(fqn, full)
        return out

    def _buffer_state(self) -> dict[str, torch.Tensor]:
        return {fqn: self._extra[self._buffer_ph[fqn]] for fqn in self._persistent_buffers}

    @torch.no_grad()
    def _load_buffer_state(self, state: dict[str, torch.Tensor]) -> None:
        for fqn, t in state.items():
            self._extra[self._buffer_ph[fqn]].copy_(t)

    def fp8_histories(self) -> dict[str, torch.Tensor]:
        """This rank's delayed-scaling amax histories (program node -> the live (3, history_len)
        buffer): every one of ``self.fp8.histories`` without pipeline parallelism, under it those of
        the linears this rank's stages run (the others are never read or updated here). Each rank's
        own: scales are per rank and per shard (tp shards, dp slices and stages see other amaxes)."""
        if self.fp8 is None or not self.fp8.histories:
            return {}
        if self._pipe is None:
            return dict(self.fp8.histories)
        live = {id(b) for s in self._pipe.own for b in self._pipe.stages[s].gm.buffers()}
        return {n: h for n, h in self.fp8.histories.items() if id(h) in live}

    def recompute_choices(self) -> list:
        """``recompute="auto"``: what passes/remat.py chose for each program this rank runs, once the first
        step has compiled them (runtime/joint_runner.py ``RecomputeChoice``: the budget per microbatch, the
        forwards in flight it was divided by, the bytes saved, the ops recomputed); one per pipeline stage
        of this rank under pp. [] before the first step and under a named policy."""
        if self._pipe is not None:
            return self._pipe.recompute_choices()
        choice = self._runner.choice() if self._runner is not None else None
        return [choice] if choice is not None else []

    def save_checkpoint(self, path, optimizer=None, extra: dict | None = None, async_save: bool = False):
        """Save parameters, persistent buffers, optimizer state (keyed by the model's names, in global
        shapes: loadable under any other layout) and (``fp8="delayed"``) every rank's FP8 amax
        histories with torch.distributed.checkpoint, every rank writing only what it holds; ``extra``
        (a small JSON-able dict: the step, the data position) is kept beside. ``path`` holds a complete
        checkpoint once ``mcompile_plan.json`` is in it. ``async_save``: the pieces are copied to CPU
        and written in the background; returns a :class:`mcompile.runtime.checkpoint.PendingSave`
        (``.wait()``), else None. Collective (runtime/checkpoint.py)."""
        from mcompile.runtime import checkpoint

        return checkpoint.save(self, path, optimizer, extra, async_save=async_save)

    def load_checkpoint(self, path, optimizer=None, fp8_state: bool = True) -> dict:
        """Restore a checkpoint saved under any plan (mesh, sequence parallelism, pipeline stages, ZeRO
        level, parameter dtype); returns its ``extra``. Everything is checked first, the same error on
        every rank (:class:`mcompile.runtime.checkpoint.CheckpointError`: an incomplete checkpoint,
        another model, another optimizer). The FP8 amax histories are per rank: they load under the
        plan they were saved with only (``Config(fp8="delayed")`` with the same history length on both
        sides, or on neither); ``fp8_state=False`` loads everything else and leaves this model's
        histories as they are (empty in a new model: its next step scales as a first step)."""
        from mcompile.runtime import checkpoint

        return checkpoint.load(self, path, optimizer, fp8_state=fp8_state)

    def program_code(self) -> str:
        return self._program.code


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def _batched(t, batch) -> bool:
    return isinstance(t, torch.Tensor) and t.ndim > 0 and t.shape[0] == batch


