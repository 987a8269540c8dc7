"""Running joint programs (passes/joint.py): forward and backward modules, no autograd.

:class:`JointRunner` owns one per-rank program (or pipeline stage program). On the first call with a
new input signature (shapes, dtypes, which inputs require grad) it traces the joint graph, chooses
the saved set by the configured recompute policy (``none`` / ``full`` / ``selective`` by name,
``auto`` by cost under ``activation_budget``: passes/remat.py), partitions, optionally splits the
backward for zero-bubble W, and hands each module to the code generator (``codegen``). Later calls
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

from mcompile.passes import joint as J

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
    def __init__(self, program: fx.GraphModule, config, *, split_inputs: list[int] | None = None, name: str = "",
                 accumulate=None, grad_buckets=None, budget: ActivationBudget | None = None):
        """``split_inputs``: program input positions whose gradients backward_input computes (the
        received activations of a pipeline stage); the other gradients are backward_weight's.
        ``accumulate(args) -> {input position: buffer}``: every input that requires grad (other than
        ``split_inputs``) has a buffer the backward adds its gradient into in place as soon as it is
        computed (the fp32 main gradients), instead of returning them all at the end — one gradient
        at a time is live, not a copy of every weight's.
        ``grad_buckets(position) -> bucket index | None``: the dp gradient bucket of an accumulated
        input whose bucket is reduced over dp; with ``Config(overlap=True)`` the backward launches each
        bucket right after its last gradient is added (passes/overlap.py ``launch_buckets``).
        ``budget``: ``recompute="auto"``'s share of ``Config(activation_budget=)`` per call (default:
        all of it, one call in flight)."""
        self.program = program
        self.budget = budget
        self.config = config
        self.split_inputs = split_inputs
        self.name = name
        self.accumulate = accumulate
        self.grad_buckets = grad_buckets
        self._cache: dict[tuple, J.JointProgram] = {}
        self.last: J.JointProgram | None = None

    # -- compile ------------------------------------------------------------------------------------
    def compile(self, args: list) -> J.JointProgram:
        key = signature(args)
        jp = self._cache.get(key)
        if jp is None:
            jp = self._cache[key] = self._build(args)
        self.last = jp
        return jp

    def _build(self, args: list) -> J.JointProgram:
        cfg = self.config
        jg = J.trace_joint(self.program, args)
        from mcompile.passes import fsdp

        gathered = fsdp.gathered_values(jg.gm)  # ZeRO-3: gathered parameters are gathered again, never saved
        if cfg.recompute == "auto":
            saved = self._solve_auto(jg.gm, gathered)
        else:
            saved = J.saved_for_policy(jg, cfg.recompute, cfg.recompute_method, cfg.recompute_num_layers)
        if gathered:
            saved = [n for n in saved if n not in gathered]
        jp = J.partition(jg, saved)
        if self.split_inputs is not None:
            pos = [jg.grad_primals.index(i) for i in self.split_inputs if i in jg.grad_primals]
            J.split_weight(jp, pos)
        if self.accumulate is not None:  # gradients into the caller's buffers, inside the graph
            # every gradient but the received activations' (a pipeline stage's): the weights' (the
            # arguments may be fake here, traced by the pipeline's probe: positions, not identities)
            acc = [j for j, i in enumerate(jg.grad_primals) if i not in (self.split_inputs or ())]
            if jp.backward_weight is not None:
                jp.acc_positions = J.accumulate_outputs(jp.backward_weight, [jp.weight_grads.index(j) for j in acc
                                                                              if j in jp.weight_grads])
                jp.acc_positions = [jg.grad_primals[jp.weight_grads[k]] for k in jp.acc_positions]
            jp.acc_full = [jg.grad_primals[j] for j in J.accumulate_outputs(jp.backward, acc)]
            if self.grad_buckets is not None and getattr(cfg, "overlap", False):
                self._launch_buckets(jp)
        if gathered and getattr(cfg, "overlap", False):  # ZeRO-3 gathers one layer ahead, reduce-scatters behind
            jp.prefetch = {"forward": fsdp.prefetch(jp.forward, f"{self.name} forward")}
            for part in ("backward", "backward_input", "backward_weight"):
                gm = getattr(jp, part)
                if gm is not None:
                    jp.prefetch[part] = fsdp.prefetch(gm, f"{self.name} {part}")
        tp_overlap = getattr(cfg, "tp_overlap", "off")
        if getattr(cfg, "overlap", False) and tp_overlap != "off":  # collective matmul on the tp collectives
            from mcompile.passes.collective_matmul import rewrite

            hw = runtime_hardware(args)
            jp.tp_overlap = []
            for part in ("forward", "backward", "backward_input", "backward_weight"):
                gm = getattr(jp, part)
                if gm is not None:
                    jp.tp_overlap += rewrite(gm, tp_overlap=tp_overlap, hardware=hw,
                                             where="forward" if part == "forward" else "backward")
        codegen = getattr(cfg, "codegen", "eager")
        if codegen == "eager":  # all-reduces of values read nowhere else: in place, without the runtime's copy
            from mcompile.passes.overlap import inplace_all_reduces

            for part in ("forward", "backward", "backward_input", "backward_weight"):
                if getattr(jp, part) is not None:
                    inplace_all_reduces(getattr(jp, part))
        if codegen != "eager":
            jp.forward = _Compiled(jp.forward, codegen)
            jp.backward = _Compiled(jp.backward, codegen)
            if jp.backward_input is not None:
                jp.backward_input = _Compiled(jp.backward_input, codegen)
                jp.backward_weight = _Compiled(jp.backward_weight, codegen)
        return jp

    def _solve_auto(self, joint: fx.GraphModule, gathered: set[str]) -> list[str]:
        """The saved set of ``recompute="auto"`` under this runner's budget; an infeasible budget names
        the program, its share of ``activation_budget`` and how far below the least it can save it is.
        ``gathered``: ZeRO-3's gathered parameters (and values of them alone), which are never saved:
        the solver is told so (must_recompute), else it would spend budget on values dropped from its
        saved set afterwards and recompute activations it had room to keep."""
        from mcompile.passes import remat

        budget = self.budget or ActivationBudget(self.config.activation_budget)
        forward, _ = remat.classify(joint)
        try:
            sol = remat.solve(joint, budget.per_call, must_save=set(), must_recompute=gathered & forward)
        except remat.BudgetError as e:
            short = e.minimum - e.budget
            share = (f"activation_budget={budget.total} bytes shared by the {budget.in_flight} forwards in flight at "
                     f"once on {budget.where or 'this rank'}, {budget.per_call} bytes each"
                     if budget.in_flight > 1 else f"activation_budget={budget.total} bytes")
            raise remat.BudgetError(e.budget, e.minimum, (
                f"recompute='auto' on {self.name or 'this program'}: {share}, is {short} bytes below the least it "
                f"can save for backward ({e.minimum} bytes per microbatch, recomputing all it can); raise "
                f"activation_budget by {e.minimum * budget.in_flight - budget.total} bytes, to at least "
                f"{e.minimum * budget.in_flight}")) from None
        return [n.name for n in joint.graph.nodes if n.name in sol.saved]

    def choice(self) -> RecomputeChoice | None:
        """What ``recompute="auto"`` chose for the last compiled signature (None before the first call,
        or under a named policy)."""
        jp = self.last
        if jp is None or self.config.recompute != "auto":
            return None
        from mcompile.passes import fsdp
        from mcompile.passes.joint import is_alias

        budget = self.budget or ActivationBudget(self.config.activation_budget)
        nodes = {n.name: n for n in jp.joint.gm.graph.nodes}
        regathered = fsdp.gathered_values(jp.joint.gm)  # ZeRO-3 gathers again whatever the budget
        ops = sum(not is_alias(nodes[r]) and r not in regathered for r in jp.recomputed)
        return RecomputeChoice(self.name, budget.per_call, budget.in_flight, jp.saved_bytes, ops, jp.recompute_flops)

    def _launch_buckets(self, jp: J.JointProgram) -> None:
        """The dp bucket launches inside the backward (or W) module: jp.launches, and the input
        positions whose readiness those count (jp.ready_positions: the caller must not count them)."""
        from mcompile.passes.overlap import launch_buckets

        gp = jp.joint.grad_primals
        whole = {j: self.grad_buckets(gp[j]) for j in range(len(gp))}
        jp.launches = launch_buckets(jp.backward, {j: b for j, b in whole.items() if b is not None})
        acc = _acc_outputs(jp.backward)
        jp.ready_positions = {gp[j] for j, b in whole.items() if b is not None and j in acc}
        if jp.backward_weight is not None:
            wpos = {k: self.grad_buckets(gp[j]) for k, j in enumerate(jp.weight_grads)}
            jp.launches_w = launch_buckets(jp.backward_weight, {k: b for k, b in wpos.items() if b is not None})
            acc_w = _acc_outputs(jp.backward_weight)
            jp.ready_positions_w = {gp[jp.weight_grads[k]] for k, b in wpos.items() if b is not None and k in acc_w}

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
        w_inputs = jp.backward_weight.meta["mc_w_inputs"] if isinstance(jp.backward_weight, fx.GraphModule) \
            else jp.backward_weight.gm.meta["mc_w_inputs"]
        ctx.stash = list(res[k:]) + [b_in[i] for i in w_inputs]
        ctx.saved = ctx.primals = None
        return list(res[:k])

    @torch.no_grad()
    def backward_weight(self, ctx: JointCtx) -> list:
        """The weight gradients (positions ``jp.weight_grads`` of grad_primals)."""
        out = ctx.jp.backward_weight(*ctx.stash, *ctx.acc_w)
        ctx.stash = ctx.acc_w = None
        return list(out)


def runtime_hardware(args: list) -> str:
    """The hardware profile (mcompile.hardware) the overlap passes price this machine with: the GPU's,
    by its name, or the CPU/gloo one."""
    dev = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    if dev.type != "cuda":
        return "cpu-gloo"
    name = torch.cuda.get_device_name(dev).lower()
    return next((k for k in ("h200", "h100", "a100", "b200") if k in name), "h100")


def _acc_outputs(gm: fx.GraphModule) -> set[int]:
    return {n.meta[J.ACC_OUTPUT] for n in gm.graph.nodes if J.ACC_OUTPUT in n.meta}


class _Compiled:
    """A module handed to the code generator on its first call (its inputs' shapes are known then)."""

    def __init__(self, gm: fx.GraphModule, codegen: str):
        self.gm, self.codegen, self.fn = gm, codegen, None
        self.meta = gm.meta

    def __call__(self, *args):
        if self.fn is None:
            from mcompile.passes.codegen import compile_graph

            self.fn = compile_graph(self.gm, list(args), self.codegen)
        return self.fn(*args)

    @property
    def code(self) -> str:
        return self.gm.code
