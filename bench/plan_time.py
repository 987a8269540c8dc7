"""Planning cost on meta-device models: capture, plan and lowering time and peak RSS.

    python bench/plan_time.py [--quick] [--full-capture] [--write]

Prints the figures (machine, commit); with ``--write`` writes bench/results/plan_time.json. Each case
runs in a fresh process so RSS is its own. Deep models are planned from two captured blocks repeated
(mcompile/sharding/repeat.py); ``--full-capture`` adds the 80-layer HF case captured whole, for comparison.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

CASES = [
    ("hf-llama3-70b", "dp=64,tp=8", False),  # unmodified HF LlamaForCausalLM, 80 layers, seq 4096
    ("llama3-8b", "dp=8,tp=8", False),
    ("llama3-70b", "dp=64,tp=8", False),
    ("llama3-70b", "dp=64,tp=8", True),
    ("gpt3-175b", "dp=8,tp=8", True),
    ("llama3-405b", "dp=16,tp=8", True),
]

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import mcompile as mc
from mcompile.models import get_preset
from mcompile.api import compile_plan
name, mesh, sp, repeat = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"
if name == "hf-llama3-70b":
    import torch
    import transformers as T
    from transformers.utils import logging
    logging.set_verbosity_error()

    class Loss(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids, labels):
            return self.m(input_ids=ids, labels=labels, use_cache=False).loss

    cfg = T.LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192)
    t1 = time.perf_counter()
    with torch.device("meta"):
        model = Loss(T.LlamaForCausalLM(cfg))
    ids = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    inputs = (ids, ids)
else:
    pre = get_preset(name)
    t1 = time.perf_counter()
    model = pre.build(device="meta")
    inputs = pre.example_inputs(device="meta")
t2 = time.perf_counter()
c = compile_plan(model, mc.Mesh.parse(mesh, fake=True), inputs, sequence_parallel=sp, repeat_blocks=repeat)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "build_s": t2 - t1, "plan_s": t3 - t2, "repeated": c.short is not None,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "collectives": len(c.plan.collectives), "params": len(c.plan.params)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the first two cases")
    ap.add_argument("--full-capture", action="store_true",
                    help="also plan the HF 80-layer case capturing every layer (repeat_blocks=False: ~70 s)")
    _results.add_arguments(ap, "plan_time")
    args = ap.parse_args()
    runs = [(n, m, sp, True) for n, m, sp in (CASES[:2] if args.quick else CASES)]
    if args.full_capture:
        runs.insert(1, (*CASES[0], False))
    rows = []
    for name, mesh, sp, repeat in runs:
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CHILD, name, mesh, "1" if sp else "0", "1" if repeat else "0"],
                             capture_output=True, text=True, check=True)
        row = {"model": name, "mesh": mesh, "sequence_parallel": sp, "repeat_blocks": repeat,
               **json.loads(out.stdout.strip().splitlines()[-1]), "wall_s": time.perf_counter() - t}
        print(row, flush=True)
        rows.append(row)
    _results.save("plan_time", {"benchmark": "plan_time", "rows": rows}, args.write, args.out)


if __name__ == "__main__":
    main()
