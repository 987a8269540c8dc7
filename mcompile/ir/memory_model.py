"""Memory per rank: parameters, gradients, optimizer state, activations, in-flight microbatches.

Model state (per parameter; Megatron-LM's distributed-optimizer table, docs/source/api-guide/
dist_optimizer.md, and Rajbhandari et al. 2020, ZeRO)
-----------------------------------------------------------------------------------------------
params in ``param_dtype`` (P B), gradients in ``grad_dtype`` (G B), AdamW's two moments in fp32
(8 B) plus an fp32 master copy when the parameters are not fp32 (4 B):

    ZeRO-0 (plain data parallelism):      P + G + (8 + 4·[P≠4])           bf16+fp32 grads: 2+4+12 = 18 B
    ZeRO-1 (distributed optimizer, dp=d): P + G + (8 + 4·[P≠4]) / d       bf16+fp32 grads: 6 + 12/d B
    ZeRO-2 (and gradients):               P + (G + 8 + 4·[P≠4]) / d       bf16+fp32 grads: 2 + 16/d B
    ZeRO-3 (and parameters, FSDP-like):   (P + G + 8 + 4·[P≠4]) / d       bf16+fp32 grads: 18/d B
    fp32 params and grads:                4 + 4 + 8 = 16 B,  ZeRO-1: 8 + 8/d B,  ZeRO-2: 4 + 12/d,  ZeRO-3: 16/d

Expert parallelism (ep, folded into data parallelism as Megatron does): a dense parameter is
replicated over the dp·ep·cp data-parallel ranks — ZeRO divides its state by those — a routed expert
lives on one rank of each ep group (E/ep a rank) and is replicated over dp·cp only
(:func:`model_state_bytes`); the plan's accounting (:func:`memory_per_rank`) does the same.

plus what ZeRO-2/3 keep in flight (:func:`zero_buffer_bytes`, in the peak as ``zero_buffers``):

    ZeRO-2, ZeRO-3: 2 gradient buckets of ``bucket_bytes`` (the runtime's ``Config.bucket_mb`` = 25 MiB of
                    fp32 gradients): one being reduce-scattered while the next fills, each freed after its
                    reduce-scatter (at most the rank's whole gradient, G·N, when that is smaller)
    ZeRO-3:         + 2 layers' parameters gathered in the compute dtype (the layer running and the one
                    prefetched, forward and backward; the largest gathered unit when the embedding or head
                    outweighs a layer): 2 · N_unit · C bytes, C = 2 (bf16/fp16/fp8 matmuls) or 4 (fp32)

Activations per transformer layer (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", Table 2; s sequence, b microbatch, h hidden, a heads, t tp; 16-bit
activations and 1-byte dropout masks; Megatron's attention with an explicit s×s softmax)
-------------------------------------------------------------------------------------------------

    no parallelism                  sbh · (34 + 5as/h)
    tensor parallel                 sbh · (10 + 24/t + 5as/(ht))
    tensor + sequence parallel      sbh/t · (34 + 5as/h)
    tp + selective recompute        sbh · (10 + 24/t)
    tp + sp + selective recompute   sbh/t · 34
    full recompute                  2sbh (the layer input only; 2sbh/t under sp)

34 = attention 11 (QKV input 2, Q and K 4, V 2, projection input 2, dropout mask 1) + MLP 19 (2 + GeLU
input 8 + second linear input 8 + mask 1) + two layer-norm inputs 4; 5as/h = softmax output 2as²b +
its dropout mask as²b + dropout output 2as²b. The sequence-parallel rows assume Megatron's variant
that saves the *sharded* layer-norm outputs and all-gathers them again in backward
(``sp_variant="regather"``); mcompile's ``save_gathered`` keeps the gathered ones, adding
2 · 2sbh·(1 − 1/t) (:func:`activation_bytes_per_layer`).

Context parallelism (cp ranks; ``mcompile.cost.model``, "Context parallelism")
------------------------------------------------------------------------
Each rank holds seq/cp positions of every sequence for the whole model, so every activation above is
evaluated at s = seq/cp: activation memory per rank falls as 1/cp (the scores of an explicit softmax,
Korthikanti's 5as/h term, see all seq keys: ``key_len``). Parameters, gradients and optimizer state are
replicated over cp; ZeRO shards them over dp·cp (·ep for dense parameters), the ranks gradients are
summed over. On top, the attention variant's buffers of one layer, live while it runs
(:func:`mcompile.cost.model.cp_buffer_bytes`, ``cp_buffers`` in :func:`peak_bytes`, X): ring 4 K/V blocks of a
rank (K/V being computed on and arriving, dK/dV travelling with them), allgather 2·cp blocks (the
gathered K/V and the full-length dK/dV before the reduce-scatter), a2a the head-split dout, dq, dk, dv.
They are transient (one layer at a time), so they are counted once, not per layer.

Outside the layers (Korthikanti §4.3): the first stage's embedding dropout mask sbh/t (sp) and the
last stage's final norm input, head input and fp32 logits 4sbh/t·(1 + v/h)-ish; modelled by
:func:`output_layer_activation_bytes`.

Graph path (:func:`saved_for_backward`): the tensors autograd would keep, read off the captured
graph by op rule — a linear keeps its activation input, SDPA its q, k, v, output and log-sum-exp, a
norm or a non-linear pointwise op its input, a product its inputs, softmax its output; dropout keeps
nothing (mcompile recomputes its mask from a counter in backward, mcompile/ir/dropout.py, where Megatron
keeps a 1-byte mask: Korthikanti's formula counts it); views resolve to the tensor they alias and
each tensor counts once. A recomputed region keeps its inputs from outside instead of what its own
nodes save. It reflects the kernels the model really uses (flash attention: no s² term) and any
architecture. A routed MoE layer (one ``moe_ffn`` call) is counted by :func:`moe_saved_bytes` from its
shapes.

In-flight microbatches (activations of how many microbatches a pipeline stage holds at its peak)
-------------------------------------------------------------------------------------------------
With p stages, m microbatches, stage i (0-based), v virtual stages (Narayanan et al. SC'21 §2.2):

    GPipe                    m
    1F1B                     min(p − i, m)
    interleaved 1F1B         min((2(p − i − 1) + (v − 1)·p + 1) / v, m)   (stage 0: p + (p−1)/v,
                             Korthikanti's factor 1 + (p−1)/(pv) over 1F1B)
    ZB-H1                    min(p, m) on every stage (Qi et al. 2023, "Zero Bubble Pipeline
                             Parallelism" §2.1: 1F1B's peak, that of its stage 0, on all workers)

in units of the stage's full activations for one microbatch (an interleaved chunk holds 1/v). ZB-H1
splits the backward into B (input gradient) and W (weight gradient). On a stage after the first the
runtime keeps the weight-gradient graph, with the tensors it saved, from B until W
(``runtime/pipeline.py``, torch's ``stage_backward_input``), and ``runtime/schedules.py`` runs
W(j) on stage i right after B(j + i): min(p − i, m) microbatches before their B plus up to i
between B and W, min(p, m) in all (stage 0's B is its whole backward and its W follows at once).
A microbatch between B and W counts as the stage's full activations, as ``peak_activation_bytes``
counts it; the output gradients B leaves at the weights' nodes for W come on top, not modelled.

Lifetimes: what is live at the peak (:func:`peak_bytes`)
----------------------------------------------------------
Parameters P and optimizer state O live throughout (from the first step on). Activations A live
from a microbatch's forward to its backward. Gradients G: a persistent flat fp32 buffer, in Megatron
(``main_grad``) and in mcompile's runtime (``runtime/leaves.py``; ZeRO-1's in ``runtime/zero.py``),
reduced over dp in place (R = 0). A runtime whose gradients are made by backward and freed by
``zero_grad()`` and that reduces from a flat copy (R = 4 B per reduced parameter) would peak
differently when a step is one microbatch on one stage; :func:`peak_bytes` keeps both cases:

    gradients meet activations (a persistent buffer; several microbatches per step, whose later
    forwards run with the earlier ones' gradients; pipelines, where one microbatch's backward runs
    while others are in flight):                              P + O + G + Z + X + max(A, R)
    otherwise (gradients made by backward, one microbatch):   P + O + Z + X + max(A, G + R)

Z: ZeRO-2/3's buffers in flight (:func:`zero_buffer_bytes`), live through forward and backward
(ZeRO-2/3 keep only the 1/d gradient shard persistently: G above is that shard). X: context
parallelism's attention buffers of one layer (above; 0 without cp).

Checked against the tracker's peak of real gloo runs (tests/test_cost_measured.py: llama3-tiny,
dp=2×tp=2 with and without SP and dp=4: −4 to −6 %; what the model leaves out is backward's working
set on top of the kept activations). The kept activations alone match the tracker to the byte but for
the shared RoPE tables counted once a layer (tests/test_cp_memory.py). pp=2×tp=2 with 4 microbatches
is under-predicted by 11.8 % (the tracker sees twice the activations modelled on the largest rank: an
open defect, xfailed there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from mcompile.ir.meta import OUT_BYTES

__all__ = [
    "DTYPE_BYTES",
    "MemoryPerRank",
    "memory_per_rank",
    "model_state_bytes_per_param",
    "zero_buffer_bytes",
    "ZERO_BUCKET_BYTES",
    "activation_bytes_per_layer",
    "output_layer_activation_bytes",
    "inflight_microbatches",
    "peak_bytes",
    "saved_for_backward",
    "moe_saved_bytes",
    "model_state_bytes",
]

DTYPE_BYTES = {"fp32": 4, "float32": 4, "float": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
               "half": 2, "fp8": 1, "float64": 8}


def _nbytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[str(dtype).replace("torch.", "")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}") from None


# --------------------------------------------------------------------------- model state


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of one rank's model state."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_state_bytes_per_param(param_dtype: str = "bf16", grad_dtype: str = "fp32", zero: int = 0,
                                dp: int = 1) -> StateBytes:
    """Bytes per parameter (see the module docstring): AdamW, ZeRO level 0-3 over ``dp`` ranks: 1 shards
    the optimizer state (moments and fp32 master), 2 also the gradients, 3 also the parameters."""
    if zero not in (0, 1, 2, 3) or isinstance(zero, bool):
        raise ValueError(f"zero={zero!r}: the memory model knows ZeRO levels 0, 1, 2 and 3")
    p, g = _nbytes(param_dtype), _nbytes(grad_dtype)
    opt = 8 + (4 if p != 4 else 0)
    return StateBytes(p / dp if zero >= 3 else p, g / dp if zero >= 2 else g, opt / dp if zero >= 1 else opt)


def model_state_bytes(dense, experts, param_dtype: str = "bf16", grad_dtype: str = "fp32", zero: int = 0, *,
                      data: int = 1, expert_data: int = 1) -> StateBytes:
    """Bytes (not per parameter) of one rank's model state holding ``dense`` replicated parameters and
    ``experts`` routed-expert parameters (its E/ep experts). Megatron folds expert parallelism into
    data parallelism: a dense parameter is replicated over every data-parallel rank (``data`` = dp·ep·cp,
    what ZeRO shards it over), an expert over ``expert_data`` = dp·cp ranks only (the ranks that hold
    the same experts)."""
    d = model_state_bytes_per_param(param_dtype, grad_dtype, zero, data)
    e = model_state_bytes_per_param(param_dtype, grad_dtype, zero, expert_data)
    return StateBytes(dense * d.params + experts * e.params, dense * d.grads + experts * e.grads,
                      dense * d.optimizer + experts * e.optimizer)


# the runtime's data-parallel gradient bucket (Config.bucket_mb = 25 MiB of fp32 gradients, runtime/leaves.py)
ZERO_BUCKET_BYTES = 25 * 2**20


def zero_buffer_bytes(zero: int, unit_params: float, compute_bytes: int = 2, *, grad_bytes: float = float("inf"),
                      bucket_bytes: float = ZERO_BUCKET_BYTES) -> float:
    """Bytes ZeRO-2/3 hold in flight on one rank (module docstring): 2 gradient buckets (at most the
    rank's ``grad_bytes`` of full gradients) for zero >= 2, plus 2 gathered units of ``unit_params``
    parameters in ``compute_bytes`` each for zero = 3 (the running layer and the prefetched one)."""
    if zero < 2:
        return 0
    out = min(2 * bucket_bytes, grad_bytes)
    if zero >= 3:
        out += 2 * unit_params * compute_bytes
    return out


@dataclass(frozen=True)
class MemoryPerRank:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def memory_per_rank(plan, dtype: str | None = None, zero: int = 0, only: set[str] | None = None) -> MemoryPerRank:
    """Bytes of parameters, gradients and AdamW state that one rank of ``plan`` holds (the largest
    rank: every rank holds the same under tp/dp). Gradients fp32 (Megatron's ``main_grad``); AdamW's
    moments fp32 plus an fp32 master copy of non-fp32 parameters; plus AdamW's 4-byte step count per
    parameter tensor. Sharded parameters count their local (padded) piece, tied ones once. ZeRO-1
    divides the optimizer state by the plan's dp size, ZeRO-2 also the gradients, ZeRO-3 also the
    parameters (buffers in flight not included: :func:`zero_buffer_bytes`). Under pipeline parallelism a rank holds its
    stages' parameters only (tied ones on every stage using them): the largest pipeline rank. Under an
    ``ep`` axis the dense parameters are replicated over dp·ep (what ZeRO divides them by) and the
    routed experts (sharded over ep: E/ep of them) over dp. ``only``: count these parameters (FQNs) alone."""
    pipe = getattr(plan, "pipeline", None) or {}
    if only is not None:
        import dataclasses

        plan = dataclasses.replace(plan, params={f: p for f, p in plan.params.items() if f in only})
    if pipe.get("param_stages"):
        per_rank = []
        for r in range(pipe["pp"]):
            mine = {f for f, stages in pipe["param_stages"].items() if any(s % pipe["pp"] == r for s in stages)}
            per_rank.append(_state_bytes([pp for f, pp in plan.params.items() if f in mine], dtype, zero,
                                         plan.mesh.get("dp", 1), _ep_of(plan)))
        return max(per_rank, key=lambda m: m.total)
    return _state_bytes(list(plan.params.values()), dtype, zero, plan.mesh.get("dp", 1), _ep_of(plan))


def _ep_of(plan) -> tuple[int, int | None]:
    """(ep size, index of the ep axis in the plan's placements) or (1, None)."""
    if "ep" not in plan.mesh:
        return 1, None
    return plan.mesh["ep"], list(plan.mesh).index("ep")


def _state_bytes(params, dtype: str | None, zero: int, dp: int, ep: tuple = (1, None)) -> MemoryPerRank:
    """Expert parameters (sharded over ep: their local piece is E/ep experts) are replicated over dp
    only; the rest over dp·ep, the data-parallel ranks ZeRO shards over (:func:`model_state_bytes`)."""
    from mcompile.ir.placements import Shard

    n_ep, ep_i = ep
    p = g = o = 0
    for pp in params:
        pb = _nbytes(dtype or pp.dtype)
        n = pp.local_numel
        expert = ep_i is not None and isinstance(pp.placements[ep_i], Shard)
        d = dp if expert else dp * n_ep
        p += (n * pb) // (d if zero >= 3 else 1)
        g += (n * 4) // (d if zero >= 2 else 1)
        o += (n * (8 + (4 if pb != 4 else 0))) // (d if zero else 1) + 4  # + AdamW's 0-d step
    return MemoryPerRank(p, g, o)


# --------------------------------------------------------------------------- activations (formulas)


def activation_bytes_per_layer(s, b, h, a, *, tp: int = 1, sequence_parallel: bool = False,
                               recompute: str = "none", sp_variant: str = "regather", key_len=None):
    """Korthikanti et al. 2022, Table 2: bytes one transformer layer keeps for backward, per rank.

    Works on numbers and on sympy symbols alike. ``recompute``: "none", "selective", "full". ``s``: the
    rank's own positions (seq/cp under context parallelism); ``key_len``: the keys each of its queries
    meets, the scores' other side (default s; the whole sequence under cp)."""
    t = tp
    sp = sequence_parallel and t > 1
    if recompute == "full":
        return 2 * s * b * h / t if sp else 2 * s * b * h
    attn_core = 5 * a * (s if key_len is None else key_len) / h  # softmax output, its dropout mask, dropout output
    if recompute == "selective":
        attn_core = 0
    elif recompute != "none":
        raise ValueError(f"recompute={recompute!r}: use 'none', 'selective' or 'full'")
    if sp:
        out = s * b * h / t * (34 + attn_core)
        if sp_variant == "save_gathered":  # QKV and first-MLP inputs kept all-gathered
            out += 2 * (2 * s * b * h) * (1 - sympy.Rational(1, t) if isinstance(s, sympy.Basic) else 1 - 1 / t)
        return out
    return s * b * h * (10 + sympy.Rational(24, t) + attn_core / t if isinstance(s, sympy.Basic)
                        else 10 + 24 / t + attn_core / t)


def output_layer_activation_bytes(s, b, h, vocab, *, tp: int = 1, sequence_parallel: bool = False,
                                  logits_bytes: int = 4):
    """Last pipeline stage, outside the layers: final-norm input (2sbh), head input (2sbh, /t under sp)
    and the logits the loss keeps (``logits_bytes`` per element: fp32 by default), vocab-parallel /t."""
    t = tp
    hidden = 4 * s * b * h / t if sequence_parallel and t > 1 else 4 * s * b * h
    return hidden + logits_bytes * s * b * vocab / t


def inflight_microbatches(schedule: str, pp: int, stage: int, microbatches, virtual: int = 1):
    """How many microbatches' activations stage ``stage`` holds at its peak (module docstring)."""
    p, i, m, v = pp, stage, microbatches, virtual
    if p == 1:
        return 1  # gradient accumulation: one microbatch at a time
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return _min(p - i, m)
    if schedule == "zb-h1":
        return _min(p, m)  # F until W: p - i before their B, up to i more awaiting W (docstring)
    if schedule == "interleaved":
        return _min(sympy.Rational(2 * (p - i - 1) + (v - 1) * p + 1, v), m)
    raise ValueError(f"schedule {schedule!r}: use 'gpipe', '1f1b', 'interleaved' or 'zb-h1'")


def peak_bytes(params, grads, optimizer, activations, *, gradients_meet_activations: bool,
               reduction_buffer=0, zero_buffers=0, cp_buffers=0) -> tuple:
    """(bytes at one rank's peak, what is live then by kind) from what it holds (module docstring,
    "Lifetimes"); ``reduction_buffer``: the data-parallel reduction's copy of the gradients (R);
    ``zero_buffers``: ZeRO-2/3's gathered parameters and gradient buckets in flight (Z); ``cp_buffers``:
    context parallelism's attention buffers of one layer (X, :func:`mcompile.cost.model.cp_buffer_bytes`)."""
    def mx(a, b):
        return sympy.Max(a, b) if isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic) else max(a, b)

    if gradients_meet_activations:
        late = mx(activations, reduction_buffer)
        g = grads
    else:
        late = mx(activations, grads + reduction_buffer)
        g = 0 if late == activations else grads
    d = {"params": params, "grads": g, "optimizer": optimizer,
         "activations": activations if late == activations else 0,
         "reduction_buffer": 0 if late == activations else reduction_buffer}
    if zero_buffers:
        d["zero_buffers"] = zero_buffers
    if cp_buffers:
        d["cp_buffers"] = cp_buffers
    return params + optimizer + (grads if gradients_meet_activations else 0) + zero_buffers + cp_buffers + late, d


def _min(a, b):
    if isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic):
        return sympy.Min(a, b)
    return min(a, b)


# --------------------------------------------------------------------------- activations (graph)

aten = torch.ops.aten

_KEEPS_ACTIVATION_INPUTS = {  # linear algebra: keeps the activation operands (weights are parameters)
    aten.linear, aten.mm, aten.matmul, aten.bmm, aten.addmm, aten.baddbmm, aten.einsum, aten.mul, aten.div,
    aten.addcmul, aten._scaled_mm,
}
_KEEPS_INPUT = {  # norms and non-linear pointwise ops: keep their (first) input
    aten.layer_norm, aten.native_layer_norm, aten.rms_norm, aten.group_norm, aten.gelu, aten.silu, aten.tanh,
    aten.sigmoid, aten.relu, aten.exp, aten.log, aten.pow, aten.sqrt, aten.sin, aten.cos, aten.var, aten.std,
    aten.cross_entropy_loss, aten.nll_loss, aten.embedding, aten.mish, aten.softplus, aten.elu, aten.leaky_relu,
}
_KEEPS_OUTPUT = {aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax, aten.rsqrt, aten.reciprocal}
_ATTENTION = {
    getattr(aten, n) for n in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                               "_scaled_dot_product_efficient_attention",
                               "_scaled_dot_product_flash_attention_for_cpu",
                               "_scaled_dot_product_cudnn_attention") if hasattr(aten, n)
}


