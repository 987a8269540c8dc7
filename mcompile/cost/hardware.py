"""Hardware profiles: what the cost model (:mod:`mcompile.cost.model`) knows about a machine.

A profile is data — peak dense FLOP/s per precision, HBM capacity and bandwidth, intra-node
(NVLink) and inter-node (InfiniBand) bandwidth and latency, GPUs per node — and every number
carries its source. Datasheet numbers are *peaks*; the cost model applies its per-op-class
efficiency constants (:class:`mcompile.cost.model.Efficiency`) to them. A profile measured on the machine
itself (:func:`calibrate`) holds *achieved* rates instead, and lists those fields in ``measured``:
the cost model then uses efficiency 1 for what was measured.

Conventions
-----------
* FLOP/s are dense (no 2:4 sparsity): NVIDIA's datasheets print the sparse figure with an
  asterisk; the dense one is half of it.
* fp32 matmuls (issue 38 item 2): ``fp32_flops`` is the true-fp32 rate (the datasheet's "FP32", CUDA
  cores) and ``tf32_flops`` the TF32 tensor-core rate. mcompile never turns TF32 on: torch runs fp32
  matmuls in true fp32 unless the user calls ``torch.set_float32_matmul_precision("high")`` (or sets
  ``torch.backends.cuda.matmul.allow_tf32`` / ``fp32_precision = "tf32"``). ``peak_flops("fp32")``
  prices what that setting makes the runtime do (:func:`fp32_matmul_precision`, read when the cost
  is asked for), so the cost model, the search and the MFU denominator agree with the kernels that run.
  Before, fp32 was priced at the TF32 rate while nothing enabled TF32: ~7x optimistic on an H100.
* Link bandwidths are per GPU and per direction, in bytes/s (NVIDIA quotes NVLink as the
  bidirectional total: 600 GB/s on A100 is 300 GB/s each way). InfiniBand: one NIC per GPU on
  DGX/HGX systems, so a GPU's inter-node bandwidth is its NIC's line rate (HDR 200 Gb/s =
  25 GB/s, NDR 400 Gb/s = 50 GB/s).
* HBM capacity in bytes as printed (``80 GB`` → 80e9; the usable GiB reported by ``nvidia-smi``
  is a little larger, so ``fits`` is conservative); HBM bandwidth in bytes/s.
* Latencies (the α of the α-β model, per ring step) are not datasheet numbers: they are the
  order of magnitude of NCCL's small-message step latency (NCCL's own tuning model uses a few
  microseconds per step over NVLink and a few more over the network). Calibrate on the target
  cluster where latency matters (small messages, many steps).
* ``collective_call_latency``: seconds per collective or point-to-point *call*, on top of α per
  ring step. 0 on the GPU profiles (NCCL's per-call cost is within α). gloo on this project's
  CPU machine (a VM whose idle virtual CPUs halt) pays a wake-up of about a millisecond per call
  whenever a process waits for its peer: a small all-gather costs what a small all-reduce costs,
  not half of it. ``calibrate(processes=k)`` measures it.
* Per-op overhead (``op_overhead_forward`` / ``op_overhead_backward``): host time per graph node
  that no roofline sees — Python, the dispatcher, autograd's bookkeeping — in seconds per node of
  the forward and per differentiable node of the backward. On a CPU it adds to every op's time (the
  same cores run it); on a GPU kernels launch asynchronously and it hides behind device time, so
  the datasheet profiles set it to 0.
* ``overlap_slowdown`` (κ >= 1): how much longer the computation takes while a collective runs beside
  it. Communication kernels are not free on a GPU: NCCL's kernels occupy SMs (a GEMM sized for all
  132 SMs of an H100 spills into a second wave) and share HBM bandwidth, so the overlapped part of a
  region of compute c and communication t costs max(c, t) + (κ − 1)·min(c, t) rather than max(c, t)
  (:func:`mcompile.cost.model.overlapped`). The GPU profiles take κ = 1.19 from Lee et al. 2025,
  "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning:
  Performance and Power Implications" (arXiv:2507.03114, abstract): overlapping computation and
  communication slows the computation by 18.9 % on average (at most 40 %) over GPT and Llama
  workloads on 4 A100s, H100s, MI250s and MI210s. κ must lie in [1, 2]: at 2 an overlap is as slow
  as running both in turn, so overlap is never priced slower than no overlap. The CPU profile has 1
  (unmeasured; gloo collectives there rarely overlap at all, see the next item).
* ``comm_overlaps_compute``: whether a collective launched during backward (the data-parallel
  gradient reduction) can hide behind compute. True on GPUs (NCCL has SMs and copy engines of its
  own). With gloo on a CPU the collective's copies, sums and socket work run on the CPU, so they
  hide only where a core is free of compute: ``calibrate(processes=k)`` sets it to k < cores (one
  compute thread per process); the cpu-gloo snapshot (2 processes on 2 cores) has it False.

NCCL bandwidths, checked against published measurements (:data:`NCCL_PUBLISHED`)
-------------------------------------------------------------------------------
The link fields are *line rates* (datasheets); the cost model multiplies them by
``Efficiency.intra_node`` / ``inter_node`` (:mod:`mcompile.cost.model`). What that gives as an NCCL ring's
bus bandwidth is held within ±15 % of these published nccl-tests figures (tests/test_cost_overlap.py;
tests/test_cost_published.py checks the same constants through ``collective_time``):

- NVLink 4 (H100/H200, 450 GB/s per direction): 370 GB/s ring bus bandwidth on 8 GPUs — "450GB/s is
  the line rate. With the protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of
  370GB/s" (S. Jeaugey, NVIDIA, github.com/NVIDIA/nccl-tests/issues/212, 2024-05-06). NCCL's default
  all-reduce on those nodes is NVLink SHARP, ~476-480 GB/s bus bandwidth (same comment; 476 GB/s on
  H100 in nccl-tests issue #290, 475 GB/s on H200 in nccl-tests issue #272): not a ring, and not
  modelled (a known gap: ``collective_time`` has no NVLS term).
- NVLink 3 (A100, 300 GB/s per direction): 232.54 GB/s all-reduce bus bandwidth on 8 A100s of one
  node (github.com/NVIDIA/nccl-tests/issues/175, 2023-10-29).
- InfiniBand NDR 400 Gb/s (one ConnectX-7 per GPU): "For NDR @ 400Gbps you should see 46-48GB/s per
  NIC" (AddyLaddy, NVIDIA, github.com/NVIDIA/nccl-tests/issues/290, 2025-03-03; "around 48GB/s from
  each CX7 NIC at 400Gbps" in nccl-tests issue #319).
- InfiniBand HDR 200 Gb/s (DGX A100, 8 NICs): "On an Nvidia DGX-A100 system we have 8x200Gbit/s IB
  cards and we measure 192GB/s AllReduce BusBW" (AddyLaddy, github.com/NVIDIA/nccl/issues/812,
  2023-03-31): 24 GB/s per NIC.

No published nccl-tests figure for B200 (NVLink 5) was found: its profile is unchecked.

``get_hardware(name)`` accepts a profile name or alias, case-insensitive; an unknown name is an
error listing the known ones. ``calibrate()`` measures the current machine: matmul FLOP/s
(``torch.matmul``), memcpy bandwidth (``Tensor.copy_``: read + write bytes / time), the per-op
overhead (a chain of tiny ``aten.mul`` calls, forward and backward, called as mcompile's programs
call ops) and the α-β of a gloo all-reduce over 2 local processes
(:func:`mcompile.runtime.launch.spawn`), fitted by least squares to the ring all-reduce time
2(n−1)α + 2(n−1)/n · B/β (Thakur et al. 2005).

Processes sharing cores (``calibrate(processes=k)``): a run of k single-threaded gloo processes on
a machine with fewer than k cores gives each process a share of a core, and its collectives wait
for peers the scheduler has not run yet. ``processes=k`` therefore measures everything inside k
concurrent single-threaded processes (each microbenchmark started together behind a barrier and
timed as a mean over a window of about a second — time slices are milliseconds, so a best-of-few
would catch a process alone on a core; the per-process rate is the median over the processes) and
the collectives in groups of 2 with all k/2 groups communicating at once: the profile of *one
process of a k-process run on this machine*. There, the mean time of gloo all-reduce, all-gather
and reduce-scatter calls of 4 KB-16 MB, each after ~1 ms of matmuls as a step's collectives follow
its kernels (back-to-back calls never let a core idle and hide the wake-up cost), is fitted to
t = L + steps·α + fraction·B/β (:func:`fit_collectives`: L ``collective_call_latency``, α, β).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Hardware", "HARDWARE", "get_hardware", "list_hardware", "calibrate", "measure_collective",
           "NCCL_PUBLISHED", "NcclFigure", "GPU_OVERLAP_SLOWDOWN", "fp32_matmul_precision"]

GB = 1e9
TB = 1e12

# Sources, cited once and referred to by key from every number below.
_SRC = {
    "a100": "NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), "
    "A100 80GB SXM column",
    "dgx_a100": "NVIDIA DGX A100 datasheet (nvidia-dgx-a100-80gb-datasheet-web-us.pdf): 8x single-port "
    "ConnectX-6 HDR 200 Gb/s InfiniBand for compute, 8 GPUs",
    "h100": "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100/, datasheet "
    "2287922), H100 SXM column",
    "dgx_h100": "NVIDIA DGX H100 datasheet (nvidia.com/en-us/data-center/dgx-h100/): 8x ConnectX-7 "
    "400 Gb/s (NDR) for compute, 8 GPUs",
    "h200": "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200/), H200 SXM column",
    "dgx_h200": "NVIDIA DGX H200 datasheet (nvidia.com/en-us/data-center/dgx-h200/): 8x ConnectX-7 "
    "400 Gb/s for compute, 8 GPUs",
    "b200": "NVIDIA HGX B200 specifications (nvidia.com/en-us/data-center/hgx/, 'Individual Blackwell GPU "
    "Specifications', HGX B200 column)",
    "b200_fp32": "NVIDIA Blackwell architecture technical brief, HGX B200 at 1,000 W: FP32 80 TFLOPS (as tabulated "
    "at glennklockwood.com/garden/processors/B200)",
    "dgx_b200": "NVIDIA DGX B200 datasheet (nvidia.com/en-us/data-center/dgx-b200/): 8x ConnectX-7 "
    "400 Gb/s for compute, 8 GPUs",
    "async_launch": "not modelled (0): kernels launch asynchronously, host overhead hides behind device time",
    "nccl_call": "not modelled (0): NCCL's per-call cost is within the per-step latency α",
    "overlap_slowdown": "Lee et al. 2025, arXiv:2507.03114 (abstract): compute overlapped with communication "
    "is 18.9 % slower on average (max 40 %), A100/H100/MI250/MI210, GPT and Llama workloads",
    "nccl_latency": "assumed order of magnitude of NCCL's per-step latency (NCCL tuning model / "
    "nccl-tests small-message times); not a datasheet number — calibrate() on the cluster",
}


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One accelerator type in its usual node. Every number is per GPU; ``sources`` says where
    each came from (field name → citation)."""

    name: str
    bf16_flops: float  # dense peak, FLOP/s
    fp8_flops: float | None  # dense peak, FLOP/s; None: no FP8 tensor cores
    fp32_flops: float  # FLOP/s of true-fp32 matmuls (CUDA cores on GPUs: the datasheet's "FP32")
    tf32_flops: float | None = None  # TF32 tensor cores, dense; None: none (a CPU). Used for fp32 matmuls only
    #                                  where torch is set to TF32 (fp32_matmul_precision)
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    intra_node_bandwidth: float  # bytes/s per GPU per direction (NVLink)
    intra_node_latency: float  # seconds per ring step
    inter_node_bandwidth: float  # bytes/s per GPU per direction (its NIC)
    inter_node_latency: float  # seconds per ring step
    gpus_per_node: int
    # host time per graph node (module docstring): forward, and backward per differentiable node
    op_overhead_forward: float = 0.0
    op_overhead_backward: float = 0.0
    # seconds per collective or point-to-point call on top of the α of its ring steps (module docstring)
    collective_call_latency: float = 0.0
    # whether collectives can run while compute runs (module docstring): GPUs have SMs and copy engines
    # for NCCL; gloo on a CPU whose cores all compute moves and sums the bytes on those same cores
    comm_overlaps_compute: bool = True
    # κ: the overlapped part of compute beside a collective takes κ times as long (module docstring); in [1, 2]
    overlap_slowdown: float = 1.0
    measured: tuple[str, ...] = ()  # fields holding achieved rates (calibrate()), not datasheet peaks
    sources: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if not 1.0 <= self.overlap_slowdown <= 2.0:
            raise ValueError(f"overlap_slowdown={self.overlap_slowdown!r} must be in [1, 2]: 1 is a perfect overlap, "
                             "2 as slow as running compute and communication one after the other")

    def peak_flops(self, dtype: str = "bf16") -> float:
        """Dense peak FLOP/s of matmuls in ``dtype`` ("bf16"/"fp16", "fp8", "fp32"). fp32: the TF32 rate
        where this process's torch runs fp32 matmuls in TF32 (:func:`fp32_matmul_precision`) and the
        profile has one, else the true-fp32 rate."""
        dtype = _DTYPE_ALIASES.get(str(dtype).replace("torch.", ""), str(dtype))
        if dtype == "bf16":
            return self.bf16_flops
        if dtype == "fp32":
            if self.tf32_flops is not None and fp32_matmul_precision() == "tf32":
                return self.tf32_flops
            return self.fp32_flops
        if dtype == "fp8":
            if self.fp8_flops is None:
                raise ValueError(f"{self.name} has no FP8 tensor cores: use precision 'bf16'")
            return self.fp8_flops
        raise ValueError(f"unknown precision {dtype!r}: use 'bf16', 'fp8' or 'fp32'")

    def replace(self, **changes) -> Hardware:
        """A copy with some numbers changed (their sources marked as user-given unless given)."""
        sources = dict(self.sources)
        for k in changes:
            if k in _NUMBER_FIELDS:
                sources[k] = "given by the user"
        sources.update(changes.pop("sources", {}))
        return dataclasses.replace(self, **changes, sources=sources)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Hardware:
        d = json.loads(text)
        d["measured"] = tuple(d.get("measured", ()))
        return cls(**d)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Hardware:
        return cls.from_json(Path(path).read_text())

    def describe(self) -> str:
        """The numbers with their sources, one per line."""
        lines = [self.name]
        for f in _NUMBER_FIELDS:
            tag = " (measured)" if f in self.measured else ""
            lines.append(f"  {f:22s} {getattr(self, f)!s:>12}{tag}  [{self.sources.get(f, '?')}]")
        return "\n".join(lines)


