"""Communication overlap on gloo: step time with ``Config(overlap=True)`` against ``overlap=False``, and
the fraction of communication time hidden under compute, from the recorded timeline.

    python bench/overlap.py [--steps 10] [--warmup 2] [--recorded 3] [--models llama3-tiny,llama-small]
                            [--out bench/results/overlap.json]

Four gloo CPU processes (:class:`mcompile.runtime.launch.WorkerPool`, one intra-op thread each). Per
model, every rank builds one ParallelModule per (layout, mode):

- layouts: ``dp=4`` (zero=0; zero=0 with 2 MB gradient buckets, so that several launch during the
  backward — at the default 25 MB llama-small's gradients fit one bucket, launched at the backward's
  end; zero=3) and ``dp=2,tp=2`` with sequence parallelism (zero=0, zero=3, and
  zero=0 with ``tp_overlap=2``: every eligible tp all-gather -> matmul / matmul -> reduce-scatter in
  two chunks);
- modes: ``on`` = ``Config(overlap=True)`` (tp_overlap "auto", or 2 where the layout says so): the dp
  gradient buckets launched inside the backward module, ZeRO-3 gathers prefetched one layer ahead,
  collective matmul; ``off`` = ``Config(overlap=False, tp_overlap="off")``: every collective where the
  program first needs it, the dp buckets launched after the backward returns.

After ``--warmup`` steps of each, ``--steps`` rounds run every (layout, mode) once per round
(on before off in even rounds, off before on in odd ones; a barrier before each step; the optimizer
step untimed), so a change in the machine's load hits both modes alike. Per rank: the median over
rounds of the wall time (``time.perf_counter``) and process CPU time of ``train_step``; the JSON
keeps their median over ranks and the ratio on/off. Then each module records ``--recorded`` more
steps with ``pm.start_timeline()`` (recording stays off during the timed rounds) and
:func:`mcompile.ir.timeline.overlap_stats` gives per rank and step the communication time (union of the
comm intervals), the part under compute (compute = forward and backward module calls minus the host's
time blocked in synchronous collectives and waits) and their ratio; the JSON keeps the median over
steps of each rank's figures, and their mean over ranks.

``--counts``: no processes and no timing — what collective matmul (``passes/tp/collective_matmul.py``)
rewrites: per model, at tp=2 with and without sequence parallelism, at batch 1 and at the model's batch,
rank 0's partitioned forward and backward modules (``recompute="none"``) are rewritten with
``tp_overlap=2`` (every eligible op, as the cost model would on a machine where chunking pays), and the
JSON's ``tp_overlap_counts`` keeps per phase the tp collectives, how many were chunked (overlapped)
and per layer (those of the transformer blocks / ``n_layers``; the LM head's and the loss's apart),
with the reasons of the skipped ones. With ``--write`` it updates that key of the committed record,
keeping the timed figures of the last full run.

On a 2-core machine four ranks already share two cores, and gloo runs each collective on its own
threads, which compete with the compute for those cores: time "hidden" under compute is not free
there, and overlap may not make a step faster. The JSON records the CPU count and the load average.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import time
from pathlib import Path

import _results  # noqa: E402 - bench/_results.py: where the JSON goes (bench/ is the script's folder)

ROOT = Path(__file__).resolve().parent.parent

LAYOUTS = {  # name -> (mesh, options shared by both modes, options of "on" only)
    "dp4-zero0": ("dp=4", {"zero": 0}, {}),
    "dp4-zero0-bucket2mb": ("dp=4", {"zero": 0, "bucket_mb": 2.0}, {}),  # several buckets: launched during backward
    "dp4-zero3": ("dp=4", {"zero": 3}, {}),
    "dp2tp2-sp-zero0": ("dp=2,tp=2", {"sequence_parallel": True, "zero": 0}, {}),
    "dp2tp2-sp-zero3": ("dp=2,tp=2", {"sequence_parallel": True, "zero": 3}, {}),
    "dp2tp2-sp-tp_overlap2": ("dp=2,tp=2", {"sequence_parallel": True, "zero": 0}, {"tp_overlap": 2}),
}
MODES = {"on": {"overlap": True}, "off": {"overlap": False, "tp_overlap": "off"}}
# llama3-tiny is the test preset (dim 64, 2 layers: latency-bound); llama-small a model whose GEMMs take
# longer than gloo's per-collective latency on this machine
MODELS = {
    "llama3-tiny": {"preset": "llama3-tiny", "batch": 8, "seq": 32},
    "llama-small": {"config": {"vocab_size": 2048, "dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4,
                               "ffn_hidden": 768, "max_seq_len": 256}, "batch": 8, "seq": 128},
}


def _model(spec: dict):
    import torch

    from mcompile.models import Llama, LlamaConfig, get_preset

    torch.manual_seed(0)
    if "preset" in spec:
        pre = get_preset(spec["preset"])
        model, vocab = pre.build(), pre.config.vocab_size
    else:
        cfg = LlamaConfig(**spec["config"])
        model, vocab = Llama(cfg), cfg.vocab_size
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (spec["batch"], spec["seq"]), generator=g)
    targets = torch.randint(0, vocab, (spec["batch"], spec["seq"]), generator=g)
    return model.eval(), (tokens, targets)


def worker(rank, world, model_name, steps, warmup, recorded, layouts, lr=1e-4):
    import torch
    import torch.distributed as dist

    import mcompile as mc
    from mcompile.ir.timeline import overlap_stats

    torch.set_num_threads(1)
    keys = [(lay, mode) for lay in layouts for mode in MODES]
    pms, opts, inputs, setup_s = {}, {}, None, {}
    for lay, mode in keys:
        mesh, shared, on_only = LAYOUTS[lay]
        options = {**shared, **MODES[mode], **(on_only if mode == "on" else {})}
        model, inputs = _model(MODELS[model_name])
        t = time.perf_counter()
        pms[lay, mode] = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
        setup_s[f"{lay}/{mode}"] = time.perf_counter() - t
        opts[lay, mode] = torch.optim.AdamW(pms[lay, mode].parameters(), lr=lr)
    losses = {f"{lay}/{mode}": [] for lay, mode in keys}

    def step(key):
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        loss = pms[key].train_step(*inputs)
        dt, dc = time.perf_counter() - t, time.process_time() - c
        opts[key].step()
        opts[key].zero_grad()
        losses[f"{key[0]}/{key[1]}"].append(loss.item())
        return dt, dc

    first = {}
    for key in keys:
        for i in range(warmup):
            dt, _ = step(key)
            if i == 0:
                first[f"{key[0]}/{key[1]}"] = dt
    wall = {f"{lay}/{mode}": [] for lay, mode in keys}
    cpu = {f"{lay}/{mode}": [] for lay, mode in keys}
    for r in range(steps):
        for lay in layouts:
            for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                dt, dc = step((lay, mode))
                wall[f"{lay}/{mode}"].append(dt)
                cpu[f"{lay}/{mode}"].append(dc)
    stats, rec_wall = {}, {}
    for key in keys:
        rec = pms[key].start_timeline()
        per_step = []
        rec_wall[f"{key[0]}/{key[1]}"] = []
        for _ in range(recorded):
            dt, _ = step(key)
            rec_wall[f"{key[0]}/{key[1]}"].append(dt)
            per_step.append(overlap_stats(rec.events())[rank])
        stats[f"{key[0]}/{key[1]}"] = {
            k: statistics.median(s[k] for s in per_step)
            for k in ("comm_s", "hidden_s", "exposed_s", "hidden_fraction", "async_comm_s", "async_hidden_s",
                      "async_hidden_fraction", "compute_s", "blocked_s", "count")}
        stats[f"{key[0]}/{key[1]}"]["by_kind"] = per_step[-1]["by_kind"]
    return {"wall_s": {k: statistics.median(v) for k, v in wall.items()},
            "cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
            "wall_s_all": wall, "first_step_s": first, "setup_s": setup_s, "timeline": stats,
            "recorded_wall_s": {k: statistics.median(v) for k, v in rec_wall.items()}, "losses": losses}


def _layers(gm, names: dict) -> dict:
    """Per tp collective of a partitioned module, the transformer block its GEMMs belong to (None: the LM
    head, the embedding, the loss): the block of a weight the matched matmuls read (``names``: placeholder
    -> block, for parameters and saved activations), else the collective's own ``mc_layer``."""
    from mcompile.passes.tp import collective_matmul as CM

    out = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in CM._PATTERN:
            continue
        layer = (n.meta.get("custom") or {}).get("mc_layer")
        m = CM._match_gather(n) if n.target is CM._AG else CM._match_scatter(n)
        for mm in ([] if isinstance(m, str) else m.mms):
            for a in mm.all_input_nodes:
                while a.op != "placeholder" and len(a.all_input_nodes) == 1:  # t, view, permute, cast
                    a = a.all_input_nodes[0]
                if a.op == "placeholder" and names.get(a.name) is not None:
                    layer = names[a.name]
        out[n.name] = layer
    return out


