"""Expert parallelism on gloo: a Mixtral-style MoE trained at ``ep=2`` (experts sharded, tokens sent to
their experts by all-to-all) against ``dp=2`` (experts replicated, gradients all-reduced).

    python bench/moe_ep.py [--steps 10] [--warmup 2] [--recorded 1] [--write] [--out PATH]

Two gloo CPU processes (:class:`mcompile.runtime.launch.WorkerPool`, one intra-op thread each). Every
rank builds both ParallelModules from the same seed (``Mixtral(MixtralConfig(**CONFIG))``, the same
batch of random tokens and targets) with one AdamW each, then, in one run:

- ``--warmup`` steps of each layout, then ``--steps`` rounds that run one step of each (ep before dp
  in even rounds, dp before ep in odd ones: a change in the machine's load hits both alike). A step
  is a barrier, then ``train_step`` + ``optimizer.step()`` + ``zero_grad()`` timed with
  ``time.perf_counter`` (``train_s``: ``train_step`` alone). Per rank the median over rounds, then
  the median over ranks.
- ``--recorded`` more steps of each with ``pm.start_timeline()``: the runtime's recorder
  (:mod:`mcompile.ir.timeline`) logs every collective with its kind, axis, source and bytes; the JSON
  keeps, per rank, the last recorded step's bytes and counts by kind (and by kind/source/axis). Bytes
  are the recorder's convention: an all-to-all's *received* buffer (it includes the rows a rank sends
  to itself, which gloo copies locally), an all-reduce's whole buffer (a ring all-reduce moves about
  2 (n-1)/n of it out of each rank).
- two more steps of each for memory. One under ``torch.profiler`` with ``profile_memory`` (the CPU
  allocator's allocations and frees, every op, inside custom ops too): ``peak_bytes`` = the bytes
  held at the step's start (local parameters, the flat gradient buffers, AdamW state) + the peak of
  the allocator's running sum above the start. The other, at dp only, under
  :class:`mcompile.runtime.memory.MemoryTracker` (live tensor bytes by category: the figure other
  benchmarks quote; a cross-check of the first). The tracker cannot run an ep step: as a dispatch
  mode it stays active inside ``mcompile::moe_ep``, whose local experts' backward comes from
  ``torch.func.vjp``, and it cannot read functorch's wrapper tensors ("Cannot access storage of
  TensorWrapper"); ep runs a plain step there instead.

In fp32 on CPU the experts of both layouts run as one grouped GEMM per projection
(``mcompile.kernels.grouped_gemm.experts_mm``: ``torch._grouped_mm`` on the CPU).

Every step of both layouts sees the same data from the same initial weights, and both programs are
exact (fp32, dropless): their losses must agree step by step to ~1e-5 (relative). The parent also
trains the single-device model for as many steps (the independent oracle) and records both layouts'
largest relative difference to it. Expert parameter bytes per rank: the local shards of the
parameters whose name has ``.experts.``.

gloo on a few shared CPU cores is not NVLink / InfiniBand: an all-to-all here is a local memory copy
through gloo's threads, competing with the ranks' compute for the same cores. The step-time ratio
says what this runtime's EP costs on this machine, not what it costs on a GPU cluster; the bytes and
memory figures are what carries over.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

# Mixtral-style (every layer MoE, SwiGLU experts, top-2 of 8), larger than the mixtral-tiny preset
CONFIG = dict(vocab_size=2048, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=512, max_seq_len=128,
              rope_theta=1e6, n_experts=8, top_k=2)
# 8 x 128 tokens (512 a rank); both layouts run their experts as one grouped GEMM per projection
# (kernels/grouped_gemm.py: torch._grouped_mm on the CPU)
BATCH, SEQ = 8, 128
LAYOUTS = ("ep=2", "dp=2")
LR = 1e-3


def _model():
    import torch

    from mcompile.models.moe_lm import Mixtral, MixtralConfig

    torch.manual_seed(0)
    model = Mixtral(MixtralConfig(**CONFIG)).eval()  # no dropout: the layouts must agree exactly
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)
    targets = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)
    return model, (tokens, targets)


def _held_bytes(pm, params, optimizer) -> int:
    """Bytes of the distinct storages held across steps: the local parameters, their gradients, the
    runtime's flat gradient buffers (``Leaves.flat_buffers``, runtime/leaves.py) and the
    optimizer state."""
    import torch

    seen = {}
    tensors = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    leaves = getattr(pm, "_leaves", None)
    tensors += list(leaves.flat_buffers()) if hasattr(leaves, "flat_buffers") else []
    tensors += [g.to_local() if hasattr(g, "to_local") else g for g in (p.grad for p in params) if g is not None]
    tensors += [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        st = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()  # AdamW's state of a DTensor too
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _allocator_peak(fn) -> tuple[int, int]:
    """Run ``fn`` under torch.profiler (CPU, profile_memory): the peak of the running sum of the CPU
    allocator's allocations and frees (every thread, inside custom ops too) above the start, and the
    net change at the end."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak, live


