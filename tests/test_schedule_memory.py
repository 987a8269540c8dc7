"""Schedule memory: how many microbatches each pipeline rank holds, read off the action lists alone.

Pure arithmetic on ``runtime/schedules.py``'s per-rank lists (no processes, no tensors). What is
isolated: the order of F/B/W actions each generator emits, ``peak_activation_bytes`` (the stage table
of ``mcompile plan``) and ``memory_model.inflight_microbatches`` (the cost model and the search).

What holds memory, as ``runtime/pipeline.py`` frees it:

- ``F(s, i)`` stores a slot (the received inputs and the outputs, whose autograd graph keeps every
  tensor saved for backward); that is "microbatch ``i`` in flight on stage ``s``".
- Without a B/W split, ``B(s, i)`` runs ``torch.autograd.backward`` (the graph is freed) and pops
  the slot: the hold ends at B.
- With the zero-bubble split (ZB-H1), ``B(s, i)`` on a stage ``s > 0`` calls torch's
  ``stage_backward_input`` with ``retain_graph=True`` and only detaches the outputs; the slot keeps
  the received inputs and the weight-gradient groups keep their autograd nodes with their saved
  tensors (and, through ``next_functions``, everything below them) until ``W(s, i)`` pops the slot.
  So the hold ends at W; what is held between B and W is at most the stage's activations (exactly
  those saved by nodes below a weight's gradient node; the nodes above, such as the loss's, go at B).
  ``peak_activation_bytes`` counts the whole stage until W: an upper bound, tight for layered stages.
- Stage 0 receives nothing, so its B is the whole backward (``FxStage.backward`` falls back to
  ``torch.autograd.backward``) and its W does nothing: stage 0's hold ends at B, split or not.

Definitions checked (p ranks, m microbatches, rank r, v virtual stages per rank):

- GPipe (Huang et al. 2019): all forwards first, so every rank holds all m microbatches.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021): ``p - r - 1`` warm-up forwards, then one forward /
  one backward: rank r holds exactly ``min(m, p - r)``.
- Interleaved 1F1B (Narayanan et al. SC'21; Megatron-LM ``megatron/core/pipeline_parallel/
  schedules.py``, ``forward_backward_pipelining_with_interleaving``): warm-up
  ``min((p - r - 1) * 2 + (v - 1) * p, m * v)`` forward steps, then one forward one backward, so rank
  r holds ``min(warm-up + 1, m * v)`` (virtual stage, microbatch) pairs at its peak. Megatron
  special-cases ``m == p`` (all ``m * v`` forwards first, GPipe-like); mcompile uses the general
  formula there too (fewer in flight on the later ranks; test_pipeline checks the bubble is still
  the formula's), and this file checks mcompile's documented formula.
- ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §2.1 "memory efficient schedule"):
  "follows the 1F1B schedule but adjusts the starting points of W depending on the number of
  warm-up microbatches ... all workers maintain the same number of in-flight microbatches", so the
  peak over workers does not exceed 1F1B's ``p * M_B``. mcompile's order (``runtime/schedules.py``):
  1F1B's F / B order, ``W(i)`` right after ``B(i + r)`` on rank r, the last W's at the end. Counted
  with the runtime's lifetimes above (hold until W except stage 0): exactly ``min(m, p)`` held on
  every rank, ``min(m, p - r)`` whose B has not run (1F1B's count) and ``min(m, r + 1)`` B's
  awaiting their W.
"""

from __future__ import annotations

import pytest

from mcompile.ir.memory_model import inflight_microbatches
from mcompile.runtime.schedules import SCHEDULES, Action, build_schedule, peak_activation_bytes

V = 2  # virtual stages per rank for the interleaved schedule
CASES = [(p, m) for p in (2, 3, 4) for m in sorted({p, 2 * p, 8})]


def _virtual(name: str) -> int:
    return V if name == "interleaved" else 1


def _valid(name: str, p: int, m: int) -> bool:
    return name != "interleaved" or m % p == 0  # Megatron's interleaving needs m divisible by p


def _cases(*names: str) -> list:
    return [pytest.param(name, p, m, id=f"{name}-p{p}-m{m}") for name in names for p, m in CASES
            if _valid(name, p, m)]


def _holds(actions: list[Action], ends_hold) -> list[int]:
    """Number of (stage, microbatch) pairs held after each action: from F until ``ends_hold(a)``."""
    held: set[tuple[int, int]] = set()
    counts = []
    for a in actions:
        key = (a.stage, a.mb)
        if a.kind == "F":
            assert key not in held, f"{a} runs twice"
            held.add(key)
        elif ends_hold(a):
            assert key in held, f"{a} ends a hold that no F began"
            held.remove(key)
        counts.append(len(held))
    return counts


