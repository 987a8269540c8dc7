"""The cost-driven search (mcompile.search): the space, its pruning, stage cuts, SC'21, bad input, plan="auto".

What each test isolates:
- pricing: with the cost model's own ⌈L/p⌉ layers per rank, the search's evaluator IS mc.estimate
  (so ranking by it ranks by the cost model); with the partitioner's cuts it only changes what the
  cuts change;
- pruning: the pruned search finds the same best as pricing every layout;
- SC'21: on every row of Narayanan et al.'s Table 1 the searched best is predicted no slower than
  Megatron's own layout, which is in the searched space (tests/test_cost.py builds those layouts);
- plan="auto" on 4 gloo processes: the layout the search picks trains with the single-device loss
  and gradients (3 AdamW steps, relative error <= 1e-5, as tests/test_runtime.py).
No timing assertions (DESIGN §8): the times are printed; bench/search_time.py measures them.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from test_cost import SC21, SC21_SETTINGS, sc21_layout

import mcompile as mc
from mcompile.cost.hardware import get_hardware
from mcompile.cost.model import Layout
from mcompile.cost.workload import estimate
from mcompile.ir.config import Config
from mcompile.ir.placements import BlockShard, Replicate, Shard
from mcompile.models.gpt import GPTConfig
from mcompile.models.presets import Preset
from mcompile.search import (
    SearchError,
    SearchWorkload,
    auto_layout,
    block_placements,
    enumerate_layouts,
    price,
    search,
    stage_split,
)

from conftest import build, pool


@pytest.fixture(scope="module")
def medium():
    """GPT-2 medium (16 heads, 24 layers), captured once with 2 layers."""
    return SearchWorkload.of("gpt2-medium")


SETTINGS = [dict(hardware="h100"), SC21_SETTINGS, dict(hardware="cpu-gloo", precision="fp32", param_dtype="fp32")]


@pytest.mark.parametrize("settings", SETTINGS, ids=["h100", "sc21", "cpu-gloo"])
def test_pricing_with_uniform_stages_is_the_cost_model(medium, settings):
    layouts = list(enumerate_layouts(medium, 32, global_batch=64, seq=1024))
    assert any(lay.tp > 1 and lay.pp > 1 and lay.virtual > 1 and lay.sequence_parallel for lay in layouts)
    for lay in layouts[:: max(1, len(layouts) // 25)]:
        e = estimate(lay, medium, global_batch=64, seq=1024, **settings)
        p = price(lay, medium, global_batch=64, seq=1024, uniform=True, **settings)
        assert p.step_time_s == pytest.approx(e.step_time_s, rel=1e-12), lay
        assert p.breakdown == pytest.approx(e.breakdown, rel=1e-12, abs=1e-15), lay
        assert p.memory_bytes == pytest.approx(e.memory_bytes, rel=1e-12), lay


@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset,world,seq,axis", [("mixtral-tiny", 8, 256, "ep"), ("llama3-tiny", 16, 4096, "cp")])
def test_search_and_estimate_price_alike(preset, world, seq, axis):
    """One cost model (issue 39): 20 layouts drawn from the search's space (ep or cp, pp, ZeRO, recompute, overlap
    all varied) priced by the search and by ``estimate``: identical step times and bytes. Both take their
    profiles from the same captured graph (``workload.Workload``: the search's workload is one), so a module priced
    by ``estimate(layout, module)`` and by the search is planned once, alike."""
    import random

    work = SearchWorkload.of(preset)
    layouts = list(enumerate_layouts(work, world, global_batch=32, seq=seq))
    sample = random.Random(1).sample(layouts, 20)
    assert any(getattr(lay, axis) > 1 for lay in sample)  # (cp: sequences long enough to be worth splitting)
    for lay in sample:
        e = estimate(lay, work, global_batch=32, seq=seq)
        p = price(lay, work, global_batch=32, seq=seq, uniform=True)
        assert (p.step_time_s, p.memory_bytes) == (e.step_time_s, e.memory_bytes), lay


@pytest.mark.timeout(120)
def test_random_layouts_price_alike_in_search_and_estimate():
    """One cost model (issue 39, item 4): 20 layouts drawn field by field (seeded: tp, pp, dp, cp, sequence
    parallel, ZeRO, recompute, microbatch size, schedule, virtual stages, overlap, precision, memory limit),
    valid ones kept, on llama3-tiny's block 8 layers deep (captured once, 2 layers). The search's price with
    ⌈L/p⌉ layers per rank and ``estimate`` run the same functions (``cost.price_ranks``: ``step_terms``,
    ``peak_memory``) on the same ``Sections``, so step time, bytes, both breakdowns and FLOPs are equal
    exactly, not approximately: a difference means one of them priced with other settings or layers."""
    import dataclasses
    import random

    from mcompile.models.presets import get_preset

    work = SearchWorkload.of(Preset("llama3-tiny-8", "llama", dataclasses.replace(get_preset("llama3-tiny").config,
                                                                                  n_layers=8)))
    rng = random.Random(39)
    kw = dict(hardware="h100", global_batch=32, seq=128)
    drawn = []
    for _ in range(2000):
        sched = rng.choice(["1f1b", "zb-h1", "interleaved", "gpipe"])
        pp = rng.choice([1, 2, 4, 8])
        tp = rng.choice([1, 2, 4])
        try:
            lay = Layout(tp=tp, pp=pp, dp=rng.choice([1, 2, 4]), cp=rng.choice([1, 1, 2]),
                         sequence_parallel=tp > 1 and rng.random() < 0.5, zero=rng.choice([0, 1, 2, 3]),
                         recompute=rng.choice(["none", "selective", "full", "auto"]),
                         microbatch_size=rng.choice([1, 2, 4]), schedule=sched if pp > 1 else "1f1b",
                         virtual=rng.choice([1, 2]) if sched == "interleaved" and pp > 1 else 1,
                         overlap=rng.random() < 0.5, precision=rng.choice(["bf16", "fp8"]))
            # a limit between 0.5x and 1.1x the layout's footprint without recompute: auto takes a real budget
            unlimited = estimate(dataclasses.replace(lay, recompute="none"), work, **kw).memory_bytes
        except ValueError:  # a field the others rule out (tp over the kv heads, pp x v over the layers, ...)
            continue
        limit = unlimited * rng.uniform(0.5, 1.1)
        e = estimate(lay, work, memory_limit=limit, **kw)
        p = price(lay, work, memory_limit=limit, uniform=True, **kw)
        assert (p.step_time_s, p.memory_bytes) == (e.step_time_s, e.memory_bytes), lay
        assert (p.breakdown, p.memory_breakdown) == (e.breakdown, e.memory_breakdown), lay
        assert (p.hardware_flops, p.fits) == (e.hardware_flops, e.fits), lay
        drawn.append((lay, e))
        if len(drawn) == 20:
            break
    assert len(drawn) == 20
    # the draw reaches what differs between ranks and modes (a test that covers none of it could not fail)
    lays = [lay for lay, _ in drawn]
    assert {lay.recompute.value for lay in lays} == {"none", "selective", "full", "auto"}
    assert {lay.zero for lay in lays} == {0, 1, 2, 3}
    assert any(lay.pp > 2 for lay in lays) and any(lay.virtual > 1 for lay in lays)
    assert any(lay.tp > 1 and lay.sequence_parallel for lay in lays) and any(lay.cp > 1 for lay in lays)
    assert any(e.details["auto_mix"][0] not in ({"none": 1.0}, {"full": 1.0}) for lay, e in drawn
               if lay.recompute.value == "auto")


def test_gpt2_xl_on_64_gpus(capsys):
    """The suite's search: GPT-2 XL (1.5B, 48 layers, 25 heads) on 64 H100s, capture included."""
    t = time.perf_counter()
    res = search("gpt2-xl", world=64, hardware="h100", global_batch=512, seq=1024, top_k=5)
    seconds = time.perf_counter() - t
    with capsys.disabled():
        print(f"\nsearch gpt2-xl on 64 GPUs: {seconds:.2f} s\n{res.table()}")
    assert len(res) == 5
    times = [c.step_time_s for c in res]
    assert times == sorted(times)
    for c in res:
        assert c.layout.world == 64 and c.estimate.fits and c.estimate.memory_bytes <= res.memory_limit
        assert c.layout.tp == 1  # 25 heads: no tp > 1 divides both them and 64
        again = price(c.layout, res.workload, hardware="h100", global_batch=512, seq=1024)
        assert again.step_time_s == pytest.approx(c.step_time_s, rel=1e-12)
        assert c.mesh(fake=True).size() == 64
        Config(**c.options())  # the runtime accepts the options
        m = c.options()["microbatches"]
        assert m * c.layout.microbatch_size * c.layout.dp == 512
    assert res.stats["space"] > res.stats["priced"] > 0


@pytest.mark.parametrize("limit_gib", [None, 6])
def test_pruning_is_exact(medium, limit_gib):
    """The pruned search (memory lower bounds, microbatch sizes past the limit, recompute dominance,
    overlap off and higher matmul precision dominated) prices a subset of the space, at the same times as
    pricing every layout; every fitting layout it skipped differs from one it priced only by a more
    expensive recompute mode, overlap off, or both, and is no faster."""
    limit = limit_gib * 2**30 if limit_gib else None
    kw = dict(hardware="a100", global_batch=32, seq=1024, top_k=3, memory_limit=limit)
    fast = search(medium, 16, **kw)
    full = search(medium, 16, exhaustive=True, **kw)
    assert full.stats["priced"] > fast.stats["priced"] > 0
    assert fast[0].layout == full[0].layout and fast[0].step_time_s == full[0].step_time_s
    fast_t = {lay: t for t, _, lay in fast.priced}
    full_t = {lay: t for t, _, lay in full.priced}
    assert all(full_t[lay] == t for lay, t in fast_t.items())
    order = ["none", "selective", "full"]
    for lay, t in full_t.items():
        if lay not in fast_t:
            recs = order[:order.index(lay.recompute.value) + 1] if lay.recompute.value in order else [lay.recompute]
            cheaper = [Layout(**{**lay.__dict__, "recompute": r, "overlap": o}) for r in recs for o in (True, False)]
            cheaper = [c for c in cheaper if c != lay]
            assert any(c in fast_t and fast_t[c] <= t for c in cheaper), lay
    if limit:
        assert fast.stats["pruned_memory"] > 0 and max(m for _, m, _ in fast.priced) <= limit


def test_stage_cuts_are_the_partitioners():
    """A 10-layer GPT captured whole (mcompile.passes.pp.stages.partition on its graph) and captured with 2
    layers (the same dynamic program over the depth's layer weights) gives the same cuts; an uneven
    split is priced with its own layer counts, not ⌈L/p⌉."""
    cfg = GPTConfig(vocab_size=512, block_size=256, n_layer=10, n_head=4, n_embd=128)
    pre = Preset("gpt-10", "gpt", cfg)
    whole = SearchWorkload.from_preset(pre, capture_layers=10)
    short = SearchWorkload.from_preset(pre)
    assert whole.full_depth and not short.full_depth and whole.depth == short.depth == 10
    for pp, v in [(3, 1), (4, 1), (7, 1), (2, 5), (5, 2)]:
        a, b = stage_split(whole, pp, v, 256), stage_split(short, pp, v, 256)
        assert a.layers_per_stage == b.layers_per_stage, (pp, v)
        assert sum(a.layers_per_stage) == 10 and len(a.cut_nodes) == pp * v - 1
        assert a.imbalance == pytest.approx(b.imbalance, rel=1e-6)
    # a module (not a preset): a shallow copy keeps 2 of its 10 blocks; the user's module is untouched, and
    # the ranking is the whole capture's
    model = pre.build("meta", torch.bfloat16)
    cut = SearchWorkload.of(model, pre.example_inputs(batch=2, seq=16, device="meta"))
    assert cut.depth == 10 and cut.trunk.num_layers == 2 and len(model.transformer.h) == 10
    kw = dict(hardware="h100", global_batch=32, seq=256, top_k=4, sequence_parallel=(False,))
    a, b = search(whole, 8, **kw), search(cut, 8, **kw)
    assert [c.layout for c in a] == [c.layout for c in b]
    assert [c.step_time_s for c in a] == pytest.approx([c.step_time_s for c in b], rel=1e-9)
    lay = Layout(dp=2, pp=4, microbatch_size=1)  # 10 layers on 4 ranks: the cost model assumes 3 each
    kw = dict(hardware="h100", global_batch=16, seq=256)
    cut = price(lay, short, **kw)
    uniform = price(lay, short, uniform=True, **kw)
    assert sum(cut.details["layers_per_rank"]) == 10 and uniform.details["layers_per_rank"] == [3] * 4
    assert cut.step_time_s < uniform.step_time_s
    assert cut.details["uniform_step_time_s"] == pytest.approx(uniform.step_time_s, rel=1e-12)


@pytest.mark.slow  # the CI tier keeps the cheaper checks of this capability (README: -m slow)
def test_sc21_searched_best_is_no_slower_than_megatron(capsys):
    """Every row of SC'21 Table 1: Megatron's layout (tp, pp from the row, microbatch 1, full recompute,
    interleaved) is in the searched space, and the searched best is predicted no slower, both priced
    alike (A100 profile, the row's GPUs and global batch, fp16 gradients, unfused attention, gradient
    reduction after the backward as in 2021)."""
    s, V = SC21["common"]["seq_len"], SC21["common"]["vocab"]
    lines = [f"{'params':>8} {'Megatron layout':<62} {'s/step':>7} {'searched best':<58} {'s/step':>7} {'speedup':>7}"]
    t = time.perf_counter()
    for row in SC21["rows"]:
        cfg = GPTConfig(vocab_size=V, block_size=s, n_layer=row["layers"], n_head=row["heads"], n_embd=row["hidden"])
        work = SearchWorkload.of(Preset(f"gpt-{row['params_b']}b", "gpt", cfg))
        kw = dict(global_batch=row["global_batch"], seq=s, **SC21_SETTINGS)
        meg = sc21_layout(row)
        # in the space: the enumeration restricted to 2021's options (a subset of the searched space, which
        # only adds options to each field) holds it
        assert meg in set(enumerate_layouts(work, row["gpus"], global_batch=row["global_batch"], seq=s,
                                            overlap_grad_reduce=False, recompute=("full",), zero=(0,),
                                            sequence_parallel=(False,), microbatch_sizes=(1,)))
        res = search(work, row["gpus"], top_k=1, overlap_grad_reduce=False, **kw)
        theirs = price(meg, work, **kw)
        assert theirs.fits
        assert theirs.details["uniform_step_time_s"] == pytest.approx(estimate(meg, work, **kw).step_time_s)
        best = res[0]
        assert best.step_time_s <= theirs.step_time_s * (1 + 1e-12), (row, str(best))
        lines.append(f"{row['params_b']:>7}B {str(meg):<62} {theirs.step_time_s:>7.2f} {str(best.layout):<58} "
                     f"{best.step_time_s:>7.2f} {theirs.step_time_s / best.step_time_s:>6.2f}x")
    with capsys.disabled():
        print(f"\nSC'21 Table 1 rows: Megatron's layout vs the searched best ({time.perf_counter() - t:.1f} s)\n"
              + "\n".join(lines))


# --------------------------------------------------------------------------- exact placements of one block


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_exact_block_placements_are_megatrons(medium, sp):
    """The integer program over the rule registry's strategies of one block, at tp=8 on an H100 at
    training sizes, chooses Megatron's layout — column-parallel q/k/v (GPT-2: the fused c_attn, in
    blocks) and MLP-in, row-parallel attention-out and MLP-out, norms replicated — and its objective is
    no worse than the planner's greedy propagation priced the same way (here: equal)."""
    pytest.importorskip("highspy", reason="the exact solver needs HiGHS (pip install highspy)")
    llama = SearchWorkload.of("llama3-8b")
    sol = block_placements(llama, 8, sequence_parallel=sp, hardware="h100", seq=2048)
    col, row = Shard(0), Shard(1)
    want = {"attention.wq": col, "attention.wk": col, "attention.wv": col, "attention.wo": row,
            "feed_forward.w1": col, "feed_forward.w3": col, "feed_forward.w2": row,
            "attention_norm": Replicate(), "ffn_norm": Replicate()}
    assert {k.removeprefix("layers.0.").removesuffix(".weight"): v for k, v in sol.params.items()} == want
    gpt = block_placements(medium, 8, sequence_parallel=sp, hardware="h100", seq=1024)
    assert gpt.params["transformer.h.0.attn.c_attn.weight"] == BlockShard(0, 3)
    assert gpt.params["transformer.h.0.attn.c_proj.weight"] == row
    assert gpt.params["transformer.h.0.mlp.c_fc.weight"] == col
    assert gpt.params["transformer.h.0.mlp.c_proj.weight"] == row
    for s in (sol, gpt):
        assert s.matches_planner and math.isfinite(s.greedy_objective_s)
        assert s.objective_s <= s.greedy_objective_s * (1 + 1e-12)
        assert s.comm_s > 0 and s.compute_s > 0


def test_exact_block_solver_beats_the_greedy_where_the_cost_model_disagrees_with_megatron():
    """Two tokens per microbatch on a B200, weights allowed replicated: the collectives' latency costs
    more than reading the attention weights whole, so the exact optimum replicates attention and the
    greedy propagation (Megatron's layout) is strictly slower under the same objective."""
    pytest.importorskip("highspy", reason="the exact solver needs HiGHS (pip install highspy)")
    sol = block_placements("llama3-8b", 8, hardware="b200", seq=2, require_sharded_weights=False)
    assert not sol.matches_planner
    assert sol.objective_s < 0.99 * sol.greedy_objective_s
    assert sol.params["layers.0.attention.wq.weight"] == Replicate()


# --------------------------------------------------------------------------- bad input


def test_world_without_a_factorization_lists_what_was_tried():
    model, inputs = build("llama3-tiny", batch=8)  # 8 heads (4 kv), 2 layers
    with pytest.raises(SearchError) as e:
        search(model, 7, hardware="cpu-gloo", global_batch=8, example_inputs=inputs, seq=16)
    msg = str(e.value)
    assert "no dp x pp x tp factorization of world=7" in msg
    assert "tp=7: tp=7 does not divide num_heads=8; valid tp sizes: 1, 2, 4" in msg
    assert "tp=1 pp=7: more pipeline stages than the model's 2 layers" in msg
    assert "tp=1 pp=1 dp=7: the global batch 8 does not divide by dp=7" in msg


def test_memory_limit_nothing_fits_states_the_smallest_footprint(medium):
    with pytest.raises(SearchError, match=r"fits in 256\.0 MiB per GPU: the smallest footprint found is "
                                          r"[0-9.]+ MiB, with .*recompute=full.*use more GPUs"):
        search(medium, 8, hardware="h100", global_batch=16, seq=1024, memory_limit=2**28)


def test_unknown_gpu_lists_the_known_ones(medium):
    with pytest.raises(ValueError, match=r"unknown hardware 'v100'; known profiles: a100-80gb, b200, cpu-gloo, "
                                         r"h100-sxm, h200"):
        search(medium, 8, hardware="v100", global_batch=16, seq=1024)


# --------------------------------------------------------------------------- plan="auto", real processes

REL = 1e-5  # DESIGN §10: fp32, lr 1e-4, 3 AdamW steps


@pytest.mark.timeout(600)
@pytest.mark.parametrize("memory", [pytest.param("as-is", marks=pytest.mark.slow), "below-dp-only"])
def test_plan_auto_trains_with_parity_on_4_processes(capsys, memory):
    """parallelize(plan="auto") on 4 gloo processes: rank 0 searches, every rank runs its choice, and
    training matches the single-device model. On the cpu-gloo profile as it is (a tiny model: data
    parallelism wins; -m slow), and with a memory limit below every dp-only footprint (the model must be
    split: a pipeline or tensor-parallel layout, with the optimizer and clipping it needs; the CI case: it
    runs a layout with more in it than dp). Parity: every step's loss and clip norm, and the last step's
    gradients before clipping."""
    from runtime_cases import grad_errors, reference
    from search_cases import train_auto

    model, inputs = build("llama3-tiny", batch=4)
    # the smallest dp-only footprint: dp=4, microbatch 1, ZeRO-1, full recompute (as the runtime keeps fp32)
    work = SearchWorkload.of(model, inputs, dtype=torch.float32)
    dp_only = price(Layout(dp=4, zero=1, recompute="full"), work, hardware="cpu-gloo", global_batch=4, seq=16,
                    precision="fp32", param_dtype="fp32", grad_dtype="fp32").memory_bytes
    small = get_hardware("cpu-gloo").replace(hbm_bytes=0.9 * dp_only)
    ref_losses, ref_grads, ref_norms = reference("llama3-tiny", batch=4)
    for hw in [None if memory == "as-is" else small]:
        axes, options, why = auto_layout(model, 4, inputs, None, {}, hardware=hw)
        with capsys.disabled():
            print("\n" + why)
        if hw is small:  # nothing with tp = pp = 1 fits
            assert axes.get("pp", 1) * axes.get("tp", 1) > 1
        results = pool(4).run(train_auto, "llama3-tiny", 3, 4, hw)
        for losses, _, mesh, chosen, norms in results:
            assert losses == pytest.approx(ref_losses, rel=REL, abs=0)
            assert norms == pytest.approx(ref_norms, rel=REL, abs=0)  # what each clipping saw
            assert mesh == axes
            assert chosen == {k: options.get(k, getattr(Config(), k)) for k in chosen}
        for k, err in grad_errors(results[0][1], ref_grads).items():  # unclipped (tests/test_runtime.py)
            assert err <= REL, (k, err)


def test_parallelize_needs_a_mesh_or_auto():
    model, inputs = build("llama3-tiny")
    with pytest.raises(ValueError, match="takes a mesh, or plan='auto'"):
        mc.parallelize(model, example_inputs=inputs)
    with pytest.raises(ValueError, match="takes a mesh, or plan='auto'"):
        mc.parallelize(model, mc.Mesh(dp=1), inputs, plan="auto")
    with pytest.raises(ValueError, match="chooses microbatches itself"):
        auto_layout(model, 4, inputs, None, {"microbatches": 2})


# --------------------------------------------------------------------------- command line


def test_cli_search_and_explain(capsys):
    import json

    from mcompile.apps.cli import main

    args = ["gpt2-medium", "--gpus", "32", "--gpu", "a100", "--global-batch", "64", "--seq", "1024", "--top", "3"]
    assert main(["search", *args, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    times = [c["step_time_s"] for c in d["candidates"]]
    assert len(times) == 3 and times == sorted(times)
    assert all(c["memory_bytes"] <= d["memory_limit"] for c in d["candidates"])
    assert main(["explain", *args]) == 0
    out = capsys.readouterr().out
    assert "best:" in out and "runner-up:" in out and "layout differences:" in out
    assert main(["search", "gpt2-medium", "--gpus", "8", "--gpu", "v100", "--global-batch", "8"]) == 2
    assert "known profiles: a100-80gb, b200, cpu-gloo, h100-sxm, h200" in capsys.readouterr().err
    assert main(["search", "gpt2-tiny", "--gpus", "4", "--gpu", "cpu-gloo", "--global-batch", "8", "--seq", "64"]) == 0
    out = capsys.readouterr().out
    assert "layers/stage" in out and "run it: mc.parallelize(model, mc.Mesh(" in out
    assert main(["search", "gpt2-tiny", "--gpus", "7", "--global-batch", "8", "--seq", "64"]) == 2
    assert "no dp x pp x tp factorization of world=7" in capsys.readouterr().err