_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "bf16", "fp16": "bf16", "half": "bf16", "float32": "fp32",
                  "float": "fp32", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "fp8": "fp8", "bf16": "bf16",
                  "fp32": "fp32"}
_NUMBER_FIELDS = ("bf16_flops", "fp8_flops", "fp32_flops", "tf32_flops", "hbm_bytes", "hbm_bandwidth",
                  "intra_node_bandwidth", "intra_node_latency", "inter_node_bandwidth", "inter_node_latency",
                  "gpus_per_node", "op_overhead_forward", "op_overhead_backward", "collective_call_latency",
                  "overlap_slowdown")


def fp32_matmul_precision() -> str:
    """How this process's torch runs an fp32 matmul on CUDA: "tf32" (TF32 tensor cores) when the user enabled
    it — ``torch.set_float32_matmul_precision("high"/"medium")``, ``torch.backends.cuda.matmul.allow_tf32 =
    True`` or ``torch.backends.cuda.matmul.fp32_precision = "tf32"`` —, else "fp32" (torch's default: true
    fp32). mcompile sets neither (fp32 stays exact: the parity tests' dtype); the cost model prices fp32 by
    this (:meth:`Hardware.peak_flops`). Reads flags only: no CUDA needed."""
    import torch

    m = torch.backends.cuda.matmul
    new = getattr(m, "fp32_precision", None)  # torch >= 2.9's API; "none": not set, the legacy flag decides
    if new not in (None, "none"):
        return "tf32" if new == "tf32" else "fp32"
    return "tf32" if m.allow_tf32 else "fp32"