def _packet(node: fx.Node):
    return getattr(node.target, "overloadpacket", None)


def _is_tensor_node(n) -> bool:
    return isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)


def _base(node: fx.Node) -> fx.Node:
    """The node that allocated the storage ``node``'s value lives in (views, getitem, in-place)."""
    seen = 0
    while seen < 64:
        seen += 1
        if node.op != "call_function":
            return node
        out = node.meta.get(OUT_BYTES)
        if out is not None and out != 0:
            return node
        ins = [a for a in node.all_input_nodes if _is_tensor_node(a) or a.op == "call_function"]
        if not ins:
            return node
        node = ins[0]
    return node


def _saved_by(node: fx.Node, is_param: Callable[[fx.Node], bool],
              needs_grad: Callable[[fx.Node], bool] | None = None) -> list[tuple[fx.Node, str, sympy.Expr | None]]:
    """What ``node``'s backward keeps: (tensor node, kind, bytes) with kind "tensor" (the tensor's own
    bytes, ``None``), "mask" (a dropout mask) or "lse" (attention's log-sum-exp). ``needs_grad(x)``
    (when given): whether x requires a gradient — autograd records nothing for a node none of whose
    inputs does (RoPE's cos/sin tables), and a product keeps an operand only for another operand's
    gradient (``q * cos`` keeps cos, not q)."""
    from mcompile.ir.annotate import numel

    pk = _packet(node)
    acts = [a for a in node.all_input_nodes if _is_tensor_node(a) and not is_param(a)]
    if needs_grad is not None and not any(needs_grad(a) for a in node.all_input_nodes):
        return []
    if pk in _ATTENTION:
        out = node.meta.get("val")
        out = out[0] if isinstance(out, (tuple, list)) else out
        kept = [(x, "tensor", None) for x in node.args[:3] if isinstance(x, fx.Node)] + [(node, "tensor", None)]
        if isinstance(out, torch.Tensor) and out.dim() >= 2:  # fp32 log-sum-exp per (batch, head, query)
            kept.append((node, "lse", numel(out) / _to_expr(out.shape[-1]) * 4))
        return kept
    if pk is aten.dropout:  # lowered to mcompile::dropout, whose backward recomputes the mask (passes/lower_dropout.py)
        return []
    if pk in _KEEPS_ACTIVATION_INPUTS:
        ins = [a for a in node.all_input_nodes if _is_tensor_node(a)]

        def for_another(a):  # a is kept for the gradient of another operand (x * x: of itself; x * 0.125 keeps
            # nothing: the other operand is a number)
            return needs_grad is None or any(needs_grad(b) for b in ins if b is not a) or (
                sum(x is a for x in node.args) > 1 and needs_grad(a))
        return [(a, "tensor", None) for a in acts if a.meta["val"].dim() > 0 and for_another(a)]
    if pk in _KEEPS_INPUT:
        return [(acts[0], "tensor", None)] if acts else []
    if pk in _KEEPS_OUTPUT:
        return [(node, "tensor", None)]
    return []


