"""Static verification: the communication of every rank matches, before anything runs (DESIGN §7.4).

Each rank describes its step as a list of :class:`CommOp` — the sends, receives and collectives
its schedule and stage programs will issue, in order, backward included (``rank_ops`` builds it
from the action list and the stages' collective nodes). :func:`verify` then checks, over all
ranks:

1. **collectives**: in every process group, every member issues the same sequence (kind, shape,
   dtype); the error names two ranks of the group and the first operation where they diverge;
2. **point-to-point**: every receive has exactly one matching send (same message, same peer,
   same shape and dtype) and no send is left unreceived; receivers post their receives in the
   sender's order (messages are tagged), so the per-pair order needs no further agreement;
3. **progress**: a simulation with non-blocking sends, blocking receives and collectives that
   wait for every member completes — a cyclic wait is reported with each blocked rank and what
   it waits for, instead of a hang.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CommOp", "VerificationError", "verify", "rank_ops"]


class VerificationError(RuntimeError):
    pass


@dataclass(frozen=True)
class CommOp:
    kind: str  # "send" | "recv" | "coll"
    what: str  # message id ("act 1->2 mb0 #0") or collective ("all_reduce sum")
    shape: tuple = ()
    dtype: str = ""
    peer: int | None = None  # send / recv
    group: tuple[int, ...] | None = None  # collectives: the global ranks of the group
    axis: str = ""

    def __str__(self) -> str:
        where = f" peer={self.peer}" if self.peer is not None else f" {self.axis}{list(self.group or ())}"
        return f"{self.kind} {self.what} {list(self.shape)} {self.dtype}{where}"


def rank_ops(actions, stage_comm, num_stages: int, peer_of_stage, step_end=()) -> list[CommOp]:
    """The ops of one rank.

    ``actions``: its schedule (:class:`~mcompile.runtime.schedules.Action` list); ``stage_comm``:
    stage -> dict with ``recv``/``send`` (lists of (shape, dtype, differentiable)), ``fwd``/``bwd``
    (lists of CommOp collectives in program order); ``peer_of_stage``: stage -> global rank;
    ``step_end``: collectives after the schedule (gradient reductions)."""
    out: list[CommOp] = []
    for a in actions:
        sc = stage_comm[a.stage]
        if a.kind == "F":
            if a.stage > 0:
                for j, (shape, dtype, _) in enumerate(sc["recv"]):
                    out.append(CommOp("recv", f"act {a.stage - 1}->{a.stage} mb{a.mb} #{j}", shape, dtype,
                                      peer=peer_of_stage(a.stage - 1)))
            out.extend(sc["fwd"])
            if a.stage < num_stages - 1:
                for j, (shape, dtype, _) in enumerate(sc["send"]):
                    out.append(CommOp("send", f"act {a.stage}->{a.stage + 1} mb{a.mb} #{j}", shape, dtype,
                                      peer=peer_of_stage(a.stage + 1)))
        elif a.kind == "B":
            if a.stage < num_stages - 1:
                for j, (shape, dtype, diff) in enumerate(sc["send"]):
                    if diff:
                        out.append(CommOp("recv", f"grad {a.stage + 1}->{a.stage} mb{a.mb} #{j}", shape, dtype,
                                          peer=peer_of_stage(a.stage + 1)))
            out.extend(sc["bwd"])
            if a.stage > 0:
                for j, (shape, dtype, diff) in enumerate(sc["recv"]):
                    if diff:
                        out.append(CommOp("send", f"grad {a.stage}->{a.stage - 1} mb{a.mb} #{j}", shape, dtype,
                                          peer=peer_of_stage(a.stage - 1)))
    out.extend(step_end)
    return out


def verify(ops: dict[int, list[CommOp]]) -> None:
    """Raise :class:`VerificationError` on the first problem; return None when all ranks match."""
    _check_collectives(ops)
    _check_p2p(ops)
    _simulate(ops)


def _check_collectives(ops) -> None:
    by_group: dict[tuple, dict[int, list[CommOp]]] = {}
    for r, lst in ops.items():
        for op in lst:
            if op.kind == "coll":
                if r not in op.group:
                    raise VerificationError(f"rank {r} issues {op} on a group it is not in")
                by_group.setdefault(op.group, {}).setdefault(r, []).append(op)
    for group, seqs in by_group.items():
        members = [r for r in group if r in ops]
        for r in members:
            seqs.setdefault(r, [])
        ref = members[0]
        for r in members[1:]:
            a, b = seqs[ref], seqs[r]
            for i in range(max(len(a), len(b))):
                x = a[i] if i < len(a) else None
                y = b[i] if i < len(b) else None
                if x is None or y is None or (x.what, x.shape, x.dtype) != (y.what, y.shape, y.dtype):
                    raise VerificationError(
                        f"collective mismatch in group {list(group)}: rank {ref} and rank {r} diverge at their "
                        f"operation #{i} on this group: rank {ref} issues {x or 'nothing'}, rank {r} issues "
                        f"{y or 'nothing'}")


def _check_p2p(ops) -> None:
    sends: dict[tuple, CommOp] = {}
    for r, lst in ops.items():
        for op in lst:
            if op.kind == "send":
                key = (r, op.peer, op.what)
                if key in sends:
                    raise VerificationError(f"rank {r} sends {op.what} to rank {op.peer} twice")
                sends[key] = op
    for r, lst in ops.items():
        for op in lst:
            if op.kind != "recv":
                continue
            s = sends.pop((op.peer, r, op.what), None)
            if s is None:
                raise VerificationError(f"rank {r} waits for {op} but rank {op.peer} never sends it")
            if (s.shape, s.dtype) != (op.shape, op.dtype):
                raise VerificationError(
                    f"send/recv mismatch between rank {op.peer} and rank {r} on {op.what}: rank {op.peer} sends "
                    f"{list(s.shape)} {s.dtype}, rank {r} expects {list(op.shape)} {op.dtype}")
    if sends:
        (src, dst, what), op = next(iter(sends.items()))
        raise VerificationError(f"rank {src} sends {op} that rank {dst} never receives")


def _simulate(ops) -> None:
    pos = {r: 0 for r in ops}
    sent: set[tuple] = set()
    progress = True
    while progress:
        progress = False
        for r, lst in ops.items():
            while pos[r] < len(lst):
                op = lst[pos[r]]
                if op.kind == "send":
                    sent.add((r, op.peer, op.what))
                elif op.kind == "recv":
                    if (op.peer, r, op.what) not in sent:
                        break
                else:
                    members = [m for m in op.group if m in ops]
                    if not all(pos[m] < len(ops[m]) and ops[m][pos[m]].kind == "coll" and
                               ops[m][pos[m]].group == op.group for m in members):
                        break
                    for m in members:  # the collective completes for all members at once
                        if m != r:
                            pos[m] += 1
                pos[r] += 1
                progress = True
    blocked = {r: ops[r][pos[r]] for r in ops if pos[r] < len(ops[r])}
    if blocked:
        lines = "; ".join(f"rank {r} waits at #{pos[r]}: {op}" for r, op in sorted(blocked.items())[:6])
        raise VerificationError(f"the schedule would deadlock: {lines}")