def _gpu(name, *, bf16, fp8, fp32, tf32, hbm, hbm_bw, nvlink_bidir, nic_gbit, chip, node, lat_intra=3e-6,
         lat_inter=6e-6) -> Hardware:
    src = {
        "bf16_flops": _SRC[chip] + " (BF16 Tensor Core, sparse figure / 2)",
        "fp8_flops": (_SRC[chip] + " (FP8 Tensor Core, sparse figure / 2)") if fp8 else _SRC[chip] + " (no FP8)",
        "fp32_flops": _SRC["b200_fp32" if chip == "b200" else chip] + " (FP32)",
        "tf32_flops": _SRC[chip] + " (TF32 Tensor Core, sparse figure / 2)",
        "hbm_bytes": _SRC[chip] + " (GPU memory)",
        "hbm_bandwidth": _SRC[chip] + " (GPU memory bandwidth)",
        "intra_node_bandwidth": _SRC[chip] + f" (NVLink {nvlink_bidir:g} GB/s bidirectional, / 2 per direction)",
        "intra_node_latency": _SRC["nccl_latency"],
        "inter_node_bandwidth": _SRC[node] + f" ({nic_gbit} Gb/s per GPU / 8 bits)",
        "inter_node_latency": _SRC["nccl_latency"],
        "gpus_per_node": _SRC[node],
        "op_overhead_forward": _SRC["async_launch"],
        "op_overhead_backward": _SRC["async_launch"],
        "collective_call_latency": _SRC["nccl_call"],
        "overlap_slowdown": _SRC["overlap_slowdown"],
    }
    return Hardware(
        name=name, bf16_flops=bf16 * TB, fp8_flops=fp8 * TB if fp8 else None, fp32_flops=fp32 * TB,
        tf32_flops=tf32 * TB, hbm_bytes=hbm * GB, hbm_bandwidth=hbm_bw * GB, intra_node_bandwidth=nvlink_bidir / 2 * GB,
        intra_node_latency=lat_intra, inter_node_bandwidth=nic_gbit / 8 * GB, inter_node_latency=lat_inter,
        gpus_per_node=8, overlap_slowdown=GPU_OVERLAP_SLOWDOWN, sources=src,
    )


