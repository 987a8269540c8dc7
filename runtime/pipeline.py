"""Pipeline execution: run a schedule's actions over stage programs with send/recv between ranks.

:class:`PipelineExecutor` is generic: a *stage* is anything with ``forward(mb, inputs)``,
``backward(mb, grads)`` and ``backward_weight(mb)`` (:class:`FxStage` wraps a stage program of
:mod:`mcompile.passes.pp.pipeline_split`; tests drive it with synthetic stages that sleep). For every
action of the rank's list (:mod:`mcompile.runtime.schedules`):

- ``F(s, i)``: stage ``s-1``'s tensors of microbatch ``i`` (from the rank holding it), run the
  stage, its outputs go to the rank of ``s+1``;
- ``B(s, i)``: the gradients of those outputs from ``s+1``, run the backward, the gradients of the
  stage inputs go to ``s-1``; ``W(s, i)``: the deferred weight gradient.

**Posting order** (:func:`p2p_plan`, the one code path both the executor and the verifier's
:func:`~mcompile.runtime.verify.rank_ops` read): before an action, the receives it needs are posted
(``irecv``; a receiver posts its receives from one peer in the order that peer sends them, since it
knows the peer's action list: NCCL ignores tags and pairs messages in posting order, and with
several stages per rank the order of use can differ) and waited for; after it, one ``isend`` per
output, waited for at the end of the step.

**A communicator per direction** (:meth:`Pipeline._make_p2p_groups`: a two-rank process group for
each sending and receiving pipeline rank). On NCCL a send completes only when its receive is
posted, and the operations of one communicator run in order; torch's default puts both
directions between two ranks on one communicator, and in 1F1B's steady state both neighbours send
first, each send queueing the receive its peer waits for behind it: a hang for any message larger
than NCCL's buffers (gloo buffers sends and hid it). With a communicator per direction a rank's
sends to a peer queue only behind earlier sends to it, whose receives the peer posts in the same
order before it needs any later message, and sends never block the host: the step completes
under NCCL's rules exactly when it does with buffered sends (:mod:`mcompile.runtime.verify`
proves both). Batching the crossing send and receive into one ``batch_isend_irecv`` (Megatron's
``send_forward_recv_backward``) also breaks the cycle, at the price of holding each send back
until the next action's receives are posted with it: the plain rule (the previous action's sends
with the next one's receives) deadlocks interleaved schedules (63 of 84 configurations up to
pp=8, v=4, m=4pp; GPipe, 1F1B and ZB-H1 pass), and Megatron's fix for them, one exchange per
forward/backward pair, sends each activation a backward late (one measurement of the interleaved
bubble at pp=4, m=8 on gloo: 0.28 against 0.16). The cost of the choice: two communicators per
neighbour pair instead of one (NCCL buffers); the groups are made a kind at a time, not one world-wide
call per group (:mod:`mcompile.runtime.pipeline_groups`: 4 calls at pp=8 for any dp × tp). NCCL creates
a communicator at its first operation, blocking the host until the peer joins, so the groups are
exercised once when they are made (:meth:`Pipeline._make_p2p_groups`).

With ``record=True`` every action and every wait is timed for the Chrome-trace timeline
(:mod:`mcompile.ir.timeline`): wall clock on CPU, comparable across processes on one machine; on a GPU
CUDA events anchored to the host clock (:class:`mcompile.ir.timeline.DeviceClock`), since a NCCL
``wait()`` does not block the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mcompile.ir.dropout import RNG_INPUT
from mcompile.ir.timeline import clock_for
from mcompile.runtime.comm import UNWATCHED
from mcompile.runtime.pipeline_groups import make_p2p_groups, make_tied_groups, p2p_directions
from mcompile.runtime.schedules import Action, Post, Wait, p2p_plan  # noqa: F401  (Post, Wait, p2p_plan: re-exported)

__all__ = ["PipelineExecutor", "FxStage", "MessageSpec", "Event", "Post", "Wait", "p2p_plan"]


@dataclass(frozen=True)
class MessageSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    differentiable: bool


@dataclass
class Event:
    """One timed span of a rank's step: an action (F/B/W), a wait for a message, or the whole step.
    ``start``/``end`` are seconds on the wall clock once the step has ended; during the step they hold
    the clock's marks (:mod:`mcompile.ir.timeline`: host times, or CUDA events resolved at the end)."""

    rank: int
    name: str
    cat: str  # "F" | "B" | "W" | "wait" | "step"
    start: float
    end: float
    stage: int = -1
    mb: int = -1


@dataclass
class _Slot:
    inputs: list = field(default_factory=list)  # received tensors (requires_grad where differentiable)
    outputs: object = None


