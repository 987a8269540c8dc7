"""Our tensor-parallel step against PyTorch's own DTensor tensor parallelism, same model, same run.

    python bench/tp_vs_dtensor.py [--steps 20] [--quick]

An unmodified Hugging Face LlamaForCausalLM over 2 gloo CPU processes, tp=2, no sequence
parallelism. Baseline: ``torch.distributed.tensor.parallel.parallelize_module`` with Megatron's plan
written by hand (q/k/v/gate/up colwise, o/down rowwise, vocab-parallel embedding rowwise, LM head
colwise with the logits gathered for HF's loss). Both train with AdamW from the same weights; their
steps alternate in one run so machine noise hits both alike. Writes
bench/results/tp_vs_dtensor.json: per-step wall and CPU time (median), their ratio, and the c10d
collectives and bytes of one step of each, counted with torch.profiler.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time

import _results  # noqa: E402 - bench/_results.py: where the JSON goes (bench/ is the script's folder)
import torch

from mcompile.models.hf import CausalLMLoss


def _model(cfg_kwargs):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**cfg_kwargs))


def _dtensor_tp(model, mesh):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        plan.update({p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                     p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(),
                     p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                     p + "mlp.down_proj": RowwiseParallel()})
    return parallelize_module(model, mesh, plan)


def _collectives(step):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    count, nbytes = {}, 0
    for e in prof.events():
        if e.name.startswith("c10d::"):
            count[e.name] = count.get(e.name, 0) + 1
        elif e.name.startswith("gloo:"):  # the backend's own event carries the tensor's shape
            for shape in e.input_shapes[:1]:
                n = 1
                for s in shape:
                    n *= s
                nbytes += 4 * n  # every tensor moved here is fp32 (the token count is summed in fp32 too)
    return count, nbytes


def worker(rank, world, cfg_kwargs, batch, seq, steps):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import mcompile as mc

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg_kwargs["vocab_size"], (batch, seq), generator=g)
    ours = mc.parallelize(CausalLMLoss(_model(cfg_kwargs)), mc.Mesh(tp=world), (ids, ids))
    theirs_model = _model(cfg_kwargs)
    theirs = _dtensor_tp(theirs_model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    opt_a = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    opt_b = torch.optim.AdamW(theirs.parameters(), lr=1e-3)

    def step_ours():
        loss = ours.train_step(ids, ids)
        opt_a.step()
        opt_a.zero_grad()
        return loss

    def step_theirs():
        loss = theirs(input_ids=ids, labels=ids).loss
        loss.backward()
        opt_b.step()
        opt_b.zero_grad()
        return loss

    first = (step_ours().item(), step_theirs().item())  # warm-up; same loss from the same weights
    times = {"ours": [], "dtensor": []}
    cpu = {"ours": [], "dtensor": []}
    for _ in range(steps):
        for name, fn in (("ours", step_ours), ("dtensor", step_theirs)):
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            fn()
            dist.barrier()
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    colls = {"ours": _collectives(step_ours), "dtensor": _collectives(step_theirs)}
    return {"first_loss": first, "times": times, "cpu": cpu, "collectives": colls}


def main() -> None:
    from mcompile.runtime.launch import spawn

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="tiny model, 3 steps (CI smoke)")
    _results.add_arguments(ap, "tp_vs_dtensor[_quick]")
    args = ap.parse_args()
    cfg = dict(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=4)
    batch, seq, steps = 4, 128, args.steps
    if args.quick:
        cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
        batch, seq, steps = 2, 32, 3
    res = spawn(worker, 2, cfg, batch, seq, steps)[0]
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    cpu = {k: statistics.median(v) for k, v in res["cpu"].items()}
    out = {
        "benchmark": "tp_vs_dtensor",
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "torch": torch.__version__},
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "model": {"hf": "LlamaForCausalLM", **cfg, "batch": batch, "seq": seq}, "tp": 2, "steps": steps,
        "first_loss": {"ours": res["first_loss"][0], "dtensor": res["first_loss"][1]},
        "median_step_s": med, "median_cpu_s": cpu,
        "step_time_ratio_ours_over_dtensor": med["ours"] / med["dtensor"],
        "collectives_per_step": {k: v[0] for k, v in res["collectives"].items()},
        "collective_bytes_per_step": {k: v[1] for k, v in res["collectives"].items()},
    }
    _results.save("tp_vs_dtensor_quick" if args.quick else "tp_vs_dtensor", out, args.write, args.out)


if __name__ == "__main__":
    main()
