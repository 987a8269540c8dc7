"""The cost model: step time, memory and throughput of a layout, from the annotated graph.

``estimate(layout, model, hardware="h100", global_batch=B)`` → :class:`Estimate`. A
:class:`Layout` says how the model is split (dp, tp, pp, virtual stages, cp, ep, microbatch size,
schedule, sequence parallelism, recompute, ZeRO); a :class:`Workload` is the model, captured once
and analysed per (tp, sp); a :class:`~mcompile.cost.hardware.Hardware` profile gives peak rates and
links. Everything below is symbolic in the batch and the sequence length: the same functions run on
numbers (``estimate``) and on sympy symbols (``step_time_expr``). They price a layout given the layers on
each pipeline rank (:func:`price_ranks`): ``estimate`` gives ⌈L/p⌉ to every rank, the search
(:mod:`mcompile.search`) the partitioner's cuts, reusing one :class:`Sections` for every layout that
shares its sizes.

What is analysed
----------------
ONE transformer block: the nodes of the captured graph whose ``annotate.layer_index`` is a layer
(the mean over the captured layers, so a 2-layer capture of a 96-layer preset is enough), times the
number of layers; plus the nodes before the first layer (embedding: the first pipeline stage) and
after the last (final norm, head, loss: the last stage). Per node: forward FLOPs and bytes from
``mcompile.ir.annotate`` (sympy in batch, seq), its op class, and its share on one tp rank from the
plan's placements (sharded or Partial output, or a sharded operand not all-gathered for it: 1/tp).
Collectives come from the plan (:class:`mcompile.ir.plan.CollectiveSpec`: kind, axis, bytes, forward and
backward), so the model's communication is what the compiler really inserts.

Compute time per op (a roofline per node, efficiency constants per op class — never per model)
------------------------------------------------------------------------------------------------
    GEMM (linear, matmul):   t_f = max(F / (peak · e_gemm), Y / (bw_hbm · e_mem))
    attention (SDPA):        t_f = max(F / (peak_bf16 · e_attn), Y / (bw_hbm · e_mem))
      unfused (``attention_kernel="unfused"``: bmm → softmax → dropout → bmm, Megatron 2021):
                             t_f = F / (peak_bf16 · e_attn) + (Y + 13 · a·s²·b) / (bw_hbm · e_mem)
                             (the s×s scores through HBM, 13 bytes per score: ``UNFUSED_ATTENTION_BYTES``)
    everything else:         t_f = Y / (bw_hbm · e_mem)          (norms, pointwise, softmax, copies:
                                                                  memory-bound)
    backward: GEMM/attention 2 · t_f (annotate's BACKWARD_MULTIPLIER); memory-bound ops
              k_c · t_f with k_c = 2 for elementwise/norm/softmax/loss (read the output gradient and
              the saved input, write the input gradient), 1 for copies and reductions;
    weight gradient (zero-bubble split): t_w = t_f of each GEMM with a parameter operand.

F and Y are the node's forward FLOPs and bytes (read + written) on one rank; ``peak`` is the dense
peak of the layout's precision (FP8 applies to GEMMs only). A layer's time is the sum over its nodes
(kernels run one after another); the captured layers are averaged (each node and collective counts
1/n of n captured layers).

Host overhead per op: every aten call of a section adds ``Hardware.op_overhead_forward`` to its
forward, every differentiable one (an input is a parameter or such a node) ``op_overhead_backward``
to its backward — Python, dispatcher and autograd time that no roofline sees. Measured on a CPU
(``calibrate``), where the same cores run it; 0 on the GPU profiles, whose kernels launch
asynchronously.

Communication (α-β per mesh axis; Thakur, Rabenseifner & Gropp 2005, ring algorithms)
----------------------------------------------------------------------------------------
n ranks on the axis, B bytes of the full tensor, β the axis's bandwidth, α its per-step latency:

    all-reduce                2(n−1)·α + 2(n−1)/n · B/β
    all-gather, reduce-scatter (n−1)·α + (n−1)/n · B/β
    all-to-all                (n−1)·α + (n−1)/n · B/β
    send/recv                 α + B/β

plus ``Hardware.collective_call_latency`` per call (0 on the GPU profiles; gloo on a CPU measures one:
a waiting process's idle core must be woken for its peer's data, once per call, not per ring step).

Mesh axes are ordered dp, pp, cp, ep, tp (tp innermost: neighbouring ranks). An axis with stride σ
(product of the sizes inside it) and size n lies inside a node when σ·n ≤ G (G GPUs per node): β =
NVLink · e_intra. Otherwise it crosses nodes; the group has k = max(1, G/σ) members per node, each
with its own NIC, so β = min(NVLink, k · NIC) · e_inter and α is the network's.

Per microbatch and layer: tp collectives of the plan (forward ones in forward and again in a full
recompute, backward ones in backward); cp: the attention variant's (below, "Context parallelism").

Overlap: priced as overlap, with contention
-------------------------------------------
A region where communication t runs beside compute c takes

    max(c, t) + (κ − 1) · min(c, t)          (:func:`overlapped`; κ = ``Hardware.overlap_slowdown``)

— the longer of the two, plus the slowdown of the overlapped part: NCCL's kernels take SMs and HBM
bandwidth from the GEMMs beside them (κ = 1.19 on the GPU profiles: Lee et al. 2025's average 18.9 %
compute slowdown under overlap; hardware.py). κ <= 2, so an overlap is never priced slower than the
two in turn. Its exposed communication, what ``breakdown`` reports per kind (``tp_comm``, ``cp_comm``,
``dp_comm``), is the region less c; ``details`` holds ``<kind>_comm_total`` and ``<kind>_comm_hidden``
(total − exposed), outside the sum. Where collectives cannot run beside compute
(``Hardware.comm_overlaps_compute`` False) everything is exposed. The regions:

- tp, ``Layout.overlap`` (collective matmul, Wang et al. ASPLOS 2023; ``Config(tp_overlap="auto")``):
  per layer and phase, the all-gathers and reduce-scatters (SP) are split into tp chunks, each chunk's
  transfer beside another chunk's GEMM: exposed = overlapped(c_gemm · (tp−1)/tp, t_ag+rs) — one GEMM
  chunk cannot overlap (the last of all-gather → matmul, the first of matmul → reduce-scatter); c_gemm
  is the phase's GEMM time (backward: input and weight gradients). All-reduces (tp without SP) are not
  split: exposed in full. Without ``overlap``: all exposed (Megatron without ``--tp-comm-overlap``).
- cp, ring attention: each of the cp−1 K/V transfers beside one block's attention (below); allgather
  and a2a are exposed.
- dp gradient buckets (``overlap_grad_reduce``): launched in the backward, the last layer's bucket
  always waits: exposed t/L + overlapped(window, t·(L−1)/L), window = the microbatch's backward on the
  stage (with its recompute and exposed tp communication). κ = 1 gives Megatron's max(t − window, t/L).
- ZeRO-3 gathers (``Layout.overlap``): prefetched one layer ahead; see "Data parallelism and ZeRO".
Each region is priced against its own compute; tp and dp regions that share a layer's compute are not
charged against each other (a known optimism when both are large).

Context parallelism (cp ranks; the load-balanced causal layout: 2·cp chunks, rank r holds r and 2cp−1−r)
-------------------------------------------------------------------------------------------------------
Each rank holds s/cp positions of every sequence for the whole model: every section is evaluated at
s/cp, except that its queries meet all s keys (attention FLOPs and bytes × cp: s²/cp a rank). Parameters
are replicated over cp, gradients summed and ZeRO sharded over dp·cp. Attention across the ranks, per
layer and microbatch on one rank, on the cp axis's link (:func:`cp_comm`; hq, hkv query and kv heads on
the rank, d the head dim, e the activation bytes, kv = 2·b·(s/cp)·hkv·d·e its K and V, q = b·(s/cp)·hq·d·e):

    ring (Liu et al. 2023)      forward cp−1 steps of send/recv(kv), backward cp−1 of send/recv(2·kv) (K/V and
                                dK/dV); each step beside one of the cp blocks of the attention core:
                                exposed (cp−1) · overlapped(t_attn/cp, t_step) per phase
    allgather (Llama 3)         forward all-gather(cp·kv); backward all-gather(cp·kv) + reduce-scatter(cp·kv)
                                (dK/dV); exposed
    a2a (Ulysses, Jacobs et al. 2023)  forward all-to-alls of q, k, v and the output, backward the same four,
                                each (cp−1)/cp of the local tensor; k, v repeated to hq heads first when cp
                                does not divide hkv; exposed. Needs cp | hq.

A full recompute repeats the forward's. ``breakdown["cp_comm"]`` is the exposed part,
``details["cp_comm_total"]`` all of it. :func:`choose_cp_attention` prices the applicable variants per
layer (forward + backward, exposed) and returns the cheapest: what ``Config(cp_attention="auto")`` and
the search take. Memory: :mod:`mcompile.ir.memory_model` ("Context parallelism": activations at s/cp, plus
the variant's buffers of one layer, :func:`cp_buffer_bytes`).

Recompute: full = one more forward of every layer (its collectives included); selective = one
more forward of the attention core (Korthikanti et al. 2022). auto (``Config(recompute="auto")``:
passes/remat.py's ILP on each rank's joint graph) gets, per pipeline stage, the activation budget the
memory model leaves under the memory limit, priced from the named policies' points
(:func:`recompute_envelope`, :func:`auto_mix`).

Pipeline (p stages, m = B_global/(dp·b) microbatches, v virtual stages; Narayanan et al. SC'21; Qi
et al. 2023 for zero bubble)
--------------------------------------------------------------------------------------------------
T = t_f + t_b + t_r + t_comm + t_p2p is one microbatch on the slowest stage (L/p layers, plus the
embedding on the first and the head on the last); the step's pipeline time is

    m · T + bubble,  bubble = (p−1) · T            GPipe, 1F1B  (fraction (p−1)/(m+p−1) of the total)
                             (p−1) · T / v         interleaved 1F1B
                             (p−1) · (T − 2 t_w)   ZB-H1: (p−1)(T_F + T_B − T_W) with T_B the input
                                                   gradient only (≈ 1/3 of 1F1B's when F = B = W)

p2p: each stage sends v activations forward and v gradients backward per microbatch, b·s·h·2 bytes
(/tp: Megatron's scatter-gather across the tp ranks, SC'21 §4.1, or already sharded under SP; then
an all-gather over tp), on the pp axis's link; not overlapped.

Data parallelism and ZeRO (Rajbhandari et al. 2020), over dp·cp ranks on the dp axis's link
--------------------------------------------------------------------------------------------
(:func:`dp_comm`; P the stage's local parameters, G/Pb/C bytes of a gradient, a stored parameter, a
gathered one in the compute dtype; m microbatches; L layers on the stage)

    ZeRO-0   all-reduce(P·G) once per step, behind the last microbatch's backward (buckets)
    ZeRO-1   reduce-scatter(P·G) once, behind the last backward; + all-gather(P·Pb) after the optimizer
    ZeRO-2   reduce-scatter(P·G) after EVERY microbatch, behind its backward (m×); + all-gather(P·Pb)
             after the optimizer
    ZeRO-3   per microbatch and layer: all-gather(layer·C) in forward, again in backward, and
             reduce-scatter(layer·G) in backward; with ``overlap`` each layer's gather (and reduce-scatter)
             runs beside the previous layer's compute — the first gather of each pass and the last
             reduce-scatter wait — exposed per microbatch g + (L−1)·overlapped(t_f, g) + g + r +
             (L−1)·overlapped(t_b, g + r); the embedding/head (P − L·layer) gathered unhidden; no step-level
             all-gather (parameters stay sharded)

The all-gather after the optimizer is exposed (the runtime gathers before the next forward). ZeRO-2/3's
per-microbatch collectives lengthen every microbatch of their stage: they are in T (and the bubble);
each stage prices its own parameters, the step-level ones use the stage with the most.
The optimizer step is memory-bound: 24 + G (+ P when the parameters are not the fp32 master) bytes
per local parameter — read and write the fp32 master and two moments, read the gradient, write the
low-precision copy; ZeRO >= 1: 1/dp of the parameters — at bw_hbm · e_mem.

    step_time = compute + recompute + tp_comm + cp_comm + pp_p2p + pp_bubble + dp_comm + optimizer + ep_comm

(each *_comm the exposed part). The bubble is the largest over the stages of the schedule's formula
(under ZB-H1, (p−1)(T_i − 2 t_w,i) per stage), so that more work on any stage never shortens the step.

Expert parallelism (ep; GShard, Lepikhin et al. 2021: experts split over ranks, tokens sent by all-to-all;
Megatron Core's MoE: ep folded into data parallelism, its all-to-all token dispatcher)
--------------------------------------------------------------------------------------------------------
A routed MoE layer is one ``moe_ffn`` node (passes/ep/find_moe.py). Its forward FLOPs are T·k·(one expert's
FFN) — each of the T tokens runs k experts, not E — counted as a GEMM (so in ``model_flops`` and the
MFU). ep folds into data parallelism: the batch splits over dp·ep ranks (m = B/(dp·ep·b)), dense
parameters are replicated over them, the experts split E/ep a rank (each expert's hidden units also
over tp: expert tensor parallelism, as the plan shards them). Per layer and microbatch a rank sends,
over the ep axis's link (the axis sits between cp and tp: stride tp), what passes/lower.py's
all-to-all dispatcher inserts — the E int64 token counts (forward), then its T·k token rows of d
elements to their experts' ranks (dispatch) and back (combine), each an all-to-all forward and again
backward — priced as all-to-alls, (n−1)·α + (n−1)/n·B/β, exposed (``ep_comm``; full recompute repeats
the forward ones). ``moe_imbalance`` (the busiest rank's routed slots over the mean, 1 = uniform
routing) multiplies the token bytes that rank receives and its experts' FLOPs and activation traffic
(their weights, E/ep, are read once whatever the load): the step waits for the busiest rank. The
data-parallel reduction is split (:func:`data_comm`): dense gradients over dp·ep·cp ranks (their
link: :func:`group_link`), the experts' over the dp·cp ranks holding the same experts; ZeRO shards
each over those ranks (memory and optimizer step alike).

Throughput: ``tflops_per_gpu`` counts matmul-class FLOPs executed (forward, backward = 2×, and the
recompute forward: Megatron's 96·B·s·l·h²·(1 + s/(6h) + V/(16lh)) for a GPT with full recompute)
per second per GPU; ``mfu`` counts the model's 3× forward only, against the peak.

Memory: :mod:`mcompile.ir.memory_model` (model state per parameter by precision and ZeRO; activations
per layer from the graph or Korthikanti's formulas; in-flight microbatches per schedule; what is live
at the peak: gradients of zero=0 exist from backward on, so one microbatch on one stage peaks at
P + O + max(A, G + R), R the data-parallel reduction's fp32 copy; otherwise P + O + G + max(A, R);
ZeRO-2/3 add their buffers in flight Z: 2 gradient buckets, and under ZeRO-3 2 gathered layers).

Against reality (bench/cost_vs_measured.py): gloo layouts of a small Llama on this machine, each
predicted on a profile ``calibrate(processes=W)`` measured in the same run.

Efficiency constants (:class:`Efficiency`): one set for every model and layout; see its docstring
for the values and where they come from.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from typing import Any

import sympy
import torch
import torch.fx as fx

from mcompile.cost.hardware import Hardware, get_hardware
from mcompile.ir import memory_model as MM
from mcompile.ir.annotate import BACKWARD_MULTIPLIER, MATMUL_CATEGORIES, node_cost

log = logging.getLogger("mcompile.cost")

__all__ = [
    "Schedule",
    "Recompute",
    "Layout",
    "Efficiency",
    "DEFAULT_EFFICIENCY",
    "ModelProfile",
    "Estimate",
    "recompute_envelope",
    "auto_mix",
    "activations_left",
    "stage_auto",
    "collective_time",
    "axis_link",
    "overlapped",
    "dp_comm",
    "resolve_precision",
    "CP_VARIANTS",
    "cp_comm",
    "choose_cp_attention",
]

BATCH = sympy.Symbol("batch", positive=True, integer=True)
SEQ = sympy.Symbol("seq", positive=True, integer=True)
GLOBAL_BATCH = sympy.Symbol("global_batch", positive=True, integer=True)

MESH_ORDER = ("dp", "pp", "cp", "ep", "tp")
CP_VARIANTS = ("ring", "allgather", "a2a")  # attention over the cp ranks (mcompile.passes.cp.ops); ties go to the first


# --------------------------------------------------------------------------- layout


class Schedule(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"  # interleaved 1F1B (Narayanan et al. SC'21)
    ZB_H1 = "zb-h1"  # zero bubble, 1F1B memory (Qi et al. 2023)


_SCHEDULE_ALIASES = {"zbh1": "zb-h1", "zb_h1": "zb-h1", "interleaved_1f1b": "interleaved",
                     "interleaved-1f1b": "interleaved"}


class Recompute(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"  # the attention core (Korthikanti et al. 2022)
    FULL = "full"  # every layer: only its input is kept
    AUTO = "auto"  # the saved set chosen under the activation budget the memory model leaves (auto_mix)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How a model is laid out: what the search enumerates and ``estimate`` prices.

    Mesh axes in the order dp, pp, cp, ep, tp (tp innermost, on neighbouring GPUs). ``virtual``:
    model chunks per pipeline stage (interleaved schedule only). ``microbatch_size``: sequences per
    microbatch per data-parallel rank. ``zero``: ZeRO stage 0-3 over dp (2 and 3 need dp > 1).
    ``overlap_grad_reduce``: the dp gradient buckets reduced inside the backward; ``overlap``: tensor-
    parallel collective matmul and ZeRO-3's gathers prefetched one layer ahead (``Config(overlap=True,
    tp_overlap="auto")``; False: every collective where it is first needed). ``precision``: the matmul
    precision the search chose (``estimate(precision=...)`` overrides it; None: estimate's, "bf16")."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    virtual: int = 1
    cp: int = 1
    ep: int = 1
    microbatch_size: int = 1
    schedule: Schedule = Schedule.ONE_F_ONE_B
    sequence_parallel: bool = False
    recompute: Recompute = Recompute.NONE
    zero: int = 0
    overlap_grad_reduce: bool = True
    overlap: bool = True  # tp collective matmul and ZeRO-3's prefetched gathers (Config(overlap=, tp_overlap=))
    precision: str | None = None  # matmul precision ("bf16", "fp8", "fp32"); None: estimate()'s precision=
    # attention across the cp ranks (cp > 1): "ring", "allgather" or "a2a" (Config(cp_attention=)); the
    # search fills in choose_cp_attention's pick
    cp_attention: str = "ring"

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "virtual", "cp", "ep", "microbatch_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Layout {name}={v!r} must be a positive integer")
        try:
            name = _SCHEDULE_ALIASES.get(str(self.schedule).lower(), str(self.schedule).lower())
            object.__setattr__(self, "schedule", Schedule(name))
        except ValueError:
            raise ValueError(f"schedule={self.schedule!r}: use one of {', '.join(s.value for s in Schedule)}") from None
        try:
            object.__setattr__(self, "recompute", Recompute(self.recompute))
        except ValueError:
            raise ValueError(f"recompute={self.recompute!r}: use 'none', 'selective', 'full' or 'auto'") from None
        if self.virtual > 1 and self.schedule != Schedule.INTERLEAVED:
            raise ValueError(f"virtual={self.virtual} needs schedule='interleaved' (got {self.schedule.value!r})")
        if self.schedule == Schedule.INTERLEAVED and self.pp == 1:
            raise ValueError("schedule='interleaved' needs pp > 1; with pp=1 use the default '1f1b'")
        if self.precision is not None and self.precision not in ("bf16", "fp8", "fp32"):
            raise ValueError(f"precision={self.precision!r}: use 'bf16', 'fp8' or 'fp32' (or None: estimate()'s)")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel=True needs tp > 1 (it shards the sequence over the tp ranks)")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise ValueError(f"zero={self.zero!r}: use 0 (replicated optimizer), 1 (optimizer state over dp), "
                             "2 (and gradients) or 3 (and parameters)")
        if self.zero >= 2 and self.dp * self.ep * self.cp == 1:
            raise ValueError(f"zero={self.zero} shards over the data-parallel ranks and needs dp > 1 (got dp=1); "
                             "use zero=0 with dp=1, or a layout with dp > 1")
        if self.cp_attention not in CP_VARIANTS:
            raise ValueError(f"cp_attention={self.cp_attention!r}: use 'ring', 'allgather' or 'a2a' (a Layout names "
                             "the variant; choose_cp_attention() picks one for cp_attention='auto')")

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.ep * self.tp

    @property
    def data_ranks(self) -> int:
        """Ranks that split the global batch: dp × ep (Megatron folds expert parallelism into data
        parallelism: the dense layers see ep as more data-parallel ranks)."""
        return self.dp * self.ep

    @property
    def mesh(self) -> dict[str, int]:
        """Axis sizes in mesh order (dp, pp, cp, ep, tp)."""
        return {a: getattr(self, a) for a in MESH_ORDER}

    def __str__(self) -> str:
        axes = " ".join(f"{a}={n}" for a, n in self.mesh.items() if n > 1) or "1 GPU"
        extra = [f"mbs={self.microbatch_size}"]
        if self.pp > 1:
            extra.append(self.schedule.value + (f"(v={self.virtual})" if self.virtual > 1 else ""))
        if self.sequence_parallel:
            extra.append("sp")
        if self.recompute != Recompute.NONE:
            extra.append(f"recompute={self.recompute.value}")
        if self.zero:
            extra.append(f"zero={self.zero}")
        if not self.overlap and (self.tp > 1 or self.zero >= 3):
            extra.append("no overlap")
        if self.precision == "fp8":
            extra.append("fp8")
        if self.cp > 1:
            extra.append(f"cp {self.cp_attention}")
        return f"{axes} ({', '.join(extra)})"


# --------------------------------------------------------------------------- efficiency constants


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Fractions of a datasheet peak that each op class reaches: ONE set for all models and layouts.

    Chosen once, as round numbers inside the range each kind of kernel is known to reach, and
    *calibrated* against Narayanan et al. SC'21 Table 1 (Megatron-LM on up to 3072 A100s) as a whole —
    never per row (tests/test_cost.py, bench/cost_sc21.py: every row within ±15 %, at most ~10 %).
    That table cannot pin the constants one by one (−30 % on ``intra_node``, ``inter_node`` or
    ``attention`` alone still leaves every row within ±15 %), so each constant is *validated* on its
    own against published figures it was not fitted to, within ±15 % (tests/test_cost_published.py,
    tests/data/published_perf.json, which cites each figure):

    - ``gemm`` 0.80: cuBLAS fp16/bf16 GEMMs of transformer shapes (b·s = 2048+ rows, h ≥ 2k) run at
      ~240-270 of A100's 312 TFLOP/s. Published: A100 cuBLASLt 8192³ 253.7 TFLOP/s (0.81), best-shape
      bf16 ``torch.mm`` A100 267.9 (0.86), H100 792.1 (0.80). Not FP8: FP8 GEMMs reach ~0.65-0.70 of
      the FP8 peak (H100/H200 8192³: ~1300 of 1979), so ``precision="fp8"`` GEMM times are ~20 %
      optimistic (a known gap: one constant serves every precision).
    - ``attention`` 0.50: the matmul part of attention (QKᵀ and PV, K = head dim 64-160) runs at
      about half of peak, forward + backward (the model's 2× backward). Published: FlashAttention-2
      on A100 (179.5 TFLOP/s in its 3.5× convention = 0.49) and FlashAttention-3 on Hopper (6.63 ms
      forward + backward at s = 8192, d = 128 = 0.50). FlashAttention-2 on Hopper reaches only ~0.28:
      where torch's SDPA runs that kernel on H100/H200, attention is priced ~1.9× too fast (a known
      gap: a kernel property per GPU generation, not this constant). An unfused attention
      (``attention_kernel="unfused"``, Megatron 2021) additionally moves its s×s scores through HBM
      (``UNFUSED_ATTENTION_BYTES``), priced at the ``memory`` rate.
    - ``memory`` 0.85: copies and elementwise kernels on large tensors reach 80-90 % of HBM
      bandwidth; per-op bytes come unfused from the graph. Published (BabelStream Copy): A100 80GB
      1.61 of 2.04 TB/s (0.79), H100 2.90 of 3.35 (0.87), H200 4.01 of 4.8 (0.84).
    - ``intra_node`` 0.75: NCCL ring all-reduce bus bandwidth over NVLink's per-direction rate:
      DGX A100 ~232 of 300 GB/s (0.77), H100 ~370 of 450 (0.82). Not NVLink SHARP: NCCL's default
      all-reduce on 8 H100/H200 reaches ~480 GB/s bus bandwidth, ~30 % above this ring formula (a
      known gap: ``collective_time`` has no NVLS term).
    - ``inter_node`` 0.85: NCCL over InfiniBand. Published: 192 GB/s all-reduce bus bandwidth over
      a DGX A100's 8 HDR NICs (24 of 25 GB/s each, 0.96), 46-48 of NDR's 50 GB/s per NIC (0.94): the
      constant prices inter-node links ~10 % slow, inside the ±15 % band (0.95 would fit both and
      moves the SC'21 rows by < 0.5 %).

    A profile measured on its machine (``Hardware.measured``) uses 1 for what was measured and keeps
    the attention/gemm ratio for attention."""

    gemm: float = 0.80
    attention: float = 0.50
    memory: float = 0.85
    intra_node: float = 0.75
    inter_node: float = 0.85

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not 0 < v <= 1:
                raise ValueError(f"Efficiency.{f.name}={v!r} must be in (0, 1]")

    def for_hardware(self, hw: Hardware) -> Efficiency:
        m = set(hw.measured)
        return Efficiency(
            gemm=1.0 if m & {"bf16_flops", "fp32_flops"} else self.gemm,
            attention=self.attention / self.gemm if m & {"bf16_flops", "fp32_flops"} else self.attention,
            memory=1.0 if "hbm_bandwidth" in m else self.memory,
            intra_node=1.0 if "intra_node_bandwidth" in m else self.intra_node,
            inter_node=1.0 if "inter_node_bandwidth" in m else self.inter_node,
        )


