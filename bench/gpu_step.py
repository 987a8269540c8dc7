"""The first GPU user's check: a Llama-3-8B-shaped model trained through ``mcompile.parallelize`` on one GPU.

    python bench/gpu_step.py           # CUDA, one GPU, 1-rank NCCL mesh -> $OUT/gpu_step.json (--out PATH)
    python bench/gpu_step.py --smoke   # CPU, tiny shapes, 1-rank gloo mesh: the same code path, ~20 s of CPU
    OUT=... BENCH=gpu_step BUDGET=400 HARD_LIMIT=450 bash bench/gpu_run.sh   # the prepared command (docs)
    options: --items a,b (a subset, in the order below) --layers N --seq S --steps K --warmup W --budget S

Installs nothing; needs torch (and triton for the fused kernels on CUDA), nothing else.

The model: models/llama.py at Llama-3 8B's width (hidden 4096, 32 heads, 8 kv heads, SwiGLU 14336,
vocab 128256, RoPE θ 500000) with 4 layers instead of 32, built on the meta device (no full copy in
memory), one sequence of 4096 tokens a step (micro-batch 1), bf16 compute. ``--smoke``: hidden 64,
2 layers, 8 / 4 heads, SwiGLU 128, vocab 256, seq 32 (llama3-tiny's shape).

Items, in order of importance; the JSON is rewritten after every one (``complete`` false and
``status`` naming the item in progress until the end: a run killed by a time limit keeps what it
measured), and an item that fails records its error (``errors``, the item's ``error``) and the run
goes on. ``--budget`` seconds from the script's start (default 400 on CUDA): items not started by
then are listed under ``skipped``.

- ``torch``: plain PyTorch, the reference. The same weights (``mcompile.runtime.init.materialize``:
  the values ``parallelize`` gives a meta model, seed 0), fp32 parameters under
  ``torch.autocast(bfloat16)`` — mcompile's recipe, fp32 master weights and bf16 compute —, SDPA
  restricted to the flash backend (``torch.nn.attention.sdpa_kernel``), AdamW.
- ``mcompile``: ``parallelize(model, Mesh(dp=1), dtype=torch.bfloat16)`` on the 1-rank world (NCCL on
  CUDA, gloo on CPU), AdamW over its parameters; ``mcompile_fuse`` (``fuse=True``), ``mcompile_fp8``
  (``fp8="current"``), ``mcompile_inductor`` (``codegen="inductor"``; ``--smoke`` skips it unless
  ``--items`` names it: Inductor's C++ compile of the CPU programs takes minutes).
- bench/kernels.py's items (its functions, imported): the device's copy bandwidth, each fused kernel
  against the PyTorch code it replaces at the model's width, the FP8-vs-bf16 GEMM, the FP8 linears
  at Llama-3 8B's shapes and its MLP block; then the MoE experts' grouped GEMM (``grouped_mm``,
  Mixtral 8x7B's expert shapes): the op the MoE runtime runs on CUDA (Triton) against
  ``torch._grouped_mm``. Under ``--smoke`` the kernels run where bench/kernels.py --smoke runs them:
  Triton's interpreter when TRITON_INTERPRET=1 is set, else the PyTorch reference (each row's
  ``triton`` says which).
- ``mcompile_fp32`` (``dtype=torch.float32``: the TF32 switches recorded, the step against the cost
  model's fp32 price), ``mcompile_fp16`` (``dtype=torch.float16``: the dynamic loss scale and the
  skipped steps).

Each model item records (``items.<name>``):

- ``step_s``: seconds per training step (forward, backward, AdamW step, zero_grad), ``--steps``
  steps back to back, synchronized at the ends only — the training loop's rate; ``tokens_per_s``;
  ``mfu``: 6·N·tokens / step_s / peak (N every parameter, tied ones once; peak 989 TFLOP/s, H100 /
  H200 SXM dense bf16, on CUDA; on CPU the cpu-gloo profile's, a check of the formula only);
  ``mfu_model_flops``: the cost model's matmul FLOPs of the step (attention included) instead of 6·N·tokens;
  ``predicted_step_s``: the cost model's step time for the plan (``mcompile.cost.workload.estimate``) on the
  device's profile (h100 / h200; cpu-gloo under --smoke).
- ``host_s``: the host's time per step — from the call to its return, each step started on an idle
  device (synchronized before), median: the time to issue the step's launches (and any host wait
  inside it); ``host_cpu_s`` the main thread's CPU time of the same; ``step_synced_s`` the same
  steps to the end of their device work.
- ``memory``: the peak of a steady-state step (after the optimizer state exists):
  ``torch.cuda.max_memory_allocated`` on CUDA, the live-tensor tracker (``runtime/memory.py``) on CPU,
  against the memory model's prediction for the plan (``estimate(...).memory_bytes``, its breakdown),
  ``predicted_over_measured``.
- ``sdpa``: one profiled step (``torch.profiler``): the attention aten ops that ran (flash, efficient,
  cuDNN, math) and, on CUDA, the attention kernels; ``backend`` in one word. ``top_kernels``: the
  step's ten costliest device kernels (CUDA).
- ``syncs`` (CUDA): one step under ``torch.cuda.set_sync_debug_mode("warn")``: how many synchronizing
  calls it warned about and the Python lines that made them.
- ``losses`` (every step, the same batch), ``loss0_rel_diff_vs_torch`` (the first step's loss against
  the reference's: the same weights and batch), ``loss_decreased``, ``finite``; ``build_s`` (planning,
  capture, initialisation), ``first_step_s`` (the joint program's trace, compilation).
"""

