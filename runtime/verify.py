"""Static verification: the communication of every rank matches, before anything runs (DESIGN §7.4).

Each rank describes its step as a list of :class:`CommOp` — the sends, receives, waits and
collectives its schedule and stage programs will issue, in order, backward included. ``rank_ops``
builds it from the *same* posting plan the executor runs (:func:`mcompile.runtime.schedules.p2p_plan`),
so a change in the runtime's posting order is what gets verified. :func:`verify` then checks, over
all ranks:

1. **collectives**: in every process group, every member issues the same sequence (kind, shape,
   dtype); the error names two ranks of the group and the first operation where they diverge;
2. **point-to-point**: every receive has exactly one matching send (same message, same peer,
   same shape and dtype) and no send is left unreceived; and, since NCCL ignores tags and pairs
   the messages between two ranks on one communicator in posting order, the k-th send from ``q``
   to ``r`` on a communicator must be the k-th receive ``r`` posts from ``q`` there;
3. **progress under NCCL's rules** (which are stricter than gloo's, where sends are buffered):

   - a send completes only when its matching receive is posted, and a receive only when its send
     is (rendezvous; NCCL's internal buffers do not hold a large activation);
   - a *posting* is the ops of one rank with the same ``batch`` id: one ``batch_isend_irecv``
     (a grouped launch: all its sends and receives are posted at once and progress
     independently; it completes when all of them have) or one single ``isend``/``irecv``; an op
     with ``batch=None`` is a posting of its own;
   - the postings of a rank on one communicator run in posting order, each blocking the next until
     it completes. The communicator is the op's ``comm`` (the runtime's: one per direction,
     ``("direction", src, dst)``; batched postings: their group's) or, when None, the one torch
     gives a rank pair by default, which both directions share;
   - the host continues after posting; it blocks at a ``wait`` for a posting (a receive with
     ``batch=None`` is waited for at once, a send with ``batch=None`` at the end of the step) and
     at a collective until every member of its group has reached it. Postings never waited for
     must still complete by the end of the step.

   A state where nothing can progress is reported as a deadlock naming each blocked rank, the op
   it waits at, and what its posting is queued behind, instead of a hang.

**At scale** nothing is gathered whole. Every rank of a pipeline group derives every member's list
from the plan (the schedules and the stage programs are the same on all of them) and runs
:func:`verify` over those (point-to-point, NCCL progress, the collectives on pipeline groups). Every
other group's collectives are compared by :func:`check_collectives_across`: each member hashes its
own sequence on the group (:func:`collective_digest`, 32 bytes) and the group all-gathers the
digests as a tensor; only when they differ are the lists gathered, to name two ranks and the first
operation where they diverge. The pipeline group checks the same way that its members derived the
same lists (:func:`check_derived_across`).
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass

__all__ = ["CommOp", "VerificationError", "verify", "rank_ops", "collective_digest", "check_collectives_across",
           "check_derived_across"]


class VerificationError(RuntimeError):
    pass


@dataclass(frozen=True)
class CommOp:
    kind: str  # "send" | "recv" | "wait" | "coll"
    what: str  # message id ("act 1->2 mb0 #0"), collective ("all_reduce sum") or "posting 3" (wait)
    shape: tuple = ()
    dtype: str = ""
    peer: int | None = None  # send / recv
    group: tuple[int, ...] | None = None  # collectives: the global ranks of the group
    axis: str = ""
    batch: int | None = None  # send / recv: the posting it belongs to (None: a single isend/irecv); wait: which
    comm: tuple | None = None  # batched send / recv: the communicator (None: the rank pair's)

    def __str__(self) -> str:
        if self.kind == "wait":
            return f"wait {self.what}"
        where = f" peer={self.peer}" if self.peer is not None else f" {self.axis}{list(self.group or ())}"
        return f"{self.kind} {self.what} {list(self.shape)} {self.dtype}{where}"


def rank_ops(actions, stage_comm, num_stages: int, peer_of_stage, step_end=(), plan=None, schedule=None,
             pp_rank: int | None = None, comm: str = "direction", lookahead: int = 0) -> list[CommOp]:
    """The ops of one rank.

    ``actions``: its schedule (:class:`~mcompile.runtime.schedules.Action` list); ``stage_comm``:
    stage -> dict with ``recv``/``send`` (lists of (shape, dtype, differentiable)), ``fwd``/``bwd``
    (lists of CommOp collectives in program order); ``peer_of_stage``: stage -> global rank;
    ``step_end``: collectives after the schedule (gradient reductions). The sends, receives and
    waits are those of the runtime's posting plan (:func:`~mcompile.runtime.schedules.p2p_plan`,
    from every rank's list ``schedule`` and this ``pp_rank``, or from ``actions`` alone), or of
    ``plan`` if given. ``comm``: the communicator of a single isend / irecv, ``"direction"`` (one
    per sending and receiving rank: the runtime's) or ``"pair"`` (both directions share one, torch's
    default); batched postings use the default group's."""
    from mcompile.runtime.schedules import Post, Wait, p2p_plan

    if plan is None:
        diff = {s: [d for _, _, d in sc["send"]] for s, sc in stage_comm.items()}
        plan = p2p_plan(actions if schedule is None else schedule, None if schedule is None else pp_rank,
                        num_stages, diff, lookahead)
    out: list[CommOp] = []
    for e in plan:
        if isinstance(e, Post):
            for op, (kind, s, mb, j) in e.ops:
                dst = s + 1 if kind == "act" else s - 1
                # each side's own view: the sending stage's outputs / inputs, the receiving one's inputs / outputs
                mine = s if op == "send" else dst
                side = "send" if (kind == "act") == (op == "send") else "recv"
                shape, dtype, _ = stage_comm[mine][side][j]
                src_rank, dst_rank = peer_of_stage(s), peer_of_stage(dst)
                c = (("default group",) if e.batched else
                     ("direction", src_rank, dst_rank) if comm == "direction" else None)
                out.append(CommOp(op, f"{kind} {s}->{dst} mb{mb} #{j}", shape, dtype,
                                  peer=dst_rank if op == "send" else src_rank, batch=e.id, comm=c))
        elif isinstance(e, Wait):
            out.append(CommOp("wait", f"posting {e.id}", batch=e.id))
        else:
            # a zero-bubble W runs collectives only when its weight-gradient graph holds some ("wgt")
            out.extend(stage_comm[e.stage].get({"F": "fwd", "B": "bwd", "W": "wgt"}[e.kind], ()))
    out.extend(step_end)
    return out