DEFAULT_EFFICIENCY = Efficiency()

# Unfused attention (bmm → softmax → dropout → bmm, Megatron 2021): HBM bytes per s×s score element in
# forward: QKᵀ writes the scores (2), softmax reads them and writes probabilities (2 + 2), dropout reads
# those and writes its output and a 1-byte mask (2 + 2 + 1), the PV bmm reads the dropout output (2).
UNFUSED_ATTENTION_BYTES = 13

# backward bytes multiplier of memory-bound ops, by annotate category (module docstring)
BACKWARD_BYTES = {"elementwise": 2, "norm": 2, "softmax": 2, "loss": 2, "reduction": 1, "memory": 1, "other": 1,
                  "unknown": 1, "view": 0}


# --------------------------------------------------------------------------- the analysed model


@dataclass(frozen=True)
class OpCost:
    """One node of an analysed section, on one tp rank, forward, per microbatch (sympy in batch, seq)."""

    name: str
    op_class: str  # "gemm" | "attention" | "memory"
    category: str  # annotate's category (backward bytes multiplier)
    flops: sympy.Expr
    bytes: sympy.Expr
    weight_grad: bool  # a GEMM with a parameter operand: half its backward is the weight gradient
    full_flops: sympy.Expr  # the node's FLOPs unsharded (all tp ranks together)
    # a routed-expert node (``moe_ffn``): its expert weights' bytes on one tp rank, all E experts (a
    # constant inside ``bytes``): under ep a rank reads E/ep of them, and its FLOPs scale by the
    # busiest rank's load (``moe_imbalance``)
    expert_weight_bytes: float | None = None