def worker(rank, world, steps, warmup, recorded):
    import torch
    import torch.distributed as dist

    import mcompile as mc
    from mcompile.runtime.memory import MemoryTracker

    torch.set_num_threads(1)
    pms, opts, setup_s, inputs = {}, {}, {}, None
    for lay in LAYOUTS:
        model, inputs = _model()
        t = time.perf_counter()
        pms[lay] = mc.parallelize(model, mc.Mesh.parse(lay), inputs)
        setup_s[lay] = time.perf_counter() - t
        opts[lay] = torch.optim.AdamW(pms[lay].parameters(), lr=LR)
    losses = {lay: [] for lay in LAYOUTS}

    def step(lay):
        dist.barrier()
        t = time.perf_counter()
        loss = pms[lay].train_step(*inputs)
        t1 = time.perf_counter()
        opts[lay].step()
        opts[lay].zero_grad()
        t2 = time.perf_counter()
        losses[lay].append(loss.item())
        return t2 - t, t1 - t

    first = {lay: [step(lay) for _ in range(warmup)][0][0] for lay in LAYOUTS}
    wall = {lay: [] for lay in LAYOUTS}
    train = {lay: [] for lay in LAYOUTS}
    for r in range(steps):
        for lay in (LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]):
            dt, dtrain = step(lay)
            wall[lay].append(dt)
            train[lay].append(dtrain)

    comm = {}
    for lay in LAYOUTS:
        rec = pms[lay].start_timeline()
        for _ in range(recorded):
            step(lay)
        by_kind, detail = {}, {}
        for e in rec.events():
            if e["cat"] != "comm":
                continue
            k = by_kind.setdefault(e["kind"], {"count": 0, "bytes": 0})
            k["count"] += 1
            k["bytes"] += int(e["bytes"])
            d = detail.setdefault(f"{e['kind']}/{e.get('source', '?')}/{e['axis']}", {"count": 0, "bytes": 0})
            d["count"] += 1
            d["bytes"] += int(e["bytes"])
        comm[lay] = {"by_kind": by_kind, "by_kind_source_axis": detail,
                     "total_bytes": sum(k["bytes"] for k in by_kind.values())}

    memory = {}
    for lay in LAYOUTS:
        params = list(pms[lay].parameters())
        # (1) the runtime's MemoryTracker (a dispatch mode), by category: dp only. It cannot run an ep step:
        # the mode stays active inside mcompile::moe_ep, whose local experts' backward comes from
        # torch.func.vjp, and it cannot read the storage of functorch's wrapper tensors there
        # ("Cannot access storage of TensorWrapper"). ep runs a plain step instead (same step count).
        tracked = None
        if "ep" not in lay:
            tracker = MemoryTracker()
            tracker.register(params, "parameters")
            tracker.register_optimizer(opts[lay])
            hooks = [p.register_post_accumulate_grad_hook(lambda p, tr=tracker: tr.register([p.grad], "gradients"))
                     for p in params]
            try:
                with tracker:
                    tracker.reset_peak()
                    step(lay)
                    tracker.register_optimizer(opts[lay])
            finally:
                for h in hooks:
                    h.remove()
            tracked = {"tracker_peak_bytes": tracker.peak_total, "tracker_at_peak": dict(tracker.peak)}
        else:
            step(lay)
        # (2) the CPU allocator's own record of one more step: sees everything, no categories
        held = _held_bytes(pms[lay], params, opts[lay])
        above, net = _allocator_peak(lambda lay=lay: step(lay))
        memory[lay] = {"peak_bytes": held + above, "held_at_step_start_bytes": held,
                       "allocator_peak_above_start_bytes": above, "allocator_net_bytes": net,
                       **(tracked or {"tracker": "not run: MemoryTracker fails inside moe_ep (torch.func.vjp)"})}

    params = {}
    for lay in LAYOUTS:
        named = [(n, p.to_local()) for n, p in pms[lay].named_parameters()]
        params[lay] = {"expert_bytes": sum(t.nbytes for n, t in named if ".experts." in n),
                       "total_bytes": sum(t.nbytes for n, t in named),
                       "expert_tensors": sorted(n for n, _ in named if ".experts." in n)}
    plan_a2a = [{"purpose": c.purpose, "forward": c.forward, "backward": c.backward, "axis": c.axis,
                 "bytes": str(c.bytes)}
                for c in pms["ep=2"].plan.collectives if c.op == "moe_ep_call"]
    return {"wall_s": {k: statistics.median(v) for k, v in wall.items()},
            "train_s": {k: statistics.median(v) for k, v in train.items()},
            "wall_s_all": wall, "first_step_s": first, "setup_s": setup_s, "comm": comm, "memory": memory,
            "params": params, "losses": losses, "plan_moe_collectives": plan_a2a}