def verify(ops: dict[int, list[CommOp]]) -> None:
    """Raise :class:`VerificationError` on the first problem; return None when all ranks match."""
    _check_collectives(ops)
    _check_p2p(ops)
    _simulate(ops)


def collective_digest(ops: list[CommOp], group: tuple[int, ...]) -> bytes:
    """SHA-256 (32 bytes) of the collectives ``ops`` issues on ``group``: what, shape, dtype, in order
    (the fields :func:`verify` compares)."""
    h = hashlib.sha256()
    for op in ops:
        if op.kind == "coll" and op.group == group:
            h.update(repr((op.what, tuple(op.shape), op.dtype)).encode())
            h.update(b"\0")
    return h.digest()


def check_collectives_across(mine: list[CommOp], groups, device=None) -> VerificationError | None:
    """Compare this rank's collectives with the other members of each of ``groups`` without gathering
    the lists: ``groups`` is a list of (process group, its global ranks as a tuple), in an order every
    rank shares (each rank passes its own group of each mesh axis, axes in the mesh's order).

    Per group one ``all_gather`` of a 32-byte digest per member (a uint8 tensor on ``device``); the
    op lists themselves are gathered (``all_gather_object``, on that group only) only when the digests
    differ, for an error naming two ranks and their first differing operation. Every group is
    exchanged even after a mismatch (the other members are waiting in it); the first error is
    returned, not raised, so the caller can agree with every rank on failing."""
    import torch
    import torch.distributed as dist

    error = None
    for pg, members in groups:
        d = torch.tensor(list(collective_digest(mine, members)), dtype=torch.uint8, device=device)
        everyone = [torch.empty_like(d) for _ in members]
        dist.all_gather(everyone, d, group=pg)
        if all(torch.equal(e, everyone[0]) for e in everyone[1:]):
            continue
        lists: list = [None] * len(members)
        dist.all_gather_object(lists, [op for op in mine if op.kind == "coll" and op.group == members], group=pg)
        try:
            _check_collectives(dict(zip(members, lists)))
        except VerificationError as e:
            error = error or e
        else:  # equal digests of different lists cannot happen; differing digests of equal lists neither
            error = error or VerificationError(f"collective digests differ in group {list(members)} but the "
                                               "lists agree (a digest of unstable fields)")
    return error