# κ of the GPU profiles (module docstring): Lee et al. 2025's average compute slowdown under overlap, 18.9 %
GPU_OVERLAP_SLOWDOWN = 1.19


@dataclass(frozen=True)
class NcclFigure:
    """A published NCCL bus bandwidth (GB/s) of one profile's link, with where it was published."""

    profile: str
    link: str  # "intra_node" (NVLink, ring over the 8 GPUs of a node) | "inter_node" (per NIC)
    busbw_gb_s: float
    source: str


# Published nccl-tests figures the profiles' effective bandwidths are checked against (module docstring).
NCCL_PUBLISHED: tuple[NcclFigure, ...] = (
    NcclFigure("h100-sxm", "intra_node", 370.0, "github.com/NVIDIA/nccl-tests/issues/212 (S. Jeaugey, NVIDIA, "
               "2024-05-06): effective NVLink bandwidth 370 GB/s, NCCL_ALGO=RING busbw, 8 H100"),
    NcclFigure("h200", "intra_node", 370.0, "NVLink 4 as H100: github.com/NVIDIA/nccl-tests/issues/212"),
    NcclFigure("a100-80gb", "intra_node", 232.54, "github.com/NVIDIA/nccl-tests/issues/175 (2023-10-29): "
               "all_reduce_perf on one node of 8 A100, 232.54 GB/s busbw"),
    NcclFigure("h100-sxm", "inter_node", 47.0, "github.com/NVIDIA/nccl-tests/issues/290 (AddyLaddy, NVIDIA, "
               "2025-03-03): 'For NDR @ 400Gbps you should see 46-48GB/s per NIC'"),
    NcclFigure("h200", "inter_node", 47.0, "NDR 400 Gb/s as H100: github.com/NVIDIA/nccl-tests/issues/290"),
    NcclFigure("a100-80gb", "inter_node", 24.0, "github.com/NVIDIA/nccl/issues/812 (AddyLaddy, NVIDIA, "
               "2023-03-31): DGX A100, 8x HDR 200 Gb/s, 192 GB/s all-reduce busbw = 24 GB/s per NIC"),
)


