"""Worker functions for the pipeline tests (module level: they run in the gloo worker pool)."""

from __future__ import annotations

import time

import torch

from mcompile.runtime.pipeline import MessageSpec, PipelineExecutor
from mcompile.runtime.schedules import build_schedule


class SleepStage:
    """A stage that only takes time: forward t_f, backward t_b (input part t_b - t_w when split)."""

    def __init__(self, t_f: float, t_b: float, t_w: float, split: bool, last: bool):
        self.t_f, self.t_b, self.t_w, self.splits_weight, self.last = t_f, t_b, t_w, split, last

    def forward(self, mb, inputs):
        time.sleep(self.t_f)
        return torch.full((), float(mb)) if self.last else (torch.full((4,), float(mb)),)

    def backward(self, mb, outputs, grads, received):
        time.sleep(self.t_b - (self.t_w if self.splits_weight else 0.0))
        return [torch.zeros(4) for _ in received]

    def backward_weight(self, mb):
        time.sleep(self.t_w)


def sleep_pipeline(rank, world, schedule, m, virtual, t_f, t_b, t_w):
    k = world * virtual
    actions = build_schedule(schedule, world, virtual, m)
    split = schedule == "zbh1"
    stages = {s: SleepStage(t_f, t_b, t_w, split, s == k - 1) for s in range(k) if s % world == rank}
    specs = {s: [MessageSpec((4,), torch.float32, True)] for s in range(k - 1)}
    ex = PipelineExecutor(rank=rank, pp_rank=rank, num_stages=k, actions=actions, microbatches=m,
                          peer_of_stage=lambda s: s % world, stages=stages, send_specs=specs, record=True)
    torch.distributed.barrier()
    ex.run(torch.device("cpu"))
    return [e.__dict__ for e in ex.events]


def contract_pp(rank, world, name, mesh, path):
    """Under pipeline parallelism: the full state dict, forward, the timeline and a checkpoint that
    resumes bit-identically."""
    from pathlib import Path

    import mcompile as mc

    from conftest import build

    model, inputs = build(name, batch=4)
    opts = {"microbatches": 2}
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **opts)
    out = {"state": {k: v.clone() for k, v in pm.full_state_dict().items()}, "forward": pm(*inputs).item()}
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    pm.start_timeline()
    continued = []
    for step in range(1, 5):
        loss = pm.train_step(*inputs)
        pm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if step == 2:
            pm.save_checkpoint(Path(path) / "ckpt", opt)
            pm.save_timeline(Path(path) / "trace.json")
        if step > 2:
            continued.append(loss.item())
    model2, _ = build(name, batch=4, seed=1)  # other weights: the checkpoint must bring them back
    pm2 = mc.parallelize(model2, mc.Mesh.parse(mesh), inputs, **opts)
    opt2 = torch.optim.AdamW(pm2.parameters(), lr=1e-3)
    pm2.load_checkpoint(Path(path) / "ckpt", opt2)
    resumed = []
    for _ in range(2):
        loss = pm2.train_step(*inputs)
        pm2.clip_grad_norm_(1.0)
        opt2.step()
        opt2.zero_grad()
        resumed.append(loss.item())
    out["continued"], out["resumed"] = continued, resumed
    return out


def recompute_choices(pm):
    """``runtime_cases.train(inspect=...)``: what recompute="auto" chose for this rank's programs, as dicts."""
    import dataclasses

    return [dataclasses.asdict(c) for c in pm.recompute_choices()]