def check_derived_across(rank: int, derived: dict[int, list[CommOp]], pg, members: tuple[int, ...],
                         device=None) -> VerificationError | None:
    """The pipeline group's members each derived every member's list (``derived``: rank -> list): check
    they derived the same, by a 32-byte digest of all the lists all-gathered over the group ``pg``.
    Only when the digests differ is each member's list of its own step gathered (objects, on this
    group) and :func:`verify` run over those, for the detailed error (two ranks, the op). Returns the
    error, if any (see :func:`check_collectives_across`)."""
    import torch
    import torch.distributed as dist

    h = hashlib.sha256(repr(sorted(derived.items())).encode()).digest()
    d = torch.tensor(list(h), dtype=torch.uint8, device=device)
    everyone = [torch.empty_like(d) for _ in members]
    dist.all_gather(everyone, d, group=pg)
    if all(torch.equal(e, everyone[0]) for e in everyone[1:]):
        return None
    lists: list = [None] * len(members)
    dist.all_gather_object(lists, derived[rank], group=pg)
    try:
        verify(dict(zip(members, lists)))
    except VerificationError as e:
        return e
    diff = [m for m, e in zip(members, everyone) if not torch.equal(e, everyone[0])]
    return VerificationError(f"the ranks of pipeline group {list(members)} derived different programs (rank "
                             f"{members[0]} and rank {diff[0]} differ), though their own steps match")


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


def _comm(r: int, op: CommOp) -> tuple:
    return op.comm if op.comm is not None else ("pair", min(r, op.peer), max(r, op.peer))


def _describe_comm(c: tuple) -> str:
    if c[0] == "pair":
        return f"the communicator of ranks {c[1]} and {c[2]}"
    if c[0] == "direction":
        return f"the communicator of rank {c[1]} -> rank {c[2]}"
    return f"communicator {c[0]!r}"


