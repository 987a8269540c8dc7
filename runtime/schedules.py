"""Pipeline schedules as per-rank action lists, and their bubble formulas.

An action is ``F`` (forward of one microbatch through one stage), ``B`` (its backward; with a
zero-bubble schedule only the gradient of the stage's inputs) or ``W`` (the deferred gradient of
the stage's weights). Stage ``s`` of ``K = pp * virtual`` lives on pipeline rank ``s % pp``
(Megatron's interleaving). Communication is implied: ``F(s, i)`` receives stage ``s-1``'s output
for microbatch ``i`` and sends its own to ``s+1``; ``B(s, i)`` receives the gradient from ``s+1``
and sends one to ``s-1``. :mod:`mcompile.runtime.verify` checks the lists before anything runs.

- ``gpipe``: all forwards, then all backwards (Huang et al. 2019). Bubble ``(p-1)/(m+p-1)``.
- ``1f1b``: ``p-r-1`` warm-up forwards, then one forward / one backward, then the remaining
  backwards (PipeDream-Flush, Narayanan et al. 2021). Same bubble, at most ``p-r`` microbatches in
  flight instead of ``m``.
- ``interleaved``: 1F1B over ``v`` virtual stages per rank in Megatron's order (Narayanan et al.
  SC'21): forwards of chunk ``c`` for ``p`` microbatches at a time; warm-up ``(p-r-1)*2 + (v-1)*p``.
  Bubble ``(p-1)/(v*m + p-1)``. Needs ``m`` to be a multiple of ``p``.
- ``zbh1``: ZB-H1 of Qi et al. 2023 ("Zero Bubble Pipeline Parallelism", §2.1): 1F1B's order with
  the backward split into B and W, rank ``r`` running ``W(i)`` right after ``B(i+r)`` (the last
  ``r`` W's at the end), so gradients travel back at the pace of B alone and the W's fill the
  cool-down. Every rank holds ``min(m, p)`` microbatches from F until W (1F1B's peak of rank 0).
  Idle time ``(p-1)(t_F + t_B - t_W)`` against 1F1B's ``(p-1)(t_F + t_B + t_W)`` (``t_B`` here is
  the input part only; ``m >= p`` and ``t_W <= min(t_F, t_B)``): a third when all three take equal
  time.

These orders are generated here rather than taken from ``torch.distributed.pipelining``: its
schedules drive its own ``PipelineStage`` objects (one module, one input tensor per stage, its own
shape inference and loss handling); ours run generated multi-input stages and must expose the
exact order of every send and receive to the static verifier and the timeline.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcompile.ir.config import PipelineSchedule

__all__ = ["Action", "SCHEDULES", "build_schedule", "bubble_fraction", "simulate", "ScheduleError", "Post", "Wait",
           "p2p_plan"]

SCHEDULES = tuple(s.value for s in PipelineSchedule)  # "gpipe", "1f1b", "interleaved", "zbh1"


class ScheduleError(ValueError):
    pass


@dataclass(frozen=True)
class Action:
    kind: str  # "F" | "B" | "W"
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.mb}"


def _check(name: str, pp: int, virtual: int, m: int) -> None:
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    if m < 1:
        raise ScheduleError(f"microbatches={m} must be >= 1")
    if virtual > 1 and name != "interleaved":
        raise ScheduleError(f"virtual={virtual} stages per rank need schedule='interleaved' (got {name!r})")
    if name == "interleaved" and m % pp:
        ok = [x for x in range(pp, 4 * pp + 1, pp)]
        raise ScheduleError(f"the interleaved schedule needs microbatches divisible by pp={pp}; got {m}; "
                            f"valid: {', '.join(map(str, ok))}, ...")


def build_schedule(name: str, pp: int, virtual: int, m: int) -> list[list[Action]]:
    """The action list of every pipeline rank."""
    _check(name, pp, virtual, m)
    if name == "gpipe":
        return [[Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)] for r in range(pp)]
    if name == "1f1b":
        return [_one_f_one_b(r, pp, m) for r in range(pp)]
    if name == "zbh1":
        return _zero_bubble_h1(pp, m)
    return [_interleaved(r, pp, virtual, m) for r in range(pp)]


def _one_f_one_b(r: int, p: int, m: int) -> list[Action]:
    warm = min(p - r - 1, m)
    out = [Action("F", r, i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        out += [Action("F", r, f), Action("B", r, b)]
        f, b = f + 1, b + 1
    out += [Action("B", r, i) for i in range(b, m)]
    return out


def _zero_bubble_h1(p: int, m: int) -> list[list[Action]]:
    """ZB-H1, the memory-efficient zero-bubble schedule of Qi et al. 2023 ("Zero Bubble Pipeline
    Parallelism", §2.1): 1F1B's order of F and B on every rank, with each W started ``r`` backwards
    late on rank ``r``.

    Rank ``r`` runs 1F1B's ``min(p - r - 1, m)`` warm-up forwards, then F / B pairs, then the
    remaining B's (:func:`_one_f_one_b`), and puts ``W(i)`` right after ``B(i + r)``; the last
    ``min(r, m)`` W's, whose ``B(i + r)`` does not exist, run at the end. Rank 0 therefore runs
    ``B(i) W(i)`` as 1F1B's whole backward; the last rank, which has no warm-up, defers most (the
    paper: "adjusts the starting points of W depending on the number of warm-up microbatches").

    In flight (F run, W not yet; the runtime keeps a stage's weight-gradient graph from B to W):
    ``min(m, p)`` on every rank, 1F1B's peak of rank 0 ("all workers maintain the same number of
    in-flight microbatches"); at most ``min(m, r + 1)`` B's wait for their W at once, and before
    their B exactly 1F1B's ``min(m, p - r)``. Idle time with uniform stages, ``m >= p`` and
    ``t_W <= min(t_F, t_B)`` (the paper's equal times among them; ``t_B`` the input part only):
    ``(p - 1)(t_F + t_B - t_W)`` against 1F1B's ``(p - 1)(t_F + t_B + t_W)``: the B's travel back at
    the pace of B alone and the deferred W's fill the cool-down."""
    out = []
    for r in range(p):
        acts: list[Action] = []
        for a in _one_f_one_b(r, p, m):
            acts.append(a)
            if a.kind == "B" and a.mb >= r:
                acts.append(Action("W", r, a.mb - r))
        acts += [Action("W", r, i) for i in range(max(0, m - r), m)]
        out.append(acts)
    return out


def _interleaved(r: int, p: int, v: int, m: int) -> list[Action]:
    total = m * v

    def fwd(k: int) -> Action:  # the k-th forward of this rank
        chunk = (k // p) % v
        mb = (k // (p * v)) * p + k % p
        return Action("F", chunk * p + r, mb)

    def bwd(k: int) -> Action:
        chunk = v - 1 - (k // p) % v
        mb = (k // (p * v)) * p + k % p
        return Action("B", chunk * p + r, mb)

    warm = min((p - r - 1) * 2 + (v - 1) * p, total) if v > 1 else min(p - r - 1, total)
    out = [fwd(k) for k in range(warm)]
    f, b = warm, 0
    while f < total:
        out.append(fwd(f))
        f += 1
        out.append(bwd(b))
        b += 1
    while b < total:
        out.append(bwd(b))
        b += 1
    return out


def bubble_fraction(name: str, pp: int, m: int, virtual: int = 1, t_f: float = 1.0, t_b: float = 2.0,
                    t_w: float | None = None) -> float:
    """Idle fraction of each rank's step under ideal conditions (uniform stages, free messages).

    ``t_b`` is the whole backward (input and weight gradients); for ``zbh1`` give ``t_w``, the part
    of it that is the weight gradient (default: half of ``t_b``)."""
    p = pp
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (virtual * m + p - 1)
    if name == "zbh1":
        tw = t_b / 2 if t_w is None else t_w
        tb = t_b - tw
        idle = (p - 1) * max(0.0, t_f + tb - tw)
        return idle / (m * (t_f + tb + tw) + idle)
    raise ScheduleError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")


def simulate(actions: list[list[Action]], t_f: float = 1.0, t_b: float = 2.0, t_w: float = 0.0,
             virtual: int = 1) -> tuple[float, list[float]]:
    """Run the action lists on an ideal machine (messages free, each action its time: ``t_b`` is the
    backward without the weight part when W actions exist). Returns (makespan, busy time per rank);
    raises :class:`ScheduleError` if the lists cannot complete (a cyclic wait)."""
    pp = len(actions)
    k = pp * virtual
    done: dict[tuple, float] = {}
    pos = [0] * pp
    clock = [0.0] * pp
    busy = [0.0] * pp
    dur = {"F": t_f / virtual, "B": t_b / virtual, "W": t_w / virtual}
    while any(pos[r] < len(actions[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while pos[r] < len(actions[r]):
                a = actions[r][pos[r]]
                if a.kind == "F":
                    dep = ("F", a.stage - 1, a.mb) if a.stage > 0 else None
                elif a.kind == "B":
                    dep = ("B", a.stage + 1, a.mb) if a.stage < k - 1 else ("F", a.stage, a.mb)
                else:
                    dep = ("B", a.stage, a.mb)
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done[dep] if dep is not None else 0.0)
                clock[r] = start + dur[a.kind]
                busy[r] += dur[a.kind]
                done[(a.kind, a.stage, a.mb)] = clock[r]
                pos[r] += 1
                moved = True
        if not moved:
            raise ScheduleError(f"the action lists cannot complete: ranks stop at {pos}")
    return max(clock), busy


def peak_activation_bytes(actions: list[Action], bytes_of_stage: dict[int, float]) -> float:
    """Peak of the activations a rank holds while running its action list: a microbatch's stage
    activations are held from its F until its B (until its W when the schedule splits them)."""
    split = any(a.kind == "W" for a in actions)
    held = 0.0
    peak = 0.0
    for a in actions:
        b = bytes_of_stage.get(a.stage, 0.0)
        if a.kind == "F":
            held += b
            peak = max(peak, held)
        elif a.kind == "W" or (a.kind == "B" and (not split or a.stage == 0)):  # stage 0's B is its whole backward
            held -= b
    return peak


# A message: (kind, sending stage, microbatch, index among the sender's messages); "act" goes to
# stage + 1, "grad" (the gradient of the sender's input j, i.e. of output j of stage - 1) to stage - 1.
@dataclass(frozen=True)
class Post:
    """Ops posted together: one ``batch_isend_irecv`` (``batched``) or a single isend / irecv."""
    id: int
    ops: tuple  # (("send" | "recv", message), ...)
    batched: bool = True


@dataclass(frozen=True)
class Wait:
    id: int  # the Post waited for


def p2p_plan(actions: list, pp_rank: int | None, num_stages: int, out_diff: dict[int, list[bool]],
             lookahead: int = 0) -> list:
    """The step of pipeline rank ``pp_rank``: its actions with the postings and waits around them.

    ``actions``: every pipeline rank's action list (a receiver posts its receives from a peer in
    the order that peer sends them; with ``pp_rank=None``, one rank's list, whose receives are
    then posted in the order it uses them); ``out_diff``: stage -> for each of its outputs, whether it is
    differentiable (a gradient comes back for it). Before an action, the receives it needs are
    posted (with any earlier messages of the same peer not yet posted) and waited for; after it,
    each output is posted as its own send, waited for at the end of the step. Every posting is a
    single op (``Post.batched`` False) on the communicator of its direction. ``lookahead`` (the overlap
    pass, ``Config(overlap=True)``: 1): the receives the next ``lookahead`` actions need are posted too,
    before this action runs, so their transfer runs under its compute (on their direction's
    communicator, in the sender's order: the same queue as before, posted earlier; one more receive
    buffer in flight). Returns a list of :class:`~mcompile.runtime.schedules.Action`, :class:`Post`
    and :class:`Wait`."""
    def messages(kind: str, sender: int, mb: int) -> list[tuple]:
        flags = out_diff.get(sender if kind == "act" else sender - 1, [])
        return [(kind, sender, mb, j) for j, d in enumerate(flags) if kind == "act" or d]

    def sends(a: Action) -> list[tuple]:
        if a.kind == "F" and a.stage < num_stages - 1:
            return messages("act", a.stage, a.mb)
        if a.kind == "B" and a.stage > 0:
            return messages("grad", a.stage, a.mb)
        return []

    def needs(a: Action) -> list[tuple]:
        if a.kind == "F" and a.stage > 0:
            return messages("act", a.stage - 1, a.mb)
        if a.kind == "B" and a.stage < num_stages - 1:
            return messages("grad", a.stage + 1, a.mb)
        return []

    if pp_rank is None:
        pp, pp_rank = 1, 0
        actions = [actions]
        incoming = {0: [msg for a in actions[0] for msg in needs(a)]}
    else:
        pp = len(actions)
        incoming: dict[int, list[tuple]] = {}  # peer -> the messages it sends here, in its order
        for q, acts in enumerate(actions):
            for a in acts:
                for msg in sends(a):
                    if (msg[1] + 1 if msg[0] == "act" else msg[1] - 1) % pp == pp_rank:
                        incoming.setdefault(q, []).append(msg)
    posted = {q: 0 for q in incoming}
    post_of: dict[tuple, int] = {}
    plan: list = []
    def post_upto(msg) -> None:
        q = msg[1] % pp
        while msg not in post_of:
            nxt = incoming[q][posted[q]]
            posted[q] += 1
            post_of[nxt] = len(plan)
            plan.append(Post(len(plan), (("recv", nxt),), batched=False))

    mine = actions[pp_rank]
    for i, a in enumerate(mine):
        for msg in needs(a):
            post_upto(msg)
            plan.append(Wait(post_of.pop(msg)))
        for b in mine[i + 1:i + 1 + lookahead]:
            for msg in needs(b):
                post_upto(msg)
        plan.append(a)
        for msg in sends(a):
            plan.append(Post(len(plan), (("send", msg),), batched=False))
    return plan
