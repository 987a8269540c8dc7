"""Running joint programs (passes/joint.py): forward and backward modules, no autograd.

:class:`JointRunner` owns one per-rank program (or pipeline stage program). On the first call with a
new input signature (shapes, dtypes, which inputs require grad) it has the compiler's signature passes
build its modules (the ``build`` it was given: :func:`mcompile.compiler.build_joint` traces the joint graph,
chooses the saved set by the configured recompute policy, partitions, optionally splits the backward for
zero-bubble W, and hands each module to the code generator); the runtime imports no pass. Later calls
only execute:

- :meth:`JointRunner.forward` — ``outputs, ctx``: ctx holds the saved tensors (and the inputs the
  backward reads) until the backward;
- :meth:`JointRunner.backward` — the gradients of the inputs that require grad, from the output
  gradients; or, split, :meth:`backward_input` (the received activations' gradients, and a stash)
  then :meth:`backward_weight` (the weights' gradients from the stash).

Weight gradients are returned, not accumulated: the caller adds them into its fp32 buffers
(runtime/leaves.py ``Leaves.add_grads``), which is where bucket readiness is counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from mcompile.ir.meta import W_INPUTS

__all__ = ["JointRunner", "JointCtx", "signature", "ActivationBudget", "RecomputeChoice"]


@dataclass(frozen=True)
class ActivationBudget:
    """What ``recompute="auto"`` may keep for one call's backward (passes/remat.py's budget).

    ``Config(activation_budget=)`` is the saved activations one rank holds at its peak. A program
    whose forwards run one at a time (no pipeline: microbatches are accumulated one after another)
    gets all of it per call; a pipeline stage shares it with the other forwards its rank holds at
    once under the schedule (``in_flight``: stage 0 of 1F1B p microbatches, the last stage 1), so
    each call gets ``total // in_flight`` and the rank's peak stays within ``total``."""

    total: int  # Config.activation_budget: bytes of saved activations per rank at its peak
    in_flight: int = 1  # forwards (microbatch, stage) whose saved activations the rank holds at once
    where: str = ""  # how in_flight was counted, for errors: "pipeline rank 0 under schedule '1f1b'"

    @property
    def per_call(self) -> int:
        return self.total // self.in_flight


@dataclass(frozen=True)
class RecomputeChoice:
    """What ``recompute="auto"`` chose for one program (a rank's, or a pipeline stage's)."""

    name: str  # "rank 0", "stage 1"
    budget: int  # bytes per call the solver was given (ActivationBudget.per_call)
    in_flight: int
    saved_bytes: int  # what the forward keeps for backward (distinct storages)
    recomputed_ops: int  # forward ops the backward runs again (not counted: views, which cost nothing, and
    #                      ZeRO-3's parameter gathers, repeated in backward whatever the budget)
    recompute_flops: float

    def __str__(self) -> str:
        return (f"{self.name}: {self.saved_bytes} of {self.budget} bytes saved per microbatch "
                f"({self.in_flight} in flight), {self.recomputed_ops} ops recomputed "
                f"({self.recompute_flops:.4g} FLOPs)")


def signature(args: list) -> tuple:
    return tuple((tuple(a.shape), a.dtype, a.requires_grad, a.device.type) if isinstance(a, torch.Tensor) else
                 ("v", a) for a in args)


class JointCtx:
    """What one forward leaves for its backward."""

    __slots__ = ("jp", "saved", "primals", "stash", "acc", "acc_w")

    def __init__(self, jp, saved, primals):
        self.jp, self.saved, self.primals, self.stash = jp, saved, primals, None
        self.acc, self.acc_w = [], []  # the buffers the backward (or W) adds gradients into


