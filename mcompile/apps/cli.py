"""The ``mcompile`` command line: plan, show, search, explain, timeline, demo; preprocess, train, eval, generate.

    mcompile plan MODEL --mesh dp=8,tp=8 [--seq S] [--batch B] [--sp] [--json]
    mcompile plan MODEL --mesh dp=2,pp=4,tp=2 --microbatches 8 --schedule interleaved --virtual 2
    mcompile timeline TRACE.json [-o out.png]
    mcompile show MODEL --mesh tp=2 --rank 1 [--fuse] [--fp8 current|delayed] [--after PASS]
    mcompile search MODEL --gpus 1024 --gpu h100 --global-batch 1536 [--seq S] [--top K] [--json]
    mcompile explain MODEL --gpus 1024 --gpu h100 --global-batch 1536   (why the best beats the runner-up; what
                                                                          its overlap / ZeRO / FP8 choices save)
    mcompile demo [--steps N]
    mcompile preprocess INPUT... --tokenizer T --output PREFIX       (mcompile.apps.data: an indexed token dataset)
    mcompile train CONFIG.toml [--set KEY=VALUE ...]                 (mcompile.apps.train: docs/training.md)
    mcompile eval CONFIG.toml [--lambada FILE] / mcompile generate CONFIG.toml --prompt TEXT

MODEL is a preset name (``mcompile plan --list``) or ``package.module:factory``, a callable that
returns a model, or ``(model, example_inputs)``. A model without example inputs is taken to be a
language model called as ``model(tokens, targets)`` with int64 tensors of shape [batch, seq].
Models are built on the meta device for ``plan`` (no memory at any size).

Start-up: this module imports nothing heavy at the top (no torch, no compiler), so ``--help`` and
argument errors answer at once; each subcommand imports what it needs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys


class CLIError(Exception):
    pass


def load_model(spec: str, device: str, batch: int, seq: int, dtype=None, max_seq: int | None = None):
    """The model, example inputs and name of ``spec``. ``max_seq``: a preset's context raised (or lowered) to
    this many positions — a RoPE model such as Llama extended to a long context (its shapes are otherwise
    the same); a model with learned positions (GPT-2) gets a position table of that length."""
    import torch

    from mcompile.models import PRESETS, get_preset
    from mcompile.models.presets import did_you_mean

    if ":" not in spec:
        if spec not in PRESETS:
            raise CLIError(
                f"unknown model {spec!r}{did_you_mean(spec, PRESETS)}: not a preset and not a module:factory "
                f"path. Presets: {', '.join(sorted(PRESETS))}"
            )
        pre = get_preset(spec)
        if max_seq is not None:
            pre = _with_max_seq(pre, max_seq)
        try:
            pre.example_inputs(batch=batch, seq=seq, device="meta")  # validates seq against the model
        except ValueError as e:
            raise CLIError(str(e)) from e
        model = pre.build(device=device, dtype=dtype)
        # the capture template is small: batch and sequence are symbols, sizes come from --batch/--seq; a model
        # whose sequence comes in units (RETRO's chunks) declares them as its config's seq_multiple
        unit = int(getattr(pre.config, "seq_multiple", 1))
        return model, pre.example_inputs(batch=2, seq=-(-16 // unit) * unit, device=device), spec
    mod_name, _, attr = spec.partition(":")
    # the console script's sys.path[0] is its own bin/ folder: `mcompile plan mypkg.models:make` run from the
    # folder holding mypkg/ should find it, as `python -m` would
    if os.getcwd() not in sys.path and "" not in sys.path:
        # appended, not first: installed packages keep their names (a checkout's folders, such as mcompile's own
        # kernels/, would otherwise shadow the Hub's `kernels` that transformers imports)
        sys.path.append(os.getcwd())
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise CLIError(f"cannot load {spec!r}: {e}") from e
    with torch.device(device):
        made = factory()
    if isinstance(made, tuple):
        model, inputs = made
    else:
        model = made
        emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
        vocab = emb.num_embeddings if emb is not None else 2
        tokens = torch.randint(0, vocab, (batch, seq)) if device != "meta" else torch.empty(
            batch, seq, dtype=torch.long, device="meta")
        inputs = (tokens, tokens.clone())
    return model, tuple(inputs), spec


def _with_max_seq(pre, max_seq: int):
    import dataclasses

    if max_seq < 1:
        raise CLIError(f"--max-seq {max_seq}: use a positive number of positions")
    field = "block_size" if hasattr(pre.config, "block_size") else "max_seq_len"
    return dataclasses.replace(pre, config=dataclasses.replace(pre.config, **{field: max_seq}))


def _compile(args, device: str):
    import torch

    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh

    try:
        mesh = Mesh.parse(args.mesh, fake=device == "meta")
    except ValueError as e:
        raise CLIError(str(e)) from e
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.seq is None:
        args.seq = _default_seq(args.model)
    max_seq = getattr(args, "max_seq", None)
    if max_seq is not None and ":" in args.model:
        raise CLIError("--max-seq applies to presets; a module:factory model sets its own context length")
    model, inputs, name = load_model(args.model, device, max(args.batch, 2), max(args.seq, 2), dtype, max_seq)
    overrides = {}
    for o in args.override or []:
        key, _, spec = o.partition("=")
        overrides[key] = spec
    layers = [int(x) for x in args.layers_per_stage.split(",")] if args.layers_per_stage else None
    # under cp the loss is planned as parallelize runs it: a mean cross-entropy rewritten into (sum, count)
    # (passes/loss.py), each rank's tokens summed where they are; a mean would gather the logits over cp
    c = compile_plan(model, mesh, inputs, sequence_parallel=args.sp, overrides=overrides or None,
                     token_weighted_loss=mesh.size("cp") > 1,
                     seq=args.seq, batch=args.batch, schedule=args.schedule, virtual_stages=args.virtual,
                     microbatches=args.microbatches, pipeline_granularity=args.granularity,
                     layers_per_stage=layers, pipeline_seq=args.seq, cp_attention=args.cp_attention)
    c.plan.model = name
    c.cli_inputs = inputs
    return c


def _default_seq(spec: str) -> int:
    from mcompile.models import PRESETS

    return min(2048, PRESETS[spec].max_seq_len) if spec in PRESETS else 2048


def cmd_plan(args) -> int:
    from mcompile.apps.report import memory_per_rank, moe_summary, moe_text
    from mcompile.ir.plan import collective_bytes, cp_summary, plan_text

    if args.list:
        from mcompile.models import PRESETS

        print("\n".join(sorted(PRESETS)))
        return 0
    if not args.model:
        raise CLIError("plan needs a MODEL (a preset name, see --list, or module:factory)")
    c = _compile(args, "cpu" if args.measure else "meta")
    sizes = {"batch": args.batch, "seq": args.seq}
    measured = None
    if args.measure:
        from mcompile.apps.report import measure_per_rank

        if c.mesh.size() > 8:
            raise CLIError(f"--measure runs every rank in this process: use a mesh of at most 8 ranks, not "
                           f"{c.mesh.size()}")
        from mcompile.models import PRESETS

        if args.model not in PRESETS:
            raise CLIError("--measure works with presets (it makes their inputs at --batch and --seq)")
        inputs = PRESETS[args.model].example_inputs(batch=args.batch * c.mesh.size("dp"), seq=args.seq)
        measured = measure_per_rank(c, inputs)
    if args.json:
        d = c.plan.to_dict()
        mem = memory_per_rank(c.plan, args.dtype)
        d["memory_per_rank"] = {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer,
                                "total": mem.total}
        d["sizes"] = sizes
        for coll in d["collectives"]:
            coll["bytes_at_sizes"] = collective_bytes(coll["bytes"], sizes)
        if measured is not None:
            d["measured_per_rank"] = measured
        d["quality"] = [{"layers": list(f.layers), "kind": f.kind, "text": f.text} for f in c.quality]
        moe = moe_summary(c, sizes, args.dtype)
        if moe is not None:
            d["moe"] = moe
        cp = cp_summary(c.plan, sizes)
        if cp is not None:
            d["context_parallel"] = cp
        fp8 = _fp8_report(args, c)
        if fp8 is not None:
            d["fp8"] = fp8.to_dict()
        print(json.dumps(d, indent=1))
    else:
        print(plan_text(c.plan, sizes, args.dtype))
        if c.quality:  # mcompile.sharding.quality: where the plan is not Megatron's tensor-parallel layout
            print("Not Megatron's layout (PlanQualityWarning):\n" + "\n".join(f"  {f}" for f in c.quality))
        moe = moe_text(c, sizes, args.dtype)
        if moe:
            print(moe)
        if c.plan.pipeline:
            from mcompile.apps.report import pipeline_text

            print(pipeline_text(c.plan, args.batch, args.dtype))
        if measured is not None:
            mem = memory_per_rank(c.plan, args.dtype)
            print("measured (one step, every rank, live tensor bytes): predicted / measured")
            for r, m in enumerate(measured):
                print(f"  rank {r}: parameters {mem.params} / {m['parameters']}, gradients {mem.grads} / "
                      f"{m['gradients']}, optimizer {mem.optimizer} / {m['optimizer']}, "
                      f"peak activations - / {m['peak_activations']}")
        fp8 = _fp8_report(args, c)
        if fp8 is not None:
            print(fp8.text())
    if args.gpu:
        print(_fit_text(c, args), file=sys.stderr if args.json else sys.stdout)
    return 0


def _fit_text(c, args) -> str:
    """``--gpu``: the cost model (mcompile.cost.workload.estimate) on this plan — predicted step time and the
    largest rank's peak memory against the device's, and whether it fits."""
    from mcompile.cost.hardware import get_hardware
    from mcompile.cost.workload import estimate

    try:
        hw = get_hardware(args.gpu)
    except (KeyError, ValueError) as e:
        raise CLIError(str(e)) from e
    if args.batch % args.microbatches:
        raise CLIError(f"--batch {args.batch} does not divide into --microbatches {args.microbatches}")
    # the parameters in the dtype the memory table counts (--dtype, else the model's), so the peak's model
    # state is the table's total (AdamW's per-tensor step counts aside) and the rest is named
    dtype = args.dtype or next(iter(c.plan.params.values())).dtype
    est = estimate(c, hardware=hw, global_batch=args.batch * c.mesh.size("dp") * c.mesh.size("ep"), seq=args.seq,
                   microbatch_size=args.batch // args.microbatches, param_dtype=dtype)
    gib = 2**30
    mem = est.memory_breakdown
    state = sum(mem.get(k, 0) for k in ("params", "grads", "optimizer"))
    rest = ", ".join(f"{k.replace('_', ' ')} {v / gib:.2f}" for k, v in mem.items()
                     if k not in ("params", "grads", "optimizer") and isinstance(v, int | float) and v)
    verdict = "fits" if est.fits else (
        f"does NOT fit: {est.memory_bytes / gib:.1f} GiB needed, {hw.hbm_bytes / gib:.1f} GiB on the device; try "
        "more tp/pp, ZeRO-1, recompute, or `mcompile search`")
    return (f"predicted on {hw.name}: step {est.step_time_s:.3f} s, {est.tflops_per_gpu:.0f} TFLOP/s per GPU; "
            f"peak memory of the largest rank {est.memory_bytes / gib:.2f} GiB of {hw.hbm_bytes / gib:.1f} GiB = "
            f"model state {state / gib:.2f} GiB ({dtype} parameters, fp32 gradients, AdamW: the memory table) + "
            f"{rest or 'nothing else'} GiB at batch {args.batch} x seq {args.seq} per rank — {verdict}")


def _fp8_report(args, c, rank: int = 0):
    """``--fp8``: run the FP8 pass (Config(fp8=...)) on a rank's program, in place; its report."""
    if not args.fp8:
        return None
    from mcompile.passes.fp8_linears import convert_fp8

    return convert_fp8(c.program(rank), c.plan, dict(c.captured.params), recipe=args.fp8,
                       user_inputs=set(c.captured.user_inputs))