class PipelineExecutor:
    """Runs one pipeline rank's step (module docstring).

    Sent tensors: each posted send's tensor is held (with its work) until the send completes:
    before every action, the sends whose works report ``is_completed()`` are released, the rest
    are waited for at the end of the step. ``peak_held_sends`` is the most send buffers held at
    once in the latest step (bounded by the sends in flight, not by the microbatches, when the
    transport completes sends as their receives are posted).

    ``clock`` (``record=True``): where the timeline's times come from
    (:func:`mcompile.ir.timeline.clock_for` the device when None: CUDA events on a GPU, host time on CPU)."""

    def __init__(self, *, rank: int, pp_rank: int, num_stages: int, actions: list[list[Action]], microbatches: int,
                 peer_of_stage, stages: dict, send_specs: dict[int, list[MessageSpec]], record: bool = False,
                 groups: dict | None = None, clock=None, lookahead: int = 0, watch=None):
        self.rank = rank
        self.lookahead = lookahead  # receives of the next actions posted early (p2p_plan)
        self.pp_rank = pp_rank
        self.k = num_stages
        self.pp = len(actions)
        self.actions = actions
        self.m = microbatches
        self.peer_of_stage = peer_of_stage
        self.stages = stages
        self.send_specs = send_specs
        self.record = record
        # (sending pipeline rank, receiving pipeline rank) -> the process group of that direction
        # (None, or missing: the default group, e.g. on gloo, where the sharing is harmless)
        self.groups = groups or {}
        self.events: list[Event] = []
        self.clock = clock
        self.peak_held_sends = 0
        self._width = max([len(v) for v in send_specs.values()] + [1])
        # DistCommunicator.watch_messages: each posting's messages in the hang watchdog's record
        self._watch = watch

    # -- message bookkeeping ------------------------------------------------------------------------
    def _tag(self, kind: str, stage: int, mb: int, j: int) -> int:
        return (((0 if kind == "act" else 1) * self.k + stage) * self.m + mb) * self._width + j

    def _spec(self, msg: tuple) -> MessageSpec:
        """Activations from ``stage`` are its outputs; gradients from ``stage`` belong to the
        outputs of ``stage - 1``."""
        kind, stage, _, j = msg
        return self.send_specs[stage if kind == "act" else stage - 1][j]

    def plan(self, actions: list[list[Action]]) -> list:
        return p2p_plan(actions, self.pp_rank, self.k,
                        {s: [sp.differentiable for sp in v] for s, v in self.send_specs.items()}, self.lookahead)

    def _post(self, post: Post) -> tuple[list, list]:
        ops = []
        for op, msg in post.ops:
            kind, stage, mb, j = msg
            dst = stage + 1 if kind == "act" else stage - 1
            group = self.groups.get((stage % self.pp, dst % self.pp))
            if op == "send":
                t = self._outbox.pop(msg)
                ops.append(dist.P2POp(dist.isend, t, self.peer_of_stage(dst), group, self._tag(*msg)))
            else:
                spec = self._spec(msg)
                t = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
                self._inbox[msg] = t
                ops.append(dist.P2POp(dist.irecv, t, self.peer_of_stage(stage), group, self._tag(*msg)))
        watched = self._watch([("send" if o.op is dist.isend else "recv", o.peer) for o in ops], "pp") \
            if self._watch is not None else UNWATCHED
        with watched:
            if post.batched:
                works = dist.batch_isend_irecv(ops)
            else:
                (o,) = ops
                works = [o.op(o.tensor, o.peer, o.group, o.tag)]
            watched.started(*works)
        return works, [o.tensor for o in ops]  # the tensors stay alive until the wait (NCCL: one work per group)

    def _wait(self, post_id: int) -> None:
        t0 = self._clock.mark() if self.record else None
        works, _ = self._works.pop(post_id)
        for w in works:
            if w is not None:
                w.wait()
        recv = next((m for op, m in self._posts[post_id].ops if op == "recv"), None)
        if self.record and recv is not None:  # marks now, seconds at the end of the step (the clock's)
            self.events.append(Event(self.rank, f"recv {recv[0]} {recv[1]}.{recv[2]}", "wait", t0,
                                     self._clock.mark(), recv[1], recv[2]))

    def _is_send(self, post_id: int) -> bool:
        return all(op == "send" for op, _ in self._posts[post_id].ops)

    def _release_sent(self) -> None:
        """Drop the tensors (and works) of the sends that have completed: an activation is freed once
        its receiver has it, not at the end of the step."""
        for post_id in [i for i, (works, _) in self._works.items()
                        if self._is_send(i) and all(w is None or w.is_completed() for w in works)]:
            del self._works[post_id]

    def _receive(self, kind: str, stage: int, mb: int) -> list[torch.Tensor]:
        return [self._inbox.pop(m) for m in sorted(m for m in self._inbox if m[:3] == (kind, stage, mb))]

    def _send(self, kind: str, stage: int, mb: int, tensors: list) -> None:
        """Queue ``stage``'s activations (to ``stage + 1``) or the gradients of its inputs (to ``stage - 1``)
        for the next posting."""
        specs = self.send_specs.get(stage if kind == "act" else stage - 1, [])
        for j, spec in enumerate(specs):
            if kind == "grad" and not spec.differentiable:
                continue
            t = tensors[j]
            if t is None:
                t = torch.zeros(spec.shape, dtype=spec.dtype, device=self.device)
            t = t.detach().contiguous()
            if tuple(t.shape) != tuple(spec.shape) or t.dtype != spec.dtype:
                raise RuntimeError(f"stage {stage} produced {kind} #{j} of shape {list(t.shape)} {t.dtype}, but "
                                   f"{list(spec.shape)} {spec.dtype} was planned (rerun shape inference)")
            self._outbox[(kind, stage, mb, j)] = t

    # -- the step -------------------------------------------------------------------------------------
    def run(self, device: torch.device, forward_only: bool = False) -> dict[int, object]:
        """Run this rank's actions; returns the last stage's outputs per microbatch (if held here)."""
        self.device = device
        self._inbox: dict[tuple, torch.Tensor] = {}
        self._outbox: dict[tuple, torch.Tensor] = {}
        self._works: dict[int, tuple[list, list]] = {}
        self._posts: dict[int, Post] = {}
        slots: dict[tuple[int, int], _Slot] = {}
        results: dict[int, object] = {}
        acts = self.actions
        if forward_only:
            acts = [[a for a in lst if a.kind == "F"] for lst in acts]
        self._clock = self.clock or clock_for(device)
        self.events = []
        if self.record:
            self._clock.start()
            t_step = self._clock.mark()
        self.peak_held_sends = held = 0
        for a in self.plan(acts):
            if isinstance(a, Post):
                self._posts[a.id] = a
                self._works[a.id] = self._post(a)
                held += self._is_send(a.id)
                self.peak_held_sends = max(self.peak_held_sends, held)
                continue
            if isinstance(a, Wait):
                self._wait(a.id)
                continue
            self._release_sent()
            held = sum(map(self._is_send, self._works))
            t0 = self._clock.mark() if self.record else None
            stage = self.stages[a.stage]
            if a.kind == "F":
                inputs = self._receive("act", a.stage - 1, a.mb) if a.stage > 0 else []
                if a.stage > 0 and not forward_only:
                    inputs = [x.requires_grad_() if s.differentiable else x
                              for x, s in zip(inputs, self.send_specs[a.stage - 1])]
                out = stage.forward(a.mb, inputs)
                if a.stage == self.k - 1:
                    results[a.mb] = out
                else:
                    self._send("act", a.stage, a.mb, list(out))
                if not forward_only:
                    slots[(a.stage, a.mb)] = _Slot(inputs, out)
            elif a.kind == "B":
                slot = slots[(a.stage, a.mb)]
                grads = self._receive("grad", a.stage + 1, a.mb) if a.stage < self.k - 1 else None
                dinputs = stage.backward(a.mb, slot.outputs, grads, slot.inputs)
                if a.stage > 0:
                    self._send("grad", a.stage, a.mb, list(dinputs))
                slot.outputs = None
                if not getattr(stage, "splits_weight", False):
                    slots.pop((a.stage, a.mb))
            else:  # W
                stage.backward_weight(a.mb)
                slots.pop((a.stage, a.mb), None)
            if self.record:
                self.events.append(Event(self.rank, str(a), a.kind, t0, self._clock.mark(), a.stage, a.mb))
        for post_id in [i for i in self._works if self._is_send(i)]:
            self._wait(post_id)  # the sends; a receive still posted here is an error below, not a hang
        if self._inbox or self._outbox:
            raise RuntimeError(f"rank {self.rank}: {len(self._inbox)} received and {len(self._outbox)} produced "
                               "messages were never used")
        if self.record:
            self.events.append(Event(self.rank, "step", "step", t_step, self._clock.mark()))
            times = iter(self._clock.seconds([m for e in self.events for m in (e.start, e.end)]))
            for e in self.events:
                e.start, e.end = next(times), next(times)
        return results