# Datasheet numbers (dense TFLOP/s; GB; GB/s). Each profile's sources are filled by _gpu().
_DATASHEETS: dict[str, Hardware] = {
    "a100-80gb": _gpu("a100-80gb", bf16=312, fp8=None, fp32=19.5, tf32=156, hbm=80, hbm_bw=2039, nvlink_bidir=600,
                      nic_gbit=200, chip="a100", node="dgx_a100"),
    "h100-sxm": _gpu("h100-sxm", bf16=989.5, fp8=1979, fp32=67, tf32=494.5, hbm=80, hbm_bw=3350, nvlink_bidir=900,
                     nic_gbit=400, chip="h100", node="dgx_h100"),
    "h200": _gpu("h200", bf16=989.5, fp8=1979, fp32=67, tf32=494.5, hbm=141, hbm_bw=4800, nvlink_bidir=900,
                 nic_gbit=400, chip="h200", node="dgx_h200"),
    "b200": _gpu("b200", bf16=2250, fp8=4500, fp32=80, tf32=1100, hbm=180, hbm_bw=7700, nvlink_bidir=1800,
                 nic_gbit=400, chip="b200", node="dgx_b200"),
}

# This project's CPU development machine (2 AMD EPYC cores with AVX-512 BF16, torch 2.13 CPU), measured
# with calibrate(): bf16 matmuls vary 3e11-9e11 FLOP/s between runs, fp32 5e10-7e10, copy 1.4e10-1.7e10
# B/s, gloo all-reduce β 1.9e9-2.3e9 B/s, α ~7e-5 s; per-op overhead ~3e-6 s forward and backward (one
# thread); rounded. Re-measure with calibrate() on another machine. calibrate(processes=k) measures the
# collectives as a training step meets them (bench/cost_vs_measured.py; its JSON records the profiles).
_CPU_MEASURED = "measured by mcompile.cost.hardware.calibrate() on the project's 2-core CPU development machine"
_CPU_GLOO = Hardware(
    name="cpu-gloo", bf16_flops=4.0e11, fp8_flops=None, fp32_flops=6.0e10, hbm_bytes=25e9,
    hbm_bandwidth=1.6e10, intra_node_bandwidth=2.0e9, intra_node_latency=7e-5,
    inter_node_bandwidth=2.0e9, inter_node_latency=7e-5, gpus_per_node=2,
    op_overhead_forward=3e-6, op_overhead_backward=3e-6, comm_overlaps_compute=False,
    measured=("bf16_flops", "fp32_flops", "hbm_bandwidth", "intra_node_bandwidth", "intra_node_latency",
              "inter_node_bandwidth", "inter_node_latency", "op_overhead_forward", "op_overhead_backward"),
    sources={f: _CPU_MEASURED for f in _NUMBER_FIELDS}
    | {"hbm_bytes": "physical memory of the machine (os.sysconf)", "gpus_per_node": "CPU cores of the machine",
       "fp8_flops": "no FP8 matmul on CPU",
       "tf32_flops": "no TF32 on CPU: fp32 matmuls at fp32_flops",
       "inter_node_bandwidth": "one machine: same as intra-node",
       "inter_node_latency": "one machine: same as intra-node",
       "collective_call_latency": "0 in this snapshot (calibrate()'s default: back-to-back all-reduces, best of "
                                  "a few); calibrate(processes=2) measures ~1e-3 s per call after compute",
       "comm_overlaps_compute": "2 single-threaded processes on 2 cores: no core is free for gloo",
       "overlap_slowdown": "not measured (1): gloo on this machine does not overlap (comm_overlaps_compute)"},
)

HARDWARE: dict[str, Hardware] = {**_DATASHEETS, "cpu-gloo": _CPU_GLOO}

_ALIASES = {
    "a100": "a100-80gb", "a100-sxm": "a100-80gb", "a100-sxm4-80gb": "a100-80gb", "a100_80gb": "a100-80gb",
    "h100": "h100-sxm", "h100-sxm5": "h100-sxm", "h200-sxm": "h200", "b200-sxm": "b200", "cpu": "cpu-gloo",
}


def list_hardware() -> list[str]:
    return sorted(HARDWARE)


def get_hardware(name: str | Hardware) -> Hardware:
    """The profile called ``name`` (case-insensitive; aliases like "h100", "a100"), or ``name`` itself
    if it already is a :class:`Hardware`."""
    if isinstance(name, Hardware):
        return name
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in HARDWARE:
        raise ValueError(
            f"unknown hardware {name!r}; known profiles: {', '.join(list_hardware())} "
            f"(aliases: {', '.join(sorted(_ALIASES))}); or measure this machine with mcompile.cost.hardware.calibrate()"
        )
    return HARDWARE[key]


# --------------------------------------------------------------------------- calibration


def _time(fn, reps: int, sync) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _measure_matmul(device, dtype, n: int, reps: int) -> float:
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return 2 * n**3 / _time(lambda: torch.mm(a, b), reps, sync)


