"""ZeRO-1: optimizer state and fp32 master weights sharded over the data-parallel axis.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(stage 1, optimizer-state partitioning), laid out as Megatron-LM's distributed optimizer does:
flat buffers per gradient bucket, each dp rank owning one contiguous range of each
(:mod:`mcompile.ir.buckets`).

Memory per parameter with AdamW (Megatron's table; d = dp size)::

                      parameter  gradient  fp32 master  Adam m + v   total
    bf16, zero=0          2         4          4           8         18
    bf16, zero=1          2         4          4/d         8/d       6 + 12/d
    fp32, zero=1          4         4          -           8/d       8 + 8/d

Under ``Config(dtype=bfloat16, zero=1)`` the model's parameters are held in bf16 (the compute
dtype) and the fp32 masters live only as this rank's shard; under fp32 the parameters are the fp32
weights and the master shard *is* this rank's range of the parameter buffer (no copy). Exactly:
every parameter starts on a multiple of 64 elements (128 bytes of bf16) and the buffers are padded
to a multiple of d x 64 (:mod:`mcompile.ir.buckets`), so owned ranges and segments are aligned too;
the master shard covers the padding of its range; torch's optimizer allocates its state per owned
parameter segment (padding excluded) and AdamW a 4-byte step count per segment
(:func:`mcompile.ir.buckets.zero1_memory` predicts all of it to the byte;
:func:`mcompile.apps.report.memory_per_rank` with ``zero=1`` is the per-tensor table without the layout).
Everything here is local to the parameters this rank holds, so under pipeline parallelism each
stage shards its own parameters.

One step:

1. backward: the programs run on plain leaves aliasing the bf16 (or fp32) parameter buffer, and
   each microbatch's gradient of a parameter is added into its slice of the bucket's fp32 gradient
   buffer (Megatron's ``main_grad``; :mod:`mcompile.runtime.leaves`), so microbatches accumulate in
   fp32 also under pipeline parallelism; when the last microbatch's backward has finished a whole
   bucket (under pp: each stage's last backward; weights tied across stages after their sum), the
   buffer is reduce-scattered over dp in place (fp32, asynchronous, overlapped with the rest of
   backward): rank r's range now holds the sum over dp of its range;
2. ``train_step`` ends: gradients Partial over tp (sequence-parallel norm weights) are all-reduced
   over tp on the owned segments only (1/d of the bytes), and everything is divided by the global
   token count; gradients kept from an earlier ``train_step`` (no ``zero_grad`` between) are added;
3. ``DistributedOptimizer.step``: any element-wise torch optimizer updates this rank's segments
   (its parameters are the segments of the fp32 master shard, each with its gradient slice as
   ``.grad``); the updated range is cast into the parameter buffer and the buffer all-gathered over
   dp in place, so every rank again holds all parameters.

Gradient clipping (:meth:`DistributedOptimizer.clip_grad_norm_`): the global norm
``||g||_p = (sum over distinct elements |g|^p)^(1/p)`` with each element counted once. Over dp the
owned ranges partition the buffer: a sum over dp. Over every other axis an element is distinct per
rank if its parameter is sharded over that axis (sum over the axis), and the same on every rank if
it is replicated there (count it on the axis's rank 0 only). So per rank, one partial sum per
"set of axes the parameter is sharded over"; all-reduce the vector over dp; then, per other axis,
zero the entries of parameters replicated over it on ranks other than its rank 0 and all-reduce
over it (adding exact zeros: no rounding). Under pipeline parallelism the stages hold disjoint
parameters: pp sums like a sharded axis.

``pm.parameters()`` carry no ``.grad`` under zero=1 (the gradients live in the buffers), so
``torch.nn.utils.clip_grad_norm_(pm.parameters(), ...)`` is for zero=0 only; ``pm.full_grads()``
all-gathers the owned ranges.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mcompile.ir.buckets import BucketLayout, Segment
from mcompile.ir.placements import BlockShard, Shard
from mcompile.runtime.comm import _ALL_GATHER, _REDUCE_SCATTER
from mcompile.runtime.leaves import grad_layout

__all__ = ["DistributedOptimizer", "ZeroBuffers"]

# Optimizers whose update of an element depends on other elements of the same tensor (factored or
# orthogonalised statistics, line searches, sparse gradients): a flat segment of a parameter would
# give another update than the whole tensor.
_NOT_ELEMENTWISE = tuple(getattr(torch.optim, n) for n in ("LBFGS", "Adafactor", "Muon", "SparseAdam")
                         if hasattr(torch.optim, n))


@dataclass
class _Bucket:
    layout: BucketLayout
    params: list  # the model's parameters (DTensors), in layout order
    param_buf: torch.Tensor  # (padded,) in the parameter dtype; the parameters' local pieces are views
    grad_buf: torch.Tensor  # (padded,) fp32
    master: torch.Tensor  # (shard,) fp32: this rank's range (a view of param_buf when that is fp32)
    lo: int
    hi: int
    ready: int = 0
    work: object = None
    open: bool = False  # gradients of this step are being accumulated
    group: str = "dp"  # the communicator group its gradients are reduced over and its state sharded over
    n: int = 1  # that group's size
    rank: int = 0  # this rank's index in that group (which range it owns)

    valid: bool = False  # the owned range holds gradients (not zeroed since)
    saved: torch.Tensor | None = None  # owned gradients of an earlier train_step, added back at the end
    # ZeRO-2: the owned range's gradients live here (fp32, accumulated over microbatches); grad_buf is
    # allocated only while a backward adds into it ("filling") and freed once reduce-scattered
    shard: torch.Tensor | None = None
    filling: bool = False

    @property
    def owned_grad(self) -> torch.Tensor:
        return self.shard if self.shard is not None else self.grad_buf[self.lo:self.hi]

    def grad_slice(self, start: int, stop: int) -> torch.Tensor:
        """Gradients of buffer positions [start, stop) of the owned range."""
        if self.shard is not None:
            return self.shard[start - self.lo:stop - self.lo]
        return self.grad_buf[start:stop]


class ZeroBuffers:
    """The flat parameter / gradient / master buffers of one rank (``ParallelModule._zero``).

    Built by the ParallelModule when ``Config(zero=1)`` and dp > 1: re-registers every parameter as
    a view of its bucket's parameter buffer (in the compute dtype) and keeps the fp32 master shard."""

    def __init__(self, pm):
        self.dp = pm.mesh.size("dp")
        self.dp_rank = pm._coords.get("dp", 0)
        # Expert parallelism (Megatron folds ep into dp): a dense parameter's gradient is reduced over the
        # dp x ep data ranks (the "data" group) and its state sharded over them; a routed expert's (sharded
        # over ep) over dp alone. A bucket holds parameters of one group.
        self.data_axes = list(pm._data_axes)
        self.coords = dict(pm._coords)
        self.axis_names = pm.mesh.axis_names
        self.axis_sizes = {a: pm.mesh.size(a) for a in self.axis_names}
        self.groups = pm._comm.groups
        self.comm = pm._comm  # its recorder times publish's all-gathers (the timeline, if on)
        self.param_dtype = pm.config.dtype
        self.optimizer_attached = False
        self.stage = pm.config.zero  # 1, or 2: gradients reduce-scattered after every microbatch, kept sharded
        self.per_microbatch = self.stage == 2
        plan = pm.plan
        # the buckets (mcompile.ir.buckets.grad_buckets, which mcompile show places the backward's launches by): every
        # parameter grouped by the communicator group its gradient is reduced over; the dense ones of dp x ep over
        # "data", routed experts over dp, each group's buckets padded for its size
        self.layout = grad_layout(pm)
        layouts = [((gb.group, gb.size, gb.rank), gb.layout) for gb in self.layout.buckets]
        self.fqn_order = [f for f in pm._params if any(f in lay.fqns for _, lay in layouts)]
        self.buckets: list[_Bucket] = []
        # the placement of each parameter over every axis but dp: which axes its elements differ on
        self._sharded_axes: dict[str, frozenset] = {}
        for fqn in self.fqn_order:
            pp = plan.params[fqn]
            sharded = {a for a, pl in zip(self.axis_names, pp.placements) if isinstance(pl, Shard | BlockShard)}
            if "pp" in self.axis_sizes:
                sharded.add("pp")  # stages hold disjoint parameters
            self._sharded_axes[fqn] = frozenset(a for a in sharded if a not in ("dp", *self.data_axes)
                                                and self.axis_sizes[a] > 1)
        self._norm_keys = sorted(set(self._sharded_axes.values()), key=sorted)
        pipe = getattr(pm, "_pipe", None)  # a tied weight on two pipeline stages: its owner counts it
        self._not_counted = {f for f in self.fqn_order if pipe is not None and pipe.owner[f] != pipe.pp_rank}
        for (group, group_size, rank), lay in layouts:
            params = [pm._params[f] for f in lay.fqns]
            full = torch.zeros(lay.padded, dtype=torch.float32, device=pm._device)
            for p, off, n in zip(params, lay.offsets, lay.numels):
                full[off:off + n].copy_(p.detach().to_local().reshape(-1))
            lo, hi = lay.owned(rank)
            if self.param_dtype == torch.float32:
                param_buf = full
                master = full[lo:hi]  # the master shard is the parameters' own range
            else:
                master = full[lo:hi].clone()
                param_buf = full.to(self.param_dtype)
                del full
            b = _Bucket(lay, [], param_buf, torch.zeros(lay.padded, dtype=torch.float32, device=pm._device),
                        master, lo, hi, group=group, n=group_size, rank=rank)
            if self.per_microbatch:  # ZeRO-2: the owned gradients apart; the full buffer only while filled
                b.shard = torch.zeros(hi - lo, dtype=torch.float32, device=pm._device)
            for fqn, p, off, n in zip(lay.fqns, params, lay.offsets, lay.numels):
                local = param_buf[off:off + n].view(p.to_local().shape)
                dt = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                        stride=p.stride())
                new = torch.nn.Parameter(dt, requires_grad=True)
                pm._register(fqn, new)
                b.params.append(new)
            self.buckets.append(b)
        # the optimizer's parameters: this rank's segments of the master shard, with their gradients
        self.segments: list[tuple[Segment, _Bucket, torch.nn.Parameter]] = []
        for b in self.buckets:
            for seg in b.layout.segments(b.rank):
                master_seg = torch.nn.Parameter(b.master[seg.start - b.lo:seg.stop - b.lo], requires_grad=True)
                self.segments.append((seg, b, master_seg))
        self._tp_partial = {f for f in self.fqn_order if "tp" in plan.params[f].grad_partial_axes
                            and pm.mesh.size("tp") > 1}

    def params(self) -> list[torch.nn.Parameter]:
        return [p for b in self.buckets for p in b.params]

    # -- gradients ----------------------------------------------------------------------------------
    def begin(self) -> None:
        """Before a train_step's first microbatch: every bucket opens for this step's gradients
        (added into the fp32 buffers by :class:`mcompile.runtime.leaves.Leaves`); owned gradients
        of an earlier train_step (no ``zero_grad`` between) are kept aside and added back."""
        if not self.optimizer_attached:
            raise RuntimeError(
                f"Config(zero={self.stage}) keeps gradients and optimizer state sharded over dp: create the optimizer "
                "with mcompile.runtime.zero.DistributedOptimizer(pm, torch.optim.AdamW, lr=...) before "
                "train_step (a torch optimizer over pm.parameters() would see no gradients)")
        for b in self.buckets:
            if b.valid:
                b.saved = b.owned_grad.clone()
            if self.per_microbatch:
                b.shard.zero_()
                if not b.filling:  # (allocated when the leaves were built, or after a load)
                    _release(b.grad_buf)
            else:
                b.grad_buf.zero_()
            b.open = True
            b.ready, b.work = 0, None

    def launch(self, b: _Bucket) -> None:
        """Every gradient of bucket ``b`` is final (ZeRO-2: for this microbatch): reduce-scatter it over
        dp, asynchronously, into the owned range of its buffer."""
        b.work = self._reduce_scatter(b, b.grad_buf[b.lo:b.hi], async_op=True)
        b.ready = 0

    def _reduce_scatter(self, b: _Bucket, out: torch.Tensor, async_op: bool = False):
        """Sum ``b``'s buffer over its group into ``out`` (its owned range); a group of one: already there."""
        if b.n == 1:
            if out.data_ptr() != b.grad_buf.data_ptr():
                out.copy_(b.grad_buf[b.lo:b.hi])
            return _DONE if async_op else None
        return _REDUCE_SCATTER(out, b.grad_buf, group=self.groups[b.group], async_op=async_op)

    def _all_gather(self, b: _Bucket, out: torch.Tensor, local: torch.Tensor, async_op: bool = False):
        if b.n == 1:
            if out.data_ptr() != local.data_ptr():
                out.copy_(local)
            return _DONE if async_op else None
        return _ALL_GATHER(out, local, group=self.groups[b.group], async_op=async_op)

    # -- ZeRO-2: the full gradient buffers exist only while a backward fills them -------------------------
    def before_backward(self) -> None:
        """Before a backward adds into the buffers: reductions still in flight are finished (their
        buffers are added into again), every released buffer is allocated and zeroed."""
        self._drain()
        for b in self.buckets:
            if not b.filling:
                _allocate(b.grad_buf)
                b.filling = True

    def ensure_buffers(self) -> None:
        """Every full buffer allocated (views of them are being made: runtime/leaves.py); released again
        at the next train_step's begin."""
        for b in self.buckets:
            if not b.filling:
                _allocate(b.grad_buf)

    def after_backward(self) -> None:
        """After a backward: the buckets it completed and launched are waited, added into the owned
        shards and released (their full buffers freed until the next backward)."""
        self._drain()

    def _drain(self, everything: bool = False) -> None:
        for b in self.buckets:
            if b.work is None and not (everything and b.filling):
                continue
            if b.work is not None:
                b.work.wait()
            else:  # filled but never complete in one microbatch (a bucket across pipeline stages): now
                with self.comm.timed("reduce_scatter", b.group, b.grad_buf, "bucket"):
                    self._reduce_scatter(b, b.grad_buf[b.lo:b.hi])
            b.shard.add_(b.grad_buf[b.lo:b.hi])
            b.work, b.ready, b.filling = None, 0, False
            _release(b.grad_buf)

    def finish(self, scale: torch.Tensor) -> None:
        """End of train_step: wait for the reductions, reduce tp-partial gradients over tp, scale."""
        opened = []
        if self.per_microbatch:  # every bucket's sum over dp is in its shard
            self._drain(everything=True)
        for b in self.buckets:
            if self.per_microbatch:
                pass
            elif b.work is not None:
                b.work.wait()
            elif b.open:  # not every parameter's hook fired in the last piece: reduce now
                with self.comm.timed("reduce_scatter", b.group, b.grad_buf, "bucket"):
                    self._reduce_scatter(b, b.owned_grad)
            if b.open:
                opened.append(b)
            b.ready, b.work, b.open = 0, None, False
        if self._tp_partial:  # sequence-parallel norm weights: their owned segments, one all-reduce
            views = [b.grad_slice(seg.start, seg.stop) for seg, b, _ in self.segments
                     if seg.fqn in self._tp_partial and any(b is o for o in opened)]
            if views:
                flat = torch.cat(views)
                with self.comm.timed("all_reduce", "tp", flat, "step"):
                    dist.all_reduce(flat, group=self.groups["tp"])
                torch._foreach_copy_(views, list(flat.split([v.numel() for v in views])))
        for b in opened:
            owned = b.owned_grad
            owned.mul_(scale)
            if b.saved is not None:
                owned.add_(b.saved)
                b.saved = None
            b.valid = True
        for seg, b, master_seg in self.segments:
            if b.valid:
                master_seg.grad = b.grad_slice(seg.start, seg.stop)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for b in self.buckets:
            b.valid = False
            if not set_to_none:
                b.owned_grad.zero_()
        for _, _, master_seg in self.segments:
            if set_to_none:
                master_seg.grad = None

    def local_grads(self) -> dict[str, torch.Tensor]:
        """Each parameter's reduced local (tp-sharded) gradient: the owned ranges all-gathered over dp."""
        out = {}
        for b in self.buckets:
            if not b.valid:
                continue
            full = torch.empty_like(b.grad_buf)
            self._all_gather(b, full, b.owned_grad.contiguous())
            for fqn, p, off, n in zip(b.layout.fqns, b.params, b.layout.offsets, b.layout.numels):
                out[fqn] = full[off:off + n].view(p.to_local().shape)
        return {f: out[f] for f in self.fqn_order if f in out}

    def grad_norm(self, norm_type: float) -> torch.Tensor:
        """The global gradient norm (see the module docstring), the same on every rank."""
        device = self.buckets[0].grad_buf.device if self.buckets else None
        parts = torch.zeros(len(self._norm_keys), dtype=torch.float32, device=device)
        index = {k: i for i, k in enumerate(self._norm_keys)}
        for seg, b, _ in self.segments:
            if not b.valid or seg.fqn in self._not_counted:
                continue
            g = b.grad_slice(seg.start, seg.stop)
            i = index[self._sharded_axes[seg.fqn]]
            if norm_type == float("inf"):
                parts[i] = torch.maximum(parts[i], g.abs().max())
            elif norm_type == 2.0:
                parts[i] += torch.dot(g, g)
            else:
                parts[i] += g.abs().pow(norm_type).sum()
        if norm_type == float("inf"):  # a maximum may see a replicated element any number of times
            for ax in self.axis_names:
                if self.axis_sizes[ax] > 1:
                    with self.comm.watch("all_reduce_max", ax):
                        dist.all_reduce(parts, op=dist.ReduceOp.MAX, group=self.groups[ax])
            return parts.max() if parts.numel() else torch.zeros(())
        # the owned ranges partition each bucket over its group; summed over all data ranks, an expert's
        # (sharded over ep, owned over dp) is counted once too
        with self.comm.watch("all_reduce", "data" if "data" in self.groups else "dp"):
            dist.all_reduce(parts, group=self.groups["data" if "data" in self.groups else "dp"])
        for ax in self.axis_names:
            if ax in ("dp", *self.data_axes) or self.axis_sizes[ax] == 1:
                continue
            if self.coords[ax] != 0:
                for k, i in index.items():
                    if ax not in k:
                        parts[i] = 0.0
            with self.comm.watch("all_reduce", ax):
                dist.all_reduce(parts, group=self.groups[ax])
        return parts.sum() ** (1.0 / norm_type)

    def scale_grads(self, factor: torch.Tensor) -> None:
        for b in self.buckets:
            if b.valid:
                b.owned_grad.mul_(factor)

    # -- parameters ---------------------------------------------------------------------------------
    @torch.no_grad()
    def publish(self) -> None:
        """After the optimizer updated the master shards: parameters <- masters, all-gathered over dp."""
        works = []
        for b in self.buckets:
            if self.param_dtype != torch.float32:
                b.param_buf[b.lo:b.hi].copy_(b.master)
            works.append(self._all_gather(b, b.param_buf, b.param_buf[b.lo:b.hi], async_op=True))
            if b.n > 1:
                works[-1] = self.comm.launched("all_gather", b.group, b.param_buf, works[-1], source="publish")
        for w in works:
            w.wait()

    @torch.no_grad()
    def set_master(self, fqn: str, local: torch.Tensor) -> None:
        """New fp32 values of one parameter's local piece (load_full_state_dict): its master segments."""
        if self.param_dtype == torch.float32:
            return  # the masters are the parameters
        flat = local.reshape(-1)
        for seg, _, master_seg in self.segments:
            if seg.fqn == fqn:
                master_seg.copy_(flat[seg.start - seg.offset:seg.stop - seg.offset])

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The fp32 gradient memory held now: the full buffers (ZeRO-2: the owned shards, and a full
        buffer only while a backward fills it)."""
        if not self.per_microbatch:
            return [b.grad_buf for b in self.buckets]
        return [b.shard for b in self.buckets] + [b.grad_buf for b in self.buckets if b.filling]

    def masters(self) -> list[torch.Tensor]:
        """fp32 master shards held in addition to the parameters (none under fp32)."""
        return [] if self.param_dtype == torch.float32 else [b.master for b in self.buckets]

    def layout_signature(self) -> str:
        layout = {"dp": self.dp, "dtype": str(self.param_dtype),
                  "buckets": [[list(b.layout.fqns), list(b.layout.numels), list(b.layout.offsets), b.layout.padded]
                              + ([b.group, b.n] if b.group != "dp" else []) for b in self.buckets]}
        return hashlib.sha256(json.dumps(layout).encode()).hexdigest()


class _Done:
    """The work of a collective over a group of one (nothing to wait for)."""

    @staticmethod
    def wait() -> bool:
        return True

    @staticmethod
    def is_completed() -> bool:
        return True


_DONE = _Done()


def _release(buf: torch.Tensor) -> None:
    """Free a flat buffer's memory; its views (the leaves' main gradients) stay valid objects."""
    buf.untyped_storage().resize_(0)


def _allocate(buf: torch.Tensor) -> None:
    """Give a released flat buffer its memory back, zeroed."""
    st = buf.untyped_storage()
    if st.size() == 0:
        st.resize_(buf.numel() * buf.element_size())
    buf.zero_()


class DistributedOptimizer:
    """A torch optimizer over this rank's ZeRO-1 shard (Rajbhandari et al. 2020, stage 1).

    ``DistributedOptimizer(pm, torch.optim.AdamW, lr=3e-4, weight_decay=0.1)``: ``optimizer`` is a
    class or a factory ``f(params, **kwargs) -> torch.optim.Optimizer``. Its update must be
    element-wise (SGD, Adam, AdamW, RMSprop, Adagrad, ...): each rank updates flat segments of
    parameters. ``options_for(fqn) -> dict`` puts parameters into groups with their own options
    (e.g. ``{"weight_decay": 0.0}`` for norms). With ``Config(zero=0)`` or dp = 1 it is a plain
    optimizer over ``pm.parameters()`` with the same interface.

    The inner optimizer is ``.optimizer`` (attach LR schedulers to it); ``state_dict()`` is this
    rank's shard; ``pm.save_checkpoint(path, optimizer=opt)`` saves every rank's segments as pieces of
    each parameter's state in its global shape (runtime/checkpoint.py): loadable under any layout and
    ZeRO level."""

    def __init__(self, pm, optimizer: Callable[..., torch.optim.Optimizer], *,
                 options_for: Callable[[str], dict] | None = None, **kwargs):
        if isinstance(optimizer, type) and issubclass(optimizer, _NOT_ELEMENTWISE):
            raise ValueError(f"{optimizer.__name__} does not update elements independently, so it cannot "
                             "run on flat shards of parameters; use an element-wise optimizer (AdamW, SGD, ...) "
                             "or Config(zero=0)")
        self._pm = pm
        self._zero: ZeroBuffers | None = pm._zero
        if self._zero is None:
            named = [(f, p) for f, p in pm.named_parameters() if p.requires_grad]
        else:
            named = [(seg.fqn, master_seg) for seg, _, master_seg in self._zero.segments]
            if not named:  # a rank whose ranges hold only padding (tiny model, large dp): torch wants one
                named = [("", torch.nn.Parameter(torch.empty(0, device=pm._device)))]
        self.optimizer = optimizer(_groups(named, options_for), **kwargs)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(self.optimizer).__name__}, not a "
                            "torch.optim.Optimizer")
        if isinstance(self.optimizer, _NOT_ELEMENTWISE) and self._zero is not None:
            raise ValueError(f"{type(self.optimizer).__name__} cannot run on flat shards of parameters")
        if self._zero is not None:
            self._zero.optimizer_attached = True

    @property
    def sharded(self) -> bool:
        return self._zero is not None

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None and self._zero is not None:
            raise ValueError("DistributedOptimizer.step takes no closure under zero=1")
        if getattr(self._pm, "step_skipped", False):  # fp16: the gradients overflowed on some rank, every rank
            return None  # skips (runtime/loss_scale.py); the masters, hence the parameters, are unchanged
        out = self.optimizer.step(closure)
        if self._zero is not None:
            self._zero.publish()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._zero is None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        else:
            self._zero.zero_grad(set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients so that their global ``norm_type``-norm is at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` on the single-device model; returns the norm before."""
        if self._zero is None:
            return torch.nn.utils.clip_grad_norm_(self._pm.parameters(), max_norm, norm_type)
        norm_type = float(norm_type)
        total = self._zero.grad_norm(norm_type)
        self._zero.scale_grads(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's shard: the inner optimizer's state dict, and the fp32 master shards (bf16)."""
        sd = {"optimizer": self.optimizer.state_dict()}
        if self._zero is not None:
            sd["masters"] = self._zero.masters()
        return sd

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self._zero is not None:
            for mine, theirs in zip(self._zero.masters(), state.get("masters", []), strict=True):
                mine.copy_(theirs)

    def sharded_state_dict(self, for_load: bool = False) -> dict:
        """This rank's shard under a key of its own (shards of different ranks are different tensors;
        DCP would keep one of equal keys): a layout-bound form for same-layout use only;
        ``pm.save_checkpoint`` writes the layout-independent one (runtime/checkpoint.py). ``for_load``
        first creates the optimizer's state tensors (DCP loads into existing tensors)."""
        if for_load:
            self._materialize_state()
        return {f"rank{dist.get_rank()}": self.state_dict()}

    def load_sharded_state_dict(self, state: dict) -> None:
        self.load_state_dict(state[f"rank{dist.get_rank()}"])

    def layout_signature(self) -> str | None:
        return self._zero.layout_signature() if self._zero is not None else None

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank holds, by MemoryTracker category: parameter and gradient buffers, and the
        optimizer's state with the fp32 master shards."""
        state = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        if self._zero is None:
            ps = [p.to_local() for p in self._pm.parameters()]
            return {"parameters": ps, "gradients": [p.grad.to_local() for p in self._pm.parameters()
                                                    if p.grad is not None], "optimizer": state}
        z = self._zero
        return {"parameters": [b.param_buf for b in z.buckets], "gradients": z.gradient_buffers(),
                "optimizer": z.masters() + state}

    @torch.no_grad()
    def _materialize_state(self) -> None:
        """Create the inner optimizer's state (one step at lr 0 with zero gradients), leaving the
        parameters, their gradients and the options as they were."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if not params or all(self.optimizer.state.get(p) for p in params):
            return
        values = [p.detach().clone() for p in params]
        grads = [p.grad for p in params]
        lrs = [g.get("lr") for g in self.optimizer.param_groups]
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in self.optimizer.param_groups:
            if "lr" in g:
                g["lr"] = 0.0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        for p, v, gr in zip(params, values, grads):
            p.copy_(v)
            p.grad = gr


def _groups(named: list[tuple[str, torch.Tensor]], options_for: Callable[[str], dict] | None):
    if options_for is None:
        return [p for _, p in named]
    groups: list[dict] = []
    for fqn, p in named:
        opts = dict(options_for(fqn) or {})
        for g in groups:
            if g["_opts"] == opts:
                g["params"].append(p)
                break
        else:
            groups.append({"_opts": opts, "params": [p], **opts})
    for g in groups:
        del g["_opts"]
    return groups
