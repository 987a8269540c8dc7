"""Precision defaults (issue 38 item 2): what ``mcompile train`` computes in, and what the cost model prices fp32 at.

- ``mcompile train`` (and the shipped example) default to bf16 compute with fp32 master weights and fp32
  gradient reduction; ``train.dtype = "fp16"`` hands its loss-scaling keys to ``mcompile.Config``; the library's
  ``Config`` stays fp32 (exact: the parity tests' dtype).
- fp32 matmuls are priced as torch will run them: mcompile enables no TF32, so with torch's default the GPU
  profiles price true fp32 (67 TFLOP/s on an H100, not the TF32 tensor-core 494.5 they used to), and the TF32
  rate only once the process turned TF32 on (the legacy flag, or torch >= 2.9's ``fp32_precision``). No CUDA.
"""

from __future__ import annotations

import types
from pathlib import Path

import torch

import mcompile as mc
from mcompile.cost.hardware import fp32_matmul_precision, get_hardware

ROOT = Path(__file__).resolve().parents[1]


def test_mcompile_train_defaults_to_bf16_with_fp32_masters():
    from mcompile.apps.train.config import load_config, parse_config
    from mcompile.apps.train.loop import _options

    base = {"model": {"preset": "llama3-tiny"}, "data": {"factory": "x:y"}, "parallel": {"mesh": "dp=2"}}
    cfg = parse_config(base, "test")
    assert cfg.train.dtype == "bf16"
    options = _options(cfg)
    assert options["dtype"] == torch.bfloat16 and "initial_loss_scale" not in options
    assert mc.Config(**options).dtype == torch.bfloat16
    assert load_config(ROOT / "examples" / "train" / "llama3-tiny.toml").train.dtype == "bf16"
    fp16 = parse_config({**base, "train": {"dtype": "fp16", "loss_scale_window": 10, "initial_loss_scale": 1024}},
                        "test")
    c = mc.Config(**_options(fp16))
    assert (c.dtype, c.loss_scale_window, c.initial_loss_scale) == (torch.float16, 10, 1024.0)
    assert mc.Config().dtype == torch.float32  # the library's default stays exact fp32


def test_fp32_matmuls_are_priced_as_torch_runs_them(monkeypatch):
    h100, cpu = get_hardware("h100"), get_hardware("cpu-gloo")
    matmul = torch.backends.cuda.matmul
    assert fp32_matmul_precision() == "fp32"  # torch's default, which mcompile leaves alone
    assert h100.peak_flops("fp32") == 67e12 and h100.peak_flops("bf16") == 989.5e12
    assert get_hardware("h200").peak_flops(torch.float32) == 67e12
    try:
        matmul.allow_tf32 = True  # what torch.set_float32_matmul_precision("high") sets
        assert fp32_matmul_precision() == "tf32"
        assert h100.peak_flops("fp32") == h100.tf32_flops == 494.5e12
        assert cpu.peak_flops("fp32") == cpu.fp32_flops  # no TF32 on a CPU
    finally:
        matmul.allow_tf32 = False
    assert h100.peak_flops("fp32") == 67e12
    # torch >= 2.9's per-backend API (a stand-in object: mixing it with the legacy flag in one process is an error)
    monkeypatch.setattr(torch.backends.cuda, "matmul", types.SimpleNamespace(fp32_precision="tf32", allow_tf32=False))
    assert fp32_matmul_precision() == "tf32" and h100.peak_flops("fp32") == 494.5e12
    monkeypatch.setattr(torch.backends.cuda, "matmul", types.SimpleNamespace(fp32_precision="ieee", allow_tf32=True))
    assert fp32_matmul_precision() == "fp32"
