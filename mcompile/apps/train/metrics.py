"""What rank 0 reports while training: a rich progress bar or plain lines, JSONL and TensorBoard, and MFU.

MFU (Chowdhery et al. 2022, PaLM, Appendix B): model FLOPs per step over the step time and the peak
of all ranks. Model FLOPs are 3x the forward matmul-class FLOPs of the captured single-device graph at
(global_batch, seq_len) (``mcompile.ir.annotate``: backward = 2x forward; recompute is not counted); the
peak is the hardware profile's dense peak for the compute dtype (``mcompile.cost.hardware``; on CPU the
measured "cpu-gloo" profile, so the figure is relative to that machine's measured matmul rate).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mcompile.apps.train.config import TrainConfig

__all__ = ["Metrics", "hardware_profile", "model_flops_per_step"]


def hardware_profile(name: str):
    """The profile MFU (and plan "auto") is measured against: ``name``, or for "auto" the measured "cpu-gloo"
    on CPU and the GPU's own profile by its name (H100's when unknown)."""
    from mcompile.cost.hardware import get_hardware

    if name != "auto":
        return get_hardware(name)
    if not torch.cuda.is_available():
        return get_hardware("cpu-gloo")
    gpu = torch.cuda.get_device_name().lower()
    for key in ("h200", "h100", "b200", "a100"):
        if key in gpu:
            return get_hardware(key)
    return get_hardware("h100")


def model_flops_per_step(pm, global_batch: int, seq_len: int) -> float | None:
    """3x the forward matmul-class FLOPs of the single-device model at (global_batch, seq_len)."""
    compiled = pm._compiled
    ann = compiled.annotation
    if ann is None:
        return None
    syms = compiled.captured.symbols
    subs = {syms[k]: v for k, v in (("batch", global_batch), ("seq", seq_len)) if k in syms}
    return 3.0 * float(ann.evaluate(ann.matmul_flops, subs))


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.0f}"


def compact(row: dict) -> str:
    """The progress bar's stats in at most ~46 characters (the bar's line fits 80 columns): loss, lr, tokens/s,
    MFU; the full figures go to the plain lines, JSONL and TensorBoard."""
    text = f"loss {row['loss']:.4f} lr {row['lr']:.1e} {_si(row['tokens_per_s'])} tok/s"
    if row.get("mfu") is not None:
        text += f" MFU {row['mfu']:.1%}"
    return text


class Metrics:
    """Rank 0's output: a rich progress bar or plain lines, JSONL and TensorBoard."""

    def __init__(self, cfg: TrainConfig, start_step: int, hardware: str, console=None):
        lc = cfg.logging
        self.steps = cfg.train.steps
        self.hardware = hardware
        self.jsonl = None
        if lc.jsonl:
            Path(lc.jsonl).parent.mkdir(parents=True, exist_ok=True)
            self.jsonl = open(lc.jsonl, "a")  # noqa: SIM115 - closed in close()
        self.tb = None
        if lc.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(lc.tensorboard)
        self.progress = None
        from rich.console import Console

        self.console = console or Console()
        if lc.progress == "on" or (lc.progress == "auto" and self.console.is_terminal):
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            # fixed widths that fit 80 columns: name 5, bar 12, steps, the compact stats (~45), time left 7
            self.progress = Progress(TextColumn("[bold]train"), BarColumn(bar_width=12), MofNCompleteColumn(),
                                     TextColumn("{task.fields[stats]}"), TimeRemainingColumn(compact=True),
                                     console=self.console, expand=False)
            self.task = self.progress.add_task("train", total=self.steps, completed=start_step, stats="")
            self.progress.start()

    def record(self, row: dict) -> None:
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, int | float) and v is not None:
                    self.tb.add_scalar(("eval/" if k.startswith("eval") else "train/") + k, v, row["step"])
        if "loss" in row:
            text = (f"loss {row['loss']:.4f}  lr {row['lr']:.2e}  {row['tokens_per_s']:,.0f} tok/s  "
                    + (f"MFU {row['mfu']:.2%} ({self.hardware})  " if row.get("mfu") is not None else "")
                    + (f"mem {row['mem_gib']:.2f} GiB" if row.get("mem_gib") is not None else ""))
        else:
            text = f"eval loss {row['eval_loss']:.4f}"
        if self.progress is not None:
            if "loss" in row:
                self.progress.update(self.task, completed=row["step"], stats=compact(row))
            else:
                self.progress.console.print(f"step {row['step']}: {text}")
        else:
            print(f"step {row['step']}/{self.steps}  {text.rstrip()}" + (f"  grad_norm {row['grad_norm']:.3g}"
                                                                          if "grad_norm" in row else ""), flush=True)

    def advance(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