def cmd_show(args) -> int:
    c = _compile(args, "meta")
    if not 0 <= args.rank < c.mesh.size():
        raise CLIError(f"--rank {args.rank} is outside the mesh of {c.mesh.size()} ranks")
    if args.after is not None:
        return _show_after(args, c)
    gm = c.program(args.rank)
    print(f"# per-rank program of rank {args.rank} {c.mesh.coords(args.rank)} on {c.mesh!r}")
    fp8 = _fp8_report(args, c, args.rank)  # FP8 linears: mcompile::fp8_linear* calls in the program below
    if fp8 is not None:
        print("\n".join(f"# {line}" for line in fp8.text().splitlines()))
    if not args.fuse:
        print(gm.code)
        return 0
    from mcompile.apps.report import fused_summary, mark_fused
    from mcompile.passes.fuse import FUSED, fuse

    counts = fuse(gm, {n.name: n for n in c.captured.gm.graph.nodes}, set(c.captured.params))
    print(mark_fused(gm, FUSED))
    print(f"# {fused_summary(counts)}")
    return 0


def _show_after(args, c) -> int:
    """``show --after PASS``: the rank's programs after that pass of mcompile.compiler.PASSES,
    forward and backward once the joint passes have run."""
    from mcompile import compiler
    from mcompile.ir.config import Config

    try:
        cfg = Config(sequence_parallel=args.sp, fuse=args.fuse, fp8=args.fp8, microbatches=args.microbatches,
                     schedule=args.schedule, virtual_stages=args.virtual, recompute=args.recompute,
                     activation_budget=args.activation_budget, codegen=args.codegen, zero=args.zero,
                     overlap=not args.no_overlap)
    except ValueError as e:
        raise CLIError(str(e)) from e
    from mcompile.models import PRESETS, get_preset

    per_step = max(args.batch, 1) * c.mesh.size("dp") * args.microbatches
    if args.model in PRESETS:
        inputs = get_preset(args.model).example_inputs(batch=per_step, seq=args.seq, device="meta")
    else:
        inputs = c.cli_inputs
    try:
        print(compiler.show(c, args.rank, cfg, inputs, after=args.after))
    except compiler.UnknownPassError as e:
        raise CLIError(str(e)) from e
    return 0


