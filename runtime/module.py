"""ParallelModule: the per-rank program of a plan, run on torch.distributed (DESIGN §3, §6).

Holds the model's parameters as DTensors with the plan's placements (the optimizer, gradient
clipping and torch.distributed.checkpoint see ordinary parameters), and runs the rank's program
on their local pieces with mcompile's collective ops bound to the mesh's process groups.

One ``train_step``:

1. split the global batch: this rank's data-parallel slice (``inputs="local"``: already sliced),
   then ``microbatches`` pieces;
2. per piece: forward (parameters cast to the compute dtype; differentiable casts, so gradients
   land in fp32 on the fp32 parameters), backward of the *summed* token loss;
3. gradient reduction: every gradient that the plan marks Partial over an axis is all-reduced over
   it — over dp in buckets of ``bucket_mb`` launched from post-accumulate-grad hooks during the
   last piece's backward (overlapped with the rest of backward), over tp (sequence-parallel norm
   weights) in one coalesced all-reduce; in fp32;
4. the token count of the global batch is summed and every new gradient divided by it, so the
   gradients and the returned loss are the single-device mean over the whole batch (labels -100
   ignored), however the batch was split. Gradients that were already in ``.grad`` are kept and
   added to, as ``loss.backward()`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from mcompile import ops
from mcompile.config import Config, Inputs
from mcompile.placements import BlockShard, Partial, unshard_tensors
from mcompile.runtime.comm import DistCommunicator

__all__ = ["ParallelModule"]


def _torch_placement(p):
    if isinstance(p, BlockShard):
        return _StridedShard(p.dim, split_factor=p.blocks)
    return p


@dataclass
class _Bucket:
    params: list
    axes: tuple[str, ...]
    ready: int = 0
    flat: torch.Tensor | None = None
    work: object = None


class ParallelModule(torch.nn.Module):
    def __init__(self, compiled, device_mesh: DeviceMesh, config: Config, model: torch.nn.Module):
        super().__init__()
        object.__setattr__(self, "_compiled", compiled)
        self.plan = compiled.plan
        self.config = config
        self.mesh = compiled.mesh
        self.device_mesh = device_mesh
        self._comm = DistCommunicator(device_mesh)
        self._rank = dist.get_rank()
        self._coords = self.mesh.coords(self._rank)
        self._device = torch.device("cuda", torch.cuda.current_device()) if device_mesh.device_type == "cuda" \
            else torch.device("cpu")
        from mcompile import meta as M
        from mcompile.passes.recompute import apply_recompute, recompute_nodes

        program = compiled.program(self._rank, self._device)
        if config.fuse:
            from mcompile.passes.fuse import fuse

            cap0 = compiled.captured
            self.fused = fuse(program, {n.name: n for n in cap0.gm.graph.nodes}, set(cap0.params))
        self.fp8 = None  # FP8 linears: what was converted / kept and why (mcompile.passes.fp8.Fp8Report)
        if config.fp8:
            from mcompile.passes.fp8 import convert_fp8

            self.fp8 = convert_fp8(program, self.plan, dict(compiled.captured.params), recipe=config.fp8,
                                   amax_history_len=config.fp8_amax_history_len, margin=config.fp8_margin,
                                   backend=config.fp8_backend, device=self._device,
                                   user_inputs=set(compiled.captured.user_inputs))
        groups = recompute_nodes(program, config.recompute, config.recompute_method, config.recompute_num_layers)
        self.plan.recompute = sorted({n.meta.get(M.ORIGIN, n.name) for n in program.graph.nodes if n.name in groups})
        self._pipe = None
        if self.mesh.size("pp") > 1:  # pipeline: this rank runs its stages (recompute applied inside each)
            from mcompile.runtime.pipeline import Pipeline

            self._pipe = Pipeline(self, program, config)
            object.__setattr__(self, "_program", program)
        else:
            object.__setattr__(self, "_program", apply_recompute(program, groups))
        cap = compiled.captured
        self._token_weighted = bool(compiled.canonical.get("mean_loss_to_sum_count"))
        self._tied = {fqn: ties for fqn, ties in cap.tied.items()}
        self._placeholders = [n.name for n in self._program.graph.nodes if n.op == "placeholder"]
        # parameters: rank 0's values, broadcast (never trust that every rank built the same weights);
        # those of a model built on the meta device: computed on every rank, piece by piece (runtime/init.py)
        full = {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()}
        self._param_of_ph: dict[str, str] = dict(cap.params)
        self._params: dict[str, torch.nn.Parameter] = {}
        self._extra: dict[str, torch.Tensor] = {}  # buffers and lifted constants, replicated
        made_buffers = self._init_meta(model, cap)
        for fqn in cap.params.values():
            if full[fqn].is_meta:  # initialised above (if this rank holds it)
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

    # -- parameters -----------------------------------------------------------------------------
    def _init_meta(self, model: torch.nn.Module, cap) -> dict[str, torch.Tensor]:
        """The parameters and buffers the model has on the meta device, initialised by the model's own
        initialisation seeded from ``(config.init_seed, name)`` (runtime/init.py): every rank computes
        the full value of one tensor at a time and keeps its piece; no broadcast. Registers this rank's
        parameters; returns the buffers (placeholder -> tensor). A failure on any rank (e.g. a module
        without initialiser, named) is raised on every rank, before anything else is communicated."""
        from mcompile.runtime import init

        params = init.meta_names(model, list(cap.params.values()))
        buffers = {fqn: ph for ph, fqn in cap.buffers.items() if fqn in init.meta_names(model, [fqn])}
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

    def _make_param(self, fqn: str, full: torch.Tensor) -> torch.nn.Parameter:
        pp = self.plan.params[fqn]
        local = pp.local_piece(full, self.mesh, self._coords)
        if local.numel() < full.numel() and local.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
            local = local.clone()  # a view of a shard would keep the whole tensor alive
        shape = torch.Size(pp.padded_shape or pp.shape)
        mesh, placements = self.device_mesh, list(pp.placements)
        if self._pipe is not None:  # a stage's parameters live on the mesh of the other axes
            keep = [a for a in self.device_mesh.mesh_dim_names if a != "pp"]
            mesh = self.device_mesh[tuple(keep)] if len(keep) > 1 else self.device_mesh[keep[0]]
            names = self.mesh.axis_names
            placements = [pp.placements[names.index(a)] if a in names else Replicate() for a in keep]
        dt = DTensor.from_local(local.contiguous(), mesh, [_torch_placement(p) for p in placements],
                                run_check=False, shape=shape, stride=_contiguous_stride(shape))
        return torch.nn.Parameter(dt, requires_grad=full.is_floating_point())

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
        out = dict(self._extra)
        dtype = self.config.dtype
        for ph, fqn in self._param_of_ph.items():
            p = self._params[fqn]
            local = p.to_local(grad_placements=p.placements)
            if dtype != torch.float32 and local.is_floating_point():
                local = local.to(dtype)
            out[ph] = local
        return out

    # -- running --------------------------------------------------------------------------------
    def _split(self, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
        dp = self.mesh.size("dp")
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
            pick = lambda t: t.chunk(dp)[self._coords.get("dp", 0)] if _batched(t, batch) else t  # noqa: E731
            args = tuple(pick(a) for a in args)
            kwargs = {k: pick(v) for k, v in kwargs.items()}
            batch //= dp
        elif batch % m:
            raise ValueError(f"the local batch of {batch} does not divide by microbatches={m}")
        pieces = []
        for i in range(m):
            cut = lambda t: t.chunk(m)[i] if _batched(t, batch) else t  # noqa: E731, B023
            pieces.append((tuple(cut(a).to(self._device) if isinstance(a, torch.Tensor) else a for a in args),
                           {k: cut(v).to(self._device) if isinstance(v, torch.Tensor) else v
                            for k, v in kwargs.items()}))
        return pieces

    def _run(self, args: tuple, kwargs: dict):
        local = self._local_inputs()
        cap = self._compiled.captured
        user = list(args) + [kwargs[n] for n in cap.input_names[len(args):]]
        by_name = dict(zip(cap.user_inputs, user))
        call = [local[n] if n in local else by_name[n] for n in self._placeholders]
        with ops.bind(self._comm):
            return self._program(*call)

    def _loss_parts(self, out) -> tuple[torch.Tensor, torch.Tensor]:
        if self._token_weighted:
            loss_sum, count = out
            return loss_sum.float(), count.to(torch.float32)
        (loss,) = out if isinstance(out, tuple | list) else (out,)
        return loss.float(), torch.ones((), dtype=torch.float32, device=loss.device)

    def train_step(self, *args, **kwargs) -> torch.Tensor:
        """Forward + backward of the global batch; gradients accumulate into ``.grad``; returns the
        single-device loss of the global batch (detached 0-d tensor, no host sync)."""
        pieces = self._split(args, kwargs)
        stash = {}
        for fqn, p in self._params.items():  # keep gradients already there out of the scaling
            stash[fqn], p.grad = p.grad, None
        total = torch.zeros((), dtype=torch.float32, device=self._device)
        count = torch.zeros((), dtype=torch.float32, device=self._device)
        with ops.bind(self._comm, process_wide=True):  # backward runs the collectives' backwards
            if self._pipe is not None:  # the schedule's microbatches through this rank's stages
                pipe_stats = self._pipe.reduce_results(self._pipe.run(pieces))
                self._armed = True
                self._pipe.push_grads()  # leaf gradients -> parameters (data-parallel hooks fire)
                total, count = pipe_stats[0], pipe_stats[1]
            for i, (a, k) in enumerate(pieces if self._pipe is None else ()):
                self._armed = i == len(pieces) - 1
                loss_sum, c = self._loss_parts(self._run(a, k))
                loss_sum.backward()
                total += loss_sum.detach()
                count += c
        self._armed = False
        stats = torch.stack([total, count])
        if self.mesh.size("dp") > 1:
            dist.all_reduce(stats, group=self._comm.groups["dp"])
        self._finish_grads(scale=1.0 / stats[1])
        for fqn, p in self._params.items():
            if stash[fqn] is not None:
                p.grad = stash[fqn] if p.grad is None else p.grad + stash[fqn]
        return (stats[0] / stats[1]).detach()

    @torch.no_grad()
    def forward(self, *args, **kwargs):
        """Forward only: the model's own output for the global batch (a loss: the global mean)."""
        if self._pipe is not None:
            return self._pipe_forward(args, kwargs)
        pieces = self._split(args, kwargs) if self.config.microbatches == 1 else None
        if pieces is None:
            raise ValueError("forward runs the whole local batch at once: use a Config with microbatches=1")
        out = self._run(*pieces[0])
        loss_like = self._token_weighted or (isinstance(out, tuple | list) and len(out) == 1 and out[0].ndim == 0)
        if loss_like:
            total, count = self._loss_parts(out)
            stats = torch.stack([total, count])
            if self.mesh.size("dp") > 1:
                dist.all_reduce(stats, group=self._comm.groups["dp"])
            return stats[0] / stats[1]
        outs = out if isinstance(out, tuple | list) else (out,)
        if self.mesh.size("dp") > 1:  # the batch dim of each output, gathered over dp
            outs = tuple(self._comm.all_gather(o.contiguous(), 0, "dp") if o.ndim else o for o in outs)
        return outs[0] if len(outs) == 1 else outs

    def _pipe_forward(self, args, kwargs):
        """Forward through the pipeline: every microbatch, outputs from the last stage to all ranks."""
        with ops.bind(self._comm, process_wide=True):
            results = self._pipe.run(self._split(args, kwargs), forward_only=True)
        if self._token_weighted:
            stats = self._pipe.reduce_results(results)
            if self.mesh.size("dp") > 1:
                dist.all_reduce(stats, group=self._comm.groups["dp"])
            return stats[0] / stats[1]
        box = [[results[i] for i in sorted(results)] if results else None]
        dist.broadcast_object_list(box, src=self._pipe.peer_of_stage(self._pipe.k - 1),
                                   group=self._comm.groups["pp"])
        per_mb = [o if isinstance(o, tuple | list) else (o,) for o in box[0]]
        outs = tuple(torch.cat([mb[j] for mb in per_mb]) if per_mb[0][j].ndim else per_mb[0][j]
                     for j in range(len(per_mb[0])))
        if self.mesh.size("dp") > 1:
            outs = tuple(self._comm.all_gather(o.contiguous(), 0, "dp") if o.ndim else o for o in outs)
        return outs[0] if len(outs) == 1 else outs

    # -- gradient reduction -----------------------------------------------------------------------
    def _build_buckets(self):
        """dp: buckets of ``bucket_mb`` (reverse registration order, roughly the order backward
        finishes gradients); tp: the parameters whose gradient is Partial over tp (SP norms).
        ``Config(zero=1)`` with dp > 1: flat buffers reduce-scattered over dp (runtime/zero.py)."""
        self._zero = None
        if self.config.zero and self.mesh.size("dp") > 1:
            from mcompile.runtime.zero import ZeroBuffers

            self._zero = ZeroBuffers(self)  # re-registers the parameters as views of flat buffers
            for p in self._zero.params():
                p.register_post_accumulate_grad_hook(self._grad_ready)
            self._buckets, self._tp_partial, self._armed = [], [], False
            return
        if self.config.zero:
            import warnings

            warnings.warn("Config(zero=1) with dp=1: there is no data-parallel axis to shard the optimizer over; "
                          "running as zero=0", stacklevel=2)
        limit = int(self.config.bucket_mb * 2**20)
        dp_params, self._tp_partial = [], []
        for fqn in reversed(list(self._params)):
            axes = [a for a in self.plan.params[fqn].grad_partial_axes if self.mesh.size(a) > 1]
            if "dp" in axes:
                dp_params.append(self._params[fqn])
            if "tp" in axes:
                self._tp_partial.append(self._params[fqn])
        self._buckets: list[_Bucket] = []
        cur, size = [], 0
        for p in dp_params:
            nbytes = p.to_local().numel() * 4
            if cur and size + nbytes > limit:
                self._buckets.append(_Bucket(cur, ("dp",)))
                cur, size = [], 0
            cur.append(p)
            size += nbytes
        if cur:
            self._buckets.append(_Bucket(cur, ("dp",)))
        self._bucket_of: dict[int, _Bucket] = {}
        for b in self._buckets:
            for p in b.params:
                self._bucket_of[id(p)] = b
                p.register_post_accumulate_grad_hook(self._grad_ready)
        self._armed = False

    def _grad_ready(self, p):
        if self._zero is not None:  # every piece accumulates into the fp32 buffer; the last one reduces
            self._zero.grad_ready(p, self._armed)
            return
        if not self._armed:
            return
        b = self._bucket_of[id(p)]
        b.ready += 1
        if b.ready == len(b.params):  # the whole bucket is final: reduce it over dp while backward goes on
            b.flat = torch.cat([q.grad.to_local().reshape(-1).float() for q in b.params])
            b.work = dist.all_reduce(b.flat, group=self._comm.groups["dp"], async_op=True)

    @staticmethod
    def _scatter_back(params, flat):
        offset = 0
        for q in params:
            n = q.to_local().numel()
            if q.grad is not None:
                g = q.grad.to_local()
                g.copy_(flat[offset:offset + n].view_as(g))
            offset += n

    def _flat_grads(self, params) -> torch.Tensor:
        return torch.cat([(q.grad.to_local().reshape(-1) if q.grad is not None else
                           torch.zeros(q.to_local().numel(), device=self._device)).float() for q in params])

    def _finish_grads(self, scale: torch.Tensor):
        if self._zero is not None:
            self._zero.finish(scale)
            return
        for b in self._buckets:
            if b.work is not None:
                b.work.wait()
            elif any(q.grad is not None for q in b.params):  # not launched during backward: now
                b.flat = self._flat_grads(b.params)
                dist.all_reduce(b.flat, group=self._comm.groups["dp"])
            if b.flat is not None:
                self._scatter_back(b.params, b.flat)
            b.ready, b.work, b.flat = 0, None, None
        if self._tp_partial:  # sequence-parallel norm weights: one coalesced all-reduce over tp per step
            flat = self._flat_grads(self._tp_partial)
            dist.all_reduce(flat, group=self._comm.groups["tp"])
            self._scatter_back(self._tp_partial, flat)
        for p in self._params.values():
            if p.grad is not None:
                p.grad.to_local().mul_(scale.to(p.grad.dtype))

    # -- state ------------------------------------------------------------------------------------
    def _gather_full(self, fqn: str, local: torch.Tensor) -> torch.Tensor:
        pp = self.plan.params[fqn]
        t = local
        for ax, p in zip(self.mesh.axis_names, pp.placements):
            if isinstance(p, Shard | BlockShard):
                pieces = [torch.empty_like(t) for _ in range(self.mesh.size(ax))]
                dist.all_gather(pieces, t.contiguous(), group=self._comm.groups[ax])
                t = unshard_tensors(pieces, p, true_size=pp.shape[p.dim % len(pp.shape)])
            elif isinstance(p, Partial):
                raise NotImplementedError(f"{fqn}: Partial parameters")
        return t

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Same keys and values as ``model.state_dict()`` (tied keys both present, persistent buffers
        included), on every rank."""
        out = {}
        fulls = {fqn: self._gather_full(fqn, p.detach().to_local()) for fqn, p in self._params.items()}
        for fqn, full in self._across_stages(fulls).items():
            for name in self._tied.get(fqn, (fqn,)):
                out[name] = full
        for fqn in self._persistent_buffers:
            out[fqn] = self._extra[self._buffer_ph[fqn]]
        return {k: out[k] for k in self._state_keys if k in out}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = [k for k in self._params if k not in state]
        if missing:
            raise KeyError(f"load_full_state_dict: missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}")
        for fqn, p in self._params.items():
            local = self.plan.params[fqn].local_piece(state[fqn].to(self._device, torch.float32), self.mesh,
                                                      self._coords)
            p.to_local().copy_(local)
            if self._zero is not None:  # bf16 parameters: their fp32 masters too
                self._zero.set_master(fqn, local)
        for fqn in self._persistent_buffers:
            if fqn in state:
                self._extra[self._buffer_ph[fqn]].copy_(state[fqn])

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Unsharded gradients, keys as ``named_parameters()``: copies, every one (a replicated
        parameter's local gradient is the whole one; returned as itself, a later in-place clip or
        ``zero_grad`` would change what the caller holds, while a sharded one's would not)."""
        if self._zero is not None:  # ZeRO-1: the gradients live in the dp-sharded buffers
            locals_ = self._zero.local_grads()
        else:
            locals_ = {fqn: p.grad.to_local() for fqn, p in self._params.items() if p.grad is not None}
        fulls = {}
        for fqn, local in locals_.items():
            full = self._gather_full(fqn, local)
            fulls[fqn] = full.clone() if full is local else full
        return self._across_stages(fulls)

    # -- pipeline timeline -------------------------------------------------------------------------
    def start_timeline(self) -> None:
        """Record every pipeline action and message wait of the following steps (mcompile.timeline)."""
        if self._pipe is None:
            raise ValueError("the timeline records pipeline schedules: use a mesh with a pp axis")
        self._pipe.record = True
        self._pipe.events = []

    def save_timeline(self, path) -> dict | None:
        """Gather every rank's recorded events; rank 0 writes a Chrome trace to ``path`` and returns
        it (other ranks return None). Collective: call it on every rank."""
        from mcompile import timeline

        if self._pipe is None:
            raise ValueError("the timeline records pipeline schedules: use a mesh with a pp axis")
        mine = [e.__dict__ for e in self._pipe.events if e.cat != "step"]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if self._rank != 0:
            return None
        meta = {"schedule": self._pipe.schedule, "pp": self._pipe.pp, "virtual": self._pipe.virtual,
                "microbatches": self._pipe.m, "bubble_formula": self.plan.pipeline.get("bubble")}
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
            counted = all(self._coords[a] == 0 for a, pl in zip(self.mesh.axis_names, self.plan.params[fqn].placements)
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

    def _across_stages(self, fulls: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Under pipeline parallelism each rank holds its stages' tensors: every one is broadcast
        from the pipeline rank that owns it, so all ranks return the whole model."""
        if self._pipe is None:
            return fulls
        group = self._comm.groups["pp"]
        have = [None] * self.mesh.size("pp")
        dist.all_gather_object(have, sorted(fulls), group=group)
        out = {}
        for fqn in self._compiled.captured.params.values():
            owner = self._pipe.owner[fqn]
            if fqn not in have[owner]:
                continue
            pp = self.plan.params[fqn]
            t = fulls[fqn] if self._pipe.pp_rank == owner else \
                torch.empty(pp.shape, dtype=torch.float32, device=self._device)
            dist.broadcast(t, src=self._pipe.peer_of_stage(owner), group=group)
            out[fqn] = t
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

    def save_checkpoint(self, path, optimizer=None, extra: dict | None = None) -> None:
        """Save parameters, persistent buffers, optimizer state and (``fp8="delayed"``) every rank's
        FP8 amax histories with torch.distributed.checkpoint (every rank its shards); ``extra`` (a
        small JSON-able dict, e.g. the step) is kept beside."""
        from mcompile.runtime import checkpoint

        checkpoint.save(self, path, optimizer, extra)

    def load_checkpoint(self, path, optimizer=None, fp8_state: bool = True) -> dict:
        """Restore a checkpoint saved under the same plan; returns its ``extra``. The FP8 amax
        histories must match this model's (``Config(fp8="delayed")`` with the same history length
        on both sides, or on neither); ``fp8_state=False`` loads everything else and leaves this
        model's histories as they are (empty in a new model: its next step scales as a first step)."""
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


