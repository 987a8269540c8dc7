"""``mcompile demo``: train a tiny Llama on 4 CPU processes (dp=2 x tp=2, sequence parallel) and
compare every step with the same run on one device.

The corpus is generated (a small grammar of English-like sentences, fixed seed) and tokenised as
bytes (the tiny Llama's vocabulary is 256), so the demo needs no download.
"""

from __future__ import annotations

import random
import time

import torch

WORDS = {
    "det": ["the", "a", "every", "no", "some"],
    "adj": ["quick", "lazy", "parallel", "sharded", "small", "large", "curious", "silent"],
    "noun": ["fox", "dog", "compiler", "graph", "tensor", "model", "rank", "pipeline", "kernel"],
    "verb": ["jumps over", "compiles", "splits", "gathers", "reduces", "trains", "sees", "follows"],
    "adv": ["quickly", "slowly", "exactly", "twice", "again"],
}


def corpus(n_sentences: int = 4000, seed: int = 0) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(n_sentences):
        w = {k: rng.choice(v) for k, v in WORDS.items()}
        w2 = {k: rng.choice(v) for k, v in WORDS.items()}
        out.append(f"{w['det']} {w['adj']} {w['noun']} {w['verb']} {w2['det']} {w2['noun']} {w['adv']}.")
    return " ".join(out)


def batches(steps: int, batch: int, seq: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = torch.tensor(list(corpus(seed=seed).encode()), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + seq] for s in starts])
        y = torch.stack([data[s + 1:s + seq + 1] for s in starts])
        out.append((x, y))
    return out


def _model():
    from mcompile.models import get_preset

    torch.manual_seed(0)
    return get_preset("llama3-tiny").build()


def _norm(total) -> float:
    """The norm ``clip_grad_norm_`` returned as a float (over DTensor parameters it is a DTensor)."""
    from torch.distributed.tensor import DTensor

    return float(total.full_tensor() if isinstance(total, DTensor) else total)


def _train(pm_or_model, data, lr, parallel: bool, progress=None):
    """AdamW with clipping to norm 1 over ``data``: the loss and the total gradient norm (before
    clipping: the norm ``clip_grad_norm_`` returns) of every step. The norm is what shows a gradient
    wrong by a constant factor, which clipping and AdamW hide from the loss."""
    opt = torch.optim.AdamW(pm_or_model.parameters(), lr=lr)
    losses, norms = [], []
    for x, y in data:
        if parallel:
            loss = pm_or_model.train_step(x, y)
        else:
            loss = pm_or_model(x, y)
            loss.backward()
        norms.append(_norm(torch.nn.utils.clip_grad_norm_(pm_or_model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(losses[-1])
    return losses, norms


def _worker(rank, world, steps, batch, seq, lr):
    import mcompile as mc

    data = batches(steps, batch, seq)
    pm = mc.parallelize(_model(), mc.Mesh(dp=2, tp=2), data[0], sequence_parallel=True)
    summary = None
    if rank == 0:
        from mcompile.ir.plan import plan_text

        summary = plan_text(pm.plan, {"batch": batch // 2, "seq": seq})
        print(summary, flush=True)
        from rich.progress import Progress

        with Progress() as bar:
            task = bar.add_task("training on 4 processes", total=steps)
            return _train(pm, data, lr, True, lambda loss: bar.update(task, advance=1, description=f"loss {loss:.3f}"))
    return _train(pm, data, lr, True)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def run(steps: int = 40, batch: int = 8, seq: int = 64, lr: float = 3e-3) -> dict:
    from rich.console import Console
    from rich.table import Table

    from mcompile.runtime.launch import spawn

    console = Console()
    console.print(f"mcompile demo: tiny Llama, dp=2 x tp=2 with sequence parallelism, {steps} steps of "
                  f"{batch} x {seq} bytes of a generated corpus")
    t0 = time.perf_counter()
    parallel, parallel_norms = spawn(_worker, 4, steps, batch, seq, lr)[0]
    t1 = time.perf_counter()
    single, single_norms = _train(_model(), batches(steps, batch, seq), lr, False)
    diff = [abs(a - b) for a, b in zip(parallel, single)]
    rel = [_rel(a, b) for a, b in zip(parallel, single)]
    norm_rel = [_rel(a, b) for a, b in zip(parallel_norms, single_norms)]
    table = Table(title="loss and gradient norm per step")
    for col in ("step", "4 processes", "1 device", "|difference|", "grad norm", "norm rel. diff"):
        table.add_column(col, justify="right")
    for i in sorted({*range(0, steps, max(1, steps // 10)), steps - 1}):
        table.add_row(str(i + 1), f"{parallel[i]:.5f}", f"{single[i]:.5f}", f"{diff[i]:.2e}",
                      f"{single_norms[i]:.4f}", f"{norm_rel[i]:.2e}")
    console.print(table)
    console.print(f"largest difference from one device over {steps} steps: {max(diff):.2e} in the loss "
                  f"({max(rel):.2e} relative), {max(norm_rel):.2e} relative in the gradient norm "
                  f"(parallel run {t1 - t0:.1f} s including start-up)")
    return {"parallel": parallel, "single": single, "max_abs_diff": max(diff), "max_rel_diff": max(rel),
            "parallel_norms": parallel_norms, "single_norms": single_norms, "max_norm_rel_diff": max(norm_rel)}