@dataclass(frozen=True)
class CommOp:
    """One collective per microbatch: kind, axis, bytes of the full tensor over the axis, phase."""

    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all | send_recv
    axis: str
    bytes: sympy.Expr
    phase: str  # "forward" | "backward"
    purpose: str = ""
    count: sympy.Rational = sympy.Integer(1)  # times per microbatch (1/n for each of n captured layers)


@dataclass(frozen=True)
class Section:
    """A part of the model on one rank: one transformer layer, or what comes before/after the layers."""

    ops: tuple[OpCost, ...]
    comms: tuple[CommOp, ...]
    params: float  # local parameters on one tp rank
    activations: dict[str, sympy.Expr]  # saved-for-backward bytes per microbatch, by recompute mode
    # aten calls per microbatch (views included), and those autograd differentiates: each costs the
    # profile's per-op host overhead (Hardware.op_overhead_forward / _backward; 0 on GPUs)
    forward_nodes: float = 0
    backward_nodes: float = 0
    expert_params: float = 0  # the part of ``params`` that is routed experts (all E of them, on one tp rank)

    def _exprs(self) -> list[sympy.Expr]:
        return ([o.flops for o in self.ops] + [o.bytes for o in self.ops] + [c.bytes for c in self.comms]
                + [sympy.Add(*[o.full_flops for o in self.ops if o.op_class != "memory"]),
                   sympy.Add(*[o.full_flops for o in self.ops if o.op_class == "attention"])]
                + [self.activations[m] for m in RECOMPUTE_MODES])

    @cached_property
    def _fn(self) -> Callable:
        return sympy.lambdify((BATCH, SEQ), self._exprs(), modules="math")

    def evaluate(self, b, s) -> SectionValues:
        """Every quantity of the section at batch b, seq s (numbers: a compiled function; sympy: subs)."""
        if _is_symbolic(b) or _is_symbolic(s):
            vals = [sympy.sympify(e).subs({BATCH: b, SEQ: s}) for e in self._exprs()]
        else:
            vals = list(self._fn(b, s))
        n, k = len(self.ops), len(self.comms)
        return SectionValues(flops=vals[:n], bytes=vals[n:2 * n], comm_bytes=vals[2 * n:2 * n + k],
                             matmul_flops=vals[2 * n + k], attention_flops=vals[2 * n + k + 1],
                             activations=dict(zip(RECOMPUTE_MODES, vals[2 * n + k + 2:])))


@dataclass(frozen=True)
class SectionValues:
    flops: list  # per op, one tp rank, forward
    bytes: list  # per op
    comm_bytes: list  # per collective
    matmul_flops: Any  # unsharded forward FLOPs of GEMMs and attention (all tp ranks together)
    attention_flops: Any  # unsharded forward FLOPs of attention
    activations: dict  # saved-for-backward bytes on one rank, by recompute mode


RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class ModelProfile:
    """A model analysed at one (tp, sequence parallel): the sections the cost and memory models price."""

    name: str
    n_layers: int
    hidden: int
    heads: int | None
    kv_heads: int | None
    vocab: int | None
    seq_len: int | None
    tp: int
    sequence_parallel: bool
    sp_variant: str
    layer: Section
    pre: Section  # before the first layer (first pipeline stage)
    post: Section  # after the last layer (last pipeline stage)
    tied_params: float  # local parameters counted in both pre and post (tied embedding/head)
    activation_bytes: int = 2  # bytes per element of the residual stream (p2p messages)
    # full (unsharded) shape of every parameter of the captured model (maybe fewer layers than n_layers):
    # what a plan priced with this profile must match (:func:`check_plan_matches`)
    param_shapes: dict = field(default_factory=dict, compare=False, repr=False)
    moe: MoEProfile | None = None  # the routed experts (None: a dense model)


@dataclass(frozen=True)
class MoEProfile:
    """The mixture-of-experts layers of a model (``moe_ffn`` nodes, passes/ep/find_moe.py), for ep.

    ``experts``: E per layer; ``top_k``: k experts per token; ``hidden``: d; ``expert_hidden``: one
    expert's FFN width f; ``layers``: MoE layers of the real model (of ``n_layers``);
    ``expert_params``: parameters of every expert of every MoE layer (unsharded); ``slot_flops``: forward
    FLOPs of one (token, expert) slot, 2·Σ over the expert's weights of their sizes (6·d·f for SwiGLU)."""

    experts: int
    top_k: int
    hidden: int
    expert_hidden: int
    layers: float
    expert_params: float
    slot_flops: int
    form: str = ""


def _is_symbolic(x) -> bool:
    return isinstance(x, sympy.Basic) and not x.is_number


def _max(*xs):
    if any(_is_symbolic(x) for x in xs):
        return sympy.Max(*xs)
    return max(float(x) for x in xs)


def _min(*xs):
    if any(_is_symbolic(x) for x in xs):
        return sympy.Min(*xs)
    return min(float(x) for x in xs)


def op_class(category: str) -> str:
    if category == "attention":
        return "attention"
    if category in MATMUL_CATEGORIES:
        return "gemm"
    return "memory"


def node_category(n: fx.Node) -> str:
    return node_cost(n).category if isinstance(n.target, torch._ops.OpOverload) else "other"


# --------------------------------------------------------------------------- workloads


# --------------------------------------------------------------------------- collectives