def _until_b(a: Action) -> bool:
    """The hold of GPipe / 1F1B / interleaved, and ZB-H1's "F done, B not yet"."""
    return a.kind == "B"


def _runtime_zb(a: Action) -> bool:
    """ZB-H1 in runtime/pipeline.py: stage 0's B is its whole backward; later stages hold until W."""
    return a.kind == "B" if a.stage == 0 else a.kind == "W"


def _pending_w(actions: list[Action]) -> int:
    """Most B's whose W has not run yet, after any action."""
    n = peak = 0
    for a in actions:
        n += (a.kind == "B") - (a.kind == "W")
        peak = max(peak, n)
    return peak


# ---- well-formedness ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name,p,m", _cases(*SCHEDULES))
def test_schedule_is_well_formed(name, p, m):
    """Every (kind, stage, microbatch) once; each on the rank of its stage; on a rank F before B before
    W; and the lists complete when each action waits only for what it receives (F(s, i) for
    F(s-1, i), B(s, i) for B(s+1, i) or the last stage's own F, W for its B) with sends not blocking,
    as the executor runs them (an independent replay, not ``simulate``)."""
    v = _virtual(name)
    k = p * v
    acts = build_schedule(name, p, v, m)
    assert len(acts) == p
    kinds = "FBW" if name == "zbh1" else "FB"
    got = sorted((a.kind, a.stage, a.mb) for lst in acts for a in lst)
    assert got == sorted((kind, s, i) for kind in kinds for s in range(k) for i in range(m))
    for r, lst in enumerate(acts):
        assert all(a.stage % p == r for a in lst), f"rank {r} runs a stage of another rank"
        pos = {(a.kind, a.stage, a.mb): j for j, a in enumerate(lst)}
        for s in range(r, k, p):
            for i in range(m):
                assert pos[("F", s, i)] < pos[("B", s, i)], f"rank {r}: B{s}.{i} before its F"
                if name == "zbh1":
                    assert pos[("B", s, i)] < pos[("W", s, i)], f"rank {r}: W{s}.{i} before its B"

    done: set[tuple] = set()
    at = [0] * p
    moved = True
    while moved:
        moved = False
        for r, lst in enumerate(acts):
            while at[r] < len(lst):
                a = lst[at[r]]
                if a.kind == "F":
                    need = ("F", a.stage - 1, a.mb) if a.stage > 0 else None
                elif a.kind == "B":
                    need = ("B", a.stage + 1, a.mb) if a.stage < k - 1 else ("F", a.stage, a.mb)
                else:
                    need = ("B", a.stage, a.mb)
                if need is not None and need not in done:
                    break
                done.add((a.kind, a.stage, a.mb))
                at[r] += 1
                moved = True
    assert at == [len(lst) for lst in acts], f"the ranks wait on each other forever at positions {at}"


# ---- in-flight microbatches per schedule ------------------------------------------------------------
@pytest.mark.parametrize("name,p,m", _cases("gpipe"))
def test_gpipe_holds_every_microbatch(name, p, m):
    acts = build_schedule(name, p, 1, m)
    assert [max(_holds(lst, _until_b)) for lst in acts] == [m] * p


@pytest.mark.parametrize("name,p,m", _cases("1f1b"))
def test_1f1b_holds_p_minus_r(name, p, m):
    """Exactly ``min(m, p - r)`` on rank r: one more (say rank 0's first B swapped with the F after
    it, same makespan) is the memory 1F1B exists to save."""
    acts = build_schedule(name, p, 1, m)
    assert [max(_holds(lst, _until_b)) for lst in acts] == [min(m, p - r) for r in range(p)]


@pytest.mark.parametrize("name,p,m", _cases("interleaved"))
def test_interleaved_follows_megatrons_warmup(name, p, m):
    """Megatron's warm-up ``(p - r - 1) * 2 + (v - 1) * p`` forwards, then F before each B: the first B
    comes after ``min(warm-up + 1, m * v)`` forwards, and that many (virtual stage, microbatch) pairs
    is the rank's peak."""
    acts = build_schedule(name, p, V, m)
    total = m * V
    for r, lst in enumerate(acts):
        warm = min((p - r - 1) * 2 + (V - 1) * p, total)
        want = min(warm + 1, total)
        leading = next(j for j, a in enumerate(lst) if a.kind == "B")
        assert leading == want, f"rank {r}: {leading} forwards before the first backward, want {want}"
        assert max(_holds(lst, _until_b)) == want, f"rank {r}"