def cmd_timeline(args) -> int:
    from pathlib import Path

    from mcompile.ir import timeline

    path = Path(args.trace)
    if not path.is_file():
        raise CLIError(f"no trace at {path}: write one with pm.start_timeline() ... pm.save_timeline(path)")
    trace = timeline.load_trace(path)
    out = timeline.draw(trace, args.out or path.with_suffix(".png"))
    b = timeline.bubble(trace)
    print(f"wrote {out}; measured bubble per rank: " + ", ".join(f"{r}: {v:.1%}" for r, v in b.items()))
    return 0


def cmd_demo(args) -> int:
    from mcompile.apps.demo import run

    result = run(steps=args.steps)
    # the gradient norm too: a gradient wrong by a constant factor leaves the loss nearly unchanged
    return 0 if result["max_abs_diff"] < 1e-3 and result["max_norm_rel_diff"] < 1e-3 else 1


# --------------------------------------------------------------------------- search / explain


def _search(args):
    from mcompile.cost.hardware import get_hardware
    from mcompile.models import PRESETS
    from mcompile.search import search

    if not args.model:
        raise CLIError(f"{args.command} needs a MODEL (a preset name, see `mcompile plan --list`, or module:factory)")
    try:
        hw = get_hardware(args.gpu)
    except ValueError as e:
        raise CLIError(str(e)) from e
    seq = args.seq or _default_seq(args.model)
    if args.model in PRESETS:
        model, inputs = args.model, ()
        try:
            PRESETS[args.model].example_inputs(batch=2, seq=seq, device="meta")  # validates seq
        except ValueError as e:
            raise CLIError(str(e)) from e
    else:
        model, inputs, _ = load_model(args.model, "meta", 2, min(seq, 16))
    kw = {}
    if args.schedules:
        kw["schedules"] = tuple(x.strip() for x in args.schedules.split(","))
    if args.recompute:
        kw["recompute"] = tuple(x.strip() for x in args.recompute.split(","))
    try:
        if args.zero:
            kw["zero"] = tuple(int(x) for x in args.zero.split(","))
        if args.overlap:
            kw["overlap"] = tuple({"on": True, "off": False}[x.strip()] for x in args.overlap.split(","))
    except (ValueError, KeyError) as e:
        raise CLIError(f"--zero takes stages 0-3 and --overlap on/off, comma-separated ({e})") from None
    precision = tuple(x.strip() for x in args.precision.split(","))
    bad = [x for x in precision if x not in ("bf16", "fp8", "fp32")]
    if bad:
        raise CLIError(f"--precision {','.join(bad)}: use bf16, fp8 or fp32, comma-separated")
    return search(model, args.gpus, hardware=hw, global_batch=args.global_batch, example_inputs=inputs, seq=seq,
                  top_k=args.top, precision=precision,
                  memory_limit=args.memory_limit * 2**30 if args.memory_limit else None, **kw)


