"""Context parallelism's activation memory per rank, measured, against the memory model.

llama3-tiny (dim 64, 2 layers, 8 query / 4 kv heads of 8, vocab 256; fp32) with its context raised to
4096, batch 1 x seq 4096, compiled for cp = 1 (Mesh(dp=1)), 2 and 4 (ring attention, token-weighted
loss). Every rank's program runs one training step in threads (the simulated communicator) under
:class:`mcompile.runtime.memory.MemoryTracker` (a dispatch mode: every storage an op makes, uncounted
when freed), as :func:`mcompile.apps.report.measure_per_rank` does; the helper here also reads the
activations still live after the forward, i.e. what autograd saved for the backward (plus the outputs),
split by dtype. The model's figure is ``mcompile.cost.workload.estimate(compiled, ...).memory_breakdown
["activations"]`` (the graph path: :func:`mcompile.ir.memory_model.saved_for_backward` over the captured
graph, every section evaluated at seq/cp).

What each test isolates:
- measured: the floating-point activations kept after forward fall as exactly 1/cp (every saved float
  tensor is per token: the RoPE tables too, computed whole and cut by cp_slice, only the slices kept);
  all dtypes and the peak within 1 % (the residual is integer token ids, itemised below);
- model vs measured: the model falls as exactly 1/cp too, and its absolute figure is the measured one
  plus a known over-count of the graph rules (itemised below), at every cp.

Measured at seq 4096 (bytes per rank; every rank of a cp alike; 2-core CPU, Dec 2026):

    cp  kept after forward: all / float    ratio to cp=1: all / float   peak activations (ratio)   model
    1   43,630,608 / 43,597,832            1       / 1                  52,019,216 (1)             43,892,736
    2   21,864,464 / 21,798,920            0.50113 / 0.5000001          26,042,384 (0.50063)       21,946,368
    4   10,948,624 / 10,899,464            0.25094 / 0.2500001          13,037,584 (0.25063)       10,973,184

The model is 1/cp exactly (0.5, 0.25) and 1.006 x the measured float bytes at every cp (43,892,736 B at
cp=1, with its 32,768 B of int64 ids); less the itemised over-count (262,144 B at cp=1) it is the measured
figure to 8 B. (Before memory_model's needs_grad it was 1.153 x: RoPE's products kept every operand.)

About 10 s a cp here (capture, plan, lower every rank, one step, estimate): the file takes ~30 s.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcompile.runtime.memory import MemoryTracker

SEQ = 4096
CPS = (1, 2, 4)
F32 = 4  # the tiny model runs in fp32


class _Tracker(MemoryTracker):
    """MemoryTracker that also remembers, per live storage, whether the tensor that made it was floating
    point."""

    def __init__(self):
        super().__init__()
        self.floating: dict[int, bool] = {}

    def track(self, t, category="activations"):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            key = id(t.untyped_storage())
            if key not in self._live:  # a new storage (an id can be reused once the old one is freed)
                self.floating[key] = t.is_floating_point()
        super().track(t, category)

    def live_activations(self) -> tuple[int, int]:
        """(floating-point bytes, other bytes) of the live activation storages."""
        fl = other = 0
        for key, (nbytes, cat) in self._live.items():
            if cat == "activations":
                if self.floating.get(key, True):
                    fl += nbytes
                else:
                    other += nbytes
        return fl, other


def _measure(compiled, inputs) -> list[dict]:
    """One training step of every rank's program (threads, simulated communicator), as
    mcompile.apps.report.measure_per_rank, reading also the activations live after the forward."""
    from mcompile.runtime.sim import ThreadedWorld, run_threads

    state = compiled.captured.state_values()
    cap = compiled.captured

    def rank_fn(r):
        local = {k: (v.detach().clone().requires_grad_(True) if k in cap.params else v)
                 for k, v in compiled.local_state(r, state).items()}
        params = [local[k] for k in cap.params]
        prog = compiled.program(r)
        names = [n.name for n in prog.graph.nodes if n.op == "placeholder"]
        user = dict(zip(cap.user_inputs, inputs))
        tracker = _Tracker()
        tracker.register(params, "parameters")
        with tracker:
            out = prog(*[local[n] if n in local else user[n] for n in names])
            tracker.resync()
            after = tracker.current["activations"]
            fl, other = tracker.live_activations()
            peak_forward = tracker.max["activations"]
            out[0].backward()
        assert fl + other == after
        return {"after_forward": after, "after_forward_float": fl, "after_forward_other": other,
                "peak_forward": peak_forward, "peak": tracker.max["activations"]}

    return run_threads(ThreadedWorld(compiled.mesh), rank_fn)


@pytest.fixture(scope="module")
def tiny():
    from mcompile.models import get_preset

    pre = get_preset("llama3-tiny")
    return dataclasses.replace(pre, config=dataclasses.replace(pre.config, max_seq_len=SEQ))


@pytest.fixture(scope="module")
def measured(tiny):
    import mcompile
    from mcompile.api import compile_plan
    from mcompile.cost.workload import estimate

    inputs = tiny.example_inputs(batch=1, seq=SEQ, seed=0)
    out = {}
    for n in CPS:
        torch.manual_seed(0)
        model = tiny.build()
        mesh = mcompile.Mesh(cp=n) if n > 1 else mcompile.Mesh(dp=1)
        c = compile_plan(model, mesh, inputs, token_weighted_loss=True, cp_attention="ring")
        ranks = _measure(c, inputs)
        est = estimate(c, hardware="h100", global_batch=1, seq=SEQ, microbatch_size=1, param_dtype="fp32")
        out[n] = {"ranks": ranks, "model": est.memory_breakdown["activations"],
                  "model_cp_buffers": est.memory_breakdown.get("cp_buffers", 0)}
        r0 = ranks[0]
        print(f"\ncp={n}: kept after forward {r0['after_forward']:,} B (float {r0['after_forward_float']:,},"
              f" int {r0['after_forward_other']:,}), peak {r0['peak']:,} B; model activations "
              f"{est.memory_breakdown['activations']:,.0f} B (+ cp buffers {out[n]['model_cp_buffers']:,.0f})")
    return out


def _rank(measured, n) -> dict:
    ranks = measured[n]["ranks"]
    assert len(ranks) == n
    assert all(r == ranks[0] for r in ranks), ranks  # the balanced layout: every rank holds the same shapes
    return ranks[0]


@pytest.mark.timeout(600)
def test_activations_fall_as_one_over_cp(measured):
    """Kept after forward and peak, per rank: 1/cp of cp=1's.

    Floating point: exact (to the 8 B of the two fp32 scalars the loss returns, which do not shrink). The
    all-dtype total is within 1 % because of int64 token ids (8 B a token), all explained:
    - the whole targets tensor, 8·s B at every cp: the loss's ``targets.view(-1)`` is a view of the
      caller's tensor, made inside the tracker, so the tracker counts the caller's storage (it is not an
      allocation of the step);
    - at cp > 1, the rank's slices of idx and targets (cp_slice: 8·s/cp B each), kept by the embedding's
      and the loss's backward; at cp = 1 autograd keeps the caller's own idx / targets, which the tracker
      never sees allocated.
    The peak (forward and backward) is within 1 %: the backward's transients scale as 1/cp as well, but
    the tracker does not see inside an opaque kernel (mcompile::cp_attention's ring buffers, the CPU flash
    kernel's), so the variant's buffers (the model's ``cp_buffers``) are not in it."""
    base = _rank(measured, 1)
    for n in CPS[1:]:
        m = _rank(measured, n)
        float_ratio = m["after_forward_float"] / base["after_forward_float"]
        assert float_ratio == pytest.approx(1 / n, rel=1e-6), (n, float_ratio)
        # the integer residual, exactly: whole targets (8 s) + the idx and targets slices (2 · 8 s/n)
        assert base["after_forward_other"] == 8 * SEQ + 8  # + the loss's int64 token count
        assert m["after_forward_other"] == 8 * SEQ + 8 + 2 * 8 * SEQ // n
        ratio = m["after_forward"] / base["after_forward"]
        assert ratio == pytest.approx(1 / n, rel=0.01), (n, ratio)
        peak = m["peak"] / base["peak"]
        assert peak == pytest.approx(1 / n, rel=0.01), (n, peak)
        assert m["peak_forward"] / base["peak_forward"] == pytest.approx(1 / n, rel=0.01)


@pytest.mark.timeout(600)
def test_matches_the_memory_model(measured, tiny):
    """The model's activations per rank fall as exactly 1/cp (every section evaluated at seq/cp), as the
    measured ones do; and, per cp, the model is the measured figure plus what the graph rules of
    memory_model.saved_for_backward over-count on this model (fp32, s_loc = seq/cp): the shared cos / sin
    tables, computed once outside the layers and kept by every layer's ``q * cos`` (the operand q's
    gradient needs), are counted in every layer's section (workload.analyse sums the layers' sections):
    (n_layers − 1) · 2 · s_loc · head_dim · 4 B. (The rules once also kept q, k and rotate_half(q) beside
    cos / sin, and cos's input: 15 % over here; ``needs_grad`` in memory_model._saved_by fixed that.)
    Compared on floating-point bytes: the model's int64 token ids (idx, 8·s_loc B) are what the tracker
    sees differently (test above). The measured after-forward figure includes the outputs (two fp32
    scalars: 8 B), within the tolerance."""
    cfg = tiny.config
    hd = cfg.dim // cfg.n_heads
    base_model = measured[1]["model"]
    for n in CPS:
        model = measured[n]["model"]
        assert model * n == pytest.approx(base_model, rel=1e-9), (n, model)
        s_loc = SEQ // n
        over = (cfg.n_layers - 1) * 2 * s_loc * hd * F32
        model_float = model - 8 * s_loc
        m = _rank(measured, n)
        assert model_float - over == pytest.approx(m["after_forward_float"], rel=1e-4), (
            n, model, over, m["after_forward_float"])
        # so the model over-states the measured float activations by the same share at every cp
        share = (model_float - m["after_forward_float"]) / model_float
        base_float = base_model - 8 * SEQ
        assert share == pytest.approx((base_float - _rank(measured, 1)["after_forward_float"]) / base_float, abs=1e-4)
        # the model's ring buffers (4 K/V blocks of a rank: 4 · 2 · s_loc · n_kv · hd · 4 B) fall as 1/cp too
        if n > 1:
            assert measured[n]["model_cp_buffers"] == 4 * 2 * s_loc * cfg.n_kv_heads * hd * F32
