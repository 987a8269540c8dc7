"""The ``mcompile`` command line: plan, show (and later explain, search, demo, train, ...).

    mcompile plan MODEL --mesh dp=8,tp=8 [--seq S] [--batch B] [--sp] [--json]
    mcompile plan MODEL --mesh dp=2,pp=4,tp=2 --microbatches 8 --schedule interleaved --virtual 2
    mcompile timeline TRACE.json [-o out.png]
    mcompile show MODEL --mesh tp=2 --rank 1 [--fuse] [--fp8 current|delayed]
    mcompile demo [--steps N]

MODEL is a preset name (``mcompile plan --list``) or ``package.module:factory``, a callable that
returns a model, or ``(model, example_inputs)``. A model without example inputs is taken to be a
language model called as ``model(tokens, targets)`` with int64 tensors of shape [batch, seq].
Models are built on the meta device for ``plan`` (no memory at any size).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

import torch

from mcompile.mesh import Mesh


class CLIError(Exception):
    pass


def load_model(spec: str, device: str, batch: int, seq: int, dtype: torch.dtype | None = None):
    from mcompile.models import PRESETS, get_preset

    if ":" not in spec:
        if spec not in PRESETS:
            raise CLIError(
                f"unknown model {spec!r}: not a preset and not a module:factory path. "
                f"Presets: {', '.join(sorted(PRESETS))}"
            )
        pre = get_preset(spec)
        try:
            pre.example_inputs(batch=batch, seq=seq, device="meta")  # validates seq against the model
        except ValueError as e:
            raise CLIError(str(e)) from e
        model = pre.build(device=device, dtype=dtype)
        # the capture template is small: batch and sequence are symbols, sizes come from --batch/--seq
        return model, pre.example_inputs(batch=2, seq=16, device=device), spec
    mod_name, _, attr = spec.partition(":")
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


def _compile(args, device: str):
    from mcompile.api import compile_plan

    try:
        mesh = Mesh.parse(args.mesh, fake=device == "meta")
    except ValueError as e:
        raise CLIError(str(e)) from e
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.seq is None:
        args.seq = _default_seq(args.model)
    model, inputs, name = load_model(args.model, device, max(args.batch, 2), max(args.seq, 2), dtype)
    overrides = {}
    for o in args.override or []:
        key, _, spec = o.partition("=")
        overrides[key] = spec
    layers = [int(x) for x in args.layers_per_stage.split(",")] if args.layers_per_stage else None
    c = compile_plan(model, mesh, inputs, sequence_parallel=args.sp, overrides=overrides or None,
                     seq=args.seq, batch=args.batch, schedule=args.schedule, virtual_stages=args.virtual,
                     microbatches=args.microbatches, pipeline_granularity=args.granularity,
                     layers_per_stage=layers, pipeline_seq=args.seq)
    c.plan.model = name
    return c


def _default_seq(spec: str) -> int:
    from mcompile.models import PRESETS

    return min(2048, PRESETS[spec].max_seq_len) if spec in PRESETS else 2048


def cmd_plan(args) -> int:
    from mcompile.report import collective_bytes, memory_per_rank, plan_text

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
        from mcompile.report import measure_per_rank

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
        fp8 = _fp8_report(args, c)
        if fp8 is not None:
            d["fp8"] = fp8.to_dict()
        print(json.dumps(d, indent=1))
    else:
        print(plan_text(c.plan, sizes, args.dtype))
        if c.plan.pipeline:
            from mcompile.report import pipeline_text

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
    return 0


def _fp8_report(args, c, rank: int = 0):
    """``--fp8``: run the FP8 pass (Config(fp8=...)) on a rank's program, in place; its report."""
    if not args.fp8:
        return None
    from mcompile.passes.fp8 import convert_fp8

    return convert_fp8(c.program(rank), c.plan, dict(c.captured.params), recipe=args.fp8,
                       user_inputs=set(c.captured.user_inputs))


def cmd_show(args) -> int:
    c = _compile(args, "meta")
    if not 0 <= args.rank < c.mesh.size():
        raise CLIError(f"--rank {args.rank} is outside the mesh of {c.mesh.size()} ranks")
    gm = c.program(args.rank)
    print(f"# per-rank program of rank {args.rank} {c.mesh.coords(args.rank)} on {c.mesh!r}")
    fp8 = _fp8_report(args, c, args.rank)  # FP8 linears: mcompile::fp8_linear* calls in the program below
    if fp8 is not None:
        print("\n".join(f"# {line}" for line in fp8.text().splitlines()))
    if not args.fuse:
        print(gm.code)
        return 0
    from mcompile.passes.fuse import FUSED, fuse
    from mcompile.report import fused_summary, mark_fused

    counts = fuse(gm, {n.name: n for n in c.captured.gm.graph.nodes}, set(c.captured.params))
    print(mark_fused(gm, FUSED))
    print(f"# {fused_summary(counts)}")
    return 0


def cmd_timeline(args) -> int:
    from pathlib import Path

    from mcompile import timeline

    path = Path(args.trace)
    if not path.is_file():
        raise CLIError(f"no trace at {path}: write one with pm.start_timeline() ... pm.save_timeline(path)")
    trace = timeline.load_trace(path)
    out = timeline.draw(trace, args.out or path.with_suffix(".png"))
    b = timeline.bubble(trace)
    print(f"wrote {out}; measured bubble per rank: " + ", ".join(f"{r}: {v:.1%}" for r, v in b.items()))
    return 0


def cmd_demo(args) -> int:
    from mcompile.demo import run

    result = run(steps=args.steps)
    return 0 if result["max_abs_diff"] < 1e-3 else 1


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
    pp.add_argument("--list", action="store_true", help="list the presets")
    pp.add_argument("--measure", action="store_true",
                    help="small models: also run one step of every rank (threads) and measure its memory")
    pp.set_defaults(func=cmd_plan)
    ps = sub.add_parser("show", help="print the per-rank program as Python")
    common(ps)
    ps.add_argument("--rank", type=int, default=0)
    ps.add_argument("--fuse", action="store_true",
                    help="apply the fusion pass (Config(fuse=True)); fused nodes are marked, counts summed up")
    ps.set_defaults(func=cmd_show)
    pt = sub.add_parser("timeline", help="draw a pipeline timeline (Chrome trace from pm.save_timeline) as a PNG")
    pt.add_argument("trace", help="trace JSON written by ParallelModule.save_timeline")
    pt.add_argument("-o", "--out", default=None, help="PNG path (default: the trace's name with .png)")
    pt.set_defaults(func=cmd_timeline)
    pd = sub.add_parser("demo", help="train a tiny Llama on 4 CPU processes (dp=2 x tp=2, SP) vs one device")
    pd.add_argument("--steps", type=int, default=40)
    pd.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    import warnings

    from mcompile.capture import CaptureError
    from mcompile.partition import PartitionError
    from mcompile.propagate import PlanError
    from mcompile.runtime.schedules import ScheduleError

    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*bos_token_id.*")
            return args.func(args)
    except (CLIError, PlanError, CaptureError, PartitionError, ScheduleError) as e:
        print(f"mcompile: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
