"""Human-readable views of a compiled program for ``mcompile plan`` / ``show``: its MoE layers, measured memory
per rank, fused ops, pipeline stages. The plan's own tables (parameters, collectives per layer, memory per rank)
are what ``str(plan)`` prints: :func:`mcompile.ir.plan.plan_text`.

Memory per rank is :func:`mcompile.ir.memory_model.memory_per_rank` (Megatron-LM's accounting:
fp32 -> 4 + 4 + 8 = 16 B per parameter, bf16 -> 2 + 4 + 4 + 8 = 18 B, plus AdamW's step counts).
"""

from __future__ import annotations

import io

import sympy

from mcompile.ir.memory_model import MemoryPerRank as MemoryPerRank  # re-exported: report used to define it
from mcompile.ir.memory_model import memory_per_rank
from mcompile.ir.plan import Plan, _gib, cut_position


def moe_summary(compiled, sizes: dict[str, int] | None = None, dtype: str | None = None) -> dict | None:
    """The mixture-of-experts facts of a compiled plan (None for a dense model): per MoE layer E experts,
    k of them per token, hidden d and expert width f; experts per rank (E/ep) and each expert's hidden
    units per rank (f/tp under expert tensor parallelism); the collectives of one MoE layer over ep as
    the plan records them (bytes this rank sends, formulas in ``batch`` and ``seq``: T = batch·seq tokens
    of this rank; the all-to-all dispatcher's token rows, T·k·d elements, also with k as a symbol), their
    sum per layer and step (forward and backward) and its value at ``sizes``; the model state per rank
    split into experts and the rest (:func:`mcompile.ir.memory_model.memory_per_rank`)."""
    from mcompile.ir.moe import ExpertForm, moe_layers_of

    cap, plan = compiled.captured, compiled.plan
    nodes = moe_layers_of(cap.gm)
    if not nodes:
        return None
    n = nodes[0]
    x, idx, _w, *ws = n.args
    form = ExpertForm.parse(n.kwargs["form"])
    E, k, d = int(ws[0].meta["val"].shape[0]), int(idx.meta["val"].shape[1]), int(x.meta["val"].shape[1])
    dn = form.n_matrices - 1  # the down projection (input-projection biases follow the matrices)
    f = int(ws[dn].meta["val"].shape[form.hidden_dims()[dn]])
    ep, tp = plan.mesh.get("ep", 1), plan.mesh.get("tp", 1)
    expert_fqns = {cap.params[w.name] for m in nodes for w in m.args[3:] if w.name in cap.params}
    down = cap.params.get(ws[dn].name)
    local_f = f
    if down in plan.params:  # each expert's hidden units on one rank (expert tensor parallelism shards them)
        local_f = int(plan.params[down].local_shape[form.hidden_dims()[dn]])
    b, s, ks = sympy.Symbol("batch", positive=True), sympy.Symbol("seq", positive=True), sympy.Symbol("k")
    at = {"batch": (sizes or {}).get("batch", 1), "seq": (sizes or {}).get("seq", 1)}
    rec = [c for c in plan.collectives if c.axis == "ep" and c.purpose.startswith("moe")]
    layer = rec[0].layer if rec else None
    colls, per_layer = [], sympy.Integer(0)
    for c in rec:
        if c.layer != layer:
            continue
        e = sympy.sympify(c.bytes, locals={"batch": b, "seq": s})
        with_k = sympy.expand(e / k) * ks if c.purpose in ("moe: dispatch", "moe: combine") else e
        times = (c.forward != "none") + (c.backward != "none")
        per_layer += times * e
        colls.append({"purpose": c.purpose, "forward": c.forward, "backward": c.backward, "bytes": c.bytes,
                      "bytes_in_k": str(with_k)})
    layer_at = int(per_layer.subs({b: at["batch"], s: at["seq"]}))
    mem_e = memory_per_rank(plan, dtype, only=expert_fqns)
    mem_all = memory_per_rank(plan, dtype)
    return {"moe_layers": len(nodes), "experts": E, "top_k": k, "hidden": d, "expert_hidden": f, "form": form.text(),
            "ep": ep, "experts_per_rank": E // ep, "expert_hidden_per_rank": local_f, "tp": tp,
            "collectives": colls, "layer_bytes": str(per_layer), "layer_bytes_at_sizes": layer_at,
            "step_bytes_at_sizes": layer_at * len(nodes), "sizes": at,
            "memory_per_rank": {"experts": mem_e.total, "dense": mem_all.total - mem_e.total, "total": mem_all.total}}