def tp_counts(name: str, sp: bool, batch: int, tp_overlap=2) -> dict:
    """Collective matmul's decisions on rank 0's forward and backward modules of ``name`` at tp=2 (module
    docstring, ``--counts``)."""
    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh
    from mcompile.passes.joint import partition, saved_for_policy, trace_joint
    from mcompile.passes.tp.collective_matmul import rewrite

    spec = dict(MODELS[name], batch=batch)
    model, inputs = _model(spec)
    c = compile_plan(model, Mesh.parse("tp=2"), inputs, sequence_parallel=sp)
    prog, state = c.program(0), c.captured.state_values()
    local = {k: v.detach().clone().requires_grad_(k in c.captured.params) for k, v in c.local_state(0, state).items()}
    by = dict(zip(c.captured.user_inputs, inputs))
    args = [local[n.name] if n.name in local else by[n.name] for n in prog.graph.nodes if n.op == "placeholder"]
    jg = trace_joint(prog, args)
    jp = partition(jg, saved_for_policy(jg, "none"))
    fqn = [c.captured.params.get(n.name, "") for n in prog.graph.nodes if n.op == "placeholder"]
    names = {p: int(m.group(1)) for p, f in zip(jg.primal_names, fqn) if (m := re.search(r"layers\.(\d+)\.", f))}
    for n in jp.forward.graph.nodes:  # saved activations: the backward's placeholders of the same names
        names.setdefault(n.name, (n.meta.get("custom") or {}).get("mc_layer"))
    n_layers = (spec.get("config") or {}).get("n_layers") or model.config.n_layers
    out = {"sequence_parallel": sp, "batch": batch, "seq": spec["seq"], "tp": 2, "tp_overlap": tp_overlap,
           "n_layers": n_layers}
    for where, gm in (("forward", jp.forward), ("backward", jp.backward)):
        layer = _layers(gm, names)
        decisions = rewrite(gm, tp_overlap=tp_overlap, where=where)
        done = [d for d in decisions if d.chunks > 1]
        in_layers = [d for d in done if layer.get(d.op) is not None]
        out[where] = {
            "tp_collectives": len(decisions), "overlapped": len(done),
            "overlapped_per_layer": len(in_layers) / n_layers,
            "overlapped_outside_layers": len(done) - len(in_layers),
            "by_pattern": {p: sum(d.pattern == p for d in done) for p in sorted({d.pattern for d in decisions})},
            "skipped": [str(d) for d in decisions if d.chunks == 1]}
    return out