@pytest.mark.parametrize("name,p,m", _cases("zbh1"))
def test_zbh1_keeps_1f1b_count_before_b(name, p, m):
    """Microbatches whose F has run and B has not: exactly 1F1B's ``min(m, p - r)``; stage 0 (whose B
    is its whole backward) therefore holds 1F1B's ``min(m, p)``."""
    acts = build_schedule(name, p, 1, m)
    assert [max(_holds(lst, _until_b)) for lst in acts] == [min(m, p - r) for r in range(p)]
    assert max(_holds(acts[0], _runtime_zb)) == min(m, p)


def test_zbh1_holds_no_more_than_the_paper_says():
    """Qi et al. 2023 §2.1: every worker keeps the same number of in-flight microbatches, p (the
    1F1B peak of rank 0), counted until W on stages > 0 (module docstring: the runtime keeps the
    stage's graph from B to W). Checked as equality: more is the memory ZB-H1 exists to save (the
    former list-scheduling generator held [4, 6, 5, 4] at p=4, m=8), fewer would be a schedule that
    does not defer W's and so cannot have the (p-1)(F+B-W) bubble (tests/test_pipeline.py)."""
    off = {}
    for p, m in CASES:
        acts = build_schedule("zbh1", p, 1, m)
        held = [max(_holds(lst, _runtime_zb)) for lst in acts]
        if held != [min(m, p)] * p:
            off[(p, m)] = held
    assert not off, f"(p, m): microbatches held per rank until W, other than min(m, p): {off}"


@pytest.mark.parametrize("name,p,m", _cases("zbh1"))
def test_zbh1_defers_a_bounded_number_of_w(name, p, m):
    """The most W's waiting at once on rank r is exactly ``min(m, r + 1)``: W(i) runs right after
    B(i + r), so right after that B, B(i) .. B(i + r) await theirs (rank 0 runs each W right after its
    B). Without a bound they would grow with m; with this one the held microbatches stay p."""
    acts = build_schedule(name, p, 1, m)
    assert [_pending_w(lst) for lst in acts] == [min(m, r + 1) for r in range(p)]


@pytest.mark.parametrize("name,p,m", _cases(*SCHEDULES))
def test_memory_model_counts_what_the_schedule_holds(name, p, m):
    """``memory_model.inflight_microbatches`` (units: one microbatch's full stage activations; an
    interleaved chunk holds 1/v of them) equals the count read off the list: GPipe m, 1F1B p - r,
    interleaved pairs / v, each held until B. ZB-H1: the runtime's hold (until W on stages > 0,
    until B on stage 0), min(m, p) on every rank."""
    v = _virtual(name)
    acts = build_schedule(name, p, v, m)
    model_name = "zb-h1" if name == "zbh1" else name
    ends_hold = _runtime_zb if name == "zbh1" else _until_b
    for r, lst in enumerate(acts):
        assert inflight_microbatches(model_name, p, r, m, v) * v == max(_holds(lst, ends_hold)), f"rank {r}"


# ---- peak_activation_bytes against hand counts -----------------------------------------------------
def test_peak_bytes_gpipe_by_hand():
    """GPipe p=2, m=4: all four forwards before any backward, so 4 x the stage's bytes."""
    acts = build_schedule("gpipe", 2, 1, 4)
    assert peak_activation_bytes(acts[0], {0: 3.0, 1: 100.0}) == 12.0  # rank 0: stage 0 only
    assert peak_activation_bytes(acts[1], {1: 5.0}) == 20.0


def test_peak_bytes_1f1b_by_hand():
    """1F1B p=4, m=8, a = 3 bytes per microbatch per stage. Rank 0: warm-up F0 F1 F2, then F3 B0 F4 B1 ..
    F7 B4, then B5 B6 B7: four held after F3 and after every later F (4a = 12); rank 1 three (9), rank 2
    two (6), rank 3 one (3)."""
    acts = build_schedule("1f1b", 4, 1, 8)
    a = 3.0
    assert [peak_activation_bytes(acts[r], {r: a}) for r in range(4)] == [4 * a, 3 * a, 2 * a, a]
    rank0 = [Action("F", 0, i) for i in range(3)]  # the list written out
    for i in range(5):
        rank0 += [Action("F", 0, 3 + i), Action("B", 0, i)]
    rank0 += [Action("B", 0, i) for i in range(5, 8)]
    assert acts[0] == rank0