def moe_text(compiled, sizes: dict[str, int] | None = None, dtype: str | None = None) -> str:
    """:func:`moe_summary` as lines for ``mcompile plan`` ("" for a dense model)."""
    m = moe_summary(compiled, sizes, dtype)
    if m is None:
        return ""
    at = m["sizes"]
    lines = [f"Mixture of experts: {m['moe_layers']} MoE layers of E={m['experts']} experts ({m['form']}), "
             f"top-k={m['top_k']}, hidden d={m['hidden']}, expert hidden f={m['expert_hidden']}",
             f"  experts per rank: {m['experts_per_rank']} (E/ep = {m['experts']}/{m['ep']})"
             + (f", each with {m['expert_hidden_per_rank']} of its {m['expert_hidden']} hidden units (expert tensor "
                f"parallelism over tp={m['tp']})" if m["expert_hidden_per_rank"] != m["expert_hidden"] else "")]
    if m["collectives"]:
        lines.append(f"  over ep={m['ep']}, per MoE layer and step, bytes this rank sends (T = batch*seq of its "
                     f"tokens, k = {m['top_k']}; an all-to-all moves (ep-1)/ep of them off the rank):")
        w = max(len(c["purpose"]) for c in m["collectives"])
        for c in m["collectives"]:
            kinds = " + ".join(x for x in (c["forward"] + " forward", c["backward"] + " backward")
                               if not x.startswith("none"))
            lines.append(f"    {c['purpose']:<{w}}  {kinds:<38} {c['bytes_in_k']}"
                         + (f" = {c['bytes']}" if c["bytes_in_k"] != c["bytes"] else ""))
        lines.append(f"    per MoE layer: {m['layer_bytes']} bytes; at batch={at['batch']}, seq={at['seq']}: "
                     f"{_gib(m['layer_bytes_at_sizes'])} a layer, {_gib(m['step_bytes_at_sizes'])} for the "
                     f"{m['moe_layers']} layers")
    else:
        lines.append("  no ep axis: every rank holds all experts and runs its own tokens through them (no all-to-all)")
    mem = m["memory_per_rank"]
    lines.append(f"  model state per rank (memory model: parameters, fp32 gradients, AdamW): experts "
                 f"{_gib(mem['experts'])} + the rest {_gib(mem['dense'])} = {_gib(mem['total'])}")
    return "\n".join(lines)


def measure_per_rank(compiled, inputs: tuple, lr: float = 1e-3) -> list[dict[str, int]]:
    """Run one training step of every rank's program together (threads, the simulated
    communicator) under :class:`mcompile.runtime.memory.MemoryTracker`; per rank: the bytes of
    parameters, gradients and AdamW state it then holds, and its peak of activations."""
    import torch

    from mcompile.runtime.memory import MemoryTracker
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
        tracker = MemoryTracker()
        tracker.register(params, "parameters")
        opt = torch.optim.AdamW(params, lr=lr)
        with tracker:
            out = prog(*[local[n] if n in local else user[n] for n in names])
            out[0].backward()
            tracker.register([p.grad for p in params], "gradients")
            opt.step()
            tracker.register_optimizer(opt)
        return {"parameters": tracker.current["parameters"], "gradients": tracker.current["gradients"],
                "optimizer": tracker.current["optimizer"], "peak_activations": tracker.max["activations"]}

    return run_threads(ThreadedWorld(compiled.mesh), rank_fn)


# ---- fused nodes in `mcompile show` ---------------------------------------------------------------
# The fusion pass (mcompile.passes.fuse) names the op it put in place of a pattern in node.meta[key];
# the key comes from the caller, so this core module needs nothing from passes/.
def mark_fused(gm, key: str) -> str:
    """``gm.code`` with ``# fused: <op>`` after each line that calls a fused op."""
    import operator

    label = {n.name: n.meta[key] for n in gm.graph.nodes if n.meta.get(key) and n.target is not operator.getitem}
    lines = []
    for line in gm.code.splitlines():
        name = line.strip().partition(" = ")[0]
        lines.append(f"{line}  # fused: {label[name]}" if name in label else line)
    return "\n".join(lines)


def fused_summary(counts: dict[str, int]) -> str:
    """One line, e.g. ``fused: rms_norm x1, add_rms_norm x4, swiglu x2, rope x4`` (patterns found)."""
    found = [f"{op} x{n}" for op, n in counts.items() if n]
    return "fused: " + (", ".join(found) if found else "nothing")


