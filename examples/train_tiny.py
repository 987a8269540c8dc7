"""Train the tiny Llama with tensor parallelism under torchrun:

    torchrun --standalone --nproc-per-node 2 examples/train_tiny.py --steps 20

Every rank builds the same plain model (rank 0's weights are broadcast), mcompile plans it and
each rank trains its shard. Prints the loss of every step on rank 0.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import mcompile as mc
from mcompile.demo import batches
from mcompile.models import get_preset
from mcompile.runtime.launch import init_distributed, shutdown_distributed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sp", action="store_true", help="sequence parallelism")
    args = ap.parse_args()

    init_distributed()  # reads torchrun's environment
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = get_preset("llama3-tiny").build()
    data = batches(args.steps, batch=4, seq=64)
    pm = mc.parallelize(model, mc.Mesh(tp=world), data[0], sequence_parallel=args.sp)
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
    for step, (x, y) in enumerate(data, 1):
        loss = pm.train_step(x, y)
        torch.nn.utils.clip_grad_norm_(pm.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.5f}", flush=True)


if __name__ == "__main__":
    main()  # returns first, so the model and its process groups are freed before shutdown
    shutdown_distributed()
