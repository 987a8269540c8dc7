"""Pipeline send/recv under NCCL's rules, proven on the action lists (no processes).

NCCL is stricter than gloo: a send completes only when its receive is posted, and the operations of
one communicator run in order (``runtime/verify.py`` models both). The runtime posts single
``isend``/``irecv`` ops on a communicator per direction (``runtime/pipeline.py``); every schedule at
pp = 2, 4, 8 and m in {pp, 2pp, 4pp} is checked deadlock-free with the verifier reading the
runtime's own posting plan. The previous runtime (the same order, rebuilt here from the executor
before the change, on torch's one communicator per rank pair) deadlocks in 1F1B's steady state:
both neighbours send first.
"""

from __future__ import annotations

import re

import pytest

from mcompile.runtime.pipeline import Post, Wait, p2p_plan
from mcompile.runtime.schedules import build_schedule
from mcompile.runtime.verify import CommOp, VerificationError, rank_ops, verify

SHAPE = ((4, 1024, 8192), "torch.bfloat16", True)  # a 70B activation: far above NCCL's buffers
CASES = [(name, p, m) for name in ("gpipe", "1f1b", "interleaved", "zbh1") for p in (2, 4, 8)
         for m in (p, 2 * p, 4 * p)]


def _stage_comm(k: int, outputs: int = 1) -> dict:
    return {s: {"recv": [SHAPE] * outputs if s > 0 else [], "send": [SHAPE] * outputs if s < k - 1 else [],
                "fwd": [], "bwd": []} for s in range(k)}


def legacy_plan(actions: list[list], pp_rank: int, k: int, out_diff: dict[int, list[bool]]) -> list:
    """The executor's order before batching: per action, single ``irecv``s posted in the sending
    rank's order up to the one needed (then waited for), the stage, a single ``isend`` per output
    (waited for at the end of the step)."""
    pp = len(actions)

    def messages(kind, sender, mb):
        flags = out_diff.get(sender if kind == "act" else sender - 1, [])
        return [(kind, sender, mb, j) for j, d in enumerate(flags) if kind == "act" or d]

    mine = {s for s in range(k) if s % pp == pp_rank}
    incoming: dict[int, list] = {}  # peer -> what it sends here, in its order
    for q, acts in enumerate(actions):
        for a in acts:
            if a.kind == "F" and a.stage + 1 < k and a.stage + 1 in mine:
                incoming.setdefault(q, []).extend(messages("act", a.stage, a.mb))
            elif a.kind == "B" and a.stage > 0 and a.stage - 1 in mine:
                incoming.setdefault(q, []).extend(messages("grad", a.stage, a.mb))
    posted = {q: 0 for q in incoming}
    post_of: dict[tuple, int] = {}
    plan: list = []

    def post(op, msg):
        plan.append(Post(len(plan), ((op, msg),), batched=False))
        return plan[-1].id

    for a in actions[pp_rank]:
        need = (messages("act", a.stage - 1, a.mb) if a.kind == "F" and a.stage > 0 else
                messages("grad", a.stage + 1, a.mb) if a.kind == "B" and a.stage < k - 1 else [])
        for msg in need:
            q = msg[1] % pp
            while msg not in post_of:
                nxt = incoming[q][posted[q]]
                posted[q] += 1
                post_of[nxt] = post("recv", nxt)
            plan.append(Wait(post_of.pop(msg)))
        plan.append(a)
        if a.kind == "F" and a.stage < k - 1:
            for msg in messages("act", a.stage, a.mb):
                post("send", msg)
        elif a.kind == "B" and a.stage > 0:
            for msg in messages("grad", a.stage, a.mb):
                post("send", msg)
    return plan


def _ops(name: str, p: int, m: int, comm: str = "direction", legacy: bool = False,
         outputs: int = 1) -> dict[int, list[CommOp]]:
    v = 2 if name == "interleaved" else 1
    k = p * v
    acts = build_schedule(name, p, v, m)
    sc = _stage_comm(k, outputs)
    diff = {s: [d for _, _, d in sc[s]["send"]] for s in range(k)}
    return {r: rank_ops(acts[r], sc, k, lambda s: s % p, schedule=acts, pp_rank=r, comm=comm,
                        plan=legacy_plan(acts, r, k, diff) if legacy else None) for r in range(p)}


@pytest.mark.parametrize("name,p,m", CASES)
def test_every_schedule_is_deadlock_free_under_nccl_rules(name, p, m):
    ops = _ops(name, p, m)
    verify(ops)
    posts = [(r, op) for r, lst in ops.items() for op in lst if op.kind in ("send", "recv")]
    # one communicator per direction: rank a's sends to b and b's receives from a, nothing else
    assert all(op.comm == ("direction", r, op.peer) if op.kind == "send" else op.comm == ("direction", op.peer, r)
               for r, op in posts)