def cmd_search(args) -> int:
    res = _search(args)
    if args.json:
        print(json.dumps(res.to_dict(), indent=1, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)
    title, how = res.summary()
    table = Table(title=title, title_justify="left")
    left = {"schedule", "recompute", "layers/stage", "largest terms"}
    for col in res.HEADER:
        table.add_column(col, justify="left" if col in left else "right")
    for row in res.rows():
        table.add_row(*row)
    console.print(table)
    console.print(how, highlight=False)
    best = res[0]
    mesh = ", ".join(f"{a}={n}" for a, n in best.mesh(fake=True).axes)
    opts = ", ".join(f"{k}={v!r}" for k, v in best.options().items())
    console.print(f"run it: mc.parallelize(model, mc.Mesh({mesh}), inputs, {opts})", highlight=False)
    return 0


def cmd_explain(args) -> int:
    args.top = max(args.top, 2)
    res = _search(args)
    if args.json:
        from mcompile.search import _candidate_dict

        a, b = res[0], res[1] if len(res) > 1 else None
        d = {"best": _candidate_dict(a), "runner_up": _candidate_dict(b) if b else None, "choices": res.choices(0)}
        if b is not None:
            d["terms"] = {k: {"best": a.estimate.breakdown[k], "runner_up": b.estimate.breakdown[k],
                              "difference": b.estimate.breakdown[k] - a.estimate.breakdown[k]}
                          for k in a.estimate.breakdown}
        print(json.dumps(d, indent=1, default=str))
        return 0
    print(res.explain())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mcompile", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("model", nargs="?", help="preset name or package.module:factory")
        sp.add_argument("--mesh", default="tp=1", help="mesh axes, e.g. dp=8,tp=8")
        sp.add_argument("--seq", type=int, default=None,
                        help="sequence length for sizes (default: 2048, or the model's maximum if smaller)")
        sp.add_argument("--batch", type=int, default=1, help="batch per data-parallel rank (default 1)")
        sp.add_argument("--sp", action="store_true", help="Megatron sequence parallelism")
        sp.add_argument("--max-seq", type=int, default=None, metavar="N",
                        help="a preset's context length raised to N positions (e.g. Llama-3-8B at 131072 for a "
                             "long-context plan with cp=...)")
        sp.add_argument("--cp-attention", choices=["auto", "ring", "allgather", "a2a"], default="auto",
                        help="attention across the cp axis (Config(cp_attention=); auto: the cost model's pick)")
        sp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="parameter dtype for memory figures (default: the model's)")
        sp.add_argument("--override", action="append", metavar="FQN=AXIS=PLACEMENT",
                        help="pin a placement, e.g. 'output.weight=tp=S(0)' (repeatable)")
        sp.add_argument("--fp8", choices=["current", "delayed"], default=None,
                        help="FP8 linears (Config(fp8=...)): list which run in FP8 and which stay in higher precision")

        sp.add_argument("--microbatches", type=int, default=1, help="pipeline microbatches per step")
        sp.add_argument("--schedule", default="1f1b", help="pipeline schedule: gpipe, 1f1b, interleaved, zbh1")
        sp.add_argument("--virtual", type=int, default=1, help="pipeline stages per rank (interleaved)")
        sp.add_argument("--granularity", choices=["auto", "layer", "sublayer"], default="auto",
                        help="pipeline cuts at layer boundaries only, also inside layers, or inside only where "
                             "that balances better (auto)")
        sp.add_argument("--layers-per-stage", default=None, metavar="N,N,...", help="pin the pipeline split")

    pp = sub.add_parser("plan", help="print the plan: placements, collectives, memory per rank")
    common(pp)
    pp.add_argument("--json", action="store_true")
    pp.add_argument("--gpu", default=None, metavar="NAME",
                    help="a hardware profile (h100, a100, ...): the cost model's step time and peak memory per rank, "
                         "and whether the layout fits")
    pp.add_argument("--list", action="store_true", help="list the presets")
    pp.add_argument("--measure", action="store_true",
                    help="small models: also run one step of every rank (threads) and measure its memory")
    pp.set_defaults(func=cmd_plan)
    ps = sub.add_parser("show", help="print the per-rank program as Python")
    common(ps)
    ps.add_argument("--rank", type=int, default=0)
    ps.add_argument("--fuse", action="store_true",
                    help="apply the fusion pass (Config(fuse=True)); fused nodes are marked, counts summed up")
    ps.add_argument("--after", default=None, metavar="PASS",
                    help="print the programs after this pass of the compiler pipeline (lower, fuse, fp8, fsdp, "
                         "pipeline_split, joint, partition, split_weight, codegen): forward and backward once "
                         "the joint passes ran")
    ps.add_argument("--recompute", default="none", choices=["none", "full", "selective", "auto"],
                    help="recompute policy for the partition pass (--after partition)")
    ps.add_argument("--activation-budget", type=int, default=None, metavar="BYTES",
                    help="recompute=auto: bytes of saved activations one rank keeps at its peak (under pp "
                         "shared by the microbatches a stage holds in flight)")
    ps.add_argument("--codegen", default="eager", choices=["eager", "inductor"])
    ps.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                    help="ZeRO stage (3: parameters sharded over dp and gathered before use: the fsdp pass)")
    ps.add_argument("--no-overlap", action="store_true",
                    help="Config(overlap=False): collectives synchronous where the program first needs them")
    ps.set_defaults(func=cmd_show)
    pt = sub.add_parser("timeline", help="draw a pipeline timeline (Chrome trace from pm.save_timeline) as a PNG")
    pt.add_argument("trace", help="trace JSON written by ParallelModule.save_timeline")
    pt.add_argument("-o", "--out", default=None, help="PNG path (default: the trace's name with .png)")
    pt.set_defaults(func=cmd_timeline)
    for name, fn, text in (("search", cmd_search, "rank the layouts of MODEL on N GPUs by predicted step time"),
                           ("explain", cmd_explain, "why the searched best layout beats the runner-up, and "
                                                    "what its overlap, ZeRO and FP8 choices save")):
        px = sub.add_parser(name, help=text)
        px.add_argument("model", nargs="?", help="preset name or package.module:factory")
        px.add_argument("--gpus", type=int, required=True, help="number of GPUs (the world size)")
        px.add_argument("--gpu", default="h100", help="hardware profile: a100, h100, h200, b200, cpu-gloo")
        px.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
        px.add_argument("--seq", type=int, default=None, help="sequence length (default: 2048, or the model's "
                        "maximum if smaller)")
        px.add_argument("--top", type=int, default=5, help="how many layouts to show (default 5)")
        px.add_argument("--memory-limit", type=float, default=None, metavar="GIB",
                        help="GiB per GPU (default: the GPU's memory)")
        px.add_argument("--precision", default="bf16,fp8",
                        help="matmul precisions to consider, e.g. bf16 or bf16,fp8 (default; fp8 only on GPUs with "
                             "FP8 tensor cores)")
        px.add_argument("--zero", default=None, help="ZeRO stages to consider, e.g. 0,1 (default 0,1,2,3)")
        px.add_argument("--overlap", default=None,
                        help="communication overlap to consider: on, off or on,off (default on,off)")
        px.add_argument("--schedules", default=None, help="pipeline schedules to consider, e.g. 1f1b,interleaved")
        px.add_argument("--recompute", default=None, help="recompute modes to consider, e.g. selective,full")
        px.add_argument("--json", action="store_true")
        px.set_defaults(func=fn)
    pd = sub.add_parser("demo", help="train a tiny Llama on 4 CPU processes (dp=2 x tp=2, SP) vs one device")
    pd.add_argument("--steps", type=int, default=40)
    pd.set_defaults(func=cmd_demo)
    from mcompile.apps.data import cli as data_cli  # light: imports nothing heavy until run

    data_cli.add_parser(sub)
    from mcompile.apps.train import cli as train_cli  # light: imports no torch until run

    train_cli.add_parser(sub)  # mcompile train CONFIG.toml [--set KEY=VALUE ...] [--nproc N] [--max-restarts R]
    from mcompile.apps.train import commands  # mcompile eval / generate CONFIG.toml [--checkpoint DIR] [--mesh ...]

    commands.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    import warnings

    args = build_parser().parse_args(argv)  # --help and argument errors: before anything heavy is imported
    from mcompile.capture.export import CaptureError
    from mcompile.ir.plan import PlanError
    from mcompile.passes.pp.stages import PartitionError
    from mcompile.runtime.schedules import ScheduleError
    from mcompile.search import SearchError

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*bos_token_id.*")
            return args.func(args)
    except (CLIError, PlanError, CaptureError, PartitionError, ScheduleError, SearchError) as e:
        print(f"mcompile: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
