"""What a :class:`~mcompile.runtime.module.ParallelModule` holds on this rank: its parameter pieces, buffers and
gradients, and what reads or writes them whole (DESIGN §3, §6).

The parameters are DTensors with the plan's placements (ZeRO-3's over dp), registered on the module, so the
optimizer, gradient clipping and torch.distributed.checkpoint see ordinary parameters; the programs never touch
them, they run on the plain local leaves of runtime/leaves.py. Buffers and lifted constants are replicated plain
tensors by placeholder. Everything here that sees whole tensors (``full_state_dict``, ``load_full_state_dict``,
``full_grads``, ``clip_grad_norm_``, checkpoints through runtime/checkpoint.py) is collective.

:class:`RankState` is one of the two halves ParallelModule is made of (runtime/module.py; the other,
runtime/step.py, runs the steps). It reads what the module's construction set: ``plan``, ``mesh``,
``device_mesh``, ``config``, ``fp8``, ``_compiled``, ``_comm``, ``_rank``, ``_coords``, ``_device``, ``_zero3``,
``_pipe``, ``_tied``; and, once the gradient buffers exist (``ParallelModule._build_buckets``), ``_leaves`` and
``_zero``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from mcompile.ir.placements import BlockShard, Partial, unshard_tensors

__all__ = ["RankState"]


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


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


class RankState:
    """This rank's parameters, buffers and gradients, and their whole-model views and checkpoints (module
    docstring); a part of :class:`~mcompile.runtime.module.ParallelModule`, which is the ``torch.nn.Module``
    the parameters are registered on."""

    # -- construction -------------------------------------------------------------------------
    def _init_parameters(self, model: torch.nn.Module, cap, weights) -> dict[str, torch.Tensor]:
        """Registers this rank's parameters: rank 0's values, broadcast (never trust that every rank built the same
        weights); those of a model built on the meta device: computed on every rank, piece by piece
        (runtime/init.py); with ``weights=``: every rank reads its pieces from the checkpoint (runtime/weights.py),
        which wins. Returns the buffers made on the way (placeholder -> tensor: loaded or initialised on meta)."""
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
        return made_buffers

    def _init_buffers(self, model: torch.nn.Module, cap, made_buffers: dict[str, torch.Tensor]) -> None:
        """The buffers and lifted constants (replicated, ``self._extra`` by placeholder): ``made_buffers`` (loaded
        or initialised on meta, :meth:`_init_parameters`), the others rank 0's values, broadcast; and what
        ``full_state_dict`` and checkpoints need of the model's state dict (persistent buffers, key order)."""
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
            names = mine + list(buffers)
            values = ((f, init.lookup(model, f)) for f in names) if self._device.type == "meta" \
                else init.init_tensors(model, names, self.config.init_seed, self._device)  # a simulated rank: none
            for fqn, t in values:
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
            from mcompile.ir.placements import local_piece

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
        from mcompile.ir.placements import dp_placements

        return dp_placements(pp.placements, list(self.mesh.axis_names), self._zero3[fqn])

    def _local_of(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the full tensor ``fqn`` as this module holds it."""
        local = self.plan.params[fqn].local_piece(full, self.mesh, self._coords)
        if fqn in self._zero3:
            from mcompile.ir.placements import local_piece

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

    # -- whole tensors, gradients, checkpoints ----------------------------------------------------
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
