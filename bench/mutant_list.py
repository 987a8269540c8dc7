"""The mutants bench/mutants.py plants, one realistic bug each, with the tests meant to catch it.

A mutant replaces ``old`` (a snippet that must occur exactly once in ``file``: the runner and
tests/test_mutants.py refuse a mutant whose snippet moved or doubled, so none rots silently) by
``new``. ``targets`` are the tests that must fail with the bug planted: pytest node ids
(``tests/test_x.py::test_y[id]``; without ``[id]`` every parametrization) or ``"tests/test_x.py -k
expr"``. Keep them narrow (the runner runs them with ``-x``) and prefer fast single-process tests
that really are the ones meant to catch the bug: a mutant caught only by a test of something else
says little. When you add a capability, add the mutant of its most likely bug here, with the test
that guards it (docs/guide.md, "Mutation testing").

The targets' order matters only for time: with ``-x`` the first failure ends the run, so put the
cheapest catching test first.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Mutant", "MUTANTS"]


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the repository root
    old: str  # must occur exactly once in ``file``
    new: str
    description: str  # the bug it plants, in one line
    targets: tuple[str, ...]  # pytest node ids, or "path -k expr"
    timeout: float = 420.0  # seconds for the targets' run; past it the outcome is "timeout"


# tests used by several mutants
_BWD_TP = "tests/test_planner.py::test_backward_parity_and_counts[llama3-tiny-tp=2-False]"
_BWD_SP = "tests/test_planner.py::test_backward_parity_and_counts[llama3-tiny-tp=2-True]"
_FWD_TP = "tests/test_planner.py::test_forward_parity_in_one_process[llama3-tiny-2-tp]"
_FWD_SP = "tests/test_planner.py::test_forward_parity_in_one_process[llama3-tiny-2-tp+sp]"
_FWD_PADDED = "tests/test_planner.py::test_forward_parity_in_one_process[hf-gpt2-2-tp]"  # vocab 129 -> 256
# the CI tier's cases (the plain tp=2, tp=2 + SP and dp=2 cases run with -m slow; the mutants are run on the CI
# tier alone, so each targets a CI case that catches it: checked by running it)
_RT_TP = "tests/test_runtime.py::test_parity_presets[llama3-tiny-tp=2-sequence_parallel=True-microbatches=2]"
_RT_SP = _RT_TP
_RT_DP = "tests/test_runtime.py::test_parity_presets[llama3-tiny-dp=2-microbatches=2]"
_RT_DP_MB = "tests/test_runtime.py::test_parity_presets[llama3-tiny-dp=2-microbatches=2]"
_BUBBLE = "tests/test_pipeline.py::test_schedules_run_every_action_once_and_meet_their_bubble"
_SCHED_MEM = "tests/test_schedule_memory.py"  # schedule in-flight counts and peak_activation_bytes
_PUBLISHED = "tests/test_cost_published.py::test_published_figure_within_margin"  # constants vs published data
_COLL = "tests/test_collectives.py"  # every collective op, forward and backward, per rank
_ARGS = "tests/test_op_args.py::test_padding_idx_on_either_rank_and_label_smoothing"  # issue 21's cases pinned
_ARGS_DRAWN = "tests/test_op_args.py::test_non_default_arguments_forward_and_backward"

MUTANTS: list[Mutant] = [
    # ---- collectives' forward and backward (mcompile/ir/ops.py) ----------------------------------------
    Mutant(
        name="ops-all-reduce-backward-reduces-again",
        file="mcompile/ir/ops.py",
        old='    "mcompile::all_reduce", lambda ctx, g: (g, None, None), '
            'setup_context=lambda ctx, inputs, output: None',
        new='    "mcompile::all_reduce", lambda ctx, g: (all_reduce(g, ctx.axis, ctx.n), None, None),\n'
            '    setup_context=lambda ctx, inputs, output: '
            'setattr(ctx, "axis", inputs[1]) or setattr(ctx, "n", inputs[2])',
        description="g's backward all-reduces the gradient again instead of passing it through "
                    "(functional collectives' autograd: tp x gradients)",
        targets=(_COLL, _BWD_TP),
    ),
    Mutant(
        name="ops-copy-ar-backward-skips-all-reduce",
        file="mcompile/ir/ops.py",
        old='"mcompile::copy_ar_bwd", lambda ctx, g: (all_reduce(g, ctx.axis, ctx.n), None, None), '
            'setup_context=_f_setup',
        new='"mcompile::copy_ar_bwd", lambda ctx, g: (g, None, None), setup_context=_f_setup',
        description="f's backward is the identity: gradients entering a tp region stay partial",
        targets=(_COLL, _BWD_TP),
    ),
    Mutant(
        name="ops-reduce-scatter-backward-tiles-local-grad",
        file="mcompile/ir/ops.py",
        old='    "mcompile::reduce_scatter",\n'
            '    lambda ctx, g: (all_gather(g, ctx.dim, ctx.axis, ctx.n, "split"), None, None, None),',
        new='    "mcompile::reduce_scatter",\n'
            '    lambda ctx, g: (torch.cat([g] * ctx.n, ctx.dim), None, None, None),',
        description="reduce_scatter's backward repeats this rank's gradient chunk instead of all-gathering "
                    "every rank's (SP exit)",
        targets=(_COLL, _BWD_SP),
    ),
    Mutant(
        name="ops-all-gather-backward-modes-swapped",
        file="mcompile/ir/ops.py",
        old='    if ctx.grad == "reduce_scatter":\n        gi = reduce_scatter(g, ctx.dim, ctx.axis, ctx.n)',
        new='    if ctx.grad == "split":\n        gi = reduce_scatter(g, ctx.dim, ctx.axis, ctx.n)',
        description="all_gather's backward reduce-scatters where it should keep the local chunk and vice versa",
        targets=(_COLL, _BWD_SP),
    ),
    Mutant(
        name="ops-all-gather-split-backward-rank0-chunk",
        file="mcompile/ir/ops.py",
        old='    """The local chunk, used as a backward (of all_gather(split)); its own backward is not needed."""\n'
            '    return _chunk(x, dim, axis, n)',
        new='    """The local chunk, used as a backward (of all_gather(split)); its own backward is not needed."""\n'
            '    return x.narrow(dim, 0, x.shape[dim] // n).clone()',
        description="all_gather(split)'s backward keeps rank 0's chunk of the gradient on every rank "
                    "(the rank offset forgotten)",
        targets=(_COLL, _BWD_SP),
    ),
    # ---- every op argument honoured or refused (issue 21) --------------------------------------------
    Mutant(
        name="lower-embedding-padding-idx-dropped",
        file="passes/lower.py",
        old="    rows = g.call_function(aten.embedding.default, (weight, safe, local_padding))",
        new="    rows = g.call_function(aten.embedding.default, (weight, safe))",
        description="the vocab-parallel embedding drops padding_idx: the padding row gets gradient (issue 21)",
        targets=(_ARGS,),
    ),
    Mutant(
        name="lower-embedding-padding-idx-not-shifted",
        file="passes/lower.py",
        old="    local_padding = padding_idx - start if padding_idx >= 0 and start <= padding_idx < start + v_local "
            "else -1",
        new="    local_padding = padding_idx",
        description="padding_idx passed to every rank's lookup unshifted: the wrong local row loses its gradient",
        targets=(_ARGS,),
    ),
    Mutant(
        name="lower-cross-entropy-label-smoothing-dropped",
        file="passes/lower.py",
        old="    if smoothing:\n        # torch's label smoothing",
        new="    if False:\n        # torch's label smoothing",
        description="the vocab-parallel loss ignores label_smoothing",
        targets=(_ARGS,),
    ),
    Mutant(
        name="loss-weighted-count-unweighted",
        file="passes/loss.py",
        old="        if weight is None:\n            count = call(aten.sum.default, kept)",
        new="        if True:\n            count = call(aten.sum.default, kept)",
        description="the token-weighted loss divides a class-weighted sum by the number of targets, not their weight",
        targets=(_ARGS_DRAWN,),
    ),
    Mutant(
        name="rules-embedding-freq-shards-ids",
        file="mcompile/sharding/rules/matmul.py",
        old="    if embedding_args(info)[1]:",
        new="    if False:",
        description="scale_grad_by_freq offered id-sharded and vocab-parallel lookups (counts per piece)",
        targets=("tests/test_rules.py::test_embedding",),
    ),
    Mutant(
        name="arguments-max-norm-not-refused",
        file="mcompile/sharding/arguments.py",
        old="        if node.target is aten.embedding_renorm_.default and mesh.size() > 1:",
        new="        if False:",
        description="nn.Embedding(max_norm) planned: the in-place renorm hits a gathered copy, silently",
        targets=("tests/test_op_args.py::test_arguments_no_layout_keeps_are_refused_by_name",),
    ),
    Mutant(
        name="runtime-full-grads-alias-replicated",
        file="runtime/state.py",
        old="                out[fqn] = t.clone() if copy and t is pieces.get(fqn) else t",
        new="                out[fqn] = t",
        description="full_grads() returns a replicated parameter's .grad itself: a later clip rescales it",
        targets=("tests/test_op_args.py::test_hugging_face_encoder_trains_exactly[tp=2]",),
    ),
    # ---- plain leaves and flat fp32 gradient buffers (runtime/leaves.py, part of issue 11) ---------
    Mutant(
        name="leaves-bf16-grads-accumulate-in-bf16",
        file="runtime/leaves.py",
        old="            if leaf.grad is not main:  # a bf16 leaf: its microbatch gradient, added in fp32",
        new="            if leaf.grad is not main and self.armed:",
        description="a bf16 leaf keeps its gradient over the microbatches (bf16 sums) and hands it to the "
                    "fp32 buffer only in the last one: 256 + 7 ones stays 256",
        targets=("tests/test_leaves.py::test_microbatch_gradients_accumulate_in_fp32",),
    ),
    Mutant(
        name="leaves-pipeline-arms-every-backward",
        file="runtime/pipeline.py",
        old="            self.leaves.armed = mb == self.last_mb.get(kind)",
        new="            self.leaves.armed = True",
        description="under pp every microbatch's backward counts the buckets: reduced over dp after the "
                    "first one, the later microbatches add onto a reduced buffer",
        targets=("tests/test_leaves.py::test_microbatch_gradients_accumulate_in_fp32",),
    ),
    # ---- meta-device initialisation (runtime/init.py, part of issue 11) ------------------------------
    Mutant(
        name="init-not-seeded-per-tensor",
        file="runtime/init.py",
        old="torch.default_generator.manual_seed(tensor_seed(seed, fqn))",
        new="torch.default_generator.initial_seed()",
        description="a meta model's tensors drawn from whatever state the generator is in: values depend on "
                    "the rank's history and which tensors it holds, not on (seed, name)",
        targets=("tests/test_init.py::test_meta_init_is_bit_identical_on_every_layout",),
    ),
    # ---- lowering (passes/lower.py) ---------------------------------------------------------------------
    Mutant(
        name="lower-embedding-floor-vocab-shard",
        file="passes/lower.py",
        old="    v_local = ax.local_size(int(w_meta.shape[0]), Shard(0))",
        new="    v_local = int(w_meta.shape[0]) // ax.size",
        description="vocab-parallel embedding rows per rank rounded down: with a padded vocabulary (129 at "
                    "tp=2) every rank but 0 looks up ids at the wrong offset",
        targets=(_FWD_PADDED,),
    ),
    Mutant(
        name="lower-vocab-padded-to-tp-only",
        file="passes/lower.py",
        old="        return vocab_local_size(size, self.size, self.vocab_pad_multiple if isinstance(p, Shard) else 1)",
        new="        return vocab_local_size(size, self.size, 1)",
        description="the lowering sizes a padded vocabulary to a multiple of tp, the plan to a multiple of "
                    "tp * 128: local shapes of the program and of the parameters disagree",
        targets=(_FWD_PADDED,),
    ),
    Mutant(
        name="lower-gathered-vocab-padding-kept",
        file="passes/lower.py",
        old="                val = g.call_function(aten.narrow.default, (val, d, 0, size))\n",
        new="",
        description="logits of a padded vocabulary gathered to the user keep the padding columns (512 for 257)",
        targets=("tests/test_alignment.py::test_logits_of_a_padded_vocabulary_have_the_true_width[tp=2-2-256]",),
    ),
    Mutant(
        name="lower-embedding-out-of-range-rows-kept",
        file="passes/lower.py",
        old="    return g.call_function(aten.masked_fill.Scalar, (rows, mask, 0.0))",
        new="    return rows",
        description="vocab-parallel embedding does not zero the rows of ids that live on another rank "
                    "(each rank adds its row 0 for them)",
        targets=(_FWD_TP,),
    ),
    Mutant(
        name="lower-cross-entropy-ignored-targets-counted",
        file="passes/lower.py",
        old="    loss = g.call_function(aten.masked_fill.Scalar, (loss, ignored, 0.0))",
        new="    loss = loss  # targets equal to ignore_index not masked out",
        description="vocab-parallel cross-entropy keeps the loss of targets equal to ignore_index (-100)",
        targets=(_FWD_TP,),
    ),
    Mutant(
        name="lower-cross-entropy-padded-columns-not-masked",
        file="passes/lower.py",
        old='        xf = g.call_function(aten.masked_fill.Scalar, (xf, pad, float("-inf")))',
        new="        xf = xf  # padded vocabulary columns left at their logits",
        description="the padded vocabulary columns' logits (0) are not masked to -inf: they enter the "
                    "max and the sum of exponentials",
        targets=(_FWD_PADDED,),
    ),
    Mutant(
        name="lower-sp-gather-backward-not-reduce-scattered",
        file="passes/lower.py",
        old='            mode = "reduce_scatter" if need_f else "split"',
        new='            mode = "split"',
        description="SP: the all-gather entering a tp region keeps the local gradient chunk in backward "
                    "instead of reduce-scattering the partial gradients (f fused into it lost)",
        targets=(_BWD_SP,),
    ),
    Mutant(
        name="lower-f-only-before-partial-outputs",
        file="passes/lower.py",
        old="                    ax.loss_replicated and isinstance(r, Replicate) and not isinstance(out_p, Replicate)",
        new="                    ax.loss_replicated and isinstance(r, Replicate) and isinstance(out_p, Partial)",
        description="Megatron's f is placed only before ops with a Partial output, not before "
                    "column-parallel ones (sharded output): their input gradients stay partial",
        targets=(_BWD_TP,),
    ),
    # ---- the token-weighted loss and the gradient reductions (passes/loss.py, runtime/module.py) ---------
    Mutant(
        name="loss-count-includes-ignored-targets",
        file="passes/loss.py",
        old="        kept = call(aten.ne.Scalar, target, ignore)",
        new="        kept = call(aten.ge.Scalar, target, ignore)",
        description="the token count of the rewritten mean counts the ignored targets (-100) too",
        targets=(_RT_TP,),
    ),
    Mutant(
        name="runtime-grads-not-divided-by-token-count",
        file="runtime/step.py",
        old="        leaves.finish(1.0 / (stats[1] * self._loss_scale()), self._tp_partial)",
        new="        leaves.finish(torch.ones_like(stats[1]), self._tp_partial)",
        description="gradients are not divided by the global token count: every gradient ~59x too large "
                    "(the loss stays right)",
        targets=(_RT_TP,),
    ),
    Mutant(
        name="demo-grads-not-divided-by-token-count",
        file="runtime/step.py",
        old="        leaves.finish(1.0 / (stats[1] * self._loss_scale()), self._tp_partial)",
        new="        leaves.finish(torch.ones_like(stats[1]), self._tp_partial)",
        description="the same bug seen by the demo (found blind: its test only read a heading): the "
                    "gradient norm's printed difference is bounded now",
        targets=("tests/test_launch.py::test_demo_command",),
    ),
    Mutant(
        name="runtime-grads-divided-by-local-token-count",
        file="runtime/step.py",
        old='        stats = torch.stack([total, count])\n'
            '        if self._data_size > 1:\n'
            '            with self._comm.timed("all_reduce", "dp", stats):\n'
            '                dist.all_reduce(stats, group=self._comm.groups["data"])\n'
            '        # the gradients are sums over the tokens, times the loss scale (fp16): both divided out here, '
            'before any\n'
            '        # clipping\n'
            '        leaves.finish(1.0 / (stats[1] * self._loss_scale()), self._tp_partial)',
        new='        stats = torch.stack([total, count])\n'
            '        local_count = stats[1].clone()\n'
            '        if self._data_size > 1:\n'
            '            with self._comm.timed("all_reduce", "dp", stats):\n'
            '                dist.all_reduce(stats, group=self._comm.groups["data"])\n'
            '        leaves.finish(1.0 / (local_count * self._loss_scale()), self._tp_partial)',
        description="each dp rank divides the summed gradients by its own token count instead of the "
                    "global one (ranks count 27 and 32 targets)",
        targets=(_RT_DP,),
    ),
    Mutant(
        name="runtime-dp-bucket-reduced-after-first-microbatch",
        file="runtime/step.py",
        old="                leaves.armed = i == len(pieces) - 1",
        new="                leaves.armed = True",
        description="the dp gradient buckets are armed on every microbatch: reduced after the first one, "
                    "the later microbatches' gradients are overwritten",
        targets=(_RT_DP_MB,),
    ),
    Mutant(
        name="runtime-sp-norm-grads-not-reduced-over-tp",
        file="runtime/leaves.py",
        old='            with pm._comm.timed("all_reduce", "tp", flat, "step"):\n'
            '                dist.all_reduce(flat, group=pm._comm.groups["tp"])\n',
        new='            with pm._comm.timed("all_reduce", "tp", flat, "step"):\n'
            '                pass\n',
        description="sequence-parallel norm weights' gradients (Partial over tp) are not all-reduced over tp",
        targets=(_RT_SP,),
    ),
    # ---- ZeRO-1 buffers (runtime/zero.py, mcompile/ir/buckets.py) -----------------------------------------
    Mutant(
        name="zero-grads-not-divided-by-token-count",
        file="runtime/zero.py",
        old="            owned.mul_(scale)\n",
        new="",
        description="ZeRO-1: the reduce-scattered gradients are not divided by the global token count",
        targets=("tests/test_zero.py::test_zero1_parity[dp=2,tp=2-]",),
    ),
    Mutant(
        name="zero-sp-norm-grads-not-reduced-over-tp",
        file="runtime/zero.py",
        old='                dist.all_reduce(flat, group=self.groups["tp"])\n',
        new="",
        description="ZeRO-1: the owned segments of SP norm-weight gradients are not all-reduced over tp",
        targets=("tests/test_zero.py::test_zero1_parity[dp=2,tp=2-sequence_parallel=True-bucket_mb=0.01]",),
    ),
    Mutant(
        name="buckets-padding-rounds-down",
        file="mcompile/ir/buckets.py",
        old="        return _round_up(end, self.dp * self.align)",
        new="        return end // (self.dp * self.align) * (self.dp * self.align)",
        description="a bucket's flat buffer is rounded down to a multiple of dp * 64 instead of padded up",
        targets=("tests/test_zero.py::test_zero1_parity_with_padded_buffers",),
    ),
    Mutant(
        name="buckets-offsets-not-aligned",
        file="mcompile/ir/buckets.py",
        old="            acc = _round_up(acc, self.align)\n",
        new="",
        description="parameters are laid end to end: their offsets are not rounded up to 64 elements (128 B)",
        targets=("tests/test_alignment.py::test_offsets_by_hand",),
    ),
    Mutant(
        name="checkpoint-zero-segment-read-from-its-parameter-start",
        file="runtime/checkpoint.py",
        old='pieces(f"model.{seg.fqn}", seg.fqn, master, seg.start - seg.offset, seg.stop - seg.offset,',
        new='pieces(f"model.{seg.fqn}", seg.fqn, master, 0, seg.stop - seg.start,',
        description="a ZeRO-1 rank saves its master segment as if it began at its parameter's first element: "
                    "the ranks' boxes overlap and leave holes",
        targets=("tests/test_checkpoint_reshard.py::test_zero1_async_save_resumes_under_zero0_with_sp",),
    ),
    # ---- pipeline schedules (runtime/schedules.py) and the split (passes/pp/pipeline_split.py) -------------
    Mutant(
        name="schedule-1f1b-one-more-warmup-forward",
        file="runtime/schedules.py",
        old="    warm = min(p - r - 1, m)",
        new="    warm = min(p - r, m)",
        description="1F1B runs p - r warm-up forwards instead of p - r - 1 (one microbatch more in flight)",
        targets=(f"{_SCHED_MEM} -k 1f1b", _BUBBLE),
    ),
    Mutant(
        name="schedule-1f1b-rank0-first-backward-early",
        file="runtime/schedules.py",
        old='        out += [Action("F", r, f), Action("B", r, b)]',
        new='        out += [Action("B", r, b), Action("F", r, f)] if (r == 0 and b == 0) else '
            '[Action("F", r, f), Action("B", r, b)]',
        description="1F1B: rank 0's first backward is swapped with the forward after it (found blind: "
                    "the bubble and every action still check out)",
        targets=(f"{_SCHED_MEM} -k 1f1b", _BUBBLE),
    ),
    Mutant(
        name="schedule-1f1b-rank0-first-backward-late",
        file="runtime/schedules.py",
        old='    out += [Action("B", r, i) for i in range(b, m)]\n    return out',
        new='    out += [Action("B", r, i) for i in range(b, m)]\n'
            '    if r == 0 and m > p:\n'
            '        k = out.index(Action("B", 0, 0))\n'
            '        out[k], out[k + 1] = out[k + 1], out[k]\n'
            '    return out',
        description="1F1B: rank 0's first backward swapped with the forward after it: p + 1 microbatches in "
                    "flight, same makespan (issue 12's blind spot: every pipeline test passed)",
        targets=(f"{_SCHED_MEM} -k 1f1b",),
    ),
    Mutant(
        name="schedule-interleaved-backward-chunk-order",
        file="runtime/schedules.py",
        old="        chunk = v - 1 - (k // p) % v",
        new="        chunk = (k // p) % v",
        description="interleaved 1F1B runs the backwards of a rank's chunks first-to-last instead of last-to-first",
        targets=(_BUBBLE,),
    ),
    Mutant(
        name="schedule-interleaved-warmup-without-factor-2",
        file="runtime/schedules.py",
        old="    warm = min((p - r - 1) * 2 + (v - 1) * p, total) if v > 1 else min(p - r - 1, total)",
        new="    warm = min((p - r - 1) + (v - 1) * p, total) if v > 1 else min(p - r - 1, total)",
        description="interleaved 1F1B warm-up (p - r - 1) + (v - 1)p forwards instead of Megatron's "
                    "2(p - r - 1) + (v - 1)p",
        targets=(_BUBBLE, f"{_SCHED_MEM} -k interleaved"),
    ),
    Mutant(
        name="schedule-zbh1-w-never-deferred",
        file="runtime/schedules.py",
        old='            if a.kind == "B" and a.mb >= r:\n'
            '                acts.append(Action("W", r, a.mb - r))\n'
            '        acts += [Action("W", r, i) for i in range(max(0, m - r), m)]',
        new='            if a.kind == "B":\n'
            '                acts.append(Action("W", r, a.mb))',
        description="ZB-H1 runs each W right after its own B on every rank instead of r backwards later "
                    "on rank r (no deferral: 1F1B's bubble)",
        targets=(_BUBBLE, f"{_SCHED_MEM} -k zbh1"),
    ),
    Mutant(
        name="schedule-peak-activations-freed-at-b",
        file="runtime/schedules.py",
        old='        elif a.kind == "W" or (a.kind == "B" and (not split or a.stage == 0)):',
        new='        elif a.kind == "B":',
        description="peak_activation_bytes frees a microbatch's activations at B even when its W still "
                    "holds them (zero-bubble split)",
        targets=(f"{_SCHED_MEM} -k peak_bytes",),
    ),
    Mutant(
        name="pipeline-split-sends-values-used-only-here",
        file="passes/pp/pipeline_split.py",
        old="                                   and last_use.get(n.name, -1) > t]",
        new="                                   and last_use.get(n.name, -1) >= t]",
        description="a stage also sends the activations whose last use is its own (off by one at the cut)",
        targets=("tests/test_pipeline.py::test_pipeline_parity[llama3-tiny-pp=2-microbatches=2]",),
    ),
    # ---- memory model (mcompile/ir/memory_model.py) -----------------------------------------------------------
    Mutant(
        name="memory-fp32-master-counted-for-fp32-params",
        file="mcompile/ir/memory_model.py",
        old="    opt = 8 + (4 if p != 4 else 0)",
        new="    opt = 8 + 4",
        description="bytes per parameter count an fp32 master copy even when the parameters are fp32 (20 B, not 16)",
        targets=("tests/test_cost.py::test_model_state_bytes_megatron_table",),
    ),
    Mutant(
        name="memory-inflight-1f1b-ignores-stage",
        file="mcompile/ir/memory_model.py",
        old="        return _min(p - i, m)",
        new="        return _min(p, m)",
        description="1F1B: every stage is taken to hold p microbatches (p - i on stage i)",
        targets=("tests/test_cost.py::test_inflight_microbatches", f"{_SCHED_MEM} -k memory_model"),
    ),
    Mutant(
        name="memory-inflight-interleaved-off-by-one",
        file="mcompile/ir/memory_model.py",
        old="        return _min(sympy.Rational(2 * (p - i - 1) + (v - 1) * p + 1, v), m)",
        new="        return _min(sympy.Rational(2 * (p - i - 1) + (v - 1) * p, v), m)",
        description="interleaved 1F1B: in-flight chunks = the warm-up count, without the one in steady state",
        targets=("tests/test_cost.py::test_inflight_microbatches", f"{_SCHED_MEM} -k memory_model"),
    ),
    # ---- cost model (mcompile/cost/model.py) ----------------------------------------------------------------------
    Mutant(
        name="cost-intra-node-efficiency-30pct-low",
        file="mcompile/cost/model.py",
        old="    intra_node: float = 0.75",
        new="    intra_node: float = 0.525",
        description="NVLink collective efficiency 30% low (0.525 instead of 0.75)",
        targets=(_PUBLISHED,),
    ),
    Mutant(
        name="cost-inter-node-efficiency-30pct-low",
        file="mcompile/cost/model.py",
        old="    inter_node: float = 0.85",
        new="    inter_node: float = 0.595",
        description="InfiniBand collective efficiency 30% low (0.595 instead of 0.85)",
        targets=(_PUBLISHED,),
    ),
    Mutant(
        name="cost-attention-efficiency-30pct-low",
        file="mcompile/cost/model.py",
        old="    attention: float = 0.50",
        new="    attention: float = 0.35",
        description="attention kernel efficiency 30% low (0.35 instead of 0.50)",
        targets=(_PUBLISHED,),
    ),
    Mutant(
        name="cost-all-reduce-without-factor-2",
        file="mcompile/cost/model.py",
        old="_ratio(2 * (n - 1), n, nbytes) * nbytes / bandwidth",
        new="_ratio(n - 1, n, nbytes) * nbytes / bandwidth",
        description="ring all-reduce moves (n-1)/n of the bytes instead of 2(n-1)/n",
        targets=("tests/test_cost.py::test_collective_formulas_and_links", _PUBLISHED),
    ),
    # ---- FP8 scaling (kernels/fp8.py) ------------------------------------------------------------------------
    Mutant(
        name="fp8-margin-multiplies-scale",
        file="kernels/fp8.py",
        old="    s = fp8_max(dtype) / amax_value.float() / 2.0 ** margin",
        new="    s = fp8_max(dtype) / amax_value.float() * 2.0 ** margin",
        description="the FP8 scale's margin multiplies by 2^margin instead of dividing (less headroom, not more)",
        targets=("tests/test_fp8.py::test_scale_edge_cases",),
    ),
    Mutant(
        name="fp8-scale-uses-e4m3-max-for-every-format",
        file="kernels/fp8.py",
        old="    s = fp8_max(dtype) / amax_value.float() / 2.0 ** margin",
        new="    s = fp8_max(torch.float8_e4m3fn) / amax_value.float() / 2.0 ** margin",
        description="the scale formula uses E4M3's largest value (448) for E5M2 gradients too (57344): "
                    "gradients use a fraction of their range",
        targets=("tests/test_fp8.py::test_cast_round_trip_within_half_an_ulp",
                 "tests/test_fp8.py::test_fp8_linear_forward_and_backward_against_float64"),
    ),
    Mutant(
        name="fp8-delayed-scale-from-newest-amax",
        file="kernels/fp8.py",
        old="    past = row.amax()  # the largest amax of the previous steps",
        new="    past = row[0]  # the largest amax of the previous steps",
        description="delayed scaling takes the newest amax of the history instead of the largest",
        targets=("tests/test_fp8.py::test_delayed_scaling_history",),
    ),
    Mutant(
        name="fp8-amax-history-shifts-wrong-way",
        file="kernels/fp8.py",
        old="    history.copy_(torch.cat([amaxes.to(history.dtype).view(3, 1), history[:, :-1]], 1))",
        new="    history.copy_(torch.cat([amaxes.to(history.dtype).view(3, 1), history[:, 1:]], 1))",
        description="the amax history push drops the newest past column instead of the oldest",
        targets=("tests/test_fp8.py::test_delayed_scaling_history",),
    ),
    # ---- checkpoints (runtime/checkpoint.py) -------------------------------------------------------------
    Mutant(
        name="checkpoint-padding-saved-as-data",
        file="runtime/checkpoint.py",
        old="    local = torch.nonzero(g >= 0).reshape(-1)",
        new="    local = torch.nonzero(g >= -1).reshape(-1)",
        description="the rows a padded vocabulary adds are saved as rows of the global tensor (at index -1)",
        targets=("tests/test_weights.py::test_mcompile_checkpoint_loads_under_another_plan",),
    ),
    Mutant(
        name="checkpoint-fp8-histories-under-a-shared-key",
        file="runtime/checkpoint.py",
        old='    return f"fp8.rank{dist.get_rank()}.{name}"',
        new='    return f"fp8.{name}"',
        description="FP8 amax histories saved under a key shared by all ranks: DCP keeps one rank's, the "
                    "tp ranks of a stage resume with the same histories",
        targets=("tests/test_fp8.py::test_fp8_delayed_checkpoint_resumes_bit_identically",),
    ),
    # ---- joint forward + backward programs (passes/joint.py, runtime/joint_runner.py; issue 13) -----------------
    Mutant(
        name="joint-microbatch-grads-overwrite",
        file="passes/joint.py",
        old="            add = gm.graph.call_function(torch.ops.aten.add_.Tensor, (buf, g))",
        new="            add = gm.graph.call_function(torch.ops.aten.copy_.default, (buf, g))",
        description="a joint backward's weight gradients overwrite the fp32 buffer instead of adding: only "
                    "the last microbatch's gradient survives",
        targets=(_RT_DP_MB,),
    ),
    Mutant(
        name="joint-stage-ignores-received-gradients",
        file="runtime/joint_runner.py",
        old="        return [g if g is not None else torch.zeros_like(outputs[i]) for g, i in zip(grads, diff)]",
        new="        return [torch.ones_like(outputs[i]) for g, i in zip(grads, diff)]",
        description="a pipeline stage's backward starts from ones instead of the gradients the next stage sent",
        targets=("tests/test_pipeline.py::test_pipeline_parity[llama3-tiny-pp=2-microbatches=2]",),
    ),
    Mutant(
        name="joint-zbh1-history-push-dropped",
        file="passes/joint.py",
        old="    b_nodes = _ancestors(roots + effects, set(phs))",
        new="    b_nodes = _ancestors(roots, set(phs))",
        description="zero-bubble's split leaves in-place ops (the FP8 amax history push) out of B and W: "
                    "delayed scaling never advances under ZB-H1",
        targets=("tests/test_fp8.py::test_fp8_under_pipeline_parallelism",),
    ),
    Mutant(
        name="joint-recompute-all-at-start-of-backward",
        file="passes/joint.py",
        old="    backward = _copy_nodes(_lazy_order(order, need_b - stop, tangent_dep), b_inputs, grads, gm)",
        new="    backward = _copy_nodes([n for n in order if n in need_b], b_inputs, grads, gm)",
        description="recomputed forward nodes all run at the start of backward (not before their first "
                    "user): every recomputed activation is live at once",
        targets=("tests/test_joint.py::test_recomputed_forward_runs_just_before_its_backward",),
    ),
    Mutant(
        name="train-resume-optimizer-state-dropped",
        file="mcompile/apps/train/loop.py",
        old="        extra = pm.load_checkpoint(resumed, opt)",
        new="        extra = pm.load_checkpoint(resumed)",
        description="mcompile train resumes the model but not the optimizer state: AdamW restarts its moments",
        targets=("tests/test_train.py::test_resume_without_fault_equals_uninterrupted",),
    ),
    Mutant(
        name="ep-batch-statistic-not-reduced",
        file="passes/lower.py",
        old='                if isinstance(c, Partial) and isinstance(w, Replicate) '
            'and c.reduce_op in ("sum", "avg") \\\n'
            '                        and ax.size > 1:',
        new='                if False:',
        description="a Partial batch statistic on dp/ep (the load-balancing loss's tokens per expert and mean "
                    "router probability) is used as if whole: each rank's aux loss from its own tokens",
        targets=("tests/test_moe_parallel.py::test_expert_parallel_parity[mixtral-ep=2]",),
    ),
    Mutant(
        name="ep-expert-grads-summed-over-ep-too",
        file="runtime/module.py",
        old="        return tuple(a for a in self._data_axes if a in partial)",
        new="        return self._data_axes",
        description="expert weights' gradients are summed over ep as well as dp: each rank adds other "
                    "ranks' experts' gradients into its own",
        targets=("tests/test_moe_parallel.py::test_expert_parallel_parity[mixtral-ep=2]",),
    ),
    Mutant(
        name="joint-pre-mutation-reader-recomputed",
        file="passes/remat.py",
        old="                    anc.update(u for u in m.users if u in order and order[u] < order[n])",
        new="                    pass",
        description="autograd's clone of a value before an in-place write is recomputed in backward, from the "
                    "overwritten value",
        targets=("tests/test_joint.py -k overwritten",),
    ),
    Mutant(
        name="zero-ep-experts-sharded-over-data",
        file="mcompile/ir/buckets.py",
        old="            if axes in group_of_axes and (axes or \"ep\" in data):\n"
            "                g = group_of_axes[axes]\n",
        new="            if axes in group_of_axes and (axes or \"ep\" in data):\n"
            "                g = group_of_axes[frozenset(data)]\n",
        description="ZeRO under ep reduce-scatters the experts' gradients over the dp x ep data ranks like the "
                    "dense ones: other ep ranks' experts' gradients are summed into each shard",
        targets=("tests/test_moe_parallel.py::test_zero_with_expert_parallel_parity",),
    ),
    Mutant(
        name="blocks-no-side-values",
        file="mcompile/sharding/blocks.py",
        old="    return _symbolic(main) or v.numel() == 1",
        new="    return False",
        description="nothing may cross a stage cut beside the residual stream: Mixtral's per-layer aux losses "
                    "leave no cut point, pp x ep cannot be partitioned",
        targets=("tests/test_moe_parallel.py::test_pipeline_with_expert_parallel_parity",),
    ),
]
