"""Functions the gloo worker processes run for tests/test_checkpoint_reshard.py: fn(rank, world, *args).

Module-level so the workers can import them by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from runtime_cases import LR

import mcompile as mc
from mcompile.runtime.zero import DistributedOptimizer

from conftest import build

STEPS, SAVE_AT, BATCH = 10, 5, 4


def batches(name="llama3-tiny"):
    """A fixed batch per step (other tokens every step: a resumed run must continue the data too)."""
    _, (tokens, targets) = build(name, batch=BATCH)
    vocab = int(max(tokens.max(), targets.max())) + 1
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        t = torch.randint(0, vocab, tokens.shape, generator=g)
        y = torch.randint(0, vocab, targets.shape, generator=g)
        y[0, :5] = -100
        out.append((t, y))
    return out


def reference(name="llama3-tiny"):
    """The uninterrupted single-device run: the plain model and torch AdamW, STEPS steps."""
    model, _ = build(name, batch=BATCH)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, saved = [], None
    for tokens, targets in batches(name):
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if len(losses) == SAVE_AT:
            saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, saved


def _module(mesh, options, seed=0, name="llama3-tiny"):
    model, inputs = build(name, seed=seed, batch=BATCH)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    if options.get("zero"):
        opt = DistributedOptimizer(pm, torch.optim.AdamW, lr=LR)
    else:
        opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    return pm, opt


def _steps(pm, opt, first, last):
    losses = []
    for tokens, targets in batches()[first:last]:
        losses.append(pm.train_step(tokens, targets).item())
        opt.step()
        opt.zero_grad()
    return losses


def train_and_save(rank, world, mesh, options, path, async_save=False):
    """SAVE_AT steps, save (``async_save``: in the background while this run goes on), then the rest:
    the losses of all STEPS steps (the run after an async save must not disturb what is written)."""
    pm, opt = _module(mesh, options)
    losses = _steps(pm, opt, 0, SAVE_AT)
    pending = pm.save_checkpoint(path, opt, extra={"step": SAVE_AT, "data": {"batch": SAVE_AT}},
                                 async_save=async_save)
    losses += _steps(pm, opt, SAVE_AT, STEPS)
    if pending is not None:
        pending.wait()
    return losses


def resume(rank, world, mesh, options, path):
    """A fresh module from other initial weights and a fresh optimizer load the checkpoint and run the
    remaining steps: their losses, the extra saved, and the final full state dict (rank 0)."""
    pm, opt = _module(mesh, options, seed=123)
    extra = pm.load_checkpoint(path, opt)
    losses = _steps(pm, opt, extra["step"], STEPS)
    full = pm.full_state_dict()
    return {"losses": losses, "extra": extra, "state": full if rank == 0 else None}


def weights_from(rank, world, mesh, path):
    """``parallelize(meta model, mesh, weights=checkpoint)``: the full state dict (rank 0)."""
    from mcompile.models import get_preset

    with torch.device("meta"):
        model = get_preset("llama3-tiny").build().eval()
    _, inputs = build("llama3-tiny", batch=BATCH)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, weights=path)
    full = pm.full_state_dict()
    return full if rank == 0 else None


def _spoil(src: Path, dst: Path, how: str) -> None:
    shutil.copytree(src, dst)
    data = sorted(dst.glob("*.distcp"))
    if how == "no_meta":
        (dst / "mcompile_plan.json").unlink()
    elif how == "no_data":
        data[-1].unlink()
    elif how == "truncated":
        with open(data[0], "r+b") as f:
            f.truncate(data[0].stat().st_size // 2)
    elif how == "bad_metadata":
        (dst / ".metadata").write_bytes(b"not a pickle")
    elif how == "old_format":  # as the first format's meta file: no "format"
        meta = json.loads((dst / "mcompile_plan.json").read_text())
        del meta["format"]
        (dst / "mcompile_plan.json").write_text(json.dumps(meta))


def bad_inputs(rank, world, path):
    """Save llama3-tiny at tp=2 after one step; then what loading refuses, each before any value is
    read: another model (vocabulary 128), a folder without its meta file, a data file missing, a
    data file truncated, unreadable DCP metadata, the first format's meta file, another optimizer. Per
    case: the error and whether the model's parameters stayed as they were."""
    import dataclasses

    from mcompile.models import get_preset
    from mcompile.models.llama import Llama

    path = Path(path)
    pm, opt = _module("tp=2", {})
    _steps(pm, opt, 0, 1)
    pm.save_checkpoint(path / "good", opt, extra={"step": 1})
    if rank == 0:
        for how in ("no_meta", "no_data", "truncated", "bad_metadata", "old_format"):
            _spoil(path / "good", path / how, how)
    torch.distributed.barrier()
    out = {}
    cfg = dataclasses.replace(get_preset("llama3-tiny").config, vocab_size=128)
    torch.manual_seed(5)
    other = Llama(cfg).eval()
    _, inputs = build("llama3-tiny", batch=BATCH)
    cases = {"other_model": (other, "good", "adamw"), "sgd": (None, "good", "sgd")}
    cases.update({how: (None, how, "adamw")
                  for how in ("no_meta", "no_data", "truncated", "bad_metadata", "old_format")})
    for case, (model, folder, kind) in cases.items():
        if model is None:
            model, _ = build("llama3-tiny", seed=9, batch=BATCH)
        target = mc.parallelize(model, mc.Mesh.parse("tp=2"), (inputs[0] % 128, inputs[1] % 128))
        o = torch.optim.SGD(target.parameters(), lr=LR) if kind == "sgd" else \
            torch.optim.AdamW(target.parameters(), lr=LR)
        before = {k: p.detach().to_local().clone() for k, p in target.named_parameters()}
        try:
            target.load_checkpoint(path / folder, o)
            err = None
        except Exception as e:  # noqa: BLE001 - the error is the result
            err = f"{type(e).__name__}: {e}"
        same = all(torch.equal(before[k], p.detach().to_local()) for k, p in target.named_parameters())
        out[case] = (err, same)
    return out
