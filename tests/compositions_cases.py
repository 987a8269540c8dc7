"""The composition matrix (tests/test_compositions.py, bench/compositions.py): every pair of features on a dense
decoder, an MoE decoder and an encoder of 4 layers (planned from 2 captured, block repetition on), accepted at parity
or refused at plan time.

A feature is a mesh axis of size 2 and/or Config options (:data:`FEATURES`); a pair is the union of both
(:func:`layout`). Module-level functions: the gloo workers import them by name (tests/conftest.py ``pool``)."""

from __future__ import annotations

import time

import torch
from bert_cases import MaskedLMLoss  # HF BertForMaskedLM's loss, positional

import mcompile as mc

LR = 1e-4  # AdamW, as tests/runtime_cases.py: at <= 1e-3 three steps keep fp32 rounding under 1e-5 (DESIGN §10)
BATCH, SEQ = 8, 16  # 8 rows: dp=2 x ep=2 x 2 microbatches, or dp=2 x 4 microbatches (pp with microbatches)
REL = 1e-5  # fp32 parity bound (DESIGN §7); never loosened
# recompute="auto": saved-activation bytes per rank at its peak; below what every layout saves at batch 8 x 16 (so
# the solver recomputes something) and above zero (so it must choose)
AUTO_BUDGET = 200_000
# parameters whose true gradient is exactly 0 (see run_layout), and the bound on theirs, of the largest gradient's norm
ZERO_GRADIENTS = ("attention.self.key.bias",)
NOISE = 1e-6

# name -> (mesh axes, Config options). Pipeline features take 2 microbatches (1 would leave a stage idle: no schedule
# to test); "microbatches" on top of pp doubles them (:func:`layout`). "overlap" is Config(overlap=False): the
# overlap passes are on by default, so every other pair with a dp axis runs them; this column runs the other path
# (collectives where first needed, dp buckets after the backward) at dp=2.
FEATURES: dict[str, tuple[dict, dict]] = {
    "tp": ({"tp": 2}, {}),
    "sp": ({"tp": 2}, {"sequence_parallel": True}),
    "pp-1f1b": ({"pp": 2}, {"schedule": "1f1b", "microbatches": 2}),
    "pp-gpipe": ({"pp": 2}, {"schedule": "gpipe", "microbatches": 2}),
    "pp-interleaved": ({"pp": 2}, {"schedule": "interleaved", "virtual_stages": 2, "microbatches": 2}),
    "pp-zbh1": ({"pp": 2}, {"schedule": "zbh1", "microbatches": 2}),
    "cp-ring": ({"cp": 2}, {"cp_attention": "ring"}),
    "cp-allgather": ({"cp": 2}, {"cp_attention": "allgather"}),
    "cp-a2a": ({"cp": 2}, {"cp_attention": "a2a"}),
    "ep": ({"ep": 2}, {}),
    "dp": ({"dp": 2}, {}),
    "zero1": ({"dp": 2}, {"zero": 1}),
    "zero2": ({"dp": 2}, {"zero": 2}),
    "zero3": ({"dp": 2}, {"zero": 3}),
    "recompute-selective": ({}, {"recompute": "selective"}),
    "recompute-full": ({}, {"recompute": "full"}),
    "recompute-auto": ({}, {"recompute": "auto", "activation_budget": AUTO_BUDGET}),
    "overlap": ({"dp": 2}, {"overlap": False}),
    "fuse": ({}, {"fuse": True}),
    "microbatches": ({}, {"microbatches": 2}),
}
# the axis a pair of option-only features runs on (recompute x fuse, ...): dp=2, the cheapest real mesh
CARRIER = {"dp": 2}
# mesh axes in the order a Mesh is written (DESIGN §3: tp last, the fastest-varying)
AXIS_ORDER = ("dp", "ep", "pp", "cp", "tp")
MODELS = ("dense", "moe", "encoder")


def family(feature: str) -> str:
    """Features of one family are alternatives, not a pair (two schedules, two cp attentions, two ZeRO stages)."""
    if feature in ("tp", "sp"):
        return "tp"  # SP is tp + sequence_parallel: the pair (tp, sp) is sp alone
    if feature == "dp" or feature.startswith("zero"):
        return "dp"  # each of these is dp=2 plus an option: (dp, zero2) is zero2 alone
    return feature.split("-")[0]


def applies(model: str, feature: str) -> bool:
    return feature != "ep" or model == "moe"  # ep splits experts: the MoE decoder only