def _to_expr(x):
    from mcompile.ir.annotate import to_sympy

    return to_sympy(x)


def moe_saved_bytes(node: fx.Node, hidden_share=1) -> sympy.Expr:
    """Bytes a ``moe_ffn`` node (mcompile.ir.moe: T tokens of width d, k experts each, experts of width f)
    keeps for backward, which :func:`saved_for_backward` cannot read off one opaque call: per routed
    slot (T·k of them) the gathered token row the first projection(s) read (d), what the activation
    keeps (SwiGLU, separate or fused gate/up: gate and up, 2f; a plain MLP: its pre-activation, f), the
    down projection's input (f), the expert output the routing weight multiplies (d), in the tokens'
    dtype, and the routing weight itself. ``hidden_share``: the share of f one rank holds (1/tp under
    expert tensor parallelism). Under ep a rank keeps the slots it received: T·k on average."""
    from mcompile.ir.annotate import numel
    from mcompile.ir.moe import ExpertForm

    x, idx, weights, *ws = node.args
    xv, iv, wv = x.meta["val"], idx.meta["val"], weights.meta["val"]
    form = ExpertForm.parse(node.kwargs["form"])
    f = int(ws[form.n_matrices - 1].meta["val"].shape[form.hidden_dims()[form.n_matrices - 1]])  # down's input
    d = int(xv.shape[-1])
    slots = numel(iv)
    hidden = (3 if form.kind != "plain" else 2) * f * sympy.sympify(hidden_share)
    return sympy.expand(slots * ((2 * d + hidden) * xv.element_size() + wv.element_size()))


