"""Alignment (issue 11): ZeRO buffer offsets on 128-byte boundaries, the vocabulary padded by default.

What is isolated:

- :class:`mcompile.ir.buckets.BucketLayout` alone (pure arithmetic, hypothesis over sizes and dp): every
  parameter offset, segment start and owned range start is a multiple of 64 elements — 128 B of the
  bf16 parameter buffer, 256 B of the fp32 gradient buffer; the padding belongs to no parameter and
  no segment; the dp ranks' segments cover each parameter exactly once. Then the layouts of realistic
  plans (GPT-2 medium and Llama 3 8B on the meta device at dp=4 x tp=8), and of a model whose sizes
  are odd (hidden 18) so that the padding is not empty. The runtime buffers are built from these
  layouts (``runtime/zero.py``); their parity and their bytes are tests/test_zero.py's.
- The vocabulary padding of the planner (``Config.vocab_pad_multiple``, 128 by default): GPT-2's
  50257 at tp=8 is padded to 51200 (6400 a rank, Megatron's ``--make-vocab-size-divisible-by 128``),
  nothing is padded at tp=1 or where tp divides the vocabulary, and ``vocab_pad_multiple=1`` keeps
  the old padding to a multiple of tp. Training parity with a padded vocabulary is
  tests/test_runtime.py's (gpt2-tiny and hf-gpt2 at tp=2: 257 -> 512 and 129 -> 256); here, the
  model's logits returned at tp=2 and tp=4 (the padded columns gathered and dropped), where a rank's
  whole slice can be padding.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mcompile as mc
from mcompile.ir.buckets import ALIGN, BucketLayout, bucket_layouts, zero1_layouts

from conftest import pool

BYTES = {"bfloat16": 2, "float32": 4}  # the parameter buffer's dtypes; gradients are fp32


def _check_layout(lay: BucketLayout) -> None:
    offsets = lay.offsets
    ends = [off + n for off, n in zip(offsets, lay.numels)]
    assert lay.padded % (lay.dp * ALIGN) == 0
    for off, end, nxt in zip(offsets, ends, offsets[1:]):
        assert off % ALIGN == 0 and 0 <= nxt - end < ALIGN  # the next aligned offset
    assert offsets[-1] % ALIGN == 0 and 0 <= lay.padded - ends[-1] < lay.dp * ALIGN
    covered = {fqn: 0 for fqn in lay.fqns}
    for r in range(lay.dp):
        lo, hi = lay.owned(r)
        assert hi - lo == lay.shard
        for size in BYTES.values():
            assert (lo * size) % 128 == 0, (r, lo, size)
        for seg in lay.segments(r):
            i = lay.fqns.index(seg.fqn)
            assert seg.offset == offsets[i] and lo <= seg.start < seg.stop <= hi
            assert seg.stop <= ends[i]  # no padding in a segment
            assert seg.start in (offsets[i], lo)  # where the parameter or the range begins: aligned
            for size in BYTES.values():
                assert (seg.start * size) % 128 == 0, (seg, size)
            covered[seg.fqn] += seg.numel
    assert covered == dict(zip(lay.fqns, lay.numels))  # each element owned once, padding by nobody


@settings(max_examples=200, deadline=None)
@given(numels=st.lists(st.integers(1, 5000), min_size=1, max_size=12), dp=st.integers(1, 8),
       bucket_kb=st.sampled_from([1, 4, 64, 25 * 1024]))
def test_layouts_are_aligned_and_padding_is_owned_by_nobody(numels, dp, bucket_kb):
    """Any sizes, dp and bucket size: aligned offsets and ranges; a segment starts either at its
    parameter's (aligned) offset or at its range's (aligned) start; padding < 64 elements after a
    parameter and < dp * 64 at the end of the buffer."""
    lays = bucket_layouts([(f"p{i}", n) for i, n in enumerate(numels)], dp, bucket_kb * 1024)
    assert [n for lay in lays for n in lay.numels] == numels
    for lay in lays:
        _check_layout(lay)


def test_offsets_by_hand():
    """Three parameters of 1, 64 and 65 elements at dp=2: offsets 0, 64, 128; the buffer ends at
    193, padded to 256 (a multiple of dp * 64); rank 1 owns [128, 256): the whole third parameter."""
    lay = BucketLayout(("a", "b", "c"), (1, 64, 65), dp=2)
    assert lay.offsets == (0, 64, 128)
    assert (lay.numel, lay.padded, lay.shard) == (130, 256, 128)
    assert [(s.fqn, s.start, s.stop) for s in lay.segments(0)] == [("a", 0, 1), ("b", 64, 128)]
    assert [(s.fqn, s.start, s.stop) for s in lay.segments(1)] == [("c", 128, 193)]
    unaligned = BucketLayout(("a", "b", "c"), (1, 64, 65), dp=2, align=1)  # the layout before alignment
    assert unaligned.offsets == (0, 1, 65) and unaligned.padded == 130


def _meta_plan(name, mesh, **options):
    from mcompile.models import get_preset

    pre = get_preset(name)
    model = pre.build(device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mc.plan(model, mesh, pre.example_inputs(batch=2, seq=32, device="meta"), **options)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpt2-medium", "llama3-8b"])
def test_realistic_zero1_layouts_are_128_byte_aligned(name):
    """The ZeRO-1 buckets of a realistic plan (meta device, dp=4 x tp=8, default 25 MB buckets and
    1 MB ones, so that parameters straddle ranges): every parameter offset, segment start and owned
    range start is on a 128-byte boundary of the bf16 and of the fp32 buffers."""
    plan = _meta_plan(name, mc.Mesh.fake(dp=4, tp=8))
    for bucket_mb in (25.0, 1.0):
        lays = zero1_layouts(plan, bucket_mb)
        assert sum(lay.numel for lay in lays) == sum(pp.local_numel for pp in plan.params.values())
        straddling = 0
        for lay in lays:
            _check_layout(lay)
            for r in range(lay.dp):
                for seg in lay.segments(r):
                    straddling += seg.start != seg.offset
                    for size in BYTES.values():
                        assert (seg.start * size) % 128 == 0, (seg, size)
        assert straddling > 0  # ranges do cut parameters: their starts are checked too


@pytest.mark.timeout(300)
def test_odd_sizes_are_padded_to_alignment():
    """Hidden 18, vocabulary 103 at dp=4 (tests/test_zero.py's "odd-llama"): parameters of 18, 324,
    540, 1854 elements; each offset rounded up to 64, each buffer to 256; zero1_memory counts the
    padding (the runtime holds it: tests/test_zero.py's byte-exact test)."""
    from mcompile.ir.buckets import zero1_memory
    from mcompile.models.llama import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=103, dim=18, n_layers=1, n_heads=1, n_kv_heads=1, ffn_hidden=30,
                              max_seq_len=64)).to("meta")
    tokens = torch.empty(4, 16, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = mc.plan(model, mc.Mesh.fake(dp=4), (tokens, tokens))
    lays = zero1_layouts(plan)
    assert len(lays) == 1
    (lay,) = lays
    _check_layout(lay)
    assert lay.padded > lay.numel and any(n % ALIGN for n in lay.numels)
    mem = zero1_memory(plan, "bfloat16")
    assert (mem.params, mem.grads) == (2 * lay.padded, 4 * lay.padded)


# ---- the vocabulary ----------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_gpt2_vocabulary_at_tp8_is_padded_to_51200():
    """GPT-2's 50257 at tp=8: 51200 = 50 x 128 x 8, 6400 rows a rank (unpadded, 6283 a rank, rows
    of 6283 x 1024 bf16 are not a multiple of any GEMM tile). The head is tied to the embedding: one
    parameter. ``vocab_pad_multiple=1`` pads to a multiple of tp only."""
    plan = _meta_plan("gpt2-medium", mc.Mesh.fake(tp=8))
    wte = plan.params["transformer.wte.weight"]
    assert wte.shape == (50257, 1024)
    assert wte.padded_shape == (51200, 1024) and wte.local_shape == (6400, 1024)
    assert wte.local_shape[0] % 128 == 0
    assert [k for k, pp in plan.params.items() if pp.padded_shape] == ["transformer.wte.weight"]
    old = _meta_plan("gpt2-medium", mc.Mesh.fake(tp=8), vocab_pad_multiple=1).params["transformer.wte.weight"]
    assert old.padded_shape == (50264, 1024) and old.local_shape == (6283, 1024)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh", ["tp=1", "dp=8"])
def test_vocabulary_is_not_padded_without_tp(mesh):
    plan = _meta_plan("gpt2-medium", mc.Mesh.fake(**{a: int(n) for a, n in (x.split("=") for x in mesh.split(","))}))
    assert all(pp.padded_shape is None for pp in plan.params.values())
    assert plan.params["transformer.wte.weight"].local_shape == (50257, 1024)


@pytest.mark.timeout(300)
def test_a_vocabulary_that_tp_divides_is_not_padded():
    """Llama 3's 128256 at tp=8 divides (16032 a rank): only a dim that does not divide is padded (the
    planner pads only vocab-parallel dims, and tells them apart from other sharded dims by that)."""
    plan = _meta_plan("llama3-8b", mc.Mesh.fake(tp=8))
    assert all(pp.padded_shape is None for pp in plan.params.values())
    assert plan.params["tok_embeddings.weight"].local_shape == (16032, 4096)


def test_config_defaults_and_validation():
    import inspect

    from mcompile.api import compile_plan
    from mcompile.ir.plan import PlanOptions

    assert mc.Config().vocab_pad_multiple == 128 == PlanOptions().vocab_pad_multiple
    assert inspect.signature(compile_plan).parameters["vocab_pad_multiple"].default == 128
    for bad in (0, -128, 1.5, True):
        with pytest.raises(ValueError, match="vocab_pad_multiple"):
            mc.Config(vocab_pad_multiple=bad)
    assert mc.Config(vocab_pad_multiple=1).vocab_pad_multiple == 1
    from mcompile.sharding.planner import vocab_local_size

    assert (vocab_local_size(50257, 8, 128), vocab_local_size(50257, 8, 1), vocab_local_size(128256, 8, 128)) == (
        6400, 6283, 16032)
    with pytest.raises(ValueError, match="vocab_pad_multiple=0"):  # compile_plan's options are not a Config
        vocab_local_size(257, 2, 0)


def logits(rank, world, name, mesh, options):
    """The model's output without targets (logits), on every rank, and the single-device one."""
    from conftest import build

    model, (tokens, _) = build(name, batch=2)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), (tokens,), **options)
    with torch.no_grad():
        return pm(tokens), model(tokens), {k: tuple(p.to_local().shape) for k, p in pm.named_parameters()}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mesh,world,local_rows", [("tp=2", 2, 256), ("tp=4", 4, 128)])
def test_logits_of_a_padded_vocabulary_have_the_true_width(mesh, world, local_rows):
    """gpt2-tiny (vocabulary 257, head tied to the embedding) at tp=2 (512: 256 a rank) and tp=4
    (512: 128 a rank, so rank 2 holds one real row and rank 3 padding only):
    the gathered logits drop the padding columns and equal the single-device ones (fp32; the same
    sums in another order: 1e-5 relative to the largest logit)."""
    for out, ref, shapes in pool(world).run(logits, "gpt2-tiny", mesh, {}):
        assert shapes["transformer.wte.weight"] == (local_rows, 64)
        assert out.shape == ref.shape == (2, 16, 257)
        assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