def test_peak_bytes_interleaved_by_hand():
    """Interleaved p=2, v=2, m=4. Rank 0 holds stages 0 (x bytes) and 2 (y): warm-up 2 + 2 = 4, then
    F0.0 F0.1 F2.0 F2.1 | F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 | B2.2 B2.3 B0.2 B0.3, held after
    each: x 2x 2x+y 2x+2y | 3x+2y 3x+y 4x+y 4x 4x+y 3x+y 3x+2y 2x+2y | ..., peak max(3x+2y, 4x+y).
    Rank 1 (stages 1 and 3): warm-up 2: F1.0 F1.1 | F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 ...,
    peak max(2x+y, 3x)."""
    acts = build_schedule("interleaved", 2, 2, 4)
    assert peak_activation_bytes(acts[0], {0: 1.0, 2: 10.0}) == 23.0  # 3 + 20 > 4 + 10
    assert peak_activation_bytes(acts[0], {0: 10.0, 2: 1.0}) == 41.0  # 40 + 1 > 30 + 2
    assert peak_activation_bytes(acts[1], {1: 1.0, 3: 10.0}) == 12.0  # 2 + 10 > 3
    assert peak_activation_bytes(acts[1], {1: 10.0, 3: 1.0}) == 30.0  # 30 > 20 + 1


def test_peak_bytes_split_backward_by_hand():
    """With W actions in the list, a stage > 0 holds until W and stage 0 until B (module docstring).

    Stage 1, a = 1: F1.0 B1.0 F1.1 B1.1 W1.0 F1.2 ... holds 1 1 2 2 1 2 ...: peak 2 (1 if it were freed
    at B). Stage 0: F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3 then the W's: peak 2 (4 if held until W)."""
    s1 = [Action("F", 1, 0), Action("B", 1, 0), Action("F", 1, 1), Action("B", 1, 1), Action("W", 1, 0),
          Action("F", 1, 2), Action("B", 1, 2), Action("W", 1, 1), Action("F", 1, 3), Action("B", 1, 3),
          Action("W", 1, 2), Action("W", 1, 3)]
    assert peak_activation_bytes(s1, {1: 1.0}) == 2.0
    assert peak_activation_bytes([a for a in s1 if a.kind != "W"], {1: 1.0}) == 1.0  # no split: B frees
    s0 = [Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0), Action("F", 0, 2), Action("B", 0, 1),
          Action("F", 0, 3), Action("B", 0, 2), Action("B", 0, 3)] + [Action("W", 0, i) for i in range(4)]
    assert peak_activation_bytes(s0, {0: 1.0}) == 2.0


def test_peak_bytes_zbh1_rank0_by_hand():
    """ZB-H1 p=4, m=8, rank 0 (stage 0: B frees): F0.0 .. F0.3 before B0.0 and never more, 4a."""
    acts = build_schedule("zbh1", 4, 1, 8)
    assert acts[0][:5] == [Action("F", 0, i) for i in range(4)] + [Action("B", 0, 0)]
    assert peak_activation_bytes(acts[0], {0: 3.0}) == 12.0


def test_peak_bytes_zbh1_last_rank_by_hand():
    """ZB-H1 p=4, m=8, rank 3 (no warm-up, W three backwards late): F3.0 B3.0 F3.1 B3.1 F3.2 B3.2 F3.3
    B3.3 W3.0 | F3.4 B3.4 W3.1 .. F3.7 B3.7 W3.4 | W3.5 W3.6 W3.7, held until W: 1 1 2 2 3 3 4 4 3 |
    4 4 3 ..: peak 4a (1F1B's rank 3: a), where the paper puts it. Rank 1 (two warm-up forwards, W one
    backward late): F1.0 F1.1 F1.2 B1.0 F1.3 B1.1 W1.0 ..: 3 after F1.2, 4 after F1.3, peak 4a."""
    acts = build_schedule("zbh1", 4, 1, 8)
    rank3 = []
    for i in range(8):
        rank3 += [Action("F", 3, i), Action("B", 3, i)] + ([Action("W", 3, i - 3)] if i >= 3 else [])
    rank3 += [Action("W", 3, i) for i in range(5, 8)]
    assert acts[3] == rank3
    assert acts[1][:7] == [Action("F", 1, 0), Action("F", 1, 1), Action("F", 1, 2), Action("B", 1, 0),
                           Action("F", 1, 3), Action("B", 1, 1), Action("W", 1, 0)]
    a = 3.0
    assert [peak_activation_bytes(acts[r], {r: a}) for r in range(4)] == [4 * a] * 4


@pytest.mark.parametrize("name,p,m", _cases(*SCHEDULES))
def test_peak_bytes_agrees_with_the_memory_model(name, p, m):
    """The plan's stage table (``peak_activation_bytes``) and the cost model (``inflight_microbatches``)
    give the same bytes when every stage holds a bytes per microbatch (a / v per interleaved chunk)."""
    v = _virtual(name)
    a = 6.0  # divisible by v: exact floats
    acts = build_schedule(name, p, v, m)
    model_name = "zb-h1" if name == "zbh1" else name
    for r, lst in enumerate(acts):
        got = peak_activation_bytes(lst, {s: a / v for s in range(r, p * v, p)})
        assert got == pytest.approx(float(inflight_microbatches(model_name, p, r, m, v)) * a), f"rank {r}"