def _measure_copy(device, nbytes: int, reps: int) -> float:
    import torch

    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return 2 * src.numel() * 4 / _time(lambda: dst.copy_(src), reps, sync)  # read + write


def _measure_op_overhead(reps: int, chain: int = 64) -> tuple[float, float]:
    """Host seconds per op, forward and backward: a chain of ``chain`` tiny ``aten.mul`` calls on a
    16-element tensor that requires grad, called through the OpOverload as mcompile's programs
    call ops (their arithmetic is nothing next to the dispatch, autograd and Python around it)."""
    import torch

    mul, total = torch.ops.aten.mul.Tensor, torch.ops.aten.sum.default
    x = torch.ones(16, requires_grad=True)
    fwd = bwd = float("inf")
    for _ in range(max(reps, 10)):
        t0 = time.perf_counter()
        y = x
        for _ in range(chain):
            y = mul(y, 1.0001)
        t1 = time.perf_counter()
        total(y).backward()
        t2 = time.perf_counter()
        fwd, bwd = min(fwd, (t1 - t0) / chain), min(bwd, (t2 - t1) / chain)
    return fwd, bwd


def _allreduce_times(rank: int, world: int, sizes: list[int], reps: int, group=None) -> list[float]:
    """Runs on every rank of a gloo group (spawn): best time of an fp32 all-reduce per size."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = []
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4))
        dist.barrier()
        out.append(_time(lambda t=t: dist.all_reduce(t, group=group), reps, lambda: None))
    return out


def _rate_over(fn, work: float, duration: float) -> float:
    """``work`` per call / mean seconds per call of ``fn``, called for ``duration`` seconds after one
    warm-up call. Processes sharing cores are time-sliced (a slice is milliseconds): a best-of-few
    would find a moment alone on a core, a mean over a long window measures the share a process gets."""
    fn()
    calls, t0 = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        dt = time.perf_counter() - t0
        if dt >= duration:
            return work * calls / dt


def _concurrent_rates(rank: int, world: int, matmul_size: int, copy_bytes: int, duration: float,
                      sizes: list[int], reps: int, collectives: bool) -> dict:
    """One of ``world`` single-threaded processes measuring at the same time as the others (spawn):
    matmul FLOP/s (bf16, fp32), copy bandwidth, per-op overhead — each the mean rate over
    ``duration`` seconds, every process starting together — and the mean time of all-reduces in pairs
    of ranks (every pair at once; ``world`` even)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    n = matmul_size
    mats = {dt: (torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)) for dt in (torch.bfloat16, torch.float32)}
    src = torch.ones(copy_bytes // 4)
    dst = torch.empty_like(src)
    chain = 64
    mul, total = torch.ops.aten.mul.Tensor, torch.ops.aten.sum.default
    x = torch.ones(16, requires_grad=True)
    ys: list = []

    def forward():
        y = x
        for _ in range(chain):
            y = mul(y, 1.0001)
        ys.append(total(y))

    def backward():
        ys.pop().backward()

    def forward_backward():
        forward()
        backward()

    out: dict = {}
    for key, fn, work in (("bf16_flops", lambda: torch.mm(*mats[torch.bfloat16]), 2 * n**3),
                          ("fp32_flops", lambda: torch.mm(*mats[torch.float32]), 2 * n**3),
                          ("hbm_bandwidth", lambda: dst.copy_(src), 2 * src.numel() * 4),  # read + write
                          ("op_forward", forward, chain),
                          ("op_forward_backward", forward_backward, chain)):
        dist.barrier()  # every process starts each microbenchmark together: they share the cores
        out[key] = _rate_over(fn, work, duration)
        ys.clear()
    # ops per second -> seconds per op; backward = (forward + backward) - forward
    out["op_overhead"] = (1 / out["op_forward"], max(0.0, 1 / out["op_forward_backward"] - 1 / out["op_forward"]))
    if collectives and world >= 2:
        out["collectives"] = _pair_collective_times(rank, world, sizes, reps, duration)
    return out


COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def _pair_collective_times(rank: int, world: int, sizes: list[int], reps: int, duration: float) -> dict:
    """Mean seconds per call of each collective kind in pairs of ranks (every pair at once), each
    call after ~1 ms of matmuls: {kind: [time per size]}; ``sizes`` are the full tensor's bytes.

    Why after compute and why the mean: where a waiting process lets its core go idle (a virtual
    CPU halts), waking it for the peer's data can cost milliseconds — back-to-back calls (the
    nccl-tests way) never idle and hide it, while a step's collectives follow its kernels. The times
    are bimodal; a step's many collectives cost their mean."""
    import torch
    import torch.distributed as dist

    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]  # every rank creates every group
    group = pairs[rank // 2]
    fa, fb = torch.randn(256, 256), torch.randn(256, 256)

    def compute():
        for _ in range(4):
            torch.mm(fa, fb)

    out: dict = {}
    for kind in COLLECTIVE_KINDS:
        out[kind] = []
        for nbytes in sizes:
            half = torch.ones(max(1, nbytes // 8))
            full = torch.ones(2 * half.numel())

            def call(kind=kind, full=full, half=half):
                if kind == "all_reduce":
                    dist.all_reduce(full, group=group)
                elif kind == "all_gather":
                    all_gather(full, half, group=group)
                else:
                    reduce_scatter(half, full, group=group)

            t0 = time.perf_counter()
            for _ in range(3):  # warm-up, and a first guess of the time per call
                compute()
                call()
            # about ``duration`` s of calls (at least ``reps``); both ranks of a pair agree on the count
            calls = torch.tensor([max(reps, int(duration / max((time.perf_counter() - t0) / 3, 1e-6)))])
            dist.all_reduce(calls, op=dist.ReduceOp.MAX)
            spent = 0.0
            for _ in range(int(calls)):
                compute()
                t1 = time.perf_counter()
                call()
                spent += time.perf_counter() - t1
            out[kind].append(spent / int(calls))
    return out


def _ring_factors(kind: str, n: int) -> tuple[float, float]:
    """(ring steps, fraction of the full tensor's bytes each rank sends) of one collective over n
    ranks (Thakur et al. 2005; :func:`mcompile.cost.model.collective_time`)."""
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    return n - 1, (n - 1) / n


def fit_collectives(samples: list[tuple[str, int, float]], n: int) -> tuple[float, float, float]:
    """Fit t = L + steps·α + fraction·B/β to (kind, bytes B, seconds t) samples of several
    collective kinds over n ranks → (L seconds per call, α seconds per ring step, β bytes/s).

    Least squares of the relative residuals (weights 1/t²: the sizes span orders of magnitude), with
    L, α ≥ 0: the best of the fits with both, with L alone and with α alone (an all-reduce and an
    all-gather of small messages that take the same time say the cost is per call, not per step)."""
    import torch

    rows = [(1.0, *_ring_factors(k, n), t) for k, _, t in samples]
    sizes = [b for _, b, _ in samples]
    A = torch.tensor([[r[0], r[1], r[2] * b] for r, b in zip(rows, sizes)], dtype=torch.float64)
    y = torch.tensor([r[3] for r in rows], dtype=torch.float64)
    w = 1 / y
    best = None
    for cols in ((0, 1, 2), (0, 2), (1, 2)):
        sol = torch.linalg.lstsq(A[:, cols] * w[:, None], y * w).solution
        coef = dict(zip(cols, sol.tolist()))
        if coef[2] <= 0 or coef.get(0, 0.0) < 0 or coef.get(1, 0.0) < 0:
            continue
        err = float((((A[:, cols] @ sol) - y) * w).pow(2).sum())
        if best is None or err < best[0]:
            best = (err, coef.get(0, 0.0), coef.get(1, 0.0), 1 / coef[2])
    if best is None:  # nothing feasible (noise): bound the latency by the smallest time, β by the largest
        i = max(range(len(samples)), key=lambda j: sizes[j])
        return min(y.tolist()), 0.0, rows[i][2] * sizes[i] / rows[i][3]
    return best[1], best[2], best[3]


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    k = len(xs)
    return xs[k // 2] if k % 2 else (xs[k // 2 - 1] + xs[k // 2]) / 2


def fit_alpha_beta(sizes: list[int], times: list[float], n: int) -> tuple[float, float]:
    """Least-squares fit of t = 2(n−1)α + 2(n−1)/n · B/β (ring all-reduce) → (α seconds, β bytes/s).

    Weighted by 1/t² (least squares of the *relative* residuals): the sizes span orders of magnitude,
    and with plain least squares a 1 % wobble of the largest message's time outweighs the smallest
    message's whole time, which is what determines α."""
    w = [1 / t**2 if t > 0 else 0.0 for t in times]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, sizes)) / sw
    mt = sum(wi * t for wi, t in zip(w, times)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, sizes))
    slope = sum(wi * (x - mx) * (t - mt) for wi, x, t in zip(w, sizes, times)) / sxx if sxx else 0.0
    intercept = mt - slope * mx
    # a negative intercept is noise: then bound α by the smallest message's whole time
    alpha = (intercept if intercept > 0 else min(times)) / (2 * (n - 1))
    beta = (2 * (n - 1) / n) / slope if slope > 0 else float("inf")
    return alpha, beta


def measure_collective(nprocs: int = 2, sizes: tuple[int, ...] = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24),
                       reps: int = 5) -> tuple[float, float]:
    """α (s) and β (bytes/s) of a gloo all-reduce over ``nprocs`` local CPU processes."""
    from mcompile.runtime.launch import spawn

    per_rank = spawn(_allreduce_times, nprocs, list(sizes), reps)
    times = [max(r[i] for r in per_rank) for i in range(len(sizes))]  # a collective ends with its slowest rank
    return fit_alpha_beta(list(sizes), times, nprocs)


