"""The tensors the programs run on, and the flat fp32 gradient buffers behind them.

A :class:`~mcompile.runtime.module.ParallelModule` shows the optimizer and checkpoints its
parameters as DTensors, but its programs run on *plain local tensors* (DESIGN §6, issue 11):
wrapping each parameter with ``to_local(grad_placements=...)`` per microbatch, and letting autograd
accumulate into a DTensor ``.grad``, costs per parameter and microbatch a DTensor dispatch in
forward and in backward (about 17 times a plain tensor's bookkeeping, measured on CPU). Here:

- **compute leaves** (:attr:`Leaves.compute`): per parameter one plain tensor that requires grad and
  is fed to every microbatch. In fp32 it *is* the parameter's local storage (an alias: the
  optimizer's in-place update is what the next step reads). In a lower compute dtype it is a copy in
  that dtype, refreshed once per step with one ``_foreach_copy_`` (Megatron keeps bf16 weights
  beside fp32 masters the same way), or, under ZeRO-1, where the parameters already are bf16 views
  of the flat parameter buffer, an alias of that view. One copy per step, never one per
  microbatch: under pipeline parallelism the cast used to keep a bf16 weight copy alive per
  microbatch in flight.
- **main gradients** (Megatron's ``main_grad``): per parameter an fp32 view into a flat buffer per
  gradient bucket. An fp32 leaf has its view preset as ``.grad``, so autograd accumulates every
  microbatch into it in place; a bf16 leaf's gradient is added into its fp32 view by a
  post-accumulate-grad hook after each microbatch and freed. Gradients therefore accumulate over
  microbatches in fp32 whatever the compute dtype (under ZeRO-1 × pp they used to accumulate in
  bf16 in the pipeline's leaves).
- **reduction during backward**: during the last microbatch's backward (``armed``) every hook
  counts its bucket; a bucket whose parameters are all final is reduced over dp at once, in place,
  asynchronously (all-reduce, or ZeRO-1's reduce-scatter), while backward goes on. Under pipeline
  parallelism each stage arms its own last backward; weights tied across stages are counted after
  their cross-stage sum.
- after the step each parameter's ``.grad`` is a DTensor over its fp32 view (zero=0; under ZeRO-1
  the gradients stay in the sharded buffers, :mod:`mcompile.runtime.zero`).

Zero-bubble W (torch's ``stage_backward_weight``) adds weight gradients by hand, not through
AccumulateGrad, so no hook fires: the stage calls :meth:`Leaves.accumulated` after it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mcompile.ir.buckets import GradBuckets, grad_buckets

__all__ = ["Leaves", "grad_layout"]


def grad_layout(pm) -> GradBuckets:
    """The gradient buckets of ParallelModule ``pm`` (:func:`mcompile.ir.buckets.grad_buckets` of its parameters, in
    registration order, with their local pieces' sizes): the buffers' layout here and in runtime/zero.py."""
    params = [(f, p._local_tensor.numel(), p.requires_grad) for f, p in pm._params.items()]
    return grad_buckets(params, pm.plan, pm.mesh, pm._coords, zero=pm.config.zero, bucket_mb=pm.config.bucket_mb,
                        zero3=set(pm._zero3))


class _GradBucket:
    """zero=0: a run of parameters whose fp32 gradients live end to end in one flat buffer."""

    def __init__(self, fqns, offsets, numels, padded, device, reduce_dp: bool):
        self.fqns = list(fqns)
        self.buf = torch.zeros(padded, dtype=torch.float32, device=device)
        self.spans = {f: (o, o + n) for f, o, n in zip(fqns, offsets, numels)}
        self.views = {f: self.buf[lo:hi] for f, (lo, hi) in self.spans.items()}
        self.reduce_dp = reduce_dp
        self.expected = 0  # parameters whose hook counts towards readiness
        self.ready = 0
        self.work = None
        self.saved: torch.Tensor | None = None


class Leaves:
    """Compute leaves and main gradients of one ParallelModule (module docstring)."""

    def __init__(self, pm, counted: set[str]):
        """``counted``: the parameters whose gradient this rank's programs produce (their hooks
        make buckets ready; the others are reduced at the end of the step)."""
        self.pm = pm
        self.dtype = pm.config.dtype
        self.zero = pm._zero
        self.armed = False
        self.counted = set(counted)
        self.deferred: set[str] = set()  # tied across pipeline stages: counted after their sum
        params = pm._params
        self.trainable = [f for f, p in params.items() if p.requires_grad]
        self.main: dict[str, torch.Tensor] = {}  # fqn -> flat fp32 view
        self._bucket_of: dict[str, object] = {}
        if self.zero is not None:
            self.layout = self.zero.layout
            for zb in self.zero.buckets:
                for fqn, off, n in zip(zb.layout.fqns, zb.layout.offsets, zb.layout.numels):
                    self.main[fqn] = zb.grad_buf[off:off + n]
                    self._bucket_of[fqn] = zb
            self.buckets = []
        else:
            self.buckets = self._make_buckets(params)
        self._expected = {}
        for fqn in self.trainable:
            if fqn in self.counted:
                b = self._bucket_of[fqn]
                self._expected[id(b)] = self._expected.get(id(b), 0) + 1
        self._grad_dt: dict[str, DTensor] = {}
        self.compute: dict[str, torch.Tensor] = {}
        self._sources: dict[str, torch.Tensor] = {}  # fp32 parameter storage of a bf16 copy
        self._ptrs: dict[str, int] = {}
        self._kept: set[str] = set()
        # per bucket reduced early this step: launched while a backward ran (an autograd hook, or the
        # backward module's own grads_ready: passes/dp/overlap.py), not after it returned?
        self.launches: list[bool] = []
        self._inside = False
        # ZeRO-2: buckets are reduce-scattered after every microbatch's backward, not only the last one's
        self.every_microbatch = self.zero is not None and self.zero.per_microbatch
        self.bucket_list = list(self.zero.buckets) if self.zero is not None else list(self.buckets)
        self._build()

    # -- layout -----------------------------------------------------------------------------------
    def _make_buckets(self, params) -> list[_GradBucket]:
        """The buffers of :func:`mcompile.ir.buckets.grad_buckets` (zero=0): the trainable parameters in reverse
        order, grouped by the data axes their gradient is summed over (dp only for an expert weight; not dp for
        a ZeRO-3 piece, reduce-scattered inside the backward), in buckets of ``bucket_mb``: the layout by which
        ``mcompile show`` places the backward's bucket launches too."""
        pm = self.pm
        self.layout = grad_layout(pm)
        out = []
        for gb in self.layout.buckets:
            lay, axes = gb.layout, gb.axes
            b = _GradBucket(lay.fqns, lay.offsets, lay.numels, lay.padded, pm._device, bool(axes))
            b.group = pm._reduce_group(axes) if axes else None
            for f in lay.fqns:
                self._bucket_of[f] = b
                self.main[f] = b.views[f]
            out.append(b)
        return out

    def _build(self) -> None:
        """(Re)make every parameter's compute leaf (after the parameters changed storage: a ZeRO
        re-registration, a load that replaced a tensor)."""
        pm = self.pm
        if self.zero is not None and self.zero.per_microbatch:  # ZeRO-2: views need the buffers' memory
            self.zero.ensure_buffers()
        self.compute, self._sources, self._ptrs = {}, {}, {}
        self._fqn_of: dict[int, str] = {}  # id(compute leaf) -> fqn (zero-bubble W hands leaves back)
        for fqn, p in pm._params.items():
            local = p._local_tensor
            self._ptrs[fqn] = local.data_ptr()
            if not p.requires_grad:
                self.compute[fqn] = local.detach()
                continue
            main = self.main[fqn].view(local.shape)
            if local.dtype == torch.float32 and self.dtype != torch.float32:
                leaf = torch.empty(local.shape, dtype=self.dtype, device=local.device)
                self._sources[fqn] = local
            else:
                leaf = local.detach()
            leaf.requires_grad_(True)
            if leaf.dtype == torch.float32:
                leaf.grad = main  # autograd accumulates into the fp32 view in place
            leaf.register_post_accumulate_grad_hook(self._hook(fqn, main))
            self.compute[fqn] = leaf
            self._fqn_of[id(leaf)] = fqn
            if self.zero is None and fqn not in self._grad_dt:
                self._grad_dt[fqn] = DTensor.from_local(main, p.device_mesh, p.placements, run_check=False,
                                                        shape=p.shape, stride=p.stride())

    def _hook(self, fqn: str, main: torch.Tensor):
        def hook(leaf: torch.Tensor) -> None:
            if leaf.grad is not main:  # a bf16 leaf: its microbatch gradient, added in fp32
                main.add_(leaf.grad)
                leaf.grad = None
            if self.armed and fqn in self.counted and fqn not in self.deferred:
                self._inside = True
                try:
                    self.ready(fqn)
                finally:
                    self._inside = False
        return hook

    # -- one step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def begin(self) -> None:
        """Before the first microbatch: refresh the compute copies, clear the main gradients (those
        already in ``.grad`` are kept aside and added back at the end, as ``backward`` adds)."""
        pm = self.pm
        self.refresh()
        self._kept = set()
        self.launches = []
        if self.zero is not None:
            self.zero.begin()
            return
        for b in self.buckets:
            kept = [(f, pm._params[f].grad) for f in b.fqns if pm._params[f].grad is not None]
            b.saved = None
            if kept:
                self._kept.update(f for f, _ in kept)
                saved = torch.zeros_like(b.buf)
                for f, g in kept:
                    lo, hi = b.spans[f]
                    saved[lo:hi].copy_(g.to_local().reshape(-1))
                b.saved = saved
            b.buf.zero_()
            b.ready, b.work = 0, None
            for f in b.fqns:
                pm._params[f].grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """The compute leaves follow the parameters: remade if a parameter changed storage, the
        lower-precision copies recopied (after an optimizer step or a load). Before every run."""
        if any(p._local_tensor.data_ptr() != self._ptrs[f] for f, p in self.pm._params.items()):
            self._build()
        if self._sources:
            srcs = list(self._sources)
            torch._foreach_copy_([self.compute[f] for f in srcs], [self._sources[f] for f in srcs])

    def bucket_index(self, fqn: str | None) -> int | None:
        """The index of ``fqn``'s bucket when a backward may launch it (its gradient counts towards a
        bucket reduced over dp), else None: what the overlap pass places launches for."""
        return self.layout.launched(fqn, self.counted, self.deferred)

    def grads_ready(self, bucket: int, count: int) -> None:
        """``count`` gradients of bucket ``bucket`` were added inside a backward module (the
        ``mcompile.grads_ready`` op, passes/dp/overlap.py): counted in the step's last microbatch."""
        if self.armed or self.every_microbatch:
            self._inside = True
            try:
                self._count(self.bucket_list[bucket], count)
            finally:
                self._inside = False

    def ready(self, fqn: str) -> None:
        """``fqn``'s gradient is final for this step: reduce its bucket once all of them are."""
        self._count(self._bucket_of[fqn], 1)

    def _count(self, b, count: int) -> None:
        if self.every_microbatch and self.deferred and \
                any(f in self.deferred for f in (b.layout.fqns if hasattr(b, "layout") else b.fqns)):
            return  # ZeRO-2, a weight tied across stages in the bucket: reduced at the step's end, after its sum
        b.ready += count
        if b.ready != self._expected.get(id(b), 0):
            return
        if self.zero is not None:
            self.zero.launch(b)
            b.work = self.pm._comm.launched("reduce_scatter", "dp", b.grad_buf, b.work,  # watchdog, timeline
                                            group=self.zero.groups[b.group])
        elif b.reduce_dp:
            b.work = dist.all_reduce(b.buf, group=b.group, async_op=True)
            b.work = self.pm._comm.launched("all_reduce", "dp", b.buf, b.work, group=b.group)  # watchdog, timeline
        else:
            return
        self.launches.append(self._inside)

    def accumulated(self, leaves: list[torch.Tensor]) -> None:
        """Gradients added to ``leaves`` outside AccumulateGrad (zero-bubble W): what the hook does."""
        for leaf in leaves:
            fqn = self._fqn_of.get(id(leaf))
            if fqn is None or leaf.grad is None:
                continue
            main = self.main[fqn].view(leaf.shape)
            if leaf.grad is not main and leaf.grad.data_ptr() != main.data_ptr():
                main.add_(leaf.grad)
                leaf.grad = None if leaf.dtype != torch.float32 else main
            if self.armed and fqn in self.counted and fqn not in self.deferred:
                self.ready(fqn)

    def targets(self, args: list) -> dict[int, torch.Tensor]:
        """Input position -> the fp32 main-gradient view of each compute leaf among a joint program's
        inputs: its backward adds the gradient there in place (runtime/joint_runner.py ``accumulate``)."""
        out = {}
        for i, a in enumerate(args):
            fqn = self._fqn_of.get(id(a)) if isinstance(a, torch.Tensor) else None
            if fqn is not None:
                out[i] = self.main[fqn].view(a.shape)
        return out

    @torch.no_grad()
    def add_grads(self, args: list, positions: list[int], grads: list, counted: set = frozenset()) -> None:
        """After a joint program's backward (runtime/joint_runner.py): ``grads[j]`` belongs to
        ``args[positions[j]]``. A compute leaf's gradient was added into its fp32 view by the backward
        itself (returned as None: :meth:`targets`) or is added here (what AccumulateGrad and the hook
        do on the autograd path); either way it counts towards its bucket, here unless the backward
        counted it itself (``counted``: positions whose ``grads_ready`` ran inside the module)."""
        for pos, g in zip(positions, grads):
            fqn = self._fqn_of.get(id(args[pos]))
            if fqn is None:
                continue
            if g is not None:
                self.main[fqn].view(g.shape).add_(g)
            if pos in counted:
                continue
            if (self.armed or self.every_microbatch) and fqn in self.counted and fqn not in self.deferred:
                self.ready(fqn)

    @torch.no_grad()
    def finish(self, scale: torch.Tensor, tp_partial: list[str]) -> None:
        """After the last backward: wait for (or run) the dp reductions, sum the gradients that are
        Partial over tp, divide by the token count, add back the kept gradients, publish ``.grad``."""
        if self.zero is not None:
            self.zero.finish(scale)
            return
        pm = self.pm
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            elif b.reduce_dp:  # not every hook fired in the last microbatch: reduce now
                with pm._comm.timed("all_reduce", "dp", b.buf, "bucket", group=b.group):
                    dist.all_reduce(b.buf, group=b.group)
            b.work, b.ready = None, 0
        if tp_partial:  # sequence-parallel norm weights: one coalesced all-reduce over tp per step
            views = [self.main[f] for f in tp_partial]
            flat = torch.cat(views)
            with pm._comm.timed("all_reduce", "tp", flat, "step"):
                dist.all_reduce(flat, group=pm._comm.groups["tp"])
            torch._foreach_copy_(views, list(flat.split([v.numel() for v in views])))
        for b in self.buckets:
            b.buf.mul_(scale)
            if b.saved is not None:
                b.buf.add_(b.saved)
                b.saved = None
        for fqn in self.counted | self._kept:
            if fqn in self._grad_dt:
                pm._params[fqn].grad = self._grad_dt[fqn]

    def before_backward(self) -> None:
        """Before a backward adds gradients (ZeRO-2: the full buffers are allocated; else nothing)."""
        if self.every_microbatch:
            self.zero.before_backward()

    def after_backward(self) -> None:
        """After a backward (ZeRO-2: the launched buckets land in their shards and are freed)."""
        if self.every_microbatch:
            self.zero.after_backward()

    def flat_buffers(self) -> list[torch.Tensor]:
        """The fp32 gradient buffers (memory accounting)."""
        if self.zero is not None:
            return self.zero.gradient_buffers()
        return [b.buf for b in self.buckets]