def reference(n_steps: int) -> list[float]:
    """The single-device model, AdamW, the same steps: the independent oracle for both layouts."""
    import torch

    torch.set_num_threads(1)
    model, inputs = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = []
    for _ in range(n_steps):
        loss = model(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--recorded", type=int, default=1)
    ap.add_argument("--raw", default=None,
                    help="the workers' results of an earlier run (the raw JSON every run writes to a temporary "
                         "file): summarize those instead of running")
    _results.add_arguments(ap, "moe_ep")
    args = ap.parse_args()
    import json
    import tempfile

    import sympy
    import torch

    from mcompile.runtime.launch import WorkerPool

    if args.raw:
        raw = json.loads(Path(args.raw).read_text())
    else:
        load_before = os.getloadavg()
        t0 = time.perf_counter()
        pool = WorkerPool(2)
        try:
            res = pool.run(worker, args.steps, args.warmup, args.recorded, timeout=7200)
        finally:
            pool.close()
        raw = {"res": res, "workers_s": time.perf_counter() - t0, "load_before": load_before,
               "load_after": os.getloadavg(), "args": vars(args)}
        fd, name = tempfile.mkstemp(prefix="mcompile-bench-moe_ep-raw-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(raw, f)
        print(f"workers' results: {name} (--raw {name} summarizes them again)", file=sys.stderr)
    res, workers_s, load_before, load_after = raw["res"], raw["workers_s"], raw["load_before"], raw["load_after"]
    for key in ("steps", "warmup", "recorded"):
        setattr(args, key, raw["args"][key])
    n_steps = len(res[0]["losses"]["ep=2"])
    ref = reference(n_steps)

    per_layout = {}
    for lay in LAYOUTS:
        per_layout[lay] = {
            "step_s": statistics.median(r["wall_s"][lay] for r in res),
            "step_s_quartiles": [statistics.median(statistics.quantiles(r["wall_s_all"][lay], n=4)[i] for r in res)
                                 for i in (0, 2)],
            "train_step_s": statistics.median(r["train_s"][lay] for r in res),
            "first_step_s": statistics.median(r["first_step_s"][lay] for r in res),
            "setup_s": statistics.median(r["setup_s"][lay] for r in res),
            "comm_bytes_per_step_per_rank": [r["comm"][lay]["total_bytes"] for r in res],
            "comm_by_kind_per_rank": [r["comm"][lay]["by_kind"] for r in res],
            "comm_detail_per_rank": [r["comm"][lay]["by_kind_source_axis"] for r in res],
            "expert_param_bytes_per_rank": [r["params"][lay]["expert_bytes"] for r in res],
            "param_bytes_per_rank": [r["params"][lay]["total_bytes"] for r in res],
            "peak_memory_bytes_per_rank": [r["memory"][lay]["peak_bytes"] for r in res],
            "memory_per_rank": [r["memory"][lay] for r in res],
            "losses": res[0]["losses"][lay],
        }
        per_layout[lay]["comm_bytes_per_step"] = statistics.mean(per_layout[lay]["comm_bytes_per_step_per_rank"])
        per_layout[lay]["peak_memory_bytes"] = max(per_layout[lay]["peak_memory_bytes_per_rank"])
    ep, dp = per_layout["ep=2"], per_layout["dp=2"]
    # what the plan says the token all-to-alls move (bytes, forward; sympy in the local batch and seq)
    local_batch = BATCH // 2
    plan_rows = []
    for c in res[0]["plan_moe_collectives"]:
        value = sympy.sympify(c["bytes"]).subs({sympy.Symbol("batch"): local_batch, sympy.Symbol("seq"): SEQ})
        plan_rows.append({**c, "bytes_at_batch_seq": int(value)})
    measured_a2a = statistics.mean(r["comm"]["ep=2"]["by_kind"].get("all_to_all", {}).get("bytes", 0) for r in res)
    counts_a2a = [r["comm"]["ep=2"]["by_kind"].get("all_to_all", {}).get("count", 0) for r in res]
    planned_fwd = sum(p["bytes_at_batch_seq"] for p in plan_rows)
    planned_step = sum(p["bytes_at_batch_seq"] * (2 if p["backward"] == "all_to_all" else 1) for p in plan_rows)
    out = {
        "benchmark": "moe_ep",
        "model": {"class": "mcompile.models.moe_lm.Mixtral", "config": CONFIG, "batch": BATCH, "seq": SEQ,
                  "dtype": "float32", "optimizer": f"AdamW(lr={LR})"},
        "machine": {**_results.machine(), "torch": torch.__version__, "backend": "gloo", "ranks": 2,
                    "threads_per_rank": 1},
        "commit": _results.commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "steps": args.steps, "warmup": args.warmup, "recorded_steps": args.recorded, "loss_steps": n_steps,
        "method": {
            "step_s": "per rank the median over the timed rounds of barrier-to-end of train_step + AdamW step + "
                      "zero_grad (time.perf_counter), timeline off, ep and dp interleaved per round; median over "
                      "ranks",
            "bytes": "mcompile.ir.timeline Recorder (pm.start_timeline()) over the last recorded step, per rank: "
                     "every collective of the programs, the dp gradient buckets and the step's loss/token-count "
                     "all-reduce; all_to_all = received buffer (own rows included), all_reduce = whole buffer",
            "expert_param_bytes": "sum of p.to_local().nbytes over parameters named '*.experts.*'",
            "peak_memory": "per rank: bytes held at the step's start (local parameters, flat gradient buffers, AdamW "
                           "state) + the peak of the CPU allocator's running sum of allocations and frees over one "
                           "steady-state step (torch.profiler profile_memory; inside the moe_ep op too); "
                           "memory_per_rank also has, at dp, the MemoryTracker's peak (it fails inside moe_ep); "
                           "peak_memory_bytes is the largest rank's",
            "losses": "rank 0's train_step losses, every step of the run, both layouts from the same weights "
                      "and data; the reference is the single-device model trained the same steps",
        },
        "layouts": per_layout,
        "ratios": {
            "step_s_ep_over_dp": ep["step_s"] / dp["step_s"],
            "train_step_s_ep_over_dp": ep["train_step_s"] / dp["train_step_s"],
            "comm_bytes_ep_over_dp": ep["comm_bytes_per_step"] / dp["comm_bytes_per_step"],
            "expert_param_bytes_ep_over_dp":
                ep["expert_param_bytes_per_rank"][0] / dp["expert_param_bytes_per_rank"][0],
            "param_bytes_ep_over_dp": ep["param_bytes_per_rank"][0] / dp["param_bytes_per_rank"][0],
            "peak_memory_ep_over_dp": ep["peak_memory_bytes"] / dp["peak_memory_bytes"],
        },
        "all_to_all_check": {
            "plan": plan_rows,
            "planned_bytes_per_step": planned_step, "planned_forward_bytes": planned_fwd,
            "measured_bytes_per_step_mean_over_ranks": measured_a2a,
            "count_per_step_per_rank": counts_a2a,
            "note": "the plan's formula is the mean over ranks (T*k*d elements a rank sends); a rank receives "
                    "what the routing sends it, so one rank's figure varies, their mean does not (the token-count "
                    "all-to-alls move E int64 a rank)",
        },
        "losses_agree": {
            "max_rel_diff_ep_vs_dp": _rel(ep["losses"], dp["losses"]),
            "max_rel_diff_ep_vs_single_device": _rel(ep["losses"], ref),
            "max_rel_diff_dp_vs_single_device": _rel(dp["losses"], ref),
            "tolerance": 1e-5,
            "single_device_losses": ref,
        },
        "caveat": f"gloo on {os.cpu_count()} shared CPU cores (other work ran alongside: see the load averages), not "
                  "NVLink/InfiniBand: an all-to-all here is a memory copy through gloo's threads that competes "
                  "with the ranks' compute for the same cores, and a tiny model's GEMMs are short. The step-time "
                  "ratio says what EP costs in this runtime on this machine, not on a GPU cluster; the byte counts "
                  "and the per-rank parameter/memory figures are what carries over. In fp32 on CPU the experts run "
                  "as models.moe_lm.grouped_mm_reference (one gathered weight per routed row), which dominates both "
                  "layouts' step time and activation memory; torch._grouped_mm (bf16) or a GPU kernel would not.",
        "load_average_before": load_before, "load_average_after": load_after,
        "workers_wall_s": workers_s,
    }
    la = out["losses_agree"]
    la["agree"] = all(la[k] <= la["tolerance"] for k in la if k.startswith("max_rel"))
    _results.save("moe_ep", out, args.write, args.out)
    print(f"step ep {ep['step_s'] * 1e3:.1f} ms, dp {dp['step_s'] * 1e3:.1f} ms "
          f"(ratio {out['ratios']['step_s_ep_over_dp']:.2f}); bytes ep {ep['comm_bytes_per_step']:,.0f}, "
          f"dp {dp['comm_bytes_per_step']:,.0f}; expert bytes/rank ep {ep['expert_param_bytes_per_rank'][0]:,}, "
          f"dp {dp['expert_param_bytes_per_rank'][0]:,}; losses agree {la['agree']} "
          f"({la['max_rel_diff_ep_vs_dp']:.2e})", file=sys.stderr)


if __name__ == "__main__":
    main()