def counts_main(args) -> None:
    import json

    rows = []
    for name in args.models.split(","):
        for sp in (True, False):
            for batch in (1, MODELS[name]["batch"]):
                t = time.perf_counter()
                rows.append({"model": name, **tp_counts(name, sp, batch)})
                r = rows[-1]
                print(f"{name:12s} sp={sp!s:5s} batch={batch}: overlapped per layer forward "
                      f"{r['forward']['overlapped_per_layer']:g} backward {r['backward']['overlapped_per_layer']:g} "
                      f"(of {r['forward']['tp_collectives']} / {r['backward']['tp_collectives']} tp collectives; "
                      f"{time.perf_counter() - t:.0f} s)", flush=True)
    counts = {"commit": _results.commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "method": "python bench/overlap.py --counts: rank 0's partitioned forward / backward modules at tp=2 "
                        "(recompute none) rewritten by passes/tp/collective_matmul.py with tp_overlap=2; overlapped = "
                        "tp collectives split into chunks whose communication runs under other chunks' GEMMs; "
                        "per layer: those inside the transformer blocks / n_layers",
              "rows": rows}
    path = _results.destination("overlap", args.write, args.out)
    if path is None:
        print(json.dumps(counts, indent=1))
        return
    record = json.loads(path.read_text()) if path.exists() else {"benchmark": "overlap"}
    record["tp_overlap_counts"] = counts
    path.write_text(json.dumps(record, indent=1) + "\n")
    print("->", path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--recorded", type=int, default=3)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    _results.add_arguments(ap, "overlap")
    ap.add_argument("--commit", default=None, help="the commit measured, for a tree outside git")
    ap.add_argument("--counts", action="store_true",
                    help="only the tp collectives collective matmul overlaps, per layer, at batch 1 and > 1 "
                         "(no processes, no timing); --write updates that key of the record")
    args = ap.parse_args()
    if args.counts:
        counts_main(args)
        return
    import torch

    from mcompile.runtime.launch import WorkerPool

    layouts = args.layouts.split(",")
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    results = {}
    pool = WorkerPool(4)
    try:
        for name in args.models.split(","):
            res = pool.run(worker, name, args.steps, args.warmup, args.recorded, layouts, timeout=3000)
            results[name] = res
            print(f"{name}: done after {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        pool.close()
    load_after = os.getloadavg()
    figures = []
    for name, res in results.items():
        for lay in layouts:
            row = {"model": name, "layout": lay, "mesh": LAYOUTS[lay][0],
                   "options_on": {**LAYOUTS[lay][1], **MODES["on"], **LAYOUTS[lay][2]},
                   "options_off": {**LAYOUTS[lay][1], **MODES["off"]}}
            for mode in MODES:
                key = f"{lay}/{mode}"
                tl = [r["timeline"][key] for r in res]
                row[mode] = {
                    "step_s": statistics.median(r["wall_s"][key] for r in res),
                    # the spread of the rounds (machine noise): per rank the quartiles, median over ranks
                    "step_s_quartiles": [statistics.median(statistics.quantiles(r["wall_s_all"][key], n=4)[i]
                                                           for r in res) for i in (0, 2)],
                    "cpu_s": statistics.median(r["cpu_s"][key] for r in res),
                    "step_s_recording": statistics.median(r["recorded_wall_s"][key] for r in res),
                    "first_step_s": statistics.median(r["first_step_s"][key] for r in res),
                    "comm_s": statistics.mean(t["comm_s"] for t in tl),
                    "hidden_s": statistics.mean(t["hidden_s"] for t in tl),
                    "exposed_s": statistics.mean(t["exposed_s"] for t in tl),
                    "hidden_fraction": statistics.mean(t["hidden_fraction"] for t in tl),
                    "async_comm_s": statistics.mean(t["async_comm_s"] for t in tl),
                    "async_hidden_fraction": statistics.mean(t["async_hidden_fraction"] for t in tl),
                    "compute_s": statistics.mean(t["compute_s"] for t in tl),
                    "collectives_per_step": statistics.mean(t["count"] for t in tl),
                    "hidden_fraction_per_rank": [t["hidden_fraction"] for t in tl],
                    "by_kind_rank0": tl[0]["by_kind"],
                }
            row["step_ratio_on_over_off"] = row["on"]["step_s"] / row["off"]["step_s"]
            row["cpu_ratio_on_over_off"] = row["on"]["cpu_s"] / row["off"]["cpu_s"]
            row["losses_equal_on_off"] = res[0]["losses"][f"{lay}/on"] == res[0]["losses"][f"{lay}/off"]
            row["max_rel_loss_diff_on_off"] = max(
                abs(a - b) / abs(b) for a, b in zip(res[0]["losses"][f"{lay}/on"], res[0]["losses"][f"{lay}/off"]))
            figures.append(row)
    git = ["git", "-C", str(ROOT)]
    out = {
        "benchmark": "overlap",
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "backend": "gloo", "ranks": 4, "threads_per_rank": 1},
        "commit": args.commit or subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True,
                                                text=True).stdout.strip(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "models": {n: MODELS[n] for n in results},
        "modes": MODES, "layouts": {k: LAYOUTS[k] for k in layouts},
        "steps": args.steps, "warmup": args.warmup, "recorded_steps": args.recorded,
        "method": "step_s: median over rounds (per rank) of train_step wall time, median over ranks, timeline "
                  "off; on/off interleaved per round. hidden_fraction: per rank median over the recorded steps "
                  "of |comm ∩ (compute - blocked)| / |comm| (mcompile.ir.timeline.overlap_stats), mean over ranks.",
        "caveat": f"{os.cpu_count()} CPU cores for 4 ranks: gloo's communication threads compete with the ranks' "
                  "compute for the same cores, so communication hidden under compute still costs CPU time and "
                  "overlap need not shorten a step here; the figures say what the runtime overlaps, the step "
                  "times what that buys on this machine.",
        "load_average_before": load_before, "load_average_after": load_after,
        "figures": figures,
        "per_rank": {n: [{k: r[k] for k in ("wall_s", "cpu_s", "timeline", "setup_s")} for r in res]
                     for n, res in results.items()},
        "per_round_rank0_s": {n: res[0]["wall_s_all"] for n, res in results.items()},
        "wall_s": time.perf_counter() - t0,
    }
    dest = _results.destination("overlap", args.write, args.out)
    if dest is not None and dest.exists():  # the --counts figures stay (a separate, untimed run)
        import json

        out.setdefault("tp_overlap_counts", json.loads(dest.read_text()).get("tp_overlap_counts"))
    path = _results.save("overlap", out, args.write, args.out)
    for row in figures:
        print(f"{row['model']:12s} {row['layout']:22s} on {row['on']['step_s'] * 1e3:8.1f} ms  off "
              f"{row['off']['step_s'] * 1e3:8.1f} ms  ratio {row['step_ratio_on_over_off']:.3f}  hidden on "
              f"{row['on']['hidden_fraction']:.1%} off {row['off']['hidden_fraction']:.1%}")
    print("->", path)


if __name__ == "__main__":
    main()