@pytest.mark.parametrize("name,p,m", CASES)
def test_receives_posted_one_action_early_stay_deadlock_free(name, p, m):
    """The overlap pass's posting (Config(overlap=True): p2p_plan lookahead=1): the receives the next
    action needs are posted before this one runs. Still deadlock-free under NCCL's rules, every
    message matched, and earlier: some receive is posted before an action it is not needed by."""
    v = 2 if name == "interleaved" else 1
    k = p * v
    acts = build_schedule(name, p, v, m)
    sc = _stage_comm(k)
    ops = {r: rank_ops(acts[r], sc, k, lambda s: s % p, schedule=acts, pp_rank=r, lookahead=1) for r in range(p)}
    verify(ops)
    diff = {s: [True] for s in range(k - 1)}
    early = 0
    for r in range(p):
        plan = p2p_plan(acts, r, k, diff, lookahead=1)
        assert [e for e in plan if not isinstance(e, (Post, Wait))] == acts[r]  # same actions, same order
        waited = {e.id for e in plan if isinstance(e, Wait)}
        posted = [e for e in plan if isinstance(e, Post) and e.ops[0][0] == "recv"]
        assert {e.id for e in posted} == waited  # every receive waited once
        at = {id(e): i for i, e in enumerate(plan)}
        for e in posted:  # posted before the action that precedes its wait: under that action's compute
            w = next(i for i, x in enumerate(plan) if isinstance(x, Wait) and x.id == e.id)
            early += any(not isinstance(x, (Post, Wait)) for x in plan[at[id(e)] + 1:w])
    assert early > 0


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zbh1"])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_the_posting_order_is_the_previous_one(name, p):
    """Only the communicators changed: the runtime posts exactly as before (the legacy order rebuilt
    above), so gloo timings and the proven orders are the ones the parity tests run."""
    v = 2 if name == "interleaved" else 1
    acts = build_schedule(name, p, v, 2 * p)
    diff = {s: [True, False, True] for s in range(p * v - 1)}
    for r in range(p):
        assert p2p_plan(acts, r, p * v, diff) == legacy_plan(acts, r, p * v, diff)


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zbh1"])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_the_previous_communicators_deadlock_under_nccl_rules(name, p):
    """One isend / irecv at a time on torch's default communicator per rank pair (both directions
    share it): the runtime before this change."""
    ops = _ops(name, p, 2 * p, comm="pair", legacy=True)
    with pytest.raises(VerificationError, match="would deadlock") as e:
        verify(ops)
    msg = str(e.value)
    blocked = {int(r) for r in re.findall(r"rank (\d+) (?:waits at|ends its step)", msg)}
    assert len(blocked) >= 2, msg  # a cycle: at least two ranks named, each with its op
    assert "queued on the communicator of ranks" in msg, msg  # a receive stuck behind a send to the same peer


def test_the_deadlock_names_the_ranks_and_the_send_first_cycle():
    with pytest.raises(VerificationError) as e:
        verify(_ops("1f1b", 2, 4, comm="pair", legacy=True))
    msg = str(e.value)
    # rank 0 sent mb1's activation and waits for mb0's gradient, queued behind that send; rank 1
    # sent mb0's gradient and waits for mb1's activation behind it
    assert re.search(r"rank 0 waits at #\d+: recv grad 1->0 mb0 #0 .* behind send act 0->1 mb1 #0", msg), msg
    assert re.search(r"rank 1 waits at #\d+: recv act 0->1 mb1 #0 .* behind send grad 1->0 mb0 #0", msg), msg


def test_gpipe_has_no_crossing_sends():
    """All forwards, then all backwards: no two neighbours send to each other at once, so GPipe
    passes NCCL's rules even on one communicator per pair."""
    for p in (2, 4, 8):
        verify(_ops("gpipe", p, 2 * p, comm="pair", legacy=True))


def test_several_messages_per_cut_and_the_order_nccl_pairs_them_in():
    for name in ("1f1b", "interleaved", "zbh1"):
        verify(_ops(name, 4, 8, outputs=3))
    ops = _ops("1f1b", 2, 2, outputs=2)
    # swap rank 0's first two sends: the names still match (gloo's tags would pair them), but NCCL
    # pairs them in posting order
    lst = ops[0]
    i, j = [n for n, op in enumerate(lst) if op.kind == "send"][:2]
    lst[i], lst[j] = lst[j], lst[i]
    with pytest.raises(VerificationError, match="in posting order"):
        verify(ops)


def test_a_batched_posting_completes_when_all_its_ops_can():
    """Megatron's send_forward_recv_backward: the crossing send and receive in one grouped launch
    on one communicator pass; the same ops posted one at a time on it deadlock."""
    def ops(batched):
        b = {"batch": 0, "comm": ("default group",)} if batched else {}
        w = [CommOp("wait", "posting 0", batch=0)] if batched else []
        x = CommOp("send", "act", (8,), "bf16", peer=1, **b)
        y = CommOp("recv", "grad", (8,), "bf16", peer=1, **b)
        x2 = CommOp("send", "grad", (8,), "bf16", peer=0, **b)
        y2 = CommOp("recv", "act", (8,), "bf16", peer=0, **b)
        return {0: [x, y, *w], 1: [x2, y2, *w]}

    verify(ops(True))
    with pytest.raises(VerificationError, match=r"rank 0 waits at #1: recv grad .* behind send act.*rank 1 waits"):
        verify(ops(False))


def test_the_verifier_reads_the_runtimes_plan():
    """rank_ops is built from p2p_plan, the executor's posting plan."""
    acts = build_schedule("1f1b", 2, 1, 4)
    plan = p2p_plan(acts, 0, 2, {0: [True]})
    posted = [(op, f"{m[0]} {m[1]}->{m[1] + (1 if m[0] == 'act' else -1)} mb{m[2]} #{m[3]}")
              for e in plan if isinstance(e, Post) for op, m in e.ops]
    ops = rank_ops(acts[0], _stage_comm(2), 2, lambda s: s, schedule=acts, pp_rank=0)
    assert [(o.kind, o.what) for o in ops if o.kind in ("send", "recv")] == posted
    assert sum(isinstance(e, Wait) for e in plan) == sum(o.kind == "wait" for o in ops) == 4