class JointRunner:
    def __init__(self, program: fx.GraphModule, config, *, build, split_inputs: list[int] | None = None,
                 name: str = "", accumulate=None, grad_buckets=None, budget: ActivationBudget | None = None):
        """``build(program, args, config, **what)``: the compiler's signature passes
        (:func:`mcompile.compiler.build_joint`, which :func:`mcompile.compiler.joint_runner` passes): the
        modules for one input signature, built on the first call with it.
        ``split_inputs``: program input positions whose gradients backward_input computes (the
        received activations of a pipeline stage); the other gradients are backward_weight's.
        ``accumulate(args) -> {input position: buffer}``: every input that requires grad (other than
        ``split_inputs``) has a buffer the backward adds its gradient into in place as soon as it is
        computed (the fp32 main gradients), instead of returning them all at the end — one gradient
        at a time is live, not a copy of every weight's.
        ``grad_buckets(position) -> bucket index | None``: the dp gradient bucket of an accumulated
        input whose bucket is reduced over dp; with ``Config(overlap=True)`` the backward launches each
        bucket right after its last gradient is added (passes/dp/overlap.py ``launch_buckets``).
        ``budget``: ``recompute="auto"``'s share of ``Config(activation_budget=)`` per call (default:
        all of it, one call in flight)."""
        self.program = program
        self.build = build
        self.budget = budget
        self.config = config
        self.split_inputs = split_inputs
        self.name = name
        self.accumulate = accumulate
        self.grad_buckets = grad_buckets
        self._cache: dict[tuple, object] = {}  # signature -> the built JointProgram (passes/joint.py)
        self.last = None  # the JointProgram of the last call

    # -- compile ------------------------------------------------------------------------------------
    def compile(self, args: list):
        key = signature(args)
        jp = self._cache.get(key)
        if jp is None:
            jp = self._cache[key] = self.build(self.program, args, self.config, name=self.name,
                                               split_inputs=self.split_inputs, accumulate=self.accumulate is not None,
                                               grad_buckets=self.grad_buckets, budget=self.budget)
        self.last = jp
        return jp

    def choice(self) -> RecomputeChoice | None:
        """What ``recompute="auto"`` chose for the last compiled signature (None before the first call,
        or under a named policy)."""
        jp = self.last
        if jp is None or self.config.recompute != "auto":
            return None
        budget = self.budget or ActivationBudget(self.config.activation_budget)
        return RecomputeChoice(self.name, budget.per_call, budget.in_flight, jp.saved_bytes, jp.recomputed_ops,
                               jp.recompute_flops)

    # -- run ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, args: list) -> tuple[tuple, JointCtx]:
        jp = self.compile(args)
        args = list(args) + jp.joint.constants  # the program's module constants, lifted (passes/joint.py)
        res = jp.forward(*args)
        n = jp.joint.num_outputs
        ctx = JointCtx(jp, list(res[n:]), [args[i] for i in jp.bwd_primals])
        if self.accumulate is not None:
            into = self.accumulate(args)

            def buf(i):  # the caller's buffer; a scratch one for the probe's fake leaves, never for real ones
                if i in into:
                    return into[i]
                from torch._subclasses.fake_tensor import FakeTensor

                if not isinstance(args[i], FakeTensor):
                    raise RuntimeError(f"{self.name}: input {i} requires grad but has no gradient buffer")
                return torch.zeros(args[i].shape, dtype=torch.float32, device=args[i].device)

            ctx.acc = [buf(i) for i in jp.acc_full]
            ctx.acc_w = [buf(i) for i in jp.acc_positions]
        return tuple(res[:n]), ctx

    def tangents(self, ctx: JointCtx, outputs: tuple, grads: list | None = None, scale: float = 1.0) -> list:
        """The output gradients in the backward's order: ``grads`` given per differentiable output
        (None -> zeros), or ``scale`` (1; fp16: the loss scale, runtime/loss_scale.py) for the first
        differentiable output (the loss) and zeros else."""
        diff = ctx.jp.joint.diff_outputs
        if grads is None:
            return [torch.full_like(outputs[i], scale) if k == 0 else torch.zeros_like(outputs[i])
                    for k, i in enumerate(diff)]
        return [g if g is not None else torch.zeros_like(outputs[i]) for g, i in zip(grads, diff)]

    @torch.no_grad()
    def backward(self, ctx: JointCtx, tangents: list) -> list:
        """Gradients of the inputs that require grad (``jp.joint.grad_primals`` order)."""
        jp = ctx.jp
        out = jp.backward(*ctx.saved, *ctx.primals, *tangents, *ctx.acc)
        ctx.saved = ctx.primals = ctx.acc = None
        return list(out)

    @torch.no_grad()
    def backward_input(self, ctx: JointCtx, tangents: list) -> list:
        """The gradients of the split inputs (in ``split_inputs`` order); keeps W's stash in ctx."""
        jp = ctx.jp
        b_in = [*ctx.saved, *ctx.primals, *tangents]
        res = jp.backward_input(*b_in)
        k = len(jp.input_grads)
        w_inputs = jp.backward_weight.meta[W_INPUTS]  # a GraphModule, or the code generator's wrapper of one
        ctx.stash = list(res[k:]) + [b_in[i] for i in w_inputs]
        ctx.saved = ctx.primals = None
        return list(res[:k])

    @torch.no_grad()
    def backward_weight(self, ctx: JointCtx) -> list:
        """The weight gradients (positions ``jp.weight_grads`` of grad_primals)."""
        out = ctx.jp.backward_weight(*ctx.stash, *ctx.acc_w)
        ctx.stash = ctx.acc_w = None
        return list(out)