def pairs(model: str) -> list[tuple[str, str]]:
    """Every unordered pair of features of distinct families that apply to ``model``, in FEATURES order."""
    names = [f for f in FEATURES if applies(model, f)]
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
            if family(a) != family(b) and {a, b} != {"dp", "overlap"}]  # (dp, overlap) is overlap alone


def layout(a: str, b: str) -> tuple[str, dict]:
    """(mesh spec, options) of the pair: the union of both features' axes and options; microbatches multiply
    (pp's 2 x the microbatches feature's 2); two option-only features run on :data:`CARRIER`."""
    (axes_a, opts_a), (axes_b, opts_b) = FEATURES[a], FEATURES[b]
    axes = {**axes_a, **axes_b} or dict(CARRIER)
    options = {**opts_a, **opts_b}
    if "microbatches" in opts_a and "microbatches" in opts_b:
        options["microbatches"] = opts_a["microbatches"] * opts_b["microbatches"]
    mesh = ",".join(f"{ax}={axes[ax]}" for ax in AXIS_ORDER if ax in axes)
    return mesh, options


# ---- models -----------------------------------------------------------------------------------------------------



def build(model: str, batch: int = BATCH, seq: int = SEQ):
    """(module in eval mode, positional inputs) of the matrix's models, 4 layers each:

    - "dense": HF LlamaForCausalLM, hidden 64, 4 heads over 2 kv heads, vocab 128 (conftest "hf-llama-4l");
    - "moe": the tiny Mixtral preset (4 experts, top-2, load-balancing and z losses on) at 4 layers;
    - "encoder": HF BertForMaskedLM, hidden 64, 4 heads, dropout 0; the first row's last 3 tokens padding
      (attention_mask 0), masked-LM targets at every third unpadded position."""
    if model == "dense":
        from conftest import build as conftest_build

        return conftest_build("hf-llama-4l", batch=batch)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if model == "moe":
        from moe_cases import MIXTRAL_TINY

        from mcompile.models.moe_lm import Mixtral, MixtralConfig

        cfg = MixtralConfig(**{**MIXTRAL_TINY, "n_layers": 4})
        m = Mixtral(cfg).eval()
        x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
        y = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
        return m, (x, y)
    if model == "encoder":
        from transformers import BertConfig, BertForMaskedLM
        from transformers.utils import logging

        logging.set_verbosity_error()
        cfg = BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
        m = MaskedLMLoss(BertForMaskedLM(cfg)).eval()
        ids = torch.randint(1, cfg.vocab_size, (batch, seq), generator=g)
        mask = torch.ones_like(ids)
        ids[0, -3:] = cfg.pad_token_id
        mask[0, -3:] = 0
        token_type = (torch.arange(seq)[None, :] >= seq // 2).long().expand(batch, seq).contiguous()
        labels = torch.full_like(ids, -100)
        labels[:, ::3] = ids[:, ::3]
        labels[mask == 0] = -100
        return m, (ids, mask, token_type, labels)
    raise ValueError(f"model={model!r}: use one of {', '.join(MODELS)}")


def data_ranks(mesh: str) -> int:
    """Ranks the batch is split over: dp x ep (cp ranks take the same rows)."""
    m = mc.Mesh.parse(mesh)
    return m.size("dp") * m.size("ep")


# ---- one pair ---------------------------------------------------------------------------------------------------
def attempt(rank, world, model, mesh, options, steps=3):
    """Worker: parallelize ``model`` on ``mesh`` with ``options``, then ``steps`` AdamW steps with clipping.
    Returns {"stage": "plan" | "run" | "done", "error": str | None, "losses", "norms", "grads" (rank 0, unclipped,
    the last step), "seconds"}: an exception from parallelize is a refusal at plan time, one from a step is not.
    Under ``fuse`` the fused ops run their PyTorch references (tests/kernel_paths.py): the composition is under test
    here, the kernels in their own tests (the Triton interpreter took 54% of the fused cover's time)."""
    if options.get("fuse"):
        from kernel_paths import reference_kernels

        with reference_kernels():
            return _attempt(rank, world, model, mesh, options, steps)
    return _attempt(rank, world, model, mesh, options, steps)


def _attempt(rank, world, model, mesh, options, steps):
    t0 = time.perf_counter()
    m, inputs = build(model)
    out = {"stage": "plan", "error": None, "losses": [], "norms": [], "grads": None}
    try:
        pm = mc.parallelize(m, mc.Mesh.parse(mesh), inputs, **options)
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        out["error"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.perf_counter() - t0
        return out
    out["stage"] = "run"
    try:
        if options.get("zero") in (1, 2):  # ZeRO-1/2: optimizer state sharded, through mcompile's optimizer
            from mcompile.runtime.zero import DistributedOptimizer

            opt = DistributedOptimizer(pm, torch.optim.AdamW, lr=LR)
            clip = opt.clip_grad_norm_
        else:  # the module's clipping counts every element once on every layout (pp: a rank holds its stages only)
            opt = torch.optim.AdamW(pm.parameters(), lr=LR)
            clip = pm.clip_grad_norm_
        for step in range(steps):
            loss = pm.train_step(*inputs)
            if step == steps - 1:
                out["grads"] = pm.full_grads()  # every rank calls it (it gathers); rank 0 reports it
            norm = clip(1.0)
            from torch.distributed.tensor import DTensor

            out["norms"].append((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
            opt.step()
            opt.zero_grad()
            out["losses"].append(loss.item())
    except Exception as e:  # noqa: BLE001 - a failure after planning: reported, never a refusal
        out["error"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.perf_counter() - t0
        return out
    out["stage"] = "done"
    if rank != 0:
        out["grads"] = None
    out["seconds"] = time.perf_counter() - t0
    return out


def reference(model: str, data: int = 1, microbatches: int = 1, steps: int = 3):
    """The single-device run of :func:`attempt`: (losses, norms, unclipped gradients of the last step). The MoE
    model's load-balancing loss holds batch statistics, which the runtime computes per global microbatch (every data
    rank's i-th piece, as Megatron and gradient accumulation on one device do): its reference accumulates over those
    microbatches (tests/moe_cases.py global_microbatches); the other models' losses are token means, whatever the
    split."""
    from moe_cases import global_microbatches

    m, inputs = build(model)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    pieces = global_microbatches(inputs, data, microbatches) if model == "moe" else [inputs]
    losses, norms, grads = [], [], None
    for step in range(steps):
        loss = torch.stack([m(*p) for p in pieces]).mean()
        loss.backward()
        if step == steps - 1:
            grads = {k: p.grad.clone() for k, p in m.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, grads


_REFERENCES: dict = {}


def cached_reference(model: str, mesh: str, options: dict):
    data = data_ranks(mesh) if model == "moe" else 1
    mb = options.get("microbatches", 1) if model == "moe" else 1
    key = (model, data, mb)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference(model, data, mb)
    return _REFERENCES[key]


def rel_err(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a)


def run_pair(model: str, a: str, b: str, timeout: float = 300) -> dict:
    """One cell of the matrix on the gloo worker pool: {"model", "pair", "mesh", "options", "verdict", ...}.

    verdict: "parity" (trained at fp32 parity: every rank's losses and clip norms, rank 0's every gradient, <= REL),
    "refused" (parallelize raised on every rank, before any step; "refusal" the message), or "failed" (anything
    else: an error after planning, a refusal on some ranks only, a hang, or a parity miss; "error" says which)."""
    mesh, options = layout(a, b)
    return {"model": model, "pair": [a, b], **run_layout(model, mesh, options, timeout)}


def run_layout(model: str, mesh: str, options: dict, timeout: float = 300) -> dict:
    """:func:`run_pair`'s record of any layout (several features at once: the CI tier's covers)."""
    from conftest import pool

    rec = {"model": model, "mesh": mesh, "options": options}
    t0 = time.perf_counter()
    world = mc.Mesh.parse(mesh).size()
    try:
        results = pool(world).run(attempt, model, mesh, options, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - a worker crash or a hang
        rec.update(verdict="failed", error=f"{type(e).__name__}: {str(e)[-2000:]}",
                   seconds=round(time.perf_counter() - t0, 1))
        return rec
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    stages = {r["stage"] for r in results}
    errors = {r["error"] for r in results}
    if stages == {"plan"}:
        if len(errors) == 1:
            # how long the ranks took to refuse (building the model included): a refusal before the capture is ~1 s
            rec.update(verdict="refused", refusal=results[0]["error"],
                       refused_after_s=round(max(r["seconds"] for r in results), 2))
        else:
            rec.update(verdict="failed", error="the ranks refused with different errors: " + " | ".join(errors))
        return rec
    if stages != {"done"}:
        bad = sorted({(r["stage"], r["error"]) for r in results if r["stage"] != "done"}, key=str)
        rec.update(verdict="failed", error="; ".join(f"at {s}: {e}" for s, e in bad))
        return rec
    ref_losses, ref_norms, ref_grads = cached_reference(model, mesh, options)
    loss_err = max(rel_err(x, y) for r in results for x, y in zip(r["losses"], ref_losses, strict=True))
    norm_err = max(rel_err(x, y) for r in results for x, y in zip(r["norms"], ref_norms, strict=True))
    grads = results[0]["grads"]
    if sorted(grads) != sorted(ref_grads):
        rec.update(verdict="failed", error=f"gradient keys differ: {sorted(set(grads) ^ set(ref_grads))}")
        return rec
    # a gradient that is exactly 0 in exact arithmetic (HF BERT's attention key.bias: softmax is invariant to a
    # per-query constant) is rounding noise on both sides, which no relative bound fits: bounded by NOISE of the
    # largest gradient instead, as tests/test_family_bert.py does
    top = max(g.norm().item() for g in ref_grads.values())
    noise = {k: (g - ref_grads[k]).norm().item() / top for k, g in grads.items() if k.endswith(ZERO_GRADIENTS)}
    grad_errs = {k: ((g - ref_grads[k]).norm() / ref_grads[k].norm()).item() for k, g in grads.items()
                 if k not in noise}
    worst = max(grad_errs, key=grad_errs.get)
    rec.update(loss_rel_err=loss_err, norm_rel_err=norm_err, grad_rel_err=grad_errs[worst], worst_grad=worst)
    if noise:
        rec["zero_grad_err"] = max(noise.values())  # of the largest gradient's norm
    ok = max(loss_err, norm_err, grad_errs[worst]) <= REL and max(noise.values(), default=0) <= NOISE
    rec["verdict"] = "parity" if ok else "failed"
    if not ok:
        rec["error"] = (f"parity miss: loss {loss_err:.2e}, clip norm {norm_err:.2e}, gradient {grad_errs[worst]:.2e} "
                        f"({worst}) > {REL}" + (f"; zero gradients {max(noise.values()):.2e} > {NOISE} of the largest"
                                                if noise else ""))
    return rec


# ---- refusals ---------------------------------------------------------------------------------------------------
# what a refusal must say to name a feature (case-insensitive, whole words): its axis or its Config field
NAMES = {
    "tp": (r"tp", r"tensor[ -]parallel\w*"),
    "sp": (r"sequence_parallel", r"sequence[ -]parallel\w*", r"SP"),
    "pp": (r"pp", r"pipeline\w*", r"schedule", r"1f1b", r"gpipe", r"interleaved", r"zbh1", r"virtual_stages"),
    "cp": (r"cp", r"context[ -]parallel\w*", r"cp_attention", r"ring", r"allgather", r"a2a"),
    "ep": (r"ep", r"expert[ -]parallel\w*"),
    "dp": (r"dp", r"data[ -]parallel\w*"),
    "zero": (r"zero", r"ZeRO-?\d"),
    "recompute": (r"recompute", r"activation_budget"),
    "overlap": (r"overlap",),
    "fuse": (r"fuse", r"fused", r"fusion"),
    "microbatches": (r"microbatch(es)?",),
}


def names(feature: str, text: str) -> bool:
    """Whether ``text`` names ``feature`` (:data:`NAMES` of its family; dp, ZeRO and overlap by their own words)."""
    import re

    key = {"tp": "tp", "sp": "sp", "dp": "dp", "overlap": "overlap", "ep": "ep", "fuse": "fuse",
           "microbatches": "microbatches"}.get(feature) or feature.split("-")[0].rstrip("0123456789")
    return any(re.search(rf"(?<![\w]){w}(?![\w])", text, re.IGNORECASE) for w in NAMES[key])


# features a model refuses alone, whatever they are paired with: their refusal names them, not the partner.
# The encoder's padding mask is not the causal pattern, which ring and a2a attention under cp require (allgather
# applies any mask: passes/cp/plan.py)
REFUSED_ALONE = {("encoder", "cp-ring"), ("encoder", "cp-a2a")}


def refusal_problems(text: str, a: str, b: str, model: str | None = None) -> list[str]:
    """What a pair's refusal lacks: each feature's name (the one a model refuses alone: :data:`REFUSED_ALONE`), and
    what to do ("use ...", "set ...", ...)."""
    import re

    alone = [f for f in (a, b) if (model, f) in REFUSED_ALONE]
    out = [f"does not name {f}" for f in (alone[:1] or (a, b)) if not names(f, text)]
    if not re.search(r"\b(use|set|add|drop|remove|build|pass|choose|give|instead|without)\b", text, re.IGNORECASE):
        out.append("does not say what to use instead")
    return out
