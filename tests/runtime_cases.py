"""Functions the gloo worker processes run for tests/test_runtime.py: fn(rank, world, *args).

Module-level so the workers can import them by name.
"""

from __future__ import annotations

import torch

import mcompile as mc

from conftest import build

LR = 1e-4  # see test_runtime.py for why


def norm_value(norm) -> float:
    """The total norm a clipping call returned, as a float: ``torch.nn.utils.clip_grad_norm_`` over
    DTensor parameters returns a DTensor."""
    from torch.distributed.tensor import DTensor

    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()


def train(rank, world, name, mesh, options, steps=3, batch=4, want_grads_at=None, inspect=None):
    """Three AdamW steps with clipping of the tiny model ``name`` (conftest.build): :func:`train_model`."""
    model, inputs = build(name, batch=batch)
    return train_model(rank, model, inputs, mesh, options, steps, want_grads_at, inspect)


def train_model(rank, model, inputs, mesh, options, steps=3, want_grads_at=None, inspect=None):
    """AdamW steps with clipping. Per-step losses; full gradients at one step, taken *before*
    clipping (rank 0); this rank's local parameter sizes; the total norm each clipping returned
    (and, given ``inspect``, a module-level function of the ParallelModule, its value after the steps).
    Clipping to norm 1 before comparing would hide a gradient wrong by a constant factor (DESIGN,
    "Learned since"): the unclipped gradients and the returned norms are what parity compares."""
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses, grads, norms = [], None, []
    want = steps - 1 if want_grads_at is None else want_grads_at
    for step in range(steps):
        loss = pm.train_step(*inputs)
        if step == want:
            grads = pm.full_grads()  # copies: the clipping below leaves them as they are
        if "pp" in mesh:  # a rank's parameters() are its stages' only: the module clips the whole model
            norms.append(norm_value(pm.clip_grad_norm_(1.0)))
        else:
            norms.append(norm_value(torch.nn.utils.clip_grad_norm_(pm.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    local_numels = {k: p.to_local().numel() for k, p in pm.named_parameters()}
    if inspect is not None:
        return losses, grads if rank == 0 else None, local_numels, norms, inspect(pm)
    return losses, grads if rank == 0 else None, local_numels, norms


def reference(name, steps=3, batch=4, want_grads_at=None):
    """``train`` on one device: per-step losses, the unclipped gradients at one step, the clip norms."""
    model, inputs = build(name, batch=batch)
    return reference_model(model, inputs, steps, want_grads_at)


def reference_model(model, inputs, steps=3, want_grads_at=None):
    """:func:`train_model` on one device."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads, norms = [], None, []
    want = steps - 1 if want_grads_at is None else want_grads_at
    for step in range(steps):
        loss = model(*inputs)
        loss.backward()
        if step == want:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, norms


def world_of(mesh: str) -> int:
    """The ranks of a mesh spec such as "dp=2,tp=2"."""
    world = 1
    for part in mesh.split(","):
        world *= int(part.split("=")[1])
    return world


def check_parity(name, mesh, options, batch=4, rel=1e-5):
    """:func:`train` of the preset ``name`` on a pool of gloo workers against one device: every rank's losses
    and clip norms, and rank 0's unclipped gradients, at ``rel`` relative. (results, gradient errors)."""
    import pytest

    from conftest import pool

    results = pool(world_of(mesh)).run(train, name, mesh, options, 3, batch, timeout=600)
    ref_losses, ref_grads, ref_norms = reference(name, batch=batch)
    for losses, _, _, norms in results:
        assert losses == pytest.approx(ref_losses, rel=rel, abs=0)
        assert norms == pytest.approx(ref_norms, rel=rel, abs=0)
    errors = grad_errors(results[0][1], ref_grads)
    for k, err in errors.items():
        assert err <= rel, (k, err)
    return results, errors


def grad_errors(grads: dict, ref: dict) -> dict[str, float]:
    """Per tensor, the relative error in norm of a (full, unclipped) gradient against the reference."""
    assert sorted(grads) == sorted(ref)
    return {k: ((g - ref[k]).norm() / ref[k].norm()).item() for k, g in grads.items()}


def profiled_step(rank, world, name, mesh, options):
    """One train_step under torch.profiler: the c10d collectives it ran, by name."""
    import collections

    from torch.profiler import ProfilerActivity, profile

    model, inputs = build(name, batch=4)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    pm.train_step(*inputs)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pm.train_step(*inputs)
    names = collections.Counter(e.name for e in prof.events() if e.name.startswith("c10d::"))
    return dict(names), [(c.op, c.forward, c.backward, c.axis) for c in pm.plan.collectives]


def train_steps(pm, opt, inputs, steps, before_step=None):
    """Losses of ``steps`` optimizer steps on the fixed batch ``inputs``; ``before_step()`` runs
    between each backward and its step (gradient clipping)."""
    losses = []
    for _ in range(steps):
        losses.append(pm.train_step(*inputs).item())
        if before_step is not None:
            before_step()
        opt.step()
        opt.zero_grad()
    return losses


def train_and_save(rank, world, name, mesh, options, path, steps=10, save_at=5):
    """Train ``steps`` steps, saving after ``save_at``; the losses of every step."""
    model, inputs = build(name, batch=4)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    losses = []
    for step in range(1, steps + 1):
        losses.append(pm.train_step(*inputs).item())
        opt.step()
        opt.zero_grad()
        if step == save_at:
            pm.save_checkpoint(path, opt, extra={"step": step})
    return losses


def resume(rank, world, name, mesh, options, path, steps=10):
    """Fresh model (another seed: the checkpoint must overwrite everything), load, train to ``steps``."""
    model, inputs = build(name, seed=123, batch=4)
    _, inputs = build(name, batch=4)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    start = pm.load_checkpoint(path, opt)["step"]
    return train_steps(pm, opt, inputs, steps - start)


def load_into(rank, world, name, mesh, options, path):
    model, inputs = build(name, batch=4)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    try:
        pm.load_checkpoint(path, torch.optim.AdamW(pm.parameters(), lr=1e-3))
    except Exception as e:  # noqa: BLE001 - the error is the result
        return f"{type(e).__name__}: {e}"
    return "loaded"


def curve(rank, world, name, mesh, options, steps=50, lr=3e-3):
    """Loss of every step of a short training run (fixed batch)."""
    model, inputs = build(name, batch=4)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    opt = torch.optim.AdamW(pm.parameters(), lr=lr)
    return train_steps(pm, opt, inputs, steps, lambda: torch.nn.utils.clip_grad_norm_(pm.parameters(), 1.0))


def expect_error(rank, world, name, mesh, options, batch=4, global_batch=None):
    model, inputs = build(name, batch=batch)
    try:
        pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
        if global_batch is not None:
            _, other = build(name, batch=global_batch)
            pm.train_step(*other)
    except Exception as e:  # noqa: BLE001 - the error is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


def contract(rank, world, name, mesh, options):
    """The public contract beyond train_step: forward, full state dict round trip, grads that
    accumulate like loss.backward(), named_parameters, DTensor parameters."""
    from torch.distributed.tensor import DTensor

    model, inputs = build(name, batch=4)
    sd_before = {k: v.clone() for k, v in model.state_dict().items()}
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    out = {"forward": pm(*inputs).item()}
    full = pm.full_state_dict()
    out["state_keys"] = list(full) == list(sd_before)
    out["state_equal"] = all(torch.equal(full[k], sd_before[k]) for k in sd_before)
    out["all_dtensor"] = all(isinstance(p, DTensor) for p in pm.parameters())
    out["names"] = [k for k, _ in pm.named_parameters()]
    pm.train_step(*inputs)
    once = pm.full_grads()
    pm.train_step(*inputs)  # no zero_grad: gradients add up, as loss.backward() twice
    twice = pm.full_grads()
    out["accumulate"] = max(((twice[k] - 2 * once[k]).norm() / (2 * once[k]).norm()).item() for k in once)
    # load_full_state_dict is the inverse of full_state_dict
    perturbed = {k: v + 0.5 if v.is_floating_point() else v for k, v in sd_before.items()}
    pm.load_full_state_dict(perturbed)
    back = pm.full_state_dict()
    out["load_round_trip"] = all(torch.equal(back[k], perturbed[k]) for k in perturbed)
    return out


def forward_loss(rank, world, name, mesh, options, batch=4):
    """The parallel module's forward (no training step) on the global batch: the model's loss."""
    model, inputs = build(name, batch=batch)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    return pm(*inputs).item()


class ShiftedIds(torch.nn.Module):
    """Embedding -> linear -> cross-entropy whose second ids are the labels shifted right in place, as Hugging
    Face's encoder-decoders make decoder inputs: zeros, a slice written, a select filled, a masked fill."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.fc = torch.nn.Linear(32, 64, bias=False)

    def forward(self, ids, labels):
        shifted = labels.new_zeros(labels.shape)
        shifted[..., 1:] = labels[..., :-1].clone()
        shifted[..., 0] = 3
        shifted.masked_fill_(shifted == -100, 0)
        h = self.emb(shifted) + self.emb(ids)
        return torch.nn.functional.cross_entropy(self.fc(h).flatten(0, 1), labels.flatten())


def shifted_ids_case():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(1, 64, (4, 16), generator=g), torch.randint(1, 64, (4, 16), generator=g)
    labels[0, :5] = -100
    return ShiftedIds(), (ids, labels)


def shifted_ids_losses(rank, world, mesh, options, steps=2):
    model, inputs = shifted_ids_case()
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    return train_steps(pm, opt, inputs, steps)


def gloo_threads() -> int:
    """Threads of this process that gloo process groups run (two per group and a TCP loop)."""
    import os

    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return sum(n.startswith(("pt_gloo", "gloo_")) for n in names)


def parallelize_repeatedly(rank, world, mesh: str, times: int):
    """``parallelize`` the same tiny model ``times`` times on one mesh: the gloo threads after each, and whether
    every module got the same process groups (made once per process, mcompile.runtime.launch.device_mesh)."""
    import gc

    threads, groups = [], []
    for _ in range(times):
        model, inputs = build("llama3-tiny")
        pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs)
        pm.train_step(*inputs)
        groups.append(tuple(id(pm.device_mesh.get_group(a)) for a in pm.device_mesh.mesh_dim_names))
        del pm
        gc.collect()
        threads.append(gloo_threads())
    return threads, len(set(groups))