def _simulate(ops) -> None:
    """NCCL's progress rules (module docstring) over every rank's list."""
    # postings: (rank, id) -> indices of their ops; the id is ("b", batch) or ("i", index) for a single op
    def posting(r: int, i: int) -> tuple:
        op = ops[r][i]
        return (r, "b", op.batch) if op.batch is not None else (r, "i", i)

    members: dict[tuple, list[int]] = {}
    comm_of: dict[tuple, tuple] = {}
    lanes: dict[tuple, dict[str, list[int]]] = {}  # (src, dst, comm) -> sends / recvs in posting order
    for r, lst in ops.items():
        for i, op in enumerate(lst):
            if op.kind not in ("send", "recv"):
                continue
            p = posting(r, i)
            c = _comm(r, op)
            if comm_of.setdefault(p, c) != c:
                raise VerificationError(f"rank {r} posts {op} in one batch with ops on another communicator")
            members.setdefault(p, []).append(i)
            src, dst = (r, op.peer) if op.kind == "send" else (op.peer, r)
            lanes.setdefault((src, dst, c), {"send": [], "recv": []})[op.kind].append(i)
    partner: dict[tuple[int, int], tuple[int, int]] = {}
    for (src, dst, c), lane in lanes.items():
        s_, r_ = lane["send"], lane["recv"]
        for k in range(max(len(s_), len(r_))):
            a = ops[src][s_[k]] if k < len(s_) else None
            b = ops[dst][r_[k]] if k < len(r_) else None
            if a is None or b is None or a.what != b.what:
                raise VerificationError(
                    f"NCCL pairs the messages of rank {src} to rank {dst} on {_describe_comm(c)} in posting order "
                    f"(tags are ignored): its #{k} send is {a.what if a else 'nothing'}, the #{k} receive rank "
                    f"{dst} posts is {b.what if b else 'nothing'}")
            partner[(src, s_[k])] = (dst, r_[k])
            partner[(dst, r_[k])] = (src, s_[k])

    pos = {r: 0 for r in ops}
    queues: dict[tuple, deque] = {}  # (rank, comm) -> postings in posting order; the head is active
    posted: set[tuple] = set()
    done_ops: set[tuple[int, int]] = set()
    complete: set[tuple] = set()

    def post(r: int, i: int) -> tuple:
        p = posting(r, i)
        if p not in posted:
            posted.add(p)
            queues.setdefault((r, comm_of[p]), deque()).append(p)
        return p

    def active(p: tuple) -> bool:
        q = queues.get((p[0], comm_of[p]))
        return bool(q) and q[0] == p

    progress = True
    while progress:
        progress = False
        for r, lst in ops.items():  # hosts run until they block
            while pos[r] < len(lst):
                op = lst[pos[r]]
                if op.kind in ("send", "recv"):
                    p = post(r, pos[r])
                    if op.kind == "recv" and op.batch is None and p not in complete:
                        break  # a single irecv is waited for at once
                elif op.kind == "wait":
                    if (r, "b", op.batch) not in complete:
                        break
                else:
                    group = [m for m in op.group if m in ops]
                    if not all(pos[m] < len(ops[m]) and ops[m][pos[m]].kind == "coll" and
                               ops[m][pos[m]].group == op.group for m in group):
                        break
                    for m in group:  # the collective completes for all members at once
                        if m != r:
                            pos[m] += 1
                pos[r] += 1
                progress = True
        for q in list(queues.values()):  # rendezvous between active postings
            while q:
                p = q[0]
                for i in members[p]:
                    if (p[0], i) not in done_ops:
                        o = partner[(p[0], i)]
                        if active(posting(*o)):
                            done_ops.update(((p[0], i), o))
                if not all((p[0], i) in done_ops for i in members[p]):
                    break
                q.popleft()
                complete.add(p)
                progress = True
    stuck = sorted({r for r in ops if pos[r] < len(ops[r])} | {k[0] for k, q in queues.items() if q})
    if not stuck:
        return
    lines = []
    for r in stuck[:16]:
        if pos[r] < len(ops[r]):
            op = ops[r][pos[r]]
            where = f"waits at #{pos[r]}: "
            p = (r, "b", op.batch) if op.kind == "wait" else posting(r, pos[r]) if op.kind in ("send", "recv") else None
        else:
            where = "ends its step waiting for "
            p = next(q[0] for k, q in queues.items() if k[0] == r and q)
        if p is None:
            lines.append(f"rank {r} {where}{op}")
            continue
        pending = [ops[r][i] for i in members[p] if (r, i) not in done_ops]
        text = where + " + ".join(map(str, pending))
        head = queues[(r, comm_of[p])][0]
        if head != p:
            behind = [ops[r][i] for i in members[head] if (r, i) not in done_ops]
            text += f" (queued on {_describe_comm(comm_of[p])} behind {' + '.join(map(str, behind))})"
        lines.append(f"rank {r} {text}")
    more = f"; and {len(stuck) - 16} more ranks" if len(stuck) > 16 else ""
    raise VerificationError(f"the schedule would deadlock: {'; '.join(lines)}{more} (NCCL's rules: a send completes "
                            "when its receive is posted, postings on one communicator run in order)")