# ---- pipeline stages in `mcompile plan` -------------------------------------------------------------
def stage_span(lo: float, hi: float, n_layers: int) -> str:
    """What a stage [lo, hi) holds (layer units as :func:`cut_position`): "embedding, layers 0-3",
    "end of layer 3, layers 4-7, head"."""
    parts = []
    if lo < 0:
        parts.append("embedding")
        lo = 0.0
    first = int(lo) if float(lo).is_integer() else int(lo) + 1
    if not float(lo).is_integer():
        parts.append(f"end of layer {int(lo)}")
    last = min(int(hi), n_layers)  # whole layers first .. last - 1
    if last > first:
        parts.append(f"layer {first}" if last - first == 1 else f"layers {first}-{last - 1}")
    if not float(hi).is_integer() and int(hi) < n_layers:
        parts.append(f"start of layer {int(hi)}" if int(hi) >= first else f"part of layer {int(hi)}")
    if hi >= n_layers:
        parts.append("head")
    return ", ".join(parts) or "nothing"


def stage_cuts_text(plan: Plan) -> str:
    """One line per cut of a pipelined plan: its position in layers and the captured node it is at
    (what ``stage_cuts=`` pins)."""
    stages = plan.pipeline.get("stages", [])
    if len(stages) < 2:
        return ""
    n_layers = int(round(stages[-1]["layers"][1]))
    lines = []
    for i, st in enumerate(stages[1:], 1):
        node = plan.stage_cuts[i - 1] if i - 1 < len(plan.stage_cuts) else "?"
        lines.append(f"cut {i}: stage {i} starts {cut_position(st['layers'][0], n_layers)} (captured node {node})")
    return "\n".join(lines)


def pipeline_text(plan: Plan, batch: int = 1, dtype: str | None = None, width: int = 160) -> str:
    """The stage table of a pipelined plan: layers, parameters and their memory, activations held
    at the peak of the schedule, cost share; imbalance and the schedule's predicted bubble."""
    from rich.console import Console
    from rich.table import Table

    from mcompile.runtime.schedules import build_schedule, peak_activation_bytes

    pl = plan.pipeline
    pp, v, m = pl["pp"], pl["virtual"], pl["microbatches"]
    per_param = 18 if dtype in ("bfloat16", "float16") else 16  # weights + fp32 grads + AdamW (Megatron)
    mb = max(1, batch // m) if batch >= m else 1
    actions = build_schedule(plan.schedule, pp, v, m)
    split = plan.mesh.get("tp", 1) * plan.mesh.get("cp", 1)  # cp: a rank holds 1/cp of every sequence's tokens
    stage_bytes = {i: st["act_bytes_per_sample"] * mb / split for i, st in enumerate(pl["stages"])}
    peak = [peak_activation_bytes(actions[r], {s: b for s, b in stage_bytes.items() if s % pp == r})
            for r in range(pp)]
    total_cost = sum(st["cost"] for st in pl["stages"]) or 1.0
    t = Table(title=f"Pipeline: {len(pl['stages'])} stages on pp={pp} (virtual {v}), schedule {plan.schedule}, "
                    f"{m} microbatches of {mb}, cuts at {pl['granularity']} granularity")
    for col in ("stage", "rank", "layers", "parameters", "per rank", "param+grad+optim per rank",
                "activations / microbatch (captured / tp" + (" / cp)" if plan.mesh.get("cp", 1) > 1 else ")"),
                "cost share"):
        t.add_column(col)
    n_layers = int(round(pl["stages"][-1]["layers"][1]))
    for i, st in enumerate(pl["stages"]):
        lo, hi = st["layers"]
        t.add_row(str(i), str(st["rank"]), stage_span(lo, hi, n_layers), f"{st['params']:,}", f"{st['local_params']:,}",
                  _gib(st["local_params"] * per_param), _gib(int(stage_bytes[i])), f"{st['cost'] / total_cost:.1%}")
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None)
    console.print(t)
    console.print(stage_cuts_text(plan), highlight=False)
    console.print("peak activations held per rank (forward until backward, as the schedule runs): "
                  + ", ".join(f"rank {r}: {_gib(int(b))}" for r, b in enumerate(peak)))
    console.print(f"stage imbalance (max / mean cost - 1): {pl['imbalance']:.1%}"
                  + ("" if pl.get("pinned") else " (the min-max optimum at this granularity)")
                  + f"; predicted bubble of {plan.schedule}: {pl['bubble']:.1%}")
    return buf.getvalue()