from __future__ import annotations

import time

T_START = time.perf_counter()  # the budget counts from here: imports and compilation included

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import _results  # noqa: E402 - bench/_results.py: where the JSON goes (bench/ is the script's folder)

ROOT = Path(__file__).resolve().parent.parent
GPU_BUDGET_S = 400.0  # default --budget on CUDA: what is started by then fits an 8-minute run
PEAK_BF16 = 989e12  # H100 / H200 SXM, dense bf16 (NVIDIA's datasheets): the MFU denominator of issue 38
MODEL_ITEMS = {  # name -> parallelize options (None: the plain PyTorch reference)
    "torch": None,
    "mcompile": {},
    "mcompile_fuse": {"fuse": True},
    "mcompile_fp8": {"fp8": "current"},
    "mcompile_inductor": {"codegen": "inductor"},
}
LATE_ITEMS = {  # after bench/kernels.py's items: lower priority
    "mcompile_fp32": {"dtype": "float32"},
    "mcompile_fp16": {"dtype": "float16"},
}
KERNEL_OPS = ("rms_norm", "add_rms_norm", "swiglu", "rope", "cross_entropy")  # the ops a Llama step fuses
GPU_MODEL = dict(vocab_size=128256, dim=4096, n_layers=4, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                 rope_theta=500000.0, max_seq_len=8192)
SMOKE_MODEL = dict(vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=128,
                   rope_theta=500000.0, max_seq_len=128)


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, 1-rank gloo mesh")
    p.add_argument("--items", default=None,
                   help="comma-separated subset: " + ",".join([*MODEL_ITEMS, "kernels", *LATE_ITEMS]))
    p.add_argument("--layers", type=int, default=None, help="transformer layers (default 4; --smoke 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 4096; --smoke 32)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per loop (default 10; --smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps after the first (default 3; --smoke 1)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds from the script's start after which remaining items are skipped "
                        f"(default {GPU_BUDGET_S:.0f} on CUDA, none with --smoke; 0: none)")
    p.add_argument("--write", action="store_true", help="record bench/results/gpu_step[_smoke].json "
                   "(default: $OUT/gpu_step.json when $OUT is set, else a temporary file, named at the end)")
    p.add_argument("--out", default=None, help="JSON path")
    return p.parse_args(argv)


ARGS = _args() if __name__ == "__main__" else None

import torch  # noqa: E402

import mcompile as mc  # noqa: E402
from mcompile.models.llama import Llama, LlamaConfig  # noqa: E402