def saved_for_backward(
    nodes: Iterable[fx.Node],
    *,
    is_param: Callable[[fx.Node], bool],
    local_fraction: Callable[[fx.Node, fx.Node | None], sympy.Expr | float] = lambda x, c: 1,
    recomputed: Iterable[fx.Node] = (),
    keep_input: Callable[[fx.Node], bool] = lambda x: True,
    needs_grad: Callable[[fx.Node], bool] | None = None,
) -> sympy.Expr:
    """Bytes of the tensors autograd keeps for the backward of ``nodes`` (annotated: OUT_BYTES set).
    ``needs_grad(x)``: whether x requires a gradient (see :func:`_saved_by`; None: every input does).

    ``is_param(n)``: placeholders that are parameters/buffers (not activation memory).
    ``local_fraction(x, consumer)``: the share of tensor x one rank holds as ``consumer`` uses it
    (1/tp for a tp-sharded value; 1 when the consumer sees it all-gathered).
    ``recomputed``: nodes run again in backward (checkpointed): what they keep is dropped and their
    inputs from outside the recomputed set are kept instead (filtered by ``keep_input``).
    """
    nodes = [n for n in nodes if n.op == "call_function"]
    rset = set(recomputed)
    kept: dict[tuple[fx.Node, str], sympy.Expr] = {}
    for n in nodes:
        if n in rset:
            continue
        for x, kind, size in _saved_by(n, is_param, needs_grad):
            base = _base(x) if kind == "tensor" else x
            if base.op == "placeholder" and is_param(base):
                continue
            if size is None:
                size = base.meta.get(OUT_BYTES, 0)
            kept.setdefault((base, kind), sympy.sympify(size) * local_fraction(base, n))
    for n in nodes:
        if n not in rset:
            continue
        for a in n.all_input_nodes:
            if a in rset or not _is_tensor_node(a):
                continue
            base = _base(a)
            if base in rset or (base.op == "placeholder" and is_param(base)) or not keep_input(base):
                continue
            kept.setdefault((base, "tensor"), sympy.sympify(base.meta.get(OUT_BYTES, 0)) * local_fraction(base, n))
    return sympy.expand(sympy.Add(*kept.values())) if kept else sympy.Integer(0)

