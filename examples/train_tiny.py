"""Train the tiny Llama with tensor parallelism under torchrun:

    torchrun --standalone --nproc-per-node 2 examples/train_tiny.py --steps 20

Every rank builds the same plain model (rank 0's weights are broadcast), mcompile plans it and
each rank trains its shard. Prints the loss of every step and the total gradient norm that clipping
saw, on rank 0. bf16 compute by default (``--dtype fp32`` for exact fp32, ``fp16`` with dynamic loss
scaling). ``--save-grads PATH`` also saves the full gradients of the first step, before
clipping (rank 0, ``torch.save``), to compare with a single-device run.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import mcompile as mc
from mcompile.apps.demo import batches
from mcompile.models import get_preset
from mcompile.runtime.launch import init_distributed, shutdown_distributed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sp", action="store_true", help="sequence parallelism")
    ap.add_argument("--save-grads", metavar="PATH", help="save the first step's unclipped full gradients (rank 0)")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                    help="compute dtype (default bf16; master weights and gradients stay fp32; fp16 scales the loss)")
    args = ap.parse_args()

    init_distributed()  # reads torchrun's environment
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = get_preset("llama3-tiny").build()
    data = batches(args.steps, batch=4, seq=64)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    pm = mc.parallelize(model, mc.Mesh(tp=world), data[0], sequence_parallel=args.sp, dtype=dtype)
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
    for step, (x, y) in enumerate(data, 1):
        loss = pm.train_step(x, y)
        if args.save_grads and step == 1:
            grads = pm.full_grads()  # collective: every rank calls it
            if dist.get_rank() == 0:
                torch.save(grads, args.save_grads)
        norm = torch.nn.utils.clip_grad_norm_(pm.parameters(), 1.0)  # the norm before clipping
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm  # over DTensors: a DTensor
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.7f} grad_norm {norm.item():.8e}", flush=True)


if __name__ == "__main__":
    main()  # returns first, so the model and its process groups are freed before shutdown
    shutdown_distributed()