class FxStage:
    """One stage program (:class:`~mcompile.passes.pp.pipeline_split.StageProgram`) made runnable.

    Zero-bubble split (``split_weight``): B computes the gradients of the received inputs only and
    keeps the autograd intermediates the weight gradients need; W finishes them (torch's
    ``stage_backward_input`` / ``stage_backward_weight``). The first stage receives nothing, so
    its B is the whole backward and its W does nothing.

    ``inputs_fn(mb)`` returns the stage's non-received inputs by placeholder name (parameters as
    per-step leaf tensors, so a zero-bubble W can find them, buffers, the microbatch's user inputs);
    the last stage's outputs are the program's outputs, and its backward starts from ``loss_fn(out)``.
    """

    def __init__(self, program, inputs_fn, loss_fn=None, split_weight: bool = False, weights_fn=None,
                 leaves=None, last_mb: dict | None = None):
        self.program = program
        self.leaves = leaves  # runtime/leaves.Leaves: armed during the last microbatch's weight gradients
        self.last_mb = last_mb or {}  # "B" / "W" -> the microbatch of this stage's last such action
        self.inputs_fn = inputs_fn
        self.loss_fn = loss_fn
        self.splits_weight = split_weight
        self.weights_fn = weights_fn
        self._groups: dict[int, list] = {}

    def forward(self, mb: int, received: list):
        named = self.inputs_fn(mb)
        args = [named[n] for n in self.program.inputs[:len(self.program.inputs) - len(received)]] + list(received)
        out = self.program.gm(*args)
        return out if self.program.is_last else tuple(out)

    def _roots(self, outputs, grads):
        if self.program.is_last:
            return [self.loss_fn(outputs)], None
        pairs = [(o, g) for o, g in zip(outputs, _expand(grads, outputs)) if isinstance(o, torch.Tensor)
                 and o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _arm(self, kind: str, mb: int) -> None:
        if self.leaves is not None:
            self.leaves.armed = mb == self.last_mb.get(kind)

    def backward(self, mb: int, outputs, grads, received: list):
        self._arm("B", mb)
        roots, gs = self._roots(outputs, grads)
        if self.splits_weight and any(isinstance(x, torch.Tensor) and x.requires_grad for x in received):
            from torch.distributed.pipelining._backward import stage_backward_input

            dinputs, groups = stage_backward_input(roots, gs, list(received), iter(self.weights_fn()))
            self._groups[mb] = groups
            return list(dinputs)
        if roots:
            torch.autograd.backward(roots, gs)
        return [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in received]

    def backward_weight(self, mb: int) -> None:
        from torch.distributed.pipelining._backward import stage_backward_weight

        groups = self._groups.pop(mb, None)
        if groups is not None:
            self._arm("W", mb)
            weights = self.weights_fn()
            stage_backward_weight(iter(weights), groups)
            if self.leaves is not None:  # added by hand, not by AccumulateGrad: no hook fired
                self.leaves.accumulated(weights)


class JointStage:
    """A stage program run as a joint program (runtime/joint_runner.py): F runs its forward module and keeps
    the saved tensors; B runs its backward module (split for zero-bubble schedules: B only the
    gradients of the received inputs, on the backward graph's input-gradient part; W the weight
    gradients, the rest of that graph); weight gradients are added into the fp32 buffers here.
    Same interface as :class:`FxStage`."""

    def __init__(self, program, runner, inputs_fn, loss_fn=None, split_weight: bool = False, leaves=None,
                 last_mb: dict | None = None, loss_scale: float = 1.0):
        self.program = program
        self.runner = runner
        self.loss_scale = loss_scale  # the last stage's loss gradient (fp16: the loss scale, runtime/loss_scale.py)
        self.inputs_fn = inputs_fn
        self.loss_fn = loss_fn
        self.splits_weight = split_weight
        self.leaves = leaves
        self.last_mb = last_mb or {}
        self.forward_only = False  # set by the pipeline for a forward-only run
        self._ctx: dict[int, tuple] = {}

    def forward(self, mb: int, received: list):
        named = self.inputs_fn(mb)
        args = [named[n] for n in self.program.inputs[:len(self.program.inputs) - len(received)]] + list(received)
        if self.forward_only:  # the plain program, nothing kept for a backward
            out = self.program.gm(*args)
            return out if self.program.is_last else tuple(out)
        outs, ctx = self.runner.forward(args)
        self._ctx[mb] = (ctx, args)
        if self.program.is_last:
            return outs if len(outs) != 1 else outs[0]
        return outs

    _arm = FxStage._arm  # the last microbatch's B (or W) counts the buckets, as on the autograd path

    def backward(self, mb: int, outputs, grads, received: list):
        ctx, args = self._ctx[mb]
        runner = self.runner
        outs = _flat(outputs)
        if self.program.is_last:
            tangents = runner.tangents(ctx, outs, scale=self.loss_scale)
        else:
            expanded = _expand(grads, outs)
            tangents = runner.tangents(ctx, outs, [expanded[i] for i in ctx.jp.joint.diff_outputs])
        first = len(args) - len(received)
        gp = ctx.jp.joint.grad_primals
        if self.splits_weight and ctx.jp.backward_input is not None and ctx.jp.input_grads:
            dins = runner.backward_input(ctx, tangents)
            by_pos = {gp[j]: g for j, g in zip(ctx.jp.input_grads, dins)}
            return [by_pos.get(first + i) for i in range(len(received))]
        self._ctx.pop(mb)
        self._arm("B", mb)
        if self.leaves is not None:
            self.leaves.before_backward()
        gs = runner.backward(ctx, tangents)
        if self.leaves is not None:
            self.leaves.add_grads(args, gp, gs, ctx.jp.ready_positions)
            self.leaves.after_backward()
        by_pos = dict(zip(gp, gs))
        return [by_pos.get(first + i) for i in range(len(received))]

    def backward_weight(self, mb: int) -> None:
        item = self._ctx.pop(mb, None)
        if item is None:  # B ran the whole backward (nothing received)
            return
        ctx, args = item
        self._arm("W", mb)
        if self.leaves is not None:
            self.leaves.before_backward()
        gs = self.runner.backward_weight(ctx)
        gp = ctx.jp.joint.grad_primals
        if self.leaves is not None:
            self.leaves.add_grads(args, [gp[j] for j in ctx.jp.weight_grads], gs, ctx.jp.ready_positions_w)
            self.leaves.after_backward()


def _flat(out) -> tuple:
    return tuple(out) if isinstance(out, tuple | list) else (out,)


def _expand(grads, outputs):
    """Gradients arrive for the differentiable outputs only; put None for the others."""
    if grads is None:
        return [None] * len(outputs)
    it = iter(grads)
    return [next(it) if isinstance(o, torch.Tensor) and o.is_floating_point() else None for o in outputs]


# ------------------------------------------------------------------------------------------------
# The glue between a ParallelModule and the executor
# ------------------------------------------------------------------------------------------------
_COMM_OPS = {"all_reduce": 1, "all_reduce_max": 1, "reduce_scatter": 2, "all_gather": 2,  # op -> axis arg
             "start_all_reduce": 1, "start_reduce_scatter": 1, "start_all_gather": 1,  # (recorded as the collective)
             "all_reduce_inplace": 1,  # (recorded as all_reduce: passes/overlap.inplace_all_reduces)
             # ops that communicate inside (mcompile.passes.cp.ops, mcompile.ir.moe): each a sequence of exchanges that
             # every
             # rank of the group runs the same way, recorded as one step of that group
             "cp_gather": 2, "cp_gather_backward": 2, "cp_attention": 4, "cp_attention_backward": 8,
             "moe_ep": 6, "moe_ep_backward": 4}


class _RecordCollectives(torch.utils._python_dispatch.TorchDispatchMode):
    """Under fake tensors: the communicating mcompile ops, in the order autograd runs them."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, str, tuple, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "mcompile":
            name = func._opname
            if name in _COMM_OPS:
                x = args[0]
                kind = name.removeprefix("start_").removesuffix("_inplace")
                self.ops.append((kind, args[_COMM_OPS[name]], tuple(int(s) for s in x.shape), str(x.dtype)))
        return out


def graph_collectives(module) -> list | None:
    """The communicating mcompile ops of a built module (a GraphModule, or a codegen module's ``.gm``) in the
    order it runs them, as :class:`_RecordCollectives` records them under fake tensors: ``(kind, axis, shape,
    dtype)``, the shape and dtype of the op's first input read from its node's value (``meta["val"]``). A
    module runs its nodes in graph order, so this is the recorder's list without running anything. None when
    such an input has no value recorded (a node a pass made without one): the caller runs the module on fake
    tensors then."""
    gm = getattr(module, "gm", module)
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or getattr(n.target, "namespace", None) != "mcompile":
            continue
        name = n.target._opname
        if name not in _COMM_OPS:
            continue
        x = n.args[0]
        val = x.meta.get("val") if hasattr(x, "meta") else None
        if not isinstance(val, torch.Tensor):
            return None
        out.append((name.removeprefix("start_").removesuffix("_inplace"), n.args[_COMM_OPS[name]],
                    tuple(int(s) for s in val.shape), str(val.dtype)))
    return out


def _output_values(module) -> list:
    gm = getattr(module, "gm", module)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    vals = out.args[0] if isinstance(out.args[0], tuple | list) else (out.args[0],)
    return [v.meta.get("val") if hasattr(v, "meta") else v for v in vals]


def stage_activation_budget(config, actions, stage: int):
    """``recompute="auto"`` under pipeline parallelism: stage ``stage``'s share of
    ``Config(activation_budget=)`` (a :class:`~mcompile.runtime.joint_runner.ActivationBudget`; None under a
    named policy). ``actions``: every pipeline rank's schedule (``build_schedule``).

    The rank holding the stage keeps the saved activations of every forward it has run and not yet
    finished the backward of (until W under zero-bubble); its schedule says how many those are at most
    (``schedules.peak_activation_bytes`` with one unit per forward: 1F1B's stage 0 holds p
    microbatches, its last stage 1, GPipe m; interleaved counts the forwards of all the rank's virtual
    stages together). Each forward gets the same share, so the rank's peak stays within the budget
    whichever of its forwards are in flight at once."""
    from mcompile.runtime.joint_runner import ActivationBudget
    from mcompile.runtime.schedules import peak_activation_bytes

    if config.recompute != "auto":
        return None
    r = stage % len(actions)
    acts = actions[r]
    in_flight = max(1, int(peak_activation_bytes(acts, {a.stage: 1.0 for a in acts})))
    return ActivationBudget(config.activation_budget, in_flight,
                            f"pipeline rank {r} under schedule {config.schedule!r}")


def _group_lookup(mesh):
    """``group_of(axis, rank)``: the global ranks of ``rank``'s group over ``axis`` (``mesh.group_ranks`` walks
    the world: once per key)."""
    known: dict[tuple[str, int], tuple[int, ...]] = {}

    def group_of(axis: str, rank: int) -> tuple[int, ...]:
        if (axis, rank) not in known:
            known[(axis, rank)] = next(tuple(g) for g in mesh.group_ranks(axis) if rank in g)
        return known[(axis, rank)]

    return group_of


class Pipeline:
    """Pipeline parallelism inside a :class:`~mcompile.runtime.module.ParallelModule`: the stage
    partition, this rank's stage programs, shape inference and verification, the schedule run."""

    def __init__(self, pm, programs, config):
        """``programs``: this rank's (mcompile.compiler.rank_programs): the stage partition and every stage's
        program, ZeRO-3's gathers in each and, under eager execution, recompute applied."""
        from mcompile.runtime.schedules import build_schedule

        self.pm = pm
        cap = pm._compiled.captured
        mesh = pm.mesh
        self.pp = mesh.size("pp")
        self.pp_rank = pm._coords["pp"]
        self.virtual = config.virtual_stages
        self.m = config.microbatches
        self.partition = programs.partition
        self.k = self.partition.num_stages
        self.schedule = config.schedule
        self.lookahead = 1 if getattr(config, "overlap", False) else 0  # receives posted one action early
        self.actions = build_schedule(config.schedule, self.pp, self.virtual, self.m)
        self.stages = programs.stages
        self.build = programs.build
        self.fake_forward = programs.fake_forward
        self.own = [s for s in range(self.k) if s % self.pp == self.pp_rank]
        # recompute="auto" chooses each stage's saved set on its joint graph (the signature passes), under its
        # share of the rank's activation budget (stage_activation_budget)
        self._check_delayed_fp8_recompute(programs.stage_groups, config)
        self.runners = None  # joint execution: one runner per own stage (runtime/joint_runner.py)
        if config.execution == "joint":
            self.runners = {s: self._make_runner(s) for s in self.own}
        self.param_of_ph = dict(cap.params)
        self.own_params = sorted({self.param_of_ph[p] for s in self.own for p in self.stages[s].params},
                                 key=list(cap.params.values()).index)
        # stages (hence pipeline ranks) using each parameter: tied weights live on several
        users: dict[str, set[int]] = {}
        for st in self.stages:
            for p in st.params:
                users.setdefault(self.param_of_ph[p], set()).add(st.index % self.pp)
        self.param_ranks = users
        self.owner = {fqn: min(r) for fqn, r in users.items()}
        self.tied_groups = self._make_tied_groups(mesh)
        self.p2p_groups = self._make_p2p_groups(mesh)
        self.record = False
        self.events: list[Event] = []
        self._probed: dict = {}

    def _check_delayed_fp8_recompute(self, groups: dict[int, dict], config) -> None:
        """FP8 delayed scaling reads a linear's amax history in forward and advances it in backward.
        A stage whose schedule runs the forward of microbatch j between the forward and the backward
        of microbatch i (1F1B's warm-up, GPipe) would recompute j's forward from a history that i's
        backward has moved on: other scales than j's forward used (autograd's saved-tensor version
        check stops it, obscurely). Refused here, on every rank alike (all stages are checked)."""
        from mcompile.ir import meta as M

        if config.fp8 != "delayed":
            return
        for st in self.stages:
            if not any(n.meta.get(M.FP8) == "delayed" and n.name in groups[st.index] for n in st.gm.graph.nodes):
                continue
            pending: list[int] = []
            for a in (a for acts in self.actions for a in acts if a.stage == st.index and a.kind in "FB"):
                if a.kind == "F" and pending:
                    raise NotImplementedError(
                        f"fp8='delayed' with recompute={config.recompute!r} under pipeline parallelism: stage "
                        f"{st.index} runs the forward of microbatch {a.mb} before the backward of microbatch "
                        f"{pending[0]} (schedule {config.schedule!r}), so recomputing {a.mb}'s FP8 linears would "
                        "read an amax history that an earlier backward has advanced, with other scales than "
                        "their forward used. Use recompute='selective' (the linears are kept, not recomputed), "
                        "fp8='current', or microbatches=1")
                (pending.append if a.kind == "F" else pending.remove)(a.mb)

    # -- groups ---------------------------------------------------------------------------------------
    def _make_tied_groups(self, mesh) -> dict[str, object]:
        """A process group per set of pipeline ranks sharing a parameter, for each (dp, tp, ...) coordinate:
        ``{fqn: (group, members)}`` for this rank's (:func:`mcompile.runtime.pipeline_groups.make_tied_groups`)."""
        return make_tied_groups(mesh, self.pm._coords, self.param_ranks)

    def _make_p2p_groups(self, mesh) -> dict[tuple[int, int], object]:
        """A process group per direction of every pair of pipeline ranks that exchange messages (for
        each (dp, tp, ...) coordinate), so that on NCCL each direction has its own communicator and
        stream (module docstring); made a kind at a time (:mod:`mcompile.runtime.pipeline_groups`)."""
        coords = self.pm._coords
        out = make_p2p_groups(mesh, coords, p2p_directions(self.actions, self.k, self.pp))
        # NCCL creates a communicator at its first operation, blocking until the peer joins: a
        # first send would then wait on the host for its receive. One element over every direction,
        # in one global order, creates them all now (each rank blocks only where both peers meet);
        # groups split from the world's communicator (launch.splits_world) exist already.
        one = torch.zeros(1, device=self.pm._device)
        for (src, dst), g in sorted(out.items()):
            if self.pp_rank == src:
                dist.send(one, dst=mesh.rank_of(**{**coords, "pp": dst}), group=g)
            else:
                dist.recv(one, src=mesh.rank_of(**{**coords, "pp": src}), group=g)
        return out

    def _param_at(self, s: int, position: int) -> str | None:
        """The parameter fed to stage ``s``'s program at input ``position`` (None: not a parameter)."""
        names = self.stages[s].inputs
        return self.param_of_ph.get(names[position]) if position < len(names) else None

    def peer_of_stage(self, s: int) -> int:
        return self.pm.mesh.rank_of(**{**self.pm._coords, "pp": s % self.pp})

    # -- shapes and verification ----------------------------------------------------------------------
    def _probe(self, piece_inputs: dict[str, torch.Tensor]):
        """Fake-run every stage, forward and backward: the message shapes per stage and each stage's
        collectives in order; then verify this rank's communication without gathering anyone's list.

        Every rank of the pipeline group derives every member's op list from the plan (the same
        schedules and stage programs, each member's own process groups, recompute applied as on its
        owner) and :func:`~mcompile.runtime.verify.verify` runs over them: sends and receives, NCCL's
        progress rules, the collectives on pipeline groups. The collectives on the other axes' groups
        (tp, dp, ...) are compared by a 32-byte digest per member
        (:func:`~mcompile.runtime.verify.check_collectives_across`), and so are the derived lists over
        the pipeline group (:func:`~mcompile.runtime.verify.check_derived_across`). Last, one int64 ``all_reduce``
        (MIN over the world) makes every rank fail when any rank found an error, naming the lowest
        such rank, instead of some ranks running into a hang. Nothing exchanged grows with the lists;
        the world-wide exchange is one element."""
        key = tuple((n, tuple(t.shape), t.dtype) for n, t in sorted(piece_inputs.items()))
        if key in self._probed:
            return self._probed[key]
        traced, trace_error = None, None
        try:  # a rank failing here must not leave the others waiting in the exchanges below
            traced = self._trace_stages(piece_inputs)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            trace_error = e
        self._agree_on_trace(trace_error)
        traced, mismatch = self._gather_stage_ops(*traced)
        send_specs = traced[0]
        group_of = _group_lookup(self.pm.mesh)
        self.derived_ops = self._derive_rank_ops(*traced, group_of)
        self._verify_everywhere(self.derived_ops, group_of, mismatch)
        self._probed[key] = send_specs
        return send_specs

    def _trace_stages(self, piece_inputs: dict[str, torch.Tensor]) -> tuple[dict, dict, dict, dict]:
        """Under fake tensors: every stage's forward in order, each fed the previous stage's outputs, for the
        messages it sends (:class:`MessageSpec`; the last stage none) — a forward without autograd, each
        distinct repeated layer run once (``programs.fake_forward``: passes/joint_blocks.py), cheap next to a
        trace; then this rank's own stages only, forward and backward as they will run, for the collectives of
        their forward, their backward and (joint execution, zero-bubble W) their weight-gradient graph. The
        other stages' collectives are their owners' (:meth:`_gather_stage_ops`): no rank traces a stage it does
        not run, so start-up per rank does not grow with the pipeline's depth. Returns ``(send_specs, fwd_ops,
        bwd_ops, wgt_ops)``, the last three for the own stages, by stage index."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        send_specs: dict[int, list[MessageSpec]] = {}
        received: dict[int, list] = {}  # own stage -> the fake activations it receives
        fwd_ops: dict[int, list] = {}
        bwd_ops: dict[int, list] = {}
        wgt_ops: dict[int, list] = {}  # joint execution, zero-bubble W: the weight-gradient graph's collectives
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            named = self._fake_inputs(mode, piece_inputs)
            carried: list = []
            with torch.no_grad():
                for st in self.stages:
                    if st.index in self.own:
                        received[st.index] = carried
                    if st.index > max(self.own):
                        break  # what comes after our last stage is its owners' to trace
                    out = self.fake_forward(st.gm, self._stage_args(st, named, carried))
                    if not st.is_last:
                        out = tuple(out)
                        send_specs[st.index] = [MessageSpec(tuple(int(s) for s in o.shape), o.dtype,
                                                            o.is_floating_point()) for o in out]
                        carried = list(out)
            with torch.enable_grad():  # the backward's collectives too, even when called under no_grad
                for s in self.own:
                    st = self.stages[s]
                    recv = [torch.empty(x.shape, dtype=x.dtype, device=x.device).requires_grad_(x.is_floating_point())
                            for x in received[s]]
                    args = self._stage_args(st, named, recv)
                    if self.runners is not None:  # the joint programs, as they will run
                        fwd_ops[s], bwd_ops[s], wgt_ops[s] = self._probe_joint(st, args)
                    else:
                        _, fwd_ops[s], bwd_ops[s] = self._probe_eager(st, args)
        return send_specs, fwd_ops, bwd_ops, wgt_ops

    @staticmethod
    def _stage_args(st, named: dict, received: list) -> list:
        return [named[n] for n in st.inputs[:len(st.inputs) - len(received)]] + list(received)

    def _gather_stage_ops(self, send_specs: dict, fwd_ops: dict, bwd_ops: dict, wgt_ops: dict) -> tuple:
        # returns ((send_specs, fwd_ops, bwd_ops, wgt_ops) of every stage, a disagreement or None): raised on
        # every rank by _verify_everywhere, never here alone (the others would wait in its exchanges)
        """Every stage's messages and collectives, from their owners: one object all-gather over the pipeline
        group (each member sends its own stages' lists, a few hundred entries). The messages each member
        derived for the stages up to its own must agree with the owners' (a rank fed other inputs, or planned
        otherwise, is named). On a simulated rank (torch's fake process group, nothing exchanged) the other
        stages' collectives are taken to be the rank's own first stage's: what a middle stage of a uniform
        model runs; verification then covers this rank's sends and receives but not its peers' lists."""
        from mcompile.runtime.verify import VerificationError

        pm = self.pm
        mine = {s: (send_specs.get(s), fwd_ops[s], bwd_ops[s], wgt_ops.get(s, [])) for s in self.own}
        box: list = [None] * self.pp
        dist.all_gather_object(box, mine, group=pm._comm.groups["pp"])
        everyone: dict = {}
        for got in box:
            everyone.update(got or {})
        if dist.get_backend() == "fake":
            for s in range(self.k):
                everyone.setdefault(s, (send_specs.get(s), *mine[self.own[0]][1:]))
        specs, fwd, bwd, wgt, error = {}, {}, {}, {}, None
        for s in range(self.k):
            sent, fwd[s], bwd[s], wgt[s] = everyone[s]
            if sent is not None:
                specs[s] = sent
            if s in send_specs and send_specs[s] != sent and error is None:
                error = VerificationError(
                    f"pipeline rank {self.pp_rank} computed stage {s}'s messages as {send_specs[s]} but its owner "
                    f"(pipeline rank {s % self.pp}) sends {sent}: the ranks were given different inputs or plans")
        return (specs, fwd, bwd, wgt), error

    def _fake_inputs(self, mode, piece_inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The stage programs' inputs by placeholder name, as fake tensors of ``mode`` (entered by the caller):
        each parameter's compute leaf (its local shape, ZeRO-3's dp piece; an fp32 leaf cast to the compute
        dtype), the buffers and constants, and one piece's user inputs."""
        pm = self.pm
        dtype = pm.config.dtype
        params = {}
        for ph, fqn in self.param_of_ph.items():
            shape = list(pm.plan.params[fqn].local_shape)
            if fqn in pm._zero3:  # ZeRO-3: the dp piece
                shape[0] //= pm.mesh.size("dp")
            leaf = torch.empty(shape, dtype=torch.float32, device=pm._device).requires_grad_()
            params[ph] = leaf.to(dtype) if dtype != torch.float32 else leaf
        state = {k: mode.from_tensor(v) for k, v in pm._extra.items()}
        users = {k: mode.from_tensor(v) for k, v in piece_inputs.items()}
        return {**params, **state, **users}

    def _probe_eager(self, st, args: list):
        """Under fake tensors: stage ``st``'s program (eager execution) on ``args``, as its owner runs it
        (recompute applied: it re-issues collectives in backward), then its backward (the last stage's
        from its loss, the others' from ones on their differentiable outputs). Returns its outputs (a
        tuple, but the last stage's as the program returns them) and the collectives of forward and
        backward."""
        gm = st.gm
        rec = _RecordCollectives()
        with rec:
            out = gm(*args)
        fwd = rec.ops
        if not st.is_last:
            out = tuple(out)
        rec = _RecordCollectives()
        with rec:
            if st.is_last:
                self.pm._loss_parts(out)[0].backward()
            else:
                roots = [o for o in out if o.requires_grad]
                torch.autograd.backward(roots, [torch.ones_like(o) for o in roots])
        return out, fwd, rec.ops

    def _derive_rank_ops(self, send_specs: dict, fwd_ops: dict, bwd_ops: dict, wgt_ops: dict, group_of) -> dict:
        """Every pipeline group member's op list (global rank -> its step), derived from the traced stages
        (:meth:`_trace_stages`) and the schedule: sends, receives, the stages' collectives on the member's
        own groups, and the collectives after the schedule on pipeline groups only
        (:func:`~mcompile.runtime.verify.rank_ops`)."""
        from mcompile.runtime.verify import CommOp, rank_ops

        def comm(ops, rank):
            return [CommOp("coll", name, shape, dt, group=group_of(axis, rank), axis=axis)
                    for name, axis, shape, dt in ops]

        derived = {}  # global rank -> its step (the collectives after the schedule: on pipeline groups only)
        msgs = {s: [(sp.shape, str(sp.dtype), sp.differentiable) for sp in send_specs.get(s, [])]
                for s in range(-1, self.k)}
        for q in range(self.pp):
            rank = self.peer_of_stage(q)
            stage_comm = {s: {"recv": msgs[s - 1], "send": msgs[s], "fwd": comm(fwd_ops[s], rank),
                              "bwd": comm(bwd_ops[s], rank), "wgt": comm(wgt_ops.get(s, []), rank)}
                          for s in range(self.k)}
            end = self.step_end_ops(q)
            derived[rank] = rank_ops(self.actions[q], stage_comm, self.k, self.peer_of_stage,
                                     [op for op in end if op.axis == "pp"], schedule=self.actions, pp_rank=q,
                                     lookahead=self.lookahead)
        return derived

    def _verify_everywhere(self, derived: dict, group_of, error: Exception | None = None) -> None:
        """Verify the derived lists (:func:`~mcompile.runtime.verify.verify`), compare this rank's collectives on
        the other axes' groups and the pipeline group's derived lists by digest, then one int64 ``all_reduce``
        (MIN over the world): every rank raises when any rank found an error (:meth:`_probe`)."""
        from mcompile.runtime.verify import VerificationError, check_collectives_across, check_derived_across, verify

        pm, mesh = self.pm, self.pm.mesh
        mine = derived[pm._rank] + [op for op in self.step_end_ops() if op.axis != "pp"]
        try:
            verify(derived)
        except VerificationError as e:
            error = error or e
        groups = [(pm._comm.groups[a], group_of(a, pm._rank)) for a in mesh.axis_names
                  if a != "pp" and mesh.size(a) > 1]
        if len(pm._data_axes) > 1:  # dp x cp (x ep): the gradient buckets' and the loss's group
            groups.append((pm._comm.groups["data"], self._data_members()))
        error = check_collectives_across(mine, groups, device=pm._control_device) or error
        if self.pp > 1:  # the pipeline's members derived the same lists (plans or inputs could differ)
            error = check_derived_across(pm._rank, derived, pm._comm.groups["pp"], group_of("pp", pm._rank),
                                         device=pm._control_device) or error
        world = dist.get_world_size()
        first = torch.tensor([pm._rank if error is not None else world], dtype=torch.int64, device=pm._control_device)
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        if error is not None:
            raise error
        if int(first) < world:
            raise VerificationError(f"communication verification failed on rank {int(first)} (its error names the "
                                    "cause); this rank's own lists match")

    def _data_members(self) -> tuple[int, ...]:
        """The global ranks of this rank's data group (dp x cp x ep: they differ only on those axes)."""
        pm, mesh = self.pm, self.pm.mesh
        return tuple(r for r in range(mesh.size()) if all(
            mesh.coords(r)[a] == pm._coords[a] for a in mesh.axis_names if a not in pm._data_axes))

    def _make_runner(self, s: int):
        """This rank's joint runner of its stage ``s``, with in-graph gradient accumulation into the main-gradient
        buffers (``fsdp.prefetch`` orders ZeRO-3's reduce-scatters by where those additions sit) and the stage's dp
        bucket launches. Only a stage's owner builds it: the probe takes the other stages' collectives from their
        owners (:meth:`_gather_stage_ops`)."""
        from mcompile.runtime.joint_runner import JointRunner

        pm, st = self.pm, self.stages[s]
        return JointRunner(st.gm, pm.config, build=self.build, name=f"stage {s}", budget=self.activation_budget(s),
                           split_inputs=list(range(len(st.inputs) - len(st.received), len(st.inputs))),
                           accumulate=lambda args: pm._leaves.targets(args),
                           grad_buckets=lambda pos: pm._leaves.bucket_index(self._param_at(s, pos)))

    def activation_budget(self, s: int):
        """Stage ``s``'s share of ``Config(activation_budget=)`` (:func:`stage_activation_budget`)."""
        return stage_activation_budget(self.pm.config, self.actions, s)

    def recompute_choices(self) -> list:
        """``recompute="auto"``: what each of this rank's stages chose (runtime/joint_runner.py
        ``RecomputeChoice``), once its first step has compiled them; [] under a named policy."""
        if self.runners is None:
            return []
        return [c for c in (self.runners[s].choice() for s in self.own) if c is not None]

    def _probe_joint(self, st, args: list) -> tuple[list, list, list]:
        """Under fake tensors: stage ``st``'s joint program on ``args`` (traced here once; the real
        step reuses it) and the collectives its forward, backward (B) and, split for zero-bubble,
        weight-gradient (W) modules run, in their graph order: read from the modules' graphs, or recorded
        in a fake run of them where a node carries no value. The last stage's output is checked to be a loss."""
        runner = self.runners[st.index]
        with torch.no_grad():  # traced outside the recorder: the trace's own ops are not the step's collectives
            jp = runner.compile(args)
        split = self.schedule == "zbh1" and jp.backward_input is not None and jp.input_grads
        parts = (jp.forward, jp.backward_input if split else jp.backward, jp.backward_weight if split else None)
        read = [graph_collectives(p) if p is not None else [] for p in parts]
        if all(r is not None for r in read):  # the modules' graphs say it all: no fake run of 3 modules
            if st.is_last:  # the last stage returns a loss (or raises)
                outs = _output_values(jp.forward)[:jp.joint.num_outputs]
                self.pm._loss_parts(outs if len(outs) != 1 else outs[0])
            return tuple(read)
        rec = _RecordCollectives()
        with rec:
            outs, ctx = runner.forward(args)
        fwd = rec.ops
        if st.is_last:
            self.pm._loss_parts(outs if len(outs) != 1 else outs[0])  # the last stage returns a loss (or raises)
            tangents = runner.tangents(ctx, outs)
        else:
            tangents = [torch.ones_like(outs[i]) for i in ctx.jp.joint.diff_outputs]
        rec_b, rec_w = _RecordCollectives(), _RecordCollectives()
        with rec_b:
            (runner.backward_input if split else runner.backward)(ctx, tangents)
        if split:
            with rec_w:
                runner.backward_weight(ctx)
        return fwd, rec_b.ops, rec_w.ops

    def _agree_on_trace(self, error: Exception | None) -> None:
        """After the fake run: one int64 all-reduce (MIN over the world) says whether any rank failed
        to trace its stages (a model whose last stage returns no scalar loss, an op the fake mode
        cannot run); then every rank raises, the failing one its own error, the others naming it
        and its message (gathered only then), instead of waiting in the exchanges that follow."""
        pm = self.pm
        world = dist.get_world_size()
        first = torch.tensor([pm._rank if error is not None else world], dtype=torch.int64, device=pm._control_device)
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        if int(first) == world:
            return
        messages: list = [None] * world
        dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        from mcompile.runtime.verify import VerificationError

        r = int(first)
        raise VerificationError(f"rank {r} failed to trace its pipeline stages, so no rank runs the step: "
                                f"{messages[r]}")

    def step_end_ops(self, pp_rank: int | None = None) -> list:
        """The collectives after the schedule, in the order train_step issues them: the loss
        broadcast over pp, tied-weight gradient sums, the dp bucket reductions (all-reduce, or
        ZeRO-1's reduce-scatter), the loss statistics over dp, the SP norm gradients over tp.

        ``pp_rank`` (another rank of this pipeline group): its collectives on pipeline groups only,
        derived from the plan (the loss broadcast, the sums of the tied weights it holds); its dp and
        tp reductions are on groups this rank is not in, checked there."""
        from mcompile.runtime.verify import CommOp

        pm = self.pm
        mesh = pm.mesh
        q = self.pp_rank if pp_rank is None else pp_rank

        def group(axis):
            return next(tuple(g) for g in mesh.group_ranks(axis) if pm._rank in g)

        f32 = "torch.float32"
        out = [CommOp("coll", "broadcast loss", (2,), f32, group=group("pp"), axis="pp")]
        for fqn, ranks in sorted(self.param_ranks.items()):
            if len(ranks) > 1 and q in ranks:
                members = tuple(mesh.rank_of(**{**pm._coords, "pp": r}) for r in sorted(ranks))
                shape = list(pm.plan.params[fqn].local_shape)
                if fqn in pm._zero3:  # ZeRO-3: the dp piece's gradient
                    shape[0] //= mesh.size("dp")
                out.append(CommOp("coll", f"all_reduce tied {fqn}", tuple(shape), f32, group=members, axis="pp"))
        if q != self.pp_rank:
            return out
        if pm._data_size > 1:  # the data ranks: dp, and cp's (each holds a share of every sequence's tokens)
            data = self._data_members()
            zero = getattr(pm, "_zero", None)
            if zero is not None:  # (ZeRO-2 reduce-scatters per microbatch too: the same sequence on every dp rank)
                out += [CommOp("coll", "reduce_scatter dp bucket", (b.grad_buf.numel(),), f32, group=data,
                               axis="dp") for b in zero.buckets]
            else:
                out += [CommOp("coll", "all_reduce dp bucket", (b.buf.numel(),), f32,
                               group=data, axis="dp") for b in pm._leaves.buckets if b.reduce_dp]
            out.append(CommOp("coll", "all_reduce loss", (2,), f32, group=data, axis="dp"))
        if getattr(pm, "_tp_partial", None):
            n = sum(pm._leaves.main[f].numel() for f in pm._tp_partial)
            out.append(CommOp("coll", "all_reduce sp norm grads", (n,), f32, group=group("tp"), axis="tp"))
        return out

    # -- running --------------------------------------------------------------------------------------
    def _inputs_fn(self, pieces, rngs):
        pm = self.pm
        cap = pm._compiled.captured
        compute = pm._leaves.compute  # plain local leaves in the compute dtype (runtime/leaves.py)
        params = {ph: compute[fqn] for ph, fqn in self.param_of_ph.items() if fqn in compute}

        def fn(mb):
            args, kwargs = pieces[mb]
            user = list(args) + [kwargs[n] for n in cap.input_names[len(args):]]
            named = dict(zip(cap.user_inputs, user))
            named.update(pm._extra)
            named.update(params)
            named[RNG_INPUT] = rngs[mb]  # the microbatch's dropout input (mcompile/ir/dropout.py)
            return named

        return fn

    def run(self, pieces, forward_only: bool = False, rngs=None):
        """One step over the microbatches; returns (loss sum, token count) of the whole local batch
        on every rank of the pipeline (forward_only: the last stage's outputs, broadcast). ``rngs``: each
        microbatch's dropout input (ParallelModule._rng_states)."""
        pm = self.pm
        cap = pm._compiled.captured
        args0, kwargs0 = pieces[0]
        user0 = list(args0) + [kwargs0[n] for n in cap.input_names[len(args0):]]
        rngs = rngs if rngs is not None else [None] * len(pieces)
        probe_inputs = {n: t for n, t in zip(cap.user_inputs, user0) if isinstance(t, torch.Tensor)}
        if rngs[0] is not None:
            probe_inputs[RNG_INPUT] = rngs[0]
        specs = self._probe(probe_inputs)
        pm._leaves.refresh()
        inputs_fn = self._inputs_fn(pieces, rngs)
        split = self.schedule == "zbh1"
        last = {(a.stage, a.kind): a.mb for a in self.actions[self.pp_rank] if a.kind in "BW"}
        stages = {}
        for s in self.own:
            st = self.stages[s]
            last_mb = {k: last[(s, k)] for k in "BW" if (s, k) in last}
            if self.runners is not None:
                stages[s] = JointStage(st, self.runners[s], inputs_fn, loss_fn=lambda out: pm._loss_parts(out)[0],
                                       split_weight=split, leaves=pm._leaves, last_mb=last_mb,
                                       loss_scale=pm._loss_scale())
                continue
            weights = [pm._leaves.compute[self.param_of_ph[p]] for p in st.params]
            stages[s] = FxStage(st, inputs_fn, loss_fn=pm._backward_root, split_weight=split,
                                weights_fn=lambda w=weights: w, leaves=pm._leaves,
                                last_mb={k: last[(s, k)] for k in "BW" if (s, k) in last})
        ex = PipelineExecutor(rank=pm._rank, pp_rank=self.pp_rank, num_stages=self.k, actions=self.actions,
                              microbatches=len(pieces), peer_of_stage=self.peer_of_stage, stages=stages,
                              send_specs=specs, record=self.record, groups=self.p2p_groups,
                              lookahead=self.lookahead, watch=pm._comm.watch_messages)
        if len(pieces) != self.m:
            raise ValueError(f"the schedule was built for {self.m} microbatches, got {len(pieces)}")
        if forward_only:
            for st in stages.values():
                st.forward_only = True
            with torch.no_grad():
                results = ex.run(pm._device, forward_only=True)
        else:
            results = ex.run(pm._device)
        if self.record:  # the latest step's events (the timeline shows one step)
            self.events = list(ex.events)
        return results

    def reduce_results(self, results) -> torch.Tensor:
        """(loss sum, token count) summed over this rank's last-stage microbatches, broadcast from
        the last pipeline rank to the others."""
        pm = self.pm
        stats = torch.zeros(2, dtype=torch.float32, device=pm._device)
        for out in results.values():
            loss_sum, c = pm._loss_parts(out)
            stats += torch.stack([loss_sum.detach(), c])
        last = self.peer_of_stage(self.k - 1)
        with pm._comm.watch("broadcast", "pp"):
            dist.broadcast(stats, src=last, group=pm._comm.groups["pp"])
        return stats

    def push_grads(self) -> None:
        """Weights tied across stages: sum their main gradients over the pipeline ranks holding them,
        then count them ready (their data-parallel buckets reduce; the others were launched during
        each stage's last backward)."""
        leaves = self.pm._leaves
        leaves.armed = False  # the schedule is over
        for fqn, (g, _) in sorted(self.tied_groups.items()):
            with self.pm._comm.watch("all_reduce", "pp-tied", group=g):
                dist.all_reduce(leaves.main[fqn].view(self.pm._params[fqn]._local_tensor.shape), group=g)
        for fqn in sorted(self.tied_groups):
            leaves.ready(fqn)