def _load_kernels_bench():
    """bench/kernels.py as a module (its items are reused here), loaded from its file: a module named
    ``kernels`` on sys.path could shadow or be shadowed by an installed package of that name."""
    spec = importlib.util.spec_from_file_location("mcompile_bench_kernels", ROOT / "bench" / "kernels.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


kb = _load_kernels_bench()
_err = kb._err


# ---- the 1-rank world and the model --------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_rank_world() -> None:
    """torchrun's variables for a world of one process (kept where torchrun set them): parallelize
    starts the process group (NCCL on CUDA, gloo on CPU) from them."""
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def build_meta(cfg: LlamaConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return Llama(cfg)


def batch(cfg: LlamaConfig, seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (1, seq), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (1, seq), generator=g)
    return idx.to(device), tgt.to(device)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hardware(device) -> str | None:
    """The cost model's profile of this device: h100 / h200 by the device's name, cpu-gloo on CPU."""
    if device.type != "cuda":
        return "cpu-gloo"
    name = torch.cuda.get_device_name(device).upper()
    return next((p for p in ("h200", "h100") if p.upper() in name), None)


def _tf32() -> dict:
    return {"cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


# ---- measurements of one training setup ----------------------------------------------------------
_ATTN_OPS = {"_scaled_dot_product_flash_attention": "flash", "_flash_attention": "flash",
             "_scaled_dot_product_efficient_attention": "efficient", "_efficient_attention": "efficient",
             "_scaled_dot_product_cudnn_attention": "cudnn", "_cudnn_attention": "cudnn",
             "_scaled_dot_product_attention_math": "math"}


def _device_us(evt) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total"):
        v = getattr(evt, attr, None)
        if v:
            return float(v)
    return 0.0


def profile_step(step, device) -> dict:
    """One step under torch.profiler: the attention ops and kernels that ran, the costliest kernels."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        _sync(device)
    aten: Counter = Counter()
    kernels: dict[str, list] = {}
    for e in prof.key_averages():
        name = e.key
        if name.startswith("aten::") and any(k in name for k in _ATTN_OPS):
            aten[name] += e.count
        if "CUDA" in str(getattr(e, "device_type", "")).upper():  # a kernel, memcpy or memset on the device
            kernels[name] = [round(_device_us(e), 1), e.count]
    backends = {b for op, b in _ATTN_OPS.items() for name in aten if name.split("::")[-1].startswith(op)}
    attn_kernels = {k: v for k, v in kernels.items()
                    if any(s in k.lower() for s in ("flash", "fmha", "attention", "attn", "sdpa"))}
    out = {"sdpa": {"backend": "/".join(sorted(backends)) if backends else "none (no fused SDPA op ran)",
                    "aten_ops": dict(aten)}}
    if device.type == "cuda":
        out["sdpa"]["kernels"] = attn_kernels
        top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:10]
        out["top_kernels"] = [[k[:160], us, n] for k, (us, n) in top]
        out["device_us_total"] = round(sum(us for us, _ in kernels.values()), 1)
    else:
        out["sdpa"]["kernels"] = "skipped: CPU (no device kernels; the aten ops say which SDPA ran)"
        out["top_kernels"] = "skipped: CPU"
    return out


def count_syncs(step, device) -> dict:
    """One step under torch.cuda.set_sync_debug_mode("warn"): the synchronizing calls it reports."""
    if device.type != "cuda":
        return {"skipped": "torch.cuda.set_sync_debug_mode reports CUDA synchronizations: a CUDA run only"}
    _sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    _sync(device)
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    where = Counter(f"{os.path.relpath(w.filename, ROOT) if w.filename.startswith(str(ROOT)) else w.filename}:"
                    f"{w.lineno}" for w in syncs)
    return {"count": len(syncs), "where": dict(where.most_common(10)),
            "messages": sorted({str(w.message)[:200] for w in syncs})[:5]}


def peak_memory(step, params, opt, device) -> dict:
    """The peak of one steady-state step: CUDA's allocator peak, or on CPU the live-tensor tracker
    (parameters, gradients, optimizer state and everything the step allocates)."""
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        _sync(device)
        return {"peak_bytes": int(torch.cuda.max_memory_allocated(device)),
                "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
                "how": "torch.cuda.max_memory_allocated over one steady-state step"}
    from mcompile.runtime.memory import MemoryTracker

    tracker = MemoryTracker()
    tracker.register(params, "parameters")
    tracker.register_optimizer(opt)
    hooks = [p.register_post_accumulate_grad_hook(lambda p: tracker.register([p.grad], "gradients"))
             for p in params]
    tracker.register([p.grad for p in params if p.grad is not None], "gradients")
    try:
        with tracker:
            tracker.reset_peak()
            step()
    finally:
        for h in hooks:
            h.remove()
    return {"peak_bytes": int(tracker.peak_total), "at_peak": dict(tracker.peak),
            "how": "live-tensor tracker (runtime/memory.py) over one steady-state step"}


def _predict(pm, hw: str | None, seq: int, precision: str) -> dict:
    """The cost and memory models' figures for the plan (mcompile.cost.workload.estimate)."""
    if hw is None:
        return {"skipped": "no cost-model profile for this device (h100 / h200 are named)"}
    from mcompile.cost.workload import estimate

    est = estimate(pm._compiled, hardware=hw, global_batch=1, seq=seq, microbatch_size=1, precision=precision,
                   param_dtype="fp32", grad_dtype="fp32")
    return {"hardware": hw, "precision": precision, "step_s": est.step_time_s, "memory_bytes": est.memory_bytes,
            "memory_breakdown": {k: v for k, v in est.memory_breakdown.items() if isinstance(v, int | float)},
            "model_flops": est.model_flops}


class Setup:
    """One way of training the model: ``step()`` runs forward, backward, the optimizer step and
    zero_grad, and returns the loss tensor (no host read)."""

    def __init__(self, name: str, options: dict | None, ctx: dict):
        self.name, self.options, self.ctx = name, options, ctx
        cfg, device = ctx["cfg"], ctx["device"]
        self.inputs = batch(cfg, ctx["seq"], device)
        self.flash_only = True  # the reference: SDPA's flash backend only (unless it has no kernel for these)
        if options is None:  # the plain PyTorch reference: materialised with parallelize's values (seed 0)
            from mcompile.runtime.init import materialize

            model = materialize(build_meta(cfg), seed=0).to(device)
            self.model, self.pm = model, None
            self.params = list(model.parameters())

            def forward():
                from torch.nn.attention import SDPBackend, sdpa_kernel

                backends = [SDPBackend.FLASH_ATTENTION] if self.flash_only else list(SDPBackend)
                with torch.autocast(device.type, dtype=torch.bfloat16), sdpa_kernel(backends):
                    try:
                        return model(*self.inputs)
                    except RuntimeError as exc:  # no flash kernel for these inputs: say so, take SDPA's choice
                        if not self.flash_only:
                            raise
                        self.flash_only = False
                        ctx["items"]["torch"]["sdpa_flash_forced"] = f"no: {_err(exc, 300)}"
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    return model(*self.inputs)

            def fwd_bwd():
                loss = forward()
                loss.backward()
                return loss.detach()
            self.fwd_bwd = fwd_bwd
        else:
            one_rank_world()
            opts = dict(options)
            opts["dtype"] = getattr(torch, opts.get("dtype", "bfloat16"))
            self.pm = mc.parallelize(build_meta(cfg), mc.Mesh(dp=1), self.inputs, **opts)
            self.params = list(self.pm.parameters())
            self.fwd_bwd = lambda: self.pm.train_step(*self.inputs)
        self.opt = torch.optim.AdamW(self.params, lr=1e-4)  # torch's default implementation (foreach on CUDA)

    def step(self) -> torch.Tensor:
        loss = self.fwd_bwd()
        if self.pm is None or not getattr(self.pm, "step_skipped", False):
            self.opt.step()
        self.opt.zero_grad(set_to_none=self.pm is None)  # mcompile keeps its flat gradient buffers
        return loss


def measure(name: str, options: dict | None, ctx: dict, row: dict, write) -> None:
    """Build one setup and take every measurement of it into ``row`` (written after each stage)."""
    device, steps, warmup = ctx["device"], ctx["steps"], ctx["warmup"]
    row.update(kind="torch" if options is None else "mcompile", options=options or {},
               tf32_before=_tf32())
    gc.collect()  # a failed item's setup (held by its traceback until now) goes before this one is built
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    s = Setup(name, options, ctx)
    row["build_s"] = time.perf_counter() - t0
    row["tf32"] = _tf32()
    losses = []
    t0 = time.perf_counter()
    losses.append(s.step())
    _sync(device)
    row["first_step_s"] = time.perf_counter() - t0
    write()
    for _ in range(warmup):
        losses.append(s.step())
    # host time: each step from an idle device, to its return (launches issued) and to its end
    host, cpu, synced = [], [], []
    for _ in range(steps):
        _sync(device)
        t0, c0 = time.perf_counter(), time.thread_time()
        losses.append(s.step())
        host.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        _sync(device)
        synced.append(time.perf_counter() - t0)
    # the training loop's rate: steps back to back
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        losses.append(s.step())
    _sync(device)
    step_s = (time.perf_counter() - t0) / steps
    tokens = ctx["seq"]
    row.update(step_s=step_s, step_synced_s=statistics.median(synced), host_s=statistics.median(host),
               host_cpu_s=statistics.median(cpu), tokens_per_s=tokens / step_s,
               mfu=6 * ctx["n_params"] * tokens / step_s / ctx["peak_flops"])
    write()
    opts = options or {}
    precision = "fp8" if opts.get("fp8") else "fp32" if opts.get("dtype") == "float32" else "bf16"
    if s.pm is not None:
        try:
            pred = _predict(s.pm, ctx["hardware"], ctx["seq"], precision)
        except ValueError as exc:  # a precision the profile has no rate for (FP8 on a CPU): not priced
            pred = {"not_priced": str(exc)[:300]}
        except Exception as exc:  # noqa: BLE001 - the measurement stands without the prediction
            pred = {"error": _err(exc)}
        row["predicted"] = pred
        if "step_s" in pred:
            row["predicted_step_s"] = pred["step_s"]
            row["mfu_model_flops"] = pred["model_flops"] / step_s / ctx["peak_flops"]
        row["plan_collectives"] = len(s.pm._compiled.plan.collectives)
    mem = peak_memory(s.step, s.params, s.opt, device)
    if s.pm is not None and "memory_bytes" in row.get("predicted", {}):
        mem["predicted_bytes"] = row["predicted"]["memory_bytes"]
        mem["predicted_over_measured"] = mem["predicted_bytes"] / mem["peak_bytes"]
    row["memory"] = mem
    write()
    row.update(profile_step(s.step, device))
    write()
    row["syncs"] = count_syncs(s.step, device)
    if s.pm is not None and getattr(s.pm, "loss_scaler", None) is not None:
        row["loss_scale"] = s.pm.loss_scaler.state_dict()
    values = [float(x) for x in losses]
    row.update(losses=values, loss0=values[0], finite=all(math.isfinite(v) for v in values),
               loss_decreased=values[-1] < values[0])
    ref = ctx["items"].get("torch", {}).get("losses")
    if ref and name != "torch":  # the same weights, batch and steps: the same losses, to rounding
        row["loss0_rel_diff_vs_torch"] = abs(values[0] - ref[0]) / abs(ref[0])
        row["losses_max_rel_diff_vs_torch"] = max(abs(a - b) / abs(b) for a, b in zip(values, ref))
        ref_step = ctx["items"]["torch"].get("step_s")
        if ref_step:
            row["step_s_over_torch"] = step_s / ref_step
    row["item_cpu_s"] = time.process_time() - cpu0  # every thread's CPU time: the item's cost on a loaded host
    del s
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- the run --------------------------------------------------------------------------------------
def run(args, out: Path) -> dict:
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("bench/gpu_step.py measures on CUDA; this machine has none (use --smoke for the CPU check)")
    device = torch.device("cpu") if smoke else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shape = dict(SMOKE_MODEL if smoke else GPU_MODEL)
    if args.layers:
        shape["n_layers"] = args.layers
    cfg = LlamaConfig(**shape)
    seq = args.seq or (32 if smoke else 4096)
    steps = args.steps or (2 if smoke else 10)
    warmup = args.warmup if args.warmup is not None else (1 if smoke else 3)
    budget = args.budget if args.budget is not None else (None if smoke else GPU_BUDGET_S)
    hw = _hardware(device)
    if device.type == "cuda":
        peak, peak_src = PEAK_BF16, "989 TFLOP/s: H100 / H200 SXM dense bf16 (issue 38's denominator)"
    else:
        from mcompile.cost.hardware import get_hardware

        peak, peak_src = get_hardware("cpu-gloo").peak_flops("bf16"), "the cpu-gloo profile's bf16 peak (smoke)"
    n_params = sum(p.numel() for p in build_meta(cfg).parameters())
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    result = {
        "benchmark": "gpu_step", "mode": "smoke" if smoke else "gpu", "complete": False, "status": "starting",
        "commit": kb._commit(), "machine": kb._machine(device),
        "versions": {"torch": torch.__version__, "triton": triton_version, "python": platform.python_version()},
        "settings": {"model": {**shape, "n_params": n_params}, "seq": seq, "micro_batch": 1,
                     "compute_dtype": "bfloat16", "mesh": "dp=1 (one rank: "
                     + ("NCCL" if device.type == "cuda" else "gloo") + ")", "steps": steps, "warmup": warmup,
                     "peak_flops": peak, "peak_flops_source": peak_src, "cost_model_hardware": hw,
                     "budget_s": budget, "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
                     "reference": "plain PyTorch: fp32 parameters under torch.autocast(bfloat16), SDPA flash "
                                  "backend only, AdamW"},
        "items": {}, "copy_bandwidth_gbps": None, "kernels": [], "gemm": [], "layers": [],
        "errors": [], "skipped": [], "timeline": [],
    }
    job = kb.Run(result, out, budget, t_start=T_START)
    ctx = {"cfg": cfg, "device": device, "seq": seq, "steps": steps, "warmup": warmup, "n_params": n_params,
           "peak_flops": peak, "hardware": hw, "items": result["items"]}
    wanted = set(args.items.split(",")) if args.items else None
    unknown = (wanted or set()) - {*MODEL_ITEMS, "kernels", *LATE_ITEMS}
    if unknown:
        raise SystemExit(f"--items: unknown {sorted(unknown)}; choose from "
                         + ",".join([*MODEL_ITEMS, "kernels", *LATE_ITEMS]))

    def model_item(name, options):
        row = result["items"].setdefault(name, {})
        try:
            measure(name, options, ctx, row, job.write)
        except Exception as exc:
            row["error"] = _err(exc, 800)
            raise

    items, by_mode = [], []  # by_mode: items this mode leaves out (not the budget's doing)
    for name, options in MODEL_ITEMS.items():
        if wanted is not None and name not in wanted:
            continue
        if smoke and name == "mcompile_inductor" and wanted is None:
            by_mode.append({"item": name, "reason": "--smoke: Inductor's C++ compile of the CPU programs takes "
                            "minutes (name it in --items to run it); the CUDA run compiles"})
            continue
        items.append((name, lambda n=name, o=options: model_item(n, o)))
    if wanted is None or "kernels" in wanted:
        items += kernel_items(result, device, smoke, seq)
    for name, options in LATE_ITEMS.items():
        if wanted is None or name in wanted:
            items.append((name, lambda n=name, o=options: model_item(n, o)))
    try:
        job.execute(items)  # "complete": every item this mode runs was started (none left to the budget)
    finally:
        result["skipped"] = by_mode + result["skipped"]
        job.write()
    return result


def bench_grouped_mm(rows: int, groups: int, a: int, b: int, device, timer) -> dict:
    """The MoE experts' grouped GEMM (x (rows, a) by w (groups, a, b), equal contiguous row groups, bf16),
    forward and forward + backward, as the MoE runtime calls it (``kernels.grouped_gemm``): its PyTorch
    path (``torch._grouped_mm``; the row's "bf16" figures, the reference) against the op the runtime
    takes on CUDA (``triton``: the Triton kernels there; elsewhere the same PyTorch path)."""
    from mcompile.kernels import grouped_gemm as gg

    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, a, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(groups, a, b, generator=g) * a ** -0.5).to(device, torch.bfloat16)
    dy = torch.randn(rows, b, generator=g).to(device, torch.bfloat16)
    offs = torch.arange(1, groups + 1, device=device, dtype=torch.int32) * (rows // groups)
    impls = {"bf16": lambda x, w: gg._ExpertsMM.apply(x, w, offs, False),
             "triton": lambda x, w: gg._ExpertsMM.apply(x, w, offs, True)}
    row = {"layer": "grouped_mm", "rows": rows, "groups": groups, "in_features": a, "out_features": b,
           "dtype": "bfloat16", "triton_kernels": bool(gg.uses_triton(device)),
           "bf16_is": "torch._grouped_mm (kernels.grouped_gemm's PyTorch path)"}
    return kb._bench_layer(row, impls, [x, w], ["dx", "dw"], dy, 2 * rows * a * b, device, timer)


def kernel_items(result: dict, device, smoke: bool, seq: int) -> list:
    """bench/kernels.py's items at this run's shapes, into result["kernels"], ["gemm"], ["layers"]."""
    dtype = torch.bfloat16
    tokens = 32 if smoke else 8192
    width = 64 if smoke else GPU_MODEL["dim"]
    gemms = [64] if smoke else [4096, 8192]
    layers = [(64, 64)] if smoke else kb._shapes(kb.LAYER_SHAPES)
    mlp = [(64, 128)] if smoke else kb._shapes(kb.MLP_SHAPE)
    # Mixtral 8x7B's experts: 8 of them, top-2 of 8192 tokens, hidden 4096 -> 14336
    grouped = (64, 4, 64, 128) if smoke else (2 * 8192, 8, 4096, 14336)
    timer = kb.Timer(device, 1, 3) if smoke else kb.Timer(device, 10, 30)
    layer_timer = kb.Timer(device, 0, 1) if smoke else timer
    result["kernel_settings"] = {"tokens": tokens, "width": width, "ops": list(KERNEL_OPS), "gemm": gemms,
                                 "layer_shapes_kxn": [list(s) for s in layers], "mlp_hxf": [list(s) for s in mlp],
                                 "grouped_mm_rows_groups_a_b": list(grouped),
                                 "warmup_repeats": [timer.warmup, timer.repeats], "torch_compile": "not run here "
                                 "(bench/kernels.py measures the torch.compile baselines)"}

    def copy():
        result["copy_bandwidth_gbps"] = kb.copy_bandwidth(device, timer, (1 << 20) if smoke else (1 << 30))

    def kernel(op):
        result["kernels"].append(kb.bench_op(op, tokens, width, device, dtype, timer, result["copy_bandwidth_gbps"]))

    def layer(bench, *shape):
        result["layers"].append(bench(tokens, *shape, device, layer_timer))

    items = [("copy bandwidth", copy)]
    items += [(f"kernel {op} w={width}", lambda op=op: kernel(op)) for op in KERNEL_OPS]
    items += [(f"gemm n={n}", lambda n=n: result["gemm"].append(kb.bench_gemm(n, device, timer))) for n in gemms]
    items += [(f"linear {k}x{n}", lambda k=k, n=n: layer(kb.bench_linear, k, n)) for k, n in layers]
    items += [(f"llama_mlp {h}x{f}", lambda h=h, f=f: layer(kb.bench_mlp, h, f)) for h, f in mlp]
    items.append((f"grouped_mm {'x'.join(map(str, grouped))}",
                  lambda: result["layers"].append(bench_grouped_mm(*grouped, device, layer_timer))))
    return items


def main(args) -> int:
    name = "gpu_step_smoke" if args.smoke else "gpu_step"
    out = args.out or (None if args.write or not os.environ.get("OUT") else Path(os.environ["OUT"]) / f"{name}.json")
    out = _results.destination(name, args.write, out, temporary=True)
    signal.signal(signal.SIGTERM, kb._on_sigterm)
    try:
        result = run(args, out)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    line = ", ".join(f"{n}: {r['step_s'] * 1e3:.1f} ms/step, MFU {r['mfu']:.1%}"
                     for n, r in result["items"].items() if "step_s" in r)
    print(f"wrote {out} ({result['seconds']:.1f} s, {result['status']}); {line}")
    for err in result["errors"]:
        print(f"error: {err}", file=sys.stderr)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