def calibrate(base: str | Hardware | None = None, *, device: str | None = None, collectives: bool = True,
              matmul_size: int | None = None, copy_bytes: int | None = None, reps: int = 5,
              processes: int | None = None, duration: float = 1.0) -> Hardware:
    """Measure this machine and return a profile of it (the measured fields listed in ``measured``).

    - matmul FLOP/s: ``torch.mm`` of two square ``matmul_size`` matrices, best of ``reps``, in bf16
      (and fp32 on CPU) (CPU: 1024; CUDA: 8192);
    - memcpy bandwidth: ``copy_`` of ``copy_bytes`` (CPU 64 MB, CUDA 1 GB), counted as read + write;
    - per-op overhead (CPU): host seconds per op forward and backward (:func:`_measure_op_overhead`);
    - collectives (CPU only, ``collectives=True``): gloo all-reduce α-β over 2 local processes.

    ``processes`` (CPU): measure inside that many concurrent single-threaded processes — the profile
    of one process of a run with that many (module docstring); collectives then in pairs, all pairs
    at once (``processes`` even; with 1 process, the 2-process measurement). Without it, the rates
    are those of this process with its current thread count. With ``processes``, each rate is the
    mean over ``duration`` seconds of repeated calls, not the best of ``reps`` (see :func:`_rate_over`),
    and an all-reduce's time the mean of ``max(reps, 10)``.

    ``base``: a datasheet profile whose other numbers (links of a GPU node, FP8) are kept — e.g.
    ``calibrate("h200")`` on one H200 measures its matmul and copy rates and keeps its NVLink/IB.
    Without ``base`` on CPU the result is a "cpu-gloo" profile of this machine.

    The collective measurement spawns processes: call it under ``if __name__ == "__main__":`` in a
    script (Python's spawn start method re-imports the main module).
    """
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = dev.type == "cuda"
    n = matmul_size or (8192 if gpu else 1024)
    nbytes = copy_bytes or ((1 << 30) if gpu else (64 << 20))
    sizes = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24)
    if processes is not None and (gpu or processes < 1 or (processes > 1 and processes % 2)):
        raise ValueError(f"processes={processes!r}: a CPU measurement in 1 or an even number of processes")
    where = torch.cuda.get_device_name(dev) if gpu else "this CPU"
    what = f"measured by calibrate() on {where} (torch {torch.__version__})"
    if processes:
        from mcompile.runtime.launch import spawn

        what += f", one of {processes} concurrent single-threaded processes on {os.cpu_count()} cores"
        per = spawn(_concurrent_rates, processes, n, nbytes, duration, list(sizes), max(reps, 10), collectives)
        changes: dict = {k: _median([r[k] for r in per]) for k in ("bf16_flops", "fp32_flops", "hbm_bandwidth")}
        changes["op_overhead_forward"] = _median([r["op_overhead"][0] for r in per])
        changes["op_overhead_backward"] = _median([r["op_overhead"][1] for r in per])
    else:
        changes = dict(bf16_flops=_measure_matmul(dev, torch.bfloat16, n, reps),
                       hbm_bandwidth=_measure_copy(dev, nbytes, reps))
        if not gpu:  # on a GPU fp32 keeps the datasheet's figures (true fp32 and TF32: fp32_matmul_precision picks)
            changes["fp32_flops"] = _measure_matmul(dev, torch.float32, n, reps)
            changes["op_overhead_forward"], changes["op_overhead_backward"] = _measure_op_overhead(reps)
    src = {k: what for k in changes}
    if collectives and not gpu:
        if processes and processes >= 2:
            # a collective ends with the slower rank of its pair; over the pairs: the median
            def pair_time(kind, j, i):
                return max(per[2 * i]["collectives"][kind][j], per[2 * i + 1]["collectives"][kind][j])

            samples = [(kind, b, _median([pair_time(kind, j, i) for i in range(processes // 2)]))
                       for kind in COLLECTIVE_KINDS for j, b in enumerate(sizes)]
            call, alpha, beta = fit_collectives(samples, 2)
            changes["collective_call_latency"] = call
            how = " (gloo all-reduce, all-gather, reduce-scatter in pairs of processes, after compute)"
            src["collective_call_latency"] = what + how
        else:
            alpha, beta = measure_collective(2)
            how = " (gloo all-reduce, 2 processes)"
        changes |= dict(intra_node_bandwidth=beta, intra_node_latency=alpha, inter_node_bandwidth=beta,
                        inter_node_latency=alpha)
        src |= {k: what + how for k in
                ("intra_node_bandwidth", "intra_node_latency", "inter_node_bandwidth", "inter_node_latency")}
    if base is None:
        if gpu:
            raise ValueError("calibrate() on a GPU needs base= a datasheet profile for its links "
                             f"(one of {', '.join(list_hardware())})")
        base_hw = _CPU_GLOO
        changes |= dict(hbm_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
                        gpus_per_node=os.cpu_count() or 1)
        if processes:  # one compute thread per process: a core is left for gloo only with fewer processes
            changes["comm_overlaps_compute"] = processes < (os.cpu_count() or 1)
    else:
        base_hw = get_hardware(base)
    name = base_hw.name if base is not None else "cpu-gloo"
    measured = tuple(dict.fromkeys((*base_hw.measured, *src)))
    if "comm_overlaps_compute" in changes:  # derived from the process and core counts, not measured
        src["comm_overlaps_compute"] = f"{processes} single-threaded processes on {os.cpu_count()} cores"
    return dataclasses.replace(base_hw, name=f"{name} (calibrated)" if base is not None else name,
                               measured=measured, sources={**base_hw.sources, **src}, **changes)