def axis_link(layout: Layout, axis: str, hw: Hardware, eff: Efficiency) -> tuple[float, float]:
    """(β bytes/s, α seconds) of a group along ``axis`` of the layout's mesh (module docstring)."""
    mesh = layout.mesh
    n = mesh[axis]
    stride = math.prod(mesh[a] for a in MESH_ORDER[MESH_ORDER.index(axis) + 1:])
    g = hw.gpus_per_node
    if stride * n <= g:
        return hw.intra_node_bandwidth * eff.intra_node, hw.intra_node_latency
    per_node = max(1, g // stride)
    bw = min(hw.intra_node_bandwidth, per_node * hw.inter_node_bandwidth)
    return bw * eff.inter_node, hw.inter_node_latency


def pipeline_bubble(schedule, p: int, v: int, stage_time, weight_time):
    """Idle time of a step's slowest rank: ``(p-1)`` stage times (GPipe, 1F1B), divided by ``v``
    (interleaved), less twice the weight-gradient time per microbatch (ZB-H1: ``(p-1)(F+B-W)``)."""
    if p == 1:
        return 0
    if schedule == Schedule.INTERLEAVED:
        return (p - 1) * stage_time / v
    if schedule == Schedule.ZB_H1:
        return (p - 1) * (stage_time - 2 * weight_time)
    return (p - 1) * stage_time


def dp_reduction_time(zero: int, n: int, params, grad_bytes: int, param_bytes: int, bandwidth: float,
                      latency: float, hw: Hardware):
    """The data-parallel gradient reduction of ``params`` parameters over ``n`` ranks: an all-reduce,
    or ZeRO-1's reduce-scatter of gradients plus all-gather of the updated parameters."""
    call = hw.collective_call_latency
    if zero:
        return (collective_time("reduce_scatter", params * grad_bytes, n, bandwidth, latency, call)
                + collective_time("all_gather", params * param_bytes, n, bandwidth, latency, call))
    return collective_time("all_reduce", params * grad_bytes, n, bandwidth, latency, call)


def collective_time(kind: str, nbytes, n: int, bandwidth: float, latency: float, call_latency: float = 0.0):
    """Ring-algorithm time of one collective over n ranks (Thakur et al. 2005); ``nbytes`` is the
    full tensor (all-gather: the gathered size; reduce-scatter: the input; all-to-all: one rank's
    buffer; send/recv: the message). ``call_latency``: a cost per call on top of the per-step
    ``latency`` (``Hardware.collective_call_latency``: 0 on GPUs; gloo on a CPU measures one)."""
    if n <= 1 and kind != "send_recv":
        return 0
    if kind == "all_reduce":
        return call_latency + 2 * (n - 1) * latency + _ratio(2 * (n - 1), n, nbytes) * nbytes / bandwidth
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return call_latency + (n - 1) * latency + _ratio(n - 1, n, nbytes) * nbytes / bandwidth
    if kind == "send_recv":
        return call_latency + latency + nbytes / bandwidth
    raise ValueError(f"unknown collective {kind!r}")


def overlapped(compute, comm, slowdown: float = 1.0):
    """The exposed part of ``comm`` seconds of communication run beside ``compute`` seconds of work:
    the region takes max(c, t) + (κ − 1)·min(c, t) (κ = ``slowdown``, ``Hardware.overlap_slowdown``: the
    overlapped compute runs κ times slower), i.e. c + this. Never more than ``comm`` for κ <= 2: an
    overlap is never priced slower than running both in turn."""
    return _max(0, comm - compute) + (slowdown - 1) * _min(compute, comm)


def dp_comm(zero: int, n: int, link: tuple[float, float], hw: Hardware, *, params, layer_params, layers: int,
            window, layer_forward, layer_backward, grad_bytes: int, param_bytes: int, gather_bytes: int,
            overlap_grad_reduce: bool, overlap: bool) -> dict:
    """Data-parallel communication of one rank over ``n`` ranks (module docstring, "Data parallelism and
    ZeRO"): ``{"mb_total", "mb_exposed"}`` per microbatch (inside the stage time: ZeRO-2's reduce-scatter,
    ZeRO-3's gathers and reduce-scatters) and ``{"step_total", "step_exposed"}`` once per step (the
    reduction of ZeRO-0/1 after the last microbatch, the parameters' all-gather after the optimizer of
    ZeRO-1/2). ``params``: the rank's parameters, ``layer_params`` of one of its ``layers`` layers;
    ``window``: one microbatch's backward on the rank (what a bucketed reduction hides behind);
    ``layer_forward``/``layer_backward``: one layer's compute (what a prefetched ZeRO-3 gather hides behind)."""
    out = {"mb_total": 0, "mb_exposed": 0, "step_total": 0, "step_exposed": 0}
    if n <= 1:
        return out
    beta, alpha = link
    call = hw.collective_call_latency
    kappa = hw.overlap_slowdown
    L = max(layers, 1)

    def ct(kind, nbytes):
        return collective_time(kind, nbytes, n, beta, alpha, call)

    def behind_backward(t):  # bucketed, launched in backward: the last layer's bucket always waits
        if not (overlap_grad_reduce and hw.comm_overlaps_compute):
            return t
        return t / L + overlapped(window, t * (L - 1) / L, kappa)

    if zero == 0:
        t = ct("all_reduce", params * grad_bytes)
        out.update(step_total=t, step_exposed=behind_backward(t))
    elif zero in (1, 2):
        rs, ag = ct("reduce_scatter", params * grad_bytes), ct("all_gather", params * param_bytes)
        if zero == 1:  # one reduce-scatter behind the last backward, the all-gather after the optimizer
            out.update(step_total=rs + ag, step_exposed=behind_backward(rs) + ag)
        else:  # a reduce-scatter behind every microbatch's backward
            out.update(mb_total=rs, mb_exposed=behind_backward(rs), step_total=ag, step_exposed=ag)
    else:  # ZeRO-3: per microbatch, each layer gathered in forward and in backward, its gradient reduce-scattered
        g = ct("all_gather", layer_params * gather_bytes)
        r = ct("reduce_scatter", layer_params * grad_bytes)
        rest = params - layers * layer_params  # embedding / head: gathered, not prefetched (exposed)
        rest_t = (2 * ct("all_gather", rest * gather_bytes) + ct("reduce_scatter", rest * grad_bytes)
                  if _gt(rest, 0) else 0)
        total = layers * (2 * g + r) + rest_t
        if overlap and hw.comm_overlaps_compute and layers >= 1:
            # the first layer's gather (forward and backward) and the last reduce-scatter wait; every other
            # layer's gather (+ reduce-scatter) runs beside the previous layer's compute
            exposed = (g + (layers - 1) * overlapped(layer_forward, g, kappa)
                       + g + r + (layers - 1) * overlapped(layer_backward, g + r, kappa) + rest_t)
        else:
            exposed = total
        out.update(mb_total=total, mb_exposed=exposed)
    return out


def _ratio(a: int, b: int, like):
    """a/b: exact when ``like`` is symbolic, a float otherwise (fast numeric path)."""
    return sympy.Rational(a, b) if _is_symbolic(like) else a / b


def plain_number(x):
    """sympy numbers → float; symbolic expressions unchanged."""
    if isinstance(x, sympy.Basic) and x.is_number:
        return float(x)
    return x


# --------------------------------------------------------------------------- the estimate


@dataclass(frozen=True)
class Estimate:
    """What a layout costs: step time (seconds), memory of the largest rank (bytes), throughput."""

    layout: Layout
    hardware: Hardware
    global_batch: int
    seq: int
    step_time_s: float
    breakdown: dict[str, float]  # seconds per step, summing to step_time_s
    memory_bytes: float  # the largest rank
    memory_breakdown: dict[str, float]  # bytes on that rank
    fits: bool
    hardware_flops: float  # matmul-class FLOPs executed per step, all GPUs (recompute included)
    model_flops: float  # matmul-class FLOPs of forward + backward (3× forward), all GPUs
    tokens_per_s: float
    details: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def tflops_per_gpu(self) -> float:
        return self.hardware_flops / self.step_time_s / self.layout.world / 1e12

    @property
    def mfu(self) -> float:
        peak = self.details.get("peak_flops", self.hardware.bf16_flops)
        return self.model_flops / self.step_time_s / self.layout.world / peak

    def __str__(self) -> str:
        gib = 2**30
        lines = [f"{self.layout} on {self.layout.world} x {self.hardware.name}, global batch {self.global_batch} "
                 f"x seq {self.seq}",
                 f"  step {self.step_time_s:.3f} s   {self.tflops_per_gpu:.1f} TFLOP/s per GPU   MFU {self.mfu:.1%}   "
                 f"{self.tokens_per_s:,.0f} tokens/s",
                 f"  memory {self.memory_bytes / gib:.1f} GiB of {self.hardware.hbm_bytes / gib:.1f} GiB "
                 f"({'fits' if self.fits else 'does NOT fit'})"]
        lines.append("  time:   " + "  ".join(f"{k} {v:.3g}s" for k, v in self.breakdown.items() if v))
        lines.append("  memory: " + "  ".join(f"{k} {v / gib:.2f}GiB" for k, v in self.memory_breakdown.items() if v))
        return "\n".join(lines)


def validate_layout(layout: Layout, prof: ModelProfile, global_batch, seq) -> None:
    if prof.heads and prof.heads % layout.tp:
        ok = [t for t in range(1, prof.heads + 1) if prof.heads % t == 0 and
              (not prof.kv_heads or prof.kv_heads % t == 0)]
        raise ValueError(f"tp={layout.tp} does not divide num_heads={prof.heads}; valid tp sizes: "
                         f"{', '.join(map(str, ok))}")
    if prof.kv_heads and prof.kv_heads % layout.tp:
        ok = [t for t in range(1, prof.kv_heads + 1) if prof.kv_heads % t == 0]
        raise ValueError(f"tp={layout.tp} does not divide num_kv_heads={prof.kv_heads}; valid tp sizes: "
                         f"{', '.join(map(str, ok))}")
    L = prof.n_layers
    if layout.pp > L:
        raise ValueError(f"pp={layout.pp} exceeds the {L} layers of {prof.name or 'the model'}")
    if layout.schedule == Schedule.INTERLEAVED and L % (layout.pp * layout.virtual):
        ok = [v for v in range(1, L // layout.pp + 1) if L % (layout.pp * v) == 0] if L % layout.pp == 0 else []
        raise ValueError(f"interleaved: pp={layout.pp} x virtual={layout.virtual} does not divide {L} layers; "
                         f"valid virtual sizes at pp={layout.pp}: {', '.join(map(str, ok)) or 'none'}")
    if layout.ep > 1:
        if prof.moe is None:
            raise ValueError(f"ep={layout.ep}: {prof.name or 'the model'} has no mixture-of-experts layer "
                             f"(moe_ffn), so there is nothing to shard over ep; use dp={layout.ep} instead")
        E = prof.moe.experts
        if E % layout.ep:
            ok = [e for e in range(1, E + 1) if E % e == 0]
            raise ValueError(f"ep={layout.ep} does not divide the {E} experts of {prof.name or 'the model'}: each "
                             f"rank holds E/ep experts; valid ep sizes: {', '.join(map(str, ok))}")
    if not _is_symbolic(global_batch) and global_batch % (layout.data_ranks * layout.microbatch_size):
        step = layout.data_ranks * layout.microbatch_size
        by = f"dp={layout.dp} x ep={layout.ep}" if layout.ep > 1 else f"dp={layout.dp}"
        raise ValueError(f"the global batch of {global_batch} does not divide by {by} x "
                         f"microbatch_size={layout.microbatch_size}; use a batch that is a multiple of {step}")
    if not _is_symbolic(seq) and layout.cp > 1 and seq % (2 * layout.cp):
        raise ValueError(f"cp={layout.cp} cuts each sequence into 2*cp = {2 * layout.cp} equal chunks (load-balanced "
                         f"causal attention): the sequence length {seq} does not divide by {2 * layout.cp}")
    if layout.cp > 1 and layout.cp_attention == "a2a" and prof.heads and (prof.heads // layout.tp) % layout.cp:
        h = prof.heads // layout.tp
        ok = [c for c in range(2, h + 1) if h % c == 0]
        per = f" ({prof.heads} heads / tp={layout.tp})" if layout.tp > 1 else ""
        raise ValueError(f"cp_attention='a2a' (Ulysses) splits the {h} query heads on a rank{per} over cp={layout.cp}: "
                         f"valid cp sizes for a2a: {', '.join(map(str, ok)) or 'none'}; or use 'ring' or 'allgather'")
    if not _is_symbolic(seq) and layout.sequence_parallel and (seq // layout.cp) % layout.tp:
        raise ValueError(f"sequence parallelism splits each rank's {seq // layout.cp} positions over tp={layout.tp}: "
                         "use a sequence length that divides by cp x tp")


def section_times(sec: Section, b, s, layout: Layout, hw: Hardware, eff: Efficiency, precision: str,
                   attention_kernel: str = "flash", head_dim: float = 1, moe_imbalance: float = 1.0) -> dict:
    """Per microbatch: forward, backward, weight-gradient, attention-forward times and tp comm, at the
    rank's own sequence ``s`` (= seq/cp). Under cp a rank's queries still meet every key: attention
    does cp × the work its s/cp-long piece would alone (s²/cp, not s²/cp²).

    Routed experts under ep (``layout.ep`` > 1): a rank reads E/ep of the experts' weights and the
    busiest rank runs ``moe_imbalance`` × the mean T·k slots (its FLOPs and activation traffic), and its
    all-to-alls (``ep_f``, ``ep_b``: counts, dispatch, combine) receive ``moe_imbalance`` × the mean
    bytes (:func:`collective_time`'s bandwidth term; the counts are not scaled)."""
    vals = sec.evaluate(b, s)
    flops, nbytes, cbytes = vals.flops, vals.bytes, vals.comm_bytes
    cp = layout.cp
    peak_gemm = hw.peak_flops(precision)
    peak_attn = hw.peak_flops("bf16" if precision == "fp8" else precision)
    bw = hw.hbm_bandwidth * eff.memory
    f = bk = w = attn = attn_b = gf = gb = ex = 0
    ep = layout.ep
    for op, fl, y in zip(sec.ops, flops, nbytes):
        if op.expert_weight_bytes is not None and ep > 1:  # E/ep experts here, the busiest rank's slots
            wb = op.expert_weight_bytes
            fl, y = fl * moe_imbalance, (y - wb) * moe_imbalance + wb / ep
        if op.op_class == "gemm":
            t = _max(fl / (peak_gemm * eff.gemm), y / bw)
            tb = BACKWARD_MULTIPLIER.get(op.category, 2) * t
            gf += t
            gb += tb
            if op.weight_grad:
                w += t
            if op.expert_weight_bytes is not None:
                ex += t
        elif op.op_class == "attention":
            fl, y = fl * cp, y * cp
            if attention_kernel == "unfused":  # s×s scores through HBM: matmul time + their traffic
                t = fl / (peak_attn * eff.attention) + (y + UNFUSED_ATTENTION_BYTES * fl / (4 * head_dim)) / bw
            else:
                t = _max(fl / (peak_attn * eff.attention), y / bw)
            tb = BACKWARD_MULTIPLIER.get(op.category, 2) * t
            attn += t
            attn_b += tb
        else:
            t = y / bw
            tb = BACKWARD_BYTES.get(op.category, 1) * t
            if op.category == "softmax":
                attn += t
                attn_b += tb
        f += t
        bk += tb
    # host overhead per aten call (Hardware.op_overhead_*: measured on a CPU, 0 on GPUs)
    f += sec.forward_nodes * hw.op_overhead_forward
    bk += sec.backward_nodes * hw.op_overhead_backward
    cf = cb = cf_mm = cb_mm = 0  # all tp collectives; those a collective matmul can split (all-gather, reduce-scatter)
    if layout.tp > 1:
        beta, alpha = axis_link(layout, "tp", hw, eff)
        for c, nb in zip(sec.comms, cbytes):
            if c.axis != "tp":
                continue
            t = float(c.count) * collective_time(c.kind, nb, layout.tp, beta, alpha, hw.collective_call_latency)
            mm = c.kind in ("all_gather", "reduce_scatter")
            if c.phase == "forward":
                cf += t
                cf_mm += t if mm else 0
            else:
                cb += t
                cb_mm += t if mm else 0
    # collective matmul (module docstring, "Overlap"): the splittable collectives of each phase behind all but
    # one chunk of the phase's GEMMs; all-reduces (tp without SP) stay exposed
    cf_x, cb_x = cf, cb
    if layout.tp > 1 and hw.comm_overlaps_compute:
        k = _ratio(layout.tp - 1, layout.tp, gf)
        cf_x = cf - cf_mm + overlapped(gf * k, cf_mm, hw.overlap_slowdown)
        cb_x = cb - cb_mm + overlapped(gb * k, cb_mm, hw.overlap_slowdown)
    ef = eb = 0  # ep: the MoE all-to-alls, exposed (no overlap with the experts' compute is modelled)
    if ep > 1:
        beta, alpha = axis_link(layout, "ep", hw, eff)
        for c, nb in zip(sec.comms, cbytes):
            if c.axis != "ep":
                continue
            load = moe_imbalance if c.purpose in MOE_TOKEN_TRAFFIC else 1
            t = float(c.count) * collective_time(c.kind, nb * load, ep, beta, alpha, hw.collective_call_latency)
            if c.phase == "forward":
                ef += t
            else:
                eb += t
    return {"f": f, "b": bk, "w": w, "attn": attn, "attn_b": attn_b, "comm_f": cf, "comm_b": cb, "comm_f_x": cf_x,
            "comm_b_x": cb_x,
            "gemm_f": gf, "gemm_b": gb, "ep_f": ef, "ep_b": eb, "expert_f": ex}


# the MoE collectives that carry token rows (their bytes follow the routing: the busiest rank gets more)
MOE_TOKEN_TRAFFIC = frozenset({"moe: dispatch", "moe: combine", "moe: gather tokens", "moe: gather weights",
                               "moe: reduce-scatter outputs"})


def gather_bytes_of(precision: str) -> int:
    """Bytes per element of ZeRO-3's gathered parameters: the compute dtype (FP8 GEMMs cast a bf16 copy)."""
    return 4 if precision == "fp32" else 2


def tp_keys(layout: Layout) -> tuple[str, str]:
    """The section-time keys of the tp communication a layout pays: all of it, or what a collective
    matmul leaves exposed (``Layout.overlap``)."""
    return ("comm_f_x", "comm_b_x") if layout.overlap else ("comm_f", "comm_b")


# --------------------------------------------------------------------------- pricing a layout, rank by rank
#
# One implementation for estimate() and the search: a layout is priced from its Sections (section times and
# activations at one (tp, sp, ep, cp, microbatch size, precision), shared by every layout that has them) and the
# layers on each pipeline rank — ⌈L/p⌉ on every rank for estimate(), the partitioner's cuts for the search.


@dataclass(frozen=True)
class CostSettings:
    """What prices a layout besides the layout and the model (:func:`estimate`'s keywords): the hardware
    and its efficiencies, the global batch and sequence length (numbers; sympy symbols for
    :func:`step_time_expr`), the matmul precision, the storage dtypes, the attention kernel, the memory
    limit, the MoE imbalance and where activation bytes come from."""

    hw: Hardware
    eff: Efficiency
    global_batch: Any
    seq: Any
    precision: str
    param_dtype: str
    grad_dtype: str
    attention_kernel: str
    efficiency: Efficiency | None  # as given (estimate() adapts it to the hardware itself)
    memory_limit: float | None = None  # bytes per GPU (None: the hardware's HBM): fits, and auto's budget
    moe_imbalance: float = 1.0  # expert parallelism: the busiest ep rank's routed slots over the mean
    activations: str = "graph"  # saved tensors of the captured graph, or "formula" (Korthikanti et al. 2022)

    @property
    def limit(self) -> float:
        return float(self.memory_limit) if self.memory_limit is not None else float(self.hw.hbm_bytes)


def cost_settings(hardware, global_batch, seq, precision: str, param_dtype: str = "bf16", grad_dtype: str = "fp32",
                  attention_kernel: str = "flash", efficiency: Efficiency | None = None,
                  memory_limit: float | None = None, moe_imbalance: float = 1.0,
                  activations: str = "graph") -> CostSettings:
    """:class:`CostSettings` from :func:`estimate`'s keywords, checked."""
    check_imbalance(moe_imbalance)
    if attention_kernel not in ("flash", "unfused"):
        raise ValueError(f"attention_kernel={attention_kernel!r}: use 'flash' (fused SDPA, what mcompile runs) or "
                         "'unfused' (bmm, softmax, dropout, bmm: s×s scores through memory)")
    if activations not in ("graph", "formula"):
        raise ValueError(f"activations={activations!r}: use 'graph' (saved tensors of the captured graph) or "
                         "'formula' (Korthikanti et al. 2022)")
    hw = get_hardware(hardware)
    eff = (efficiency or DEFAULT_EFFICIENCY).for_hardware(hw)
    whole = (lambda x: x if _is_symbolic(x) else int(x))  # noqa: E731
    return CostSettings(hw, eff, whole(global_batch), whole(seq), precision, param_dtype, grad_dtype,
                        attention_kernel, efficiency, float(memory_limit) if memory_limit is not None else None,
                        float(moe_imbalance), activations)


class Sections:
    """Per (tp, sp, ep, cp, microbatch size, precision): the section times (:func:`section_times`) of a mean
    layer, the embedding (``pre``) and the head (``post``) at the rank's seq/cp positions, their activation
    bytes, a mean layer's parameters on a rank (E/ep of its experts), and under cp each attention variant's
    per-layer communication and buffers (:func:`cp_comm`) and the cheapest applicable one
    (:func:`choose_cp_attention`'s pick). Every layout with these sizes shares them: the search builds one
    per group of layouts, :func:`estimate` one per call. The times work on sympy symbols too; the bytes,
    the cp pick and the recompute envelopes are numbers (made when first read)."""

    def __init__(self, prof: ModelProfile, b, st: CostSettings, precision: str | None = None, ep: int = 1,
                 cp: int = 1):
        self.precision = precision = precision or st.precision
        self.ep, self.cp_size, self.b = ep, cp, b
        self._prof, self._st = prof, st
        self.lay_params, self.lay_experts = expert_split(prof, ep)
        kw = dict(attention_kernel=st.attention_kernel, head_dim=prof.hidden / (prof.heads or 1),
                  moe_imbalance=st.moe_imbalance)
        # tp is innermost, ep next, then cp: their links depend on tp, ep and cp alone
        lay = Layout(tp=prof.tp, ep=ep, cp=cp)
        self.s_loc = s_loc = st.seq / cp
        self.lay = section_times(prof.layer, b, s_loc, lay, st.hw, st.eff, precision, **kw)
        self.pre = section_times(prof.pre, b, s_loc, lay, st.hw, st.eff, precision, **kw)
        self.post = section_times(prof.post, b, s_loc, lay, st.hw, st.eff, precision, **kw)
        # context parallelism: every variant's layer communication
        self.cp = {v: cp_layer(lay, prof, st.hw, st.eff, b, st.seq, self.lay, v) for v in CP_VARIANTS}
        self._envelopes = {}

    @cached_property
    def _activations(self) -> tuple[dict[str, float], float, float]:
        prof, st, b, s_loc = self._prof, self._st, self.b, self.s_loc
        if st.activations == "formula":
            if not prof.heads:
                raise ValueError("activations='formula' needs the number of heads (Workload(..., heads=...))")
            kw = dict(tp=prof.tp, sequence_parallel=prof.sequence_parallel)
            layer = {md: float(MM.activation_bytes_per_layer(s_loc, b, prof.hidden, prof.heads, recompute=md,
                                                             sp_variant=prof.sp_variant, key_len=st.seq, **kw))
                     for md in RECOMPUTE_MODES}
            return layer, 0.0, float(MM.output_layer_activation_bytes(s_loc, b, prof.hidden, prof.vocab or 0, **kw))
        layer = {m: float(v) for m, v in prof.layer.evaluate(b, s_loc).activations.items()}
        return (layer, float(prof.pre.evaluate(b, s_loc).activations["none"]),
                float(prof.post.evaluate(b, s_loc).activations["none"]))

    @cached_property
    def layer_act(self) -> dict[str, float]:
        """Bytes one layer keeps for its backward per microbatch, by recompute mode."""
        return self._activations[0]

    @cached_property
    def pre_act(self) -> float:
        return self._activations[1]

    @cached_property
    def post_act(self) -> float:
        return self._activations[2]

    @cached_property
    def cp_allowed(self) -> tuple[str, ...]:
        return cp_variants_allowed(Layout(tp=self._prof.tp, cp=self.cp_size), self._prof.heads) \
            if self.cp_size > 1 else CP_VARIANTS[:1]

    @cached_property
    def cp_choice(self) -> str:
        """The cheapest applicable cp attention variant (exposed forward + backward; ties to the first)."""
        prices = {v: float(self.cp[v]["f_x"] + self.cp[v]["b_x"]) for v in self.cp_allowed}
        return min(prices, key=lambda v: (prices[v], CP_VARIANTS.index(v)))

    @property
    def envelope(self) -> list:
        return self.envelope_of(True)

    def envelope_of(self, overlap: bool, cp_attention: str = "ring") -> list:
        """recompute="auto": the named policies' (bytes, recompute time) per layer and their lower envelope
        (:func:`recompute_envelope`), with the recomputed forward's tp communication as the layout pays it
        (all, or what collective matmul exposes) and its cp communication (exposed)."""
        key = (overlap, cp_attention if self.cp_size > 1 else "ring")
        if key not in self._envelopes:
            comm = self.lay["comm_f_x"] if overlap else self.lay["comm_f"]
            rec_time = {"none": 0.0, "selective": float(self.lay["attn"]),
                        "full": float(self.lay["f"]) + float(comm) + float(self.cp[key[1]]["f_x"])
                        + float(self.lay["ep_f"])}
            self._envelopes[key] = recompute_envelope(self.layer_act, rec_time)
        return self._envelopes[key]

    def cp_buffers(self, cp_attention: str) -> float:
        """Bytes of the cp attention variant's buffers of one layer (0 without cp)."""
        return float(self.cp[cp_attention]["buffers"]) if self.cp_size > 1 else 0.0


@functools.lru_cache(maxsize=4096)
def ranks_to_check(layers: tuple[int, ...]) -> tuple[int, ...]:
    """Pipeline ranks that can hold the most memory or take the longest: the first, the last, and the first
    middle rank of each distinct layer count above the first rank's (in-flight microbatches never grow with
    the rank, so a middle rank with no more layers than the first, which adds the embedding, never exceeds
    it). ⌈L/p⌉ layers on every rank: the first and the last."""
    p = len(layers)
    out, seen = [0], {layers[0]}
    for i in range(1, p - 1):
        if layers[i] > layers[0] and layers[i] not in seen:
            seen.add(layers[i])
            out.append(i)
    if p > 1:
        out.append(p - 1)
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def inflight(schedule: str, p: int, i: int, m: float, v: int) -> float:
    """:func:`mcompile.ir.memory_model.inflight_microbatches` as a float (cached: the search asks often)."""
    return float(MM.inflight_microbatches(schedule, p, i, m, v))


@dataclass(frozen=True)
class PerParam:
    """Model-state bytes per parameter of a layout: dense parameters (replicated over dp·ep·cp, what
    ZeRO shards them over) and routed experts (over dp·cp); :func:`state_of` per parameter."""

    dense: MM.StateBytes
    experts: MM.StateBytes

    def of(self, n_par, n_experts) -> tuple[float, float, float]:
        """(parameters, gradients, optimizer state) bytes of ``n_par`` parameters, ``n_experts`` of them experts."""
        d, e, n = self.dense, self.experts, n_par - n_experts
        if not n_experts:
            return n_par * d.params, n_par * d.grads, n_par * d.optimizer
        return (n * d.params + n_experts * e.params, n * d.grads + n_experts * e.grads,
                n * d.optimizer + n_experts * e.optimizer)


@functools.lru_cache(maxsize=1024)
def state_per_param(param_dtype: str, grad_dtype: str, zero: int, dp: int, ep: int = 1, cp: int = 1) -> PerParam:
    """:class:`PerParam` of a layout with these ZeRO stage and dp, ep, cp sizes."""
    return PerParam(MM.model_state_bytes_per_param(param_dtype, grad_dtype, zero, dp * cp * ep),
                    MM.model_state_bytes_per_param(param_dtype, grad_dtype, zero, dp * cp))


def layout_per_param(layout: Layout, st: CostSettings) -> PerParam:
    return state_per_param(st.param_dtype, st.grad_dtype, layout.zero, layout.dp, layout.ep, layout.cp)


def microbatches(layout: Layout, global_batch):
    """m = B / (dp·ep·b): microbatches per pipeline per step."""
    return global_batch / (layout.data_ranks * layout.microbatch_size)


def rank_share(prof: ModelProfile, sec: Sections, layers: tuple[int, ...], i: int) -> tuple[float, float, float]:
    """Pipeline rank ``i``'s parameters (its layers, the embedding on the first, the head on the last,
    a tied weight counted once without pp), its activations outside the layers, and how many of its
    parameters are routed experts (E/ep of each layer's)."""
    p = len(layers)
    n_par, extra_act = layers[i] * sec.lay_params, 0.0
    if i == 0:
        n_par += prof.pre.params
        extra_act += sec.pre_act
    if i == p - 1:
        n_par += prof.post.params - (prof.tied_params if p == 1 else 0)
        extra_act += sec.post_act
    return n_par, extra_act, layers[i] * sec.lay_experts


def zero_buffers(zero: int, prof: ModelProfile, i: int, p: int, n_par, grad_dtype: str, compute_bytes: int,
                 ep: int = 1):
    """ZeRO-2/3's bytes in flight on pipeline rank ``i`` (:func:`mcompile.ir.memory_model.zero_buffer_bytes`):
    the largest gathered unit is a layer (its E/ep experts), or the embedding (first rank) / head (last
    rank) if larger."""
    if zero < 2:
        return 0
    unit = expert_split(prof, ep)[0]
    if i == 0:
        unit = max(unit, prof.pre.params)
    if i == p - 1:
        unit = max(unit, prof.post.params)
    return MM.zero_buffer_bytes(zero, unit, compute_bytes, grad_bytes=n_par * MM.DTYPE_BYTES[grad_dtype])


def auto_stages(prof: ModelProfile, sec: Sections, layers: tuple[int, ...], per: PerParam, schedule: str, v: int,
                m: float, limit: float, *, overlap: bool = True, zero: int = 0, grad_dtype: str = "fp32",
                cp_attention: str = "ring", one_pass: bool = False, reduce_bytes: float = 0.0) -> dict:
    """``recompute="auto"`` on every rank :func:`peak_memory` checks: :func:`stage_auto` (the budget left
    under ``limit``, per layer, and the envelope's mix there), by rank. ``one_pass``/``reduce_bytes``:
    :func:`peak_memory`'s."""
    p = len(layers)
    out = {}
    cp_buf = sec.cp_buffers(cp_attention)
    cbytes = gather_bytes_of(sec.precision)
    for i in ranks_to_check(layers):
        n_par, extra_act, n_exp = rank_share(prof, sec, layers, i)
        zbuf = zero_buffers(zero, prof, i, p, n_par, grad_dtype, cbytes, sec.ep)
        sp, sg, so = per.of(n_par, n_exp)
        out[i] = stage_auto(limit, (sp + zbuf + cp_buf, sg, so), inflight(schedule, p, i, m, v), layers[i], extra_act,
                            sec.envelope_of(overlap, cp_attention), sec.layer_act,
                            gradients_meet_activations=not one_pass, reduction_buffer=n_par * reduce_bytes)
    return out


def layout_auto(layout: Layout, prof: ModelProfile, sec: Sections, layers: tuple[int, ...],
                st: CostSettings) -> dict | None:
    """:func:`auto_stages` of a layout (None unless it recomputes "auto")."""
    if layout.recompute != Recompute.AUTO:
        return None
    return auto_stages(prof, sec, layers, layout_per_param(layout, st), layout.schedule.value, layout.virtual,
                       microbatches(layout, st.global_batch), st.limit, overlap=layout.overlap, zero=layout.zero,
                       grad_dtype=st.grad_dtype, cp_attention=layout.cp_attention)


def auto_is_none(auto: dict) -> bool:
    """auto reduces to no recompute on every rank (the budget left holds none's activations)."""
    return all(a["fits"] and a["mix"] == {"none": 1.0} for a in auto.values())


def activation_budget(auto: dict) -> float | None:
    """``Config(activation_budget=)`` every pipeline rank can take, or None: the runtime gives each of a
    rank's forwards the budget divided by the forwards it holds in flight (runtime/pipeline.py
    ``stage_activation_budget``, which counts what ``inflight_microbatches`` does), so the budget is
    the smallest over the ranks of their per-microbatch budget times their in-flight microbatches."""
    b = [None if a["budget"] is None else a["budget"] * float(a["inflight"]) for a in auto.values()]
    return None if any(x is None for x in b) else min(b)


def peak_memory(prof: ModelProfile, sec: Sections, layers: tuple[int, ...], per: PerParam, schedule: str, v: int,
                m: float, mode: str, detail: bool = True, *, zero: int = 0, grad_dtype: str = "fp32",
                auto: dict | None = None, cp_buffers: float = 0.0, one_pass: bool = False,
                reduce_bytes: float = 0.0):
    """The largest rank's bytes (and its breakdown when ``detail``) with ``layers[i]`` layers on pipeline
    rank i, from its parts (:func:`mcompile.ir.memory_model.peak_bytes`: what is live together at the peak).
    ``mode`` "auto": ``auto`` is :func:`auto_stages`'s per-rank result (each rank's layers keep its mix's
    bytes). ``zero``: the ZeRO stage (ZeRO-2/3's buffers in flight: :func:`zero_buffers`); ``cp_buffers``:
    :meth:`Sections.cp_buffers`.

    Lifetimes (memory_model "Lifetimes"): the runtime's gradients are persistent flat fp32 buffers
    (runtime/leaves.py, ZeRO-1's too), reduced over dp in place: they meet the activations on every layout,
    and no reduction copy is made — ``one_pass=False``, ``reduce_bytes=0`` (kept as parameters for a
    runtime whose gradients come and go: ``reduce_bytes`` per parameter of the reduction's copy)."""
    p = len(layers)
    if mode == "auto" and auto is None:
        raise ValueError("peak_memory(mode='auto') needs auto=auto_stages(...)")
    layer_act = sec.layer_act[mode] if mode != "auto" else None
    cbytes = gather_bytes_of(sec.precision)
    best, best_d = None, None
    for i in ranks_to_check(layers):
        n_par, extra_act, n_exp = rank_share(prof, sec, layers, i)
        n_inflight = inflight(schedule, p, i, m, v)
        act_i = layer_act if auto is None else auto[i]["layer_bytes"]
        sp, sg, so = per.of(n_par, n_exp)
        tot, d = MM.peak_bytes(sp, sg, so, n_inflight * (layers[i] * act_i + extra_act),
                               gradients_meet_activations=not one_pass, reduction_buffer=n_par * reduce_bytes,
                               zero_buffers=zero_buffers(zero, prof, i, p, n_par, grad_dtype, cbytes, sec.ep),
                               cp_buffers=cp_buffers)
        if auto is not None and auto[i]["fits"]:  # the budget used is what is left: ≤ the limit (rounding)
            tot = min(tot, auto[i]["limit"])
        if best is None or tot > best:
            best, best_d = tot, (d, i, n_inflight)
    if not detail:
        return float(best), None
    d, i, n_inflight = best_d
    return float(best), {**d, "stage": i, "inflight_microbatches": n_inflight}


def layout_memory(layout: Layout, prof: ModelProfile, sec: Sections, layers: tuple[int, ...], st: CostSettings,
                  auto: dict | None = None) -> tuple[float, dict]:
    """:func:`peak_memory` of a layout (``auto``: its :func:`layout_auto`, made here when not given)."""
    if layout.recompute == Recompute.AUTO and auto is None:
        auto = layout_auto(layout, prof, sec, layers, st)
    return peak_memory(prof, sec, layers, layout_per_param(layout, st), layout.schedule.value, layout.virtual,
                       microbatches(layout, st.global_batch), layout.recompute.value, zero=layout.zero,
                       grad_dtype=st.grad_dtype, auto=auto, cp_buffers=sec.cp_buffers(layout.cp_attention))


def layout_links(layout: Layout, st: CostSettings) -> dict:
    """(β, α) of the layout's pp, tp and dp axes (:func:`axis_link`)."""
    return {a: axis_link(layout, a, st.hw, st.eff) for a in ("pp", "tp", "dp")}


_STAGE_KEYS = ("f", "b", "w", "comm_f", "comm_b", "comm_f_x", "comm_b_x", "ep_f", "ep_b")


def layer_recompute(layout: Layout, lay: dict, mix: dict | None = None) -> tuple:
    """One layer's recompute per microbatch (module docstring, "Recompute"): (time, its exposed tp
    communication, all of its tp communication, the fraction of the layer recomputed in full — whose cp and
    MoE forward communication repeat too). ``mix``: recompute="auto"'s weights over the named policies on
    the rank (:func:`auto_mix`)."""
    kf = tp_keys(layout)[0]
    if layout.recompute == Recompute.FULL:
        return lay["f"], lay[kf], lay["comm_f"], 1.0
    if layout.recompute == Recompute.SELECTIVE:
        return lay["attn"], 0, 0, 0.0
    if layout.recompute == Recompute.AUTO:
        full = mix.get("full", 0.0)
        return full * lay["f"] + mix.get("selective", 0.0) * lay["attn"], full * lay[kf], full * lay["comm_f"], full
    return 0, 0, 0, 0.0


def rank_times(layout: Layout, sec: Sections, n: int, extra: list[dict], mix: dict | None = None) -> dict:
    """One microbatch on a pipeline rank with ``n`` layers and the ``extra`` sections (the embedding on the
    first rank, the head on the last): the section times summed (``_STAGE_KEYS``), its recompute (``r``,
    ``comm_r`` exposed, ``comm_r_total``), its cp attention communication (``cp`` exposed, ``cp_total``; the
    layout's variant, its forward again under full recompute) and the MoE forward recomputed (``ep_r``).
    ``mix``: the rank's recompute="auto" weights."""
    lay = sec.lay
    r, rc, rt, full = layer_recompute(layout, lay, mix)
    cpc = sec.cp[layout.cp_attention] if layout.cp > 1 else _NO_CP
    d = {k: n * lay[k] for k in _STAGE_KEYS}
    d["r"] = n * r
    d["comm_r"] = n * rc
    d["comm_r_total"] = n * rt
    d["cp"] = n * (cpc["f_x"] + cpc["b_x"] + full * cpc["f_x"])
    d["cp_total"] = n * (cpc["f"] + cpc["b"] + full * cpc["f"])
    d["ep_r"] = n * full * lay["ep_f"]
    for e in extra:
        for k in _STAGE_KEYS:
            d[k] = d[k] + e[k]
    return d


def p2p_time(layout: Layout, prof: ModelProfile, st: CostSettings, links: dict):
    """Pipeline p2p per microbatch (module docstring, "Pipeline"): v sends forward and v backward of b·s·h
    (/tp), then an all-gather over tp unless sequence parallel; 0 without pp."""
    if layout.pp == 1:
        return 0
    hw, v = st.hw, layout.virtual
    beta, alpha = links["pp"]
    msg = layout.microbatch_size * (st.seq / layout.cp) * prof.hidden * prof.activation_bytes / layout.tp
    p2p = 2 * v * collective_time("send_recv", msg, 2, beta, alpha, hw.collective_call_latency)
    if layout.tp > 1 and not layout.sequence_parallel:
        tb, ta = links["tp"]
        p2p = p2p + 2 * v * collective_time("all_gather", msg * layout.tp, layout.tp, tb, ta,
                                            hw.collective_call_latency)
    return p2p


def step_terms(layout: Layout, prof: ModelProfile, sec: Sections, layers: tuple[int, ...], st: CostSettings,
               links: dict | None = None, auto: dict | None = None) -> tuple[dict, dict]:
    """The step-time terms (seconds) and details with ``layers[r]`` layers on pipeline rank r (module
    docstring: per rank T_r = n_r·t_layer + [first]·t_pre + [last]·t_post + t_p2p; the slowest rank sets
    the pipeline, the rank with most parameters the data-parallel reduction and the optimizer). ``sec``:
    the layout's :class:`Sections` (at its precision); ``links``: :func:`layout_links`, when already known;
    ``auto``: :func:`layout_auto` for recompute="auto" (made here when not given). The batch and sequence
    of ``st`` may be sympy symbols."""
    hw, eff = st.hw, st.eff
    links = links or layout_links(layout, st)
    p, v = layout.pp, layout.virtual
    m = microbatches(layout, st.global_batch)
    lay, pre, post = sec.lay, sec.pre, sec.post
    kf, kb = tp_keys(layout)
    if layout.recompute == Recompute.AUTO and auto is None:
        auto = layout_auto(layout, prof, sec, layers, st)
    p2p = p2p_time(layout, prof, st, links)

    def total(d):
        return (d["f"] + d["b"] + d["r"] + d[kf] + d[kb] + d["comm_r"] + d["cp"] + p2p
                + d["ep_f"] + d["ep_b"] + d["ep_r"])

    g_bytes, p_bytes = MM.DTYPE_BYTES[st.grad_dtype], MM.DTYPE_BYTES[st.param_dtype]
    n_dp = layout.dp * layout.cp * layout.ep  # ranks replicating the dense parameters

    def dp_of(d, params, n, n_experts=None):  # n_experts: the layers whose experts ``params`` holds (default n)
        experts = (n if n_experts is None else n_experts) * sec.lay_experts
        return data_comm(layout, hw, eff, params=params, experts=experts, layer_params=sec.lay_params,
                         layer_experts=sec.lay_experts, layers=n, window=d["b"] + d["r"] + d[kb] + d["comm_r"],
                         layer_forward=lay["f"],
                         layer_backward=lay["b"] + d["r"] / max(n, 1),  # recompute runs in backward too
                         grad_bytes=g_bytes, param_bytes=p_bytes, gather_bytes=gather_bytes_of(sec.precision))

    # data-parallel communication (dp x cp ranks hold the same parameters; dense ones dp x ep x cp): ZeRO-2/3's
    # per-microbatch collectives lengthen every microbatch of their rank (each rank its own parameters); once per
    # step, the reduction of the rank with the most parameters. The bubble: of the rank that idles longest (the
    # slowest one's under GPipe/1F1B/interleaved; under ZB-H1 (T - 2 t_w) per rank, so that more work on any rank
    # never shortens the step)
    per_mb = layout.zero >= 2 and n_dp > 1
    slow, T, n_slow, slow_rank, P_stage, P_layers, mb = None, None, None, None, None, None, None
    bubbles = []
    for i in ranks_to_check(layers):
        extra = ([pre] if i == 0 else []) + ([post] if i == p - 1 else [])
        d = rank_times(layout, sec, layers[i], extra, auto[i]["mix"] if auto is not None else None)
        params = layers[i] * sec.lay_params + (prof.pre.params if i == 0 else 0) + \
            (prof.post.params - (prof.tied_params if p == 1 else 0) if i == p - 1 else 0)
        dpi = dp_of(d, params, layers[i]) if per_mb else None
        t = total(d) + (dpi["mb_exposed"] if per_mb else 0)
        bubbles.append(pipeline_bubble(layout.schedule, p, v, t, d["w"]))
        if slow is None or _gt(t, T):  # symbolic: cannot decide; the last rank (head) is usually the slower
            slow, T, n_slow, slow_rank, mb = d, t, layers[i], i, dpi
        if P_stage is None or params > P_stage:
            P_stage, P_layers = params, layers[i]
    bubble = _max(*bubbles)

    dpc = dp_of(slow, P_stage, n_slow, P_layers)
    if per_mb:
        dpc.update(mb_total=mb["mb_total"], mb_exposed=mb["mb_exposed"])
    opt_params = optimizer_params(layout, P_stage, P_layers * sec.lay_experts)
    optimizer = opt_params * (24 + g_bytes + (p_bytes if p_bytes != 4 else 0)) / (hw.hbm_bandwidth * eff.memory)
    tp_exposed = m * (slow[kf] + slow[kb] + slow["comm_r"])
    tp_total = m * (slow["comm_f"] + slow["comm_b"] + slow["comm_r_total"])
    terms = {"compute": m * (slow["f"] + slow["b"]), "recompute": m * slow["r"],
             "tp_comm": tp_exposed, "cp_comm": m * slow["cp"],
             "pp_p2p": m * p2p, "pp_bubble": bubble, "dp_comm": m * dpc["mb_exposed"] + dpc["step_exposed"],
             "optimizer": optimizer, "ep_comm": m * (slow["ep_f"] + slow["ep_b"] + slow["ep_r"])}
    dp_total = m * dpc["mb_total"] + dpc["step_total"]
    cp_total = m * slow["cp_total"]
    details = {"microbatches": m, "layers_per_stage": n_slow, "params_per_rank": P_stage, "stage_time": T,
               "slow_stage": slow_rank, "stage_weight_grad": slow["w"],
               "dp_comm_total": dp_total, "dp_comm_hidden": dp_total - terms["dp_comm"],
               "tp_comm_total": tp_total, "tp_comm_hidden": tp_total - tp_exposed,
               "cp_comm_total": cp_total, "cp_comm_hidden": cp_total - terms["cp_comm"],
               "layer_forward": lay["f"], "layer_backward": lay["b"],
               "layer_tp_comm_forward": lay["comm_f"], "layer_tp_comm_backward": lay["comm_b"]}
    if prof.moe is not None:
        details.update(ep_details(layout, prof, lay, st.moe_imbalance))
    return {k: _value(x) for k, x in terms.items()}, details


def _value(x):
    """A float, or a sympy expression where the batch or sequence is symbolic."""
    return x if _is_symbolic(x) else float(x)


@dataclass(frozen=True)
class RankPrice:
    """:func:`price_ranks`'s answer: the step-time terms (seconds) and details, the largest rank's bytes and
    their breakdown, and recompute="auto"'s per-rank mix (:func:`auto_stages`; None for a named mode)."""

    terms: dict[str, float]
    details: dict[str, Any]
    memory_bytes: float
    memory_breakdown: dict[str, Any]
    auto: dict | None

    @property
    def step_time_s(self) -> float:
        return sum(self.terms.values())


def price_ranks(layout: Layout, prof: ModelProfile, sec: Sections, layers: tuple[int, ...],
                st: CostSettings) -> RankPrice:
    """A layout's step-time terms and memory with ``layers[r]`` layers on pipeline rank r (:func:`step_terms`,
    :func:`layout_memory`): what :func:`estimate` prices with ⌈L/p⌉ layers on every rank and the search
    with the partitioner's cuts."""
    auto = layout_auto(layout, prof, sec, layers, st)
    terms, details = step_terms(layout, prof, sec, layers, st, auto=auto)
    mem, mem_d = layout_memory(layout, prof, sec, layers, st, auto=auto)
    return RankPrice(terms, details, mem, mem_d, auto)


def matmul_flops(layout: Layout, prof: ModelProfile, global_batch, seq, mix: dict | None = None) -> tuple[float, float]:
    """(model, hardware) matmul-class FLOPs per step on all GPUs: 3 x forward, and that plus the recompute
    forward (``mix``: recompute="auto"'s weights per named policy, applied to every layer)."""
    b = layout.microbatch_size
    n_seqs = global_batch / b
    lay_v = prof.layer.evaluate(b, seq)
    lay_mm = float(lay_v.matmul_flops) * prof.n_layers
    out_mm = float(prof.pre.evaluate(b, seq).matmul_flops + prof.post.evaluate(b, seq).matmul_flops)
    model_flops = n_seqs * 3 * (lay_mm + out_mm)
    if layout.recompute == Recompute.FULL:
        rec = lay_mm
    elif layout.recompute == Recompute.SELECTIVE:
        rec = float(lay_v.attention_flops) * prof.n_layers
    elif layout.recompute == Recompute.AUTO:
        rec = mix.get("full", 0.0) * lay_mm + mix.get("selective", 0.0) * float(lay_v.attention_flops) * prof.n_layers
    else:
        rec = 0.0
    return model_flops, model_flops + n_seqs * rec


def ep_details(layout: Layout, prof: ModelProfile, lay: dict, moe_imbalance: float) -> dict:
    """What an MoE layout's estimate reports beside its terms (per microbatch and mean layer)."""
    return {"experts_per_rank": prof.moe.experts // layout.ep, "moe_imbalance": float(moe_imbalance),
            "layer_ep_comm_forward": lay["ep_f"], "layer_ep_comm_backward": lay["ep_b"],
            "layer_expert_forward": lay["expert_f"]}


def expert_split(prof: ModelProfile, ep: int) -> tuple[float, float]:
    """(one mean layer's parameters on a rank, of which routed experts) with E/ep experts a rank."""
    e = prof.layer.expert_params
    if not e or ep == 1:
        return prof.layer.params, e
    return prof.layer.params - e + e / ep, e / ep


def state_of(layout: Layout, n_par, n_experts, param_dtype: str, grad_dtype: str) -> MM.StateBytes:
    """Model-state bytes of a rank holding ``n_par`` parameters, ``n_experts`` of them routed experts:
    dense ones replicated over dp·ep·cp, experts over dp·cp (:func:`mcompile.ir.memory_model.model_state_bytes`)."""
    return MM.model_state_bytes(n_par - n_experts, n_experts, param_dtype, grad_dtype, layout.zero,
                                data=layout.dp * layout.cp * layout.ep, expert_data=layout.dp * layout.cp)


def optimizer_params(layout: Layout, params, experts) -> float:
    """Parameters whose optimizer step a rank runs: all, or under ZeRO its 1/dp share (dense ones 1/(dp·ep))."""
    if not layout.zero:
        return params
    if layout.ep == 1:
        return params / layout.dp
    return (params - experts) / (layout.dp * layout.ep) + experts / layout.dp


def group_link(layout: Layout, axes, hw: Hardware, eff: Efficiency) -> tuple[float, float]:
    """(β, α) of a group spanning several mesh axes (every combination of their indices): inside a node
    when all its members are; otherwise the members a node holds (each axis contributes
    min(size, G/stride) of them), each with its own NIC — :func:`axis_link` for one axis."""
    mesh = layout.mesh
    g = hw.gpus_per_node
    n = math.prod(mesh[a] for a in axes)
    per_node = 1
    for a in axes:
        stride = math.prod(mesh[x] for x in MESH_ORDER[MESH_ORDER.index(a) + 1:])
        per_node *= min(mesh[a], max(1, g // stride))
    if per_node >= n:
        return hw.intra_node_bandwidth * eff.intra_node, hw.intra_node_latency
    bw = min(hw.intra_node_bandwidth, per_node * hw.inter_node_bandwidth)
    return bw * eff.inter_node, hw.inter_node_latency


def data_comm(layout: Layout, hw: Hardware, eff: Efficiency, *, params, experts, layer_params, layer_experts,
              layers: int, window, layer_forward, layer_backward, grad_bytes: int, param_bytes: int,
              gather_bytes: int) -> dict:
    """:func:`dp_comm` of one rank: without ep over its dp·cp ranks (the dp axis's link); with ep the
    dense parameters over the dp·ep·cp ranks that replicate them (:func:`group_link`) and the experts
    over dp·cp (the ranks holding the same experts), each priced against the same backward window."""
    n_dp = layout.dp * layout.cp
    kw = dict(window=window, layer_forward=layer_forward, layer_backward=layer_backward, grad_bytes=grad_bytes,
              param_bytes=param_bytes, gather_bytes=gather_bytes, overlap_grad_reduce=layout.overlap_grad_reduce,
              overlap=layout.overlap, layers=layers)
    dp_link = axis_link(layout, "dp", hw, eff) if n_dp > 1 else (1.0, 0.0)
    if layout.ep == 1:
        return dp_comm(layout.zero, n_dp, dp_link, hw, params=params, layer_params=layer_params, **kw)
    dense = dp_comm(layout.zero, n_dp * layout.ep, group_link(layout, ("dp", "cp", "ep"), hw, eff), hw,
                    params=params - experts, layer_params=layer_params - layer_experts, **kw)
    mine = dp_comm(layout.zero, n_dp, dp_link, hw, params=experts, layer_params=layer_experts, **kw)
    return {k: dense[k] + mine[k] for k in dense}


def check_imbalance(moe_imbalance) -> None:
    if isinstance(moe_imbalance, bool) or not isinstance(moe_imbalance, int | float) or not moe_imbalance >= 1:
        raise ValueError(f"moe_imbalance={moe_imbalance!r}: the busiest ep rank's routed tokens over the mean, >= 1 "
                         "(1: uniform routing)")


# --------------------------------------------------------------------------- context parallelism


def cp_buffer_bytes(variant: str, *, cp: int, b, seq, heads, kv_heads, head_dim, activation_bytes: int = 2):
    """Bytes one rank's cp attention holds for one layer beside what the layer saves for backward (module
    docstring, "Context parallelism"; its backward, the larger phase): ring 4 K/V blocks (the block computed
    and the one arriving, and the dK/dV travelling with them), allgather the gathered K/V and the
    full-length dK/dV before their reduce-scatter (2·cp blocks), a2a the head-split dout, dq, dk, dv (kv heads
    repeated to the query heads when cp does not divide them). ``heads``/``kv_heads``: on the rank."""
    if cp <= 1:
        return 0
    s_loc = seq / cp
    kv = 2 * b * s_loc * kv_heads * head_dim * activation_bytes
    if variant == "ring":
        return 4 * kv
    if variant == "allgather":
        return 2 * cp * kv
    if variant == "a2a":
        q = b * s_loc * heads * head_dim * activation_bytes
        return 2 * q + _a2a_kv_bytes(kv, cp, heads, kv_heads)
    raise ValueError(f"cp_attention={variant!r}: use one of {', '.join(CP_VARIANTS)}")


def _a2a_kv_bytes(kv, cp: int, heads, kv_heads):
    """K and V as Ulysses moves them: the kv heads split over cp, or first repeated to the query heads."""
    return kv if kv_heads % cp == 0 else kv * heads / kv_heads


def cp_comm(variant: str, *, cp: int, b, seq, heads, kv_heads, head_dim, link: tuple[float, float], hw: Hardware,
            attention_forward=0, attention_backward=None, activation_bytes: int = 2) -> dict:
    """One layer's attention communication over ``cp`` ranks, per microbatch, on one rank (module
    docstring, "Context parallelism"). ``heads``/``kv_heads``: the query and kv heads on the rank (its tp
    share); ``head_dim``; ``seq``: the whole sequence (the rank holds seq/cp of it); ``link``: (β, α) of the
    cp axis (:func:`axis_link`); ``attention_forward``/``_backward``: the rank's attention core time per
    phase, what ring attention runs its transfers beside (backward default 2×). Works on numbers and sympy.

    Returns seconds ``f`` and ``b`` (all of it, per phase), ``f_x`` and ``b_x`` (exposed), the bytes a rank
    sends per phase ``sent_f``/``sent_b``, and ``buffers`` (:func:`cp_buffer_bytes`)."""
    if cp <= 1:
        return dict(_NO_CP)
    if variant not in CP_VARIANTS:
        raise ValueError(f"cp_attention={variant!r}: use one of {', '.join(CP_VARIANTS)}")
    beta, alpha = link
    call = hw.collective_call_latency
    s_loc = seq / cp
    kv = 2 * b * s_loc * kv_heads * head_dim * activation_bytes  # this rank's K and V
    q = b * s_loc * heads * head_dim * activation_bytes  # its queries (the output: the same size)
    if attention_backward is None:
        attention_backward = 2 * attention_forward
    frac = _ratio(cp - 1, cp, seq)
    if variant == "ring":  # cp - 1 steps, each passing a K/V block on (backward: with its dK/dV)
        step_f = collective_time("send_recv", kv, 2, beta, alpha, call)
        step_b = collective_time("send_recv", 2 * kv, 2, beta, alpha, call)
        f, bk = (cp - 1) * step_f, (cp - 1) * step_b
        if hw.comm_overlaps_compute:  # each step beside one block's attention (the last block has no transfer)
            k = hw.overlap_slowdown
            f_x = (cp - 1) * overlapped(attention_forward / cp, step_f, k)
            b_x = (cp - 1) * overlapped(attention_backward / cp, step_b, k)
        else:
            f_x, b_x = f, bk
        sent_f, sent_b = (cp - 1) * kv, (cp - 1) * 2 * kv
    elif variant == "allgather":  # K/V gathered; backward: gathered again, dK/dV reduce-scattered
        ag = collective_time("all_gather", kv * cp, cp, beta, alpha, call)
        rs = collective_time("reduce_scatter", kv * cp, cp, beta, alpha, call)
        f, bk = ag, ag + rs
        f_x, b_x = f, bk
        sent_f, sent_b = (cp - 1) * kv, 2 * (cp - 1) * kv
    else:  # a2a (Ulysses): q, k, v to heads-split, the output back; backward the same four
        kvr = _a2a_kv_bytes(kv, cp, heads, kv_heads)
        f = 2 * collective_time("all_to_all", q, cp, beta, alpha, call) + \
            2 * collective_time("all_to_all", kvr / 2, cp, beta, alpha, call)
        bk = f
        f_x, b_x = f, bk
        sent_f = sent_b = frac * (2 * q + kvr)
    buffers = cp_buffer_bytes(variant, cp=cp, b=b, seq=seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                              activation_bytes=activation_bytes)
    return {"f": f, "b": bk, "f_x": f_x, "b_x": b_x, "sent_f": sent_f, "sent_b": sent_b, "buffers": buffers}


_NO_CP = {"f": 0, "b": 0, "f_x": 0, "b_x": 0, "sent_f": 0, "sent_b": 0, "buffers": 0}


def cp_heads(prof: ModelProfile, tp: int) -> tuple:
    """(query heads, kv heads, head dim) on one tp rank; a model whose heads are unknown: one head of width
    hidden/tp."""
    if not prof.heads:
        return 1, 1, prof.hidden / tp
    H, KV = prof.heads, prof.kv_heads or prof.heads
    per = lambda x: x // tp if x % tp == 0 else x / tp  # noqa: E731
    return per(H), per(KV), prof.hidden / H


def cp_layer(layout: Layout, prof: ModelProfile, hw: Hardware, eff: Efficiency, b, s, lay: dict,
              variant: str | None = None) -> dict:
    """:func:`cp_comm` of one mean layer of ``prof`` under ``layout`` (its variant, or ``variant``)."""
    if layout.cp <= 1:
        return dict(_NO_CP)
    hq, hkv, d = cp_heads(prof, layout.tp)
    return cp_comm(variant or layout.cp_attention, cp=layout.cp, b=b, seq=s, heads=hq, kv_heads=hkv, head_dim=d,
                   link=axis_link(layout, "cp", hw, eff), hw=hw, attention_forward=lay["attn"],
                   attention_backward=lay["attn_b"], activation_bytes=prof.activation_bytes)


def cp_variants_allowed(layout: Layout, heads: int | None, masked: bool = False) -> tuple[str, ...]:
    """The cp attention variants that can run: an arbitrary mask only allgather; a2a (Ulysses) only where
    cp divides the query heads on a tp rank (``heads``: the model's; None: unknown, not refused)."""
    if masked:
        return ("allgather",)
    return tuple(v for v in CP_VARIANTS if v != "a2a" or not heads or (heads // layout.tp) % layout.cp == 0)


def choose_cp_attention(layout: Layout, hardware: str | Hardware = "h100", *, seq: int, model=None,
                        heads: int | None = None, kv_heads: int | None = None, head_dim: float | None = None,
                        masked: bool = False, precision: str | None = None, attention_kernel: str = "flash",
                        efficiency: Efficiency | None = None, activation_bytes: int = 2) -> tuple[str, dict]:
    """The cheapest cp attention variant for ``layout`` (cp > 1) and every applicable variant's price.

    What ``Config(cp_attention="auto")`` and the search use: cheap (no capture when given a
    :class:`ModelProfile` or the shapes) and deterministic. The model is either ``model`` — a
    :class:`ModelProfile` analysed at the layout's tp, or a :class:`Workload` (its profile at the layout's
    (tp, SP), captured once if not cached) — or its shapes: ``heads`` and ``kv_heads`` (the model's, all tp
    ranks: the layout's tp splits them), ``head_dim`` and ``activation_bytes``. ``seq``: the whole sequence
    (each cp rank holds seq/cp); the microbatch is ``layout.microbatch_size`` sequences. ``masked``: the
    attention takes an arbitrary mask (only allgather applies). A variant's price is its exposed seconds
    per layer and microbatch on one rank, forward + backward (:func:`cp_comm`'s ``f_x + b_x``; a full
    recompute would repeat the forward's for every variant alike, and is left out so that the choice does
    not depend on the recompute mode); ring's transfers run beside the attention core, priced from the
    profile's layer (or, from shapes, 4·b·hq·(s/cp)·s·d FLOPs at the attention efficiency). Returns
    ``(variant, {variant: seconds})``, the dict holding the applicable variants only (a2a needs cp to
    divide the query heads on a tp rank); ties go to the earlier of ``CP_VARIANTS``."""
    if layout.cp <= 1:
        raise ValueError("choose_cp_attention needs a layout with cp > 1 (there is no attention across ranks)")
    hw = get_hardware(hardware)
    eff = (efficiency or DEFAULT_EFFICIENCY).for_hardware(hw)
    precision = precision or layout.precision or "bf16"
    if seq % (2 * layout.cp):
        raise ValueError(f"cp={layout.cp} cuts each sequence into 2*cp = {2 * layout.cp} chunks: the sequence length "
                         f"{seq} does not divide by {2 * layout.cp}")
    b = layout.microbatch_size
    prof = None
    if model is not None:
        # a Workload (mcompile.cost.workload, above this module): its profile at the layout's (tp, SP)
        prof = model if isinstance(model, ModelProfile) or not hasattr(model, "profile") else \
            model.profile(layout.tp, layout.sequence_parallel)
        if not isinstance(prof, ModelProfile):
            raise TypeError(f"model={type(model).__name__}: pass a ModelProfile or a Workload (or heads=, kv_heads=, "
                            "head_dim=)")
        if prof.tp != layout.tp:
            raise ValueError(f"the profile was analysed at tp={prof.tp}, the layout has tp={layout.tp}")
        heads = prof.heads
        hq, hkv, d = cp_heads(prof, layout.tp)
        activation_bytes = prof.activation_bytes
        kw = dict(attention_kernel=attention_kernel, head_dim=prof.hidden / (prof.heads or 1))
        lay = section_times(prof.layer, b, seq / layout.cp, layout, hw, eff, precision, **kw)
        t_f, t_b = float(lay["attn"]), float(lay["attn_b"])
    else:
        if not heads or not head_dim:
            raise ValueError("choose_cp_attention needs model= (a ModelProfile or Workload) or heads= and head_dim=")
        kv_heads = kv_heads or heads
        if heads % layout.tp or kv_heads % layout.tp:
            raise ValueError(f"tp={layout.tp} does not divide the {heads} query heads and {kv_heads} kv heads")
        hq, hkv, d = heads // layout.tp, kv_heads // layout.tp, head_dim
        t_f = _attention_time(b, seq, layout.cp, hq, hkv, d, hw, eff, precision, attention_kernel, activation_bytes)
        t_b = BACKWARD_MULTIPLIER.get("attention", 2) * t_f
    link = axis_link(layout, "cp", hw, eff)
    prices = {}
    for v in cp_variants_allowed(layout, heads, masked):
        c = cp_comm(v, cp=layout.cp, b=b, seq=seq, heads=hq, kv_heads=hkv, head_dim=d, link=link, hw=hw,
                    attention_forward=t_f, attention_backward=t_b, activation_bytes=activation_bytes)
        prices[v] = float(c["f_x"] + c["b_x"])
    best = min(prices, key=lambda v: (prices[v], CP_VARIANTS.index(v)))
    return best, prices


def _attention_time(b, seq, cp, hq, hkv, d, hw: Hardware, eff: Efficiency, precision: str, kernel: str,
                    e: int) -> float:
    """One rank's attention core forward under cp, from shapes, as :func:`section_times` prices an SDPA
    node: torch's FLOP count 4·b·hq·(s/cp)·s·d (no causal halving), its q, k, v and output bytes × cp."""
    s_loc = seq / cp
    fl = 4 * b * hq * s_loc * seq * d
    y = (2 * b * s_loc * hq * d + 2 * b * s_loc * hkv * d) * e * cp
    peak = hw.peak_flops("bf16" if precision == "fp8" else precision) * eff.attention
    bw = hw.hbm_bandwidth * eff.memory
    if kernel == "unfused":
        return fl / peak + (y + UNFUSED_ATTENTION_BYTES * fl / (4 * d)) / bw
    return max(fl / peak, y / bw)


# --------------------------------------------------------------------------- recompute="auto"


def recompute_envelope(bytes_per_layer: dict[str, float], time_per_layer: dict[str, float]) -> list[tuple]:
    """The lower envelope of the named policies' points (bytes a layer keeps, its recompute time) as
    ``[(bytes, time, mode), ...]`` by increasing bytes: the convex hull's lower side from the least
    memory (full, normally) to the fastest (none, 0 s), without the points above it (a policy that a
    mix of its neighbours beats, or that keeps as much as a faster one)."""
    pts = sorted(((float(bytes_per_layer[m]), float(time_per_layer[m]), m) for m in bytes_per_layer),
                 key=lambda x: (x[0], x[1]))
    fastest = min(pts, key=lambda x: (x[1], x[0]))
    pts = [q for q in pts if q[0] <= fastest[0] and (q[1] > fastest[1] or q is fastest)]
    hull: list[tuple] = []
    for q in pts:
        if hull and q[0] == hull[-1][0]:  # same bytes: the faster one (sorted: the first) is kept
            continue
        while len(hull) >= 2:
            (x1, y1, _), (x2, y2, _) = hull[-2], hull[-1]
            if (y2 - y1) * (q[0] - x1) >= (q[1] - y1) * (x2 - x1):  # hull[-1] on or above the chord
                hull.pop()
            else:
                break
        hull.append(q)
    return hull


def auto_mix(allowed_bytes: float, envelope: list[tuple]) -> dict[str, float] | None:
    """How ``recompute="auto"`` is priced on one layer allowed ``allowed_bytes`` of saved activations:
    weights over the named policies (summing to 1) read off :func:`recompute_envelope` — the point
    itself when ``allowed_bytes`` falls on one, else the linear interpolation between the two
    neighbouring envelope points; ``{"none": 1}`` at or above none's bytes; None below full's (does
    not fit). The recompute time is Σ weight · the policy's time, the bytes Σ weight · its bytes.

    This is an estimate from the named policies' points, not the ILP's own optimum: passes/remat.py
    solves on each rank's real joint graph and recomputes no more than the best named policy that
    fits its budget (tests/test_joint.py). An interpolated weight stands for a per-layer mix — that
    fraction of the stage's layers under one policy and the rest under its neighbour — which is a
    saved set the ILP may choose, so at a whole-layer mix this is an upper bound on what the ILP
    recomputes at that budget (in its FLOPs; the time here prices those FLOPs with the roofline).
    Between whole-layer mixes the interpolation is the continuous relaxation: it can understate the
    recompute of a mix restricted to whole layers by at most one layer's step between the two
    policies per microbatch (the ILP chooses per tensor, finer than a layer)."""
    lo, hi = envelope[0], envelope[-1]
    if allowed_bytes >= hi[0]:
        return {hi[2]: 1.0}
    if allowed_bytes < lo[0] * (1 - 1e-12):
        return None
    if allowed_bytes <= lo[0]:
        return {lo[2]: 1.0}
    for (x1, _, m1), (x2, _, m2) in zip(envelope[:-1], envelope[1:]):
        if x1 <= allowed_bytes <= x2:
            w2 = (allowed_bytes - x1) / (x2 - x1)
            if w2 <= 0:
                return {m1: 1.0}
            return {m2: 1.0} if w2 >= 1 else {m1: 1.0 - w2, m2: w2}
    return {hi[2]: 1.0}  # unreachable: the envelope covers [lo, hi]


def activations_left(limit: float, params, grads, optimizer, *, gradients_meet_activations: bool = True,
                     reduction_buffer=0) -> float | None:
    """The activation bytes A that :func:`mcompile.ir.memory_model.peak_bytes` allows under ``limit`` on
    a rank holding the rest: limit − (P + O + G) when the gradients meet the activations, else
    limit − (P + O); None when even A = 0 is over the limit."""
    if gradients_meet_activations:
        left = limit - (params + optimizer + grads)
        return left if left >= reduction_buffer else None
    left = limit - (params + optimizer)
    return left if left >= grads + reduction_buffer else None


def stage_auto(limit: float, fixed: tuple, inflight, n_layers: int, extra_act: float, envelope: list[tuple],
               acts: dict[str, float], *, gradients_meet_activations: bool = True, reduction_buffer=0) -> dict:
    """``recompute="auto"`` on one pipeline stage: the activation budget the memory model leaves
    (``fixed`` = (params, grads, optimizer) bytes of the stage; ``inflight`` microbatches, each keeping
    ``n_layers`` layers and ``extra_act`` bytes outside them), inverted to bytes per layer, and the
    mix of :func:`auto_mix` there. Returns {"mix", "layer_bytes", "budget" (bytes per microbatch, the
    ILP's budget per call), "fits", "limit", "inflight"}; where even full recompute does not fit, the mix is
    full's (and its memory is over the limit)."""
    left = activations_left(limit, *fixed, gradients_meet_activations=gradients_meet_activations,
                            reduction_buffer=reduction_buffer)
    per_mb = None if left is None else left / float(inflight)
    allowed = None
    if per_mb is not None:
        allowed = math.inf if n_layers == 0 else (per_mb - extra_act) / n_layers
    mix = auto_mix(allowed, envelope) if allowed is not None else None
    fits = mix is not None
    if mix is None:
        mix = {"full": 1.0}
    layer_bytes = sum(w * float(acts[m]) for m, w in mix.items())
    return {"mix": mix, "layer_bytes": layer_bytes, "budget": per_mb if fits else None, "fits": fits,
            "limit": limit, "inflight": inflight}


def _gt(a, b) -> bool:
    try:
        return bool(a > b)
    except TypeError:  # symbolic: cannot decide; the last stage (head) is usually the slower
        return True


def resolve_precision(layout: Layout, precision: str | None) -> Layout:
    """The layout with its matmul precision settled: ``precision`` when given (it overrides the layout's,
    as any keyword of :func:`estimate` does), else the layout's own, else "bf16"."""
    p = precision or layout.precision or "bf16"
    return layout if layout.precision == p else dataclasses.replace(layout, precision=p)


