"""Per-node FLOPs and bytes of a captured graph, symbolic in the dynamic batch/sequence sizes.

``annotate(gm)`` walks a ``torch.export`` graph at the default *training IR* (``linear``, SDPA,
``layer_norm``, ``cross_entropy_loss`` still whole; never call ``run_decompositions`` first), sets
four ``node.meta`` keys (:mod:`mcompile.ir.meta`) on every node and returns an
:class:`AnnotationSummary`:

- ``FLOPS``          sympy expr: floating-point operations of the node's *forward*;
- ``BYTES_READ``     sympy expr: bytes of the tensor inputs the node reads;
- ``BYTES_WRITTEN``  sympy expr: bytes of the tensor outputs the node writes;
- ``OUT_BYTES``      sympy expr: bytes the node's output(s) newly allocate (what saving it costs).

Sizes come from ``node.meta["val"]`` (FakeTensors whose sizes may be SymInts); a SymInt becomes
its sympy expression ``s.node.expr`` (``s23``, ``s23*s27``, ...), an int a ``sympy.Integer``. Every
value this module produces is a ``sympy.Expr``, so it can be evaluated later at any local batch
or sequence (``expr.subs({b: 8, s: 2048})``).

Conventions (each chosen deliberately; change them here and in the tests together)
-------------------------------------------------------------------------------------
FLOPs
  * Matmul class: 2·M·N·K (one multiply + one add per MAC; torch's ``flop_counter`` convention,
    which also ignores the "2K−1" subtlety and the bias add of ``addmm``/``linear``). Where
    ``torch.utils.flop_counter.flop_registry`` has a formula (``mm``, ``addmm``, ``bmm``,
    ``baddbmm``, ``_scaled_mm``, convolutions, the fused SDPA kernels) it is used, fed with
    tuples of sympy sizes (those formulas are plain arithmetic, so they work on sympy). The
    training IR keeps ops torch has no entry for; they get formulas here in the same convention:
    ``linear`` and ``matmul`` = 2·numel(out)·K, two-operand ``einsum`` = 2·Π(all index sizes).
  * Attention (``scaled_dot_product_attention`` and its CPU flash kernel): torch's
    ``sdpa_flop_count`` = the two matmuls QKᵀ and PV = 4·b·h_q·s_q·s_k·d. **Causal masking is not
    halved** (torch's convention, and what a dense kernel computes); the softmax inside SDPA is
    not counted. GQA (fewer K/V heads) counts with the query heads, as the kernel broadcasts.
  * Elementwise (every aten op tagged ``torch.Tag.pointwise``, plus ``dropout``): 1 flop per
    output element, whatever the function (``add`` and ``tanh`` alike). Integer/bool-only
    elementwise ops (position ids, mask building) count 0: they are not floating-point work.
  * Norms, per element of the input: ``layer_norm``/``group_norm``/``batch_norm`` 5 (mean,
    centre, square, accumulate, scale) + 1 per affine weight + 1 per bias; ``rms_norm`` 3
    (square, accumulate, scale) + 1 per weight.
  * ``softmax``/``log_softmax``: 5 per element (max, subtract, exp, sum, divide/log).
    ``cross_entropy_loss``: 5 per logit (its log_softmax) + 1 per target (pick and accumulate);
    ``nll_loss``: 1 per target; ``mse_loss``: 3 per element.
  * Reductions (``sum``, ``mean``, ``amax``, ...): 1 per *input* element; ``var``/``std``: 3.
  * Data movement and creation (``cat``, copies, casts, ``pad``, ``embedding``/``index`` gathers,
    ``arange``/``zeros``/``full``, random fills): 0 flops (bytes only).
  * Views and bookkeeping (see bytes below; ``sym_size``, ``getitem``, asserts, SymInt
    arithmetic): 0 flops.
  * Anything else (unknown aten ops, custom ops such as ``torch.ops.mcompile.*`` or
    ``transformers.grouped_mm_fallback``) gets 0 flops and its name in
    ``AnnotationSummary.no_flop_formula``; its bytes are counted normally. Give it a formula
    with :func:`register_flop_formula`. A formula that raises never crashes annotation either:
    the op is listed in ``no_flop_formula`` and the error in ``formula_errors``.
  * Higher-order ops with subgraphs (``wrap_with_set_grad_enabled``, ``wrap_with_autocast``):
    the subgraphs are annotated too and the node carries their sums.

Training FLOPs (:func:`training_flops`)
  forward + backward, with backward = 2× forward for the matmul class (``matmul`` and
  ``attention`` categories: grad-input and grad-weight are one matmul each of the forward's size;
  SDPA's backward has 4 matmuls to the forward's 2) and 1× forward for everything else (a rough
  convention: those ops are a few percent of the total). No recompute is included. For the usual
  "model FLOPs" (MFU) numerator use ``3 * summary.matmul_flops``.

Bytes
  * Itemsize × numel, per tensor; sizes come from the FakeTensor so dtype changes (fp32 → bf16)
    halve them.
  * A node whose output shares storage with one of its inputs (``view``, ``transpose``,
    ``unsqueeze``, ``expand``, ``slice``, ``split``, ``t``, a same-dtype ``to``, a ``reshape``
    or ``contiguous`` that did not copy, ...) moves no data: BYTES_READ = BYTES_WRITTEN =
    OUT_BYTES = 0. Aliasing is read off the FakeTensors (the storage of ``meta["val"]``), so a
    ``reshape`` that must copy (e.g. after ``expand``) is counted as a copy. ``getitem`` (the
    producer already counted its outputs), ``sym_size``/``sym_numel``/``sym_stride``,
    ``_assert_*``, ``detach_`` and SymInt arithmetic are also 0/0/0. The memory a view pins is
    its base's: it is counted at the node that allocated the base.
  * In-place ops (``add_``, ``copy_``) read their inputs and write their output but allocate
    nothing: OUT_BYTES = 0.
  * Each distinct input node is read once (``mul(x, x)`` reads x once). An input with stride-0
    (expanded/broadcast) dims is read at its storage footprint: sizes of stride-0 dims do not
    count (the ``[b, 1, s, s]`` mask expanded from ``[1, 1, s, s]`` reads s² elements).
  * Gathers (``embedding``, ``index``, ``index_select``, ``gather``, ``take``) read the rows they
    gather (numel(out) × itemsize of the table) plus the indices, not the whole table.
  * ``new_ones``/``zeros_like``-style factories read nothing (their tensor argument only gives
    dtype/device/shape).
  * Placeholders get FLOPS = BYTES_READ = BYTES_WRITTEN = 0 and OUT_BYTES = the size of the
    input (parameter, buffer or user input); the output node gets zeros.

Layers
  A node's layer is found in ``node.meta["nn_module_stack"]``: the *outermost* module path
  whose last component is an integer (``m.model.layers.3`` → 3, ``m.transformer.h.3`` → 3).
  Outermost rather than innermost, so that a numbered module nested inside a layer (a list of
  experts, ``...layers.3.mlp.experts.7``) still belongs to layer 3. Nodes outside any numbered
  module go to ``None``. Two numbered lists at the same depth (an encoder's and a decoder's
  ``layers.0``) share index keys; ``AnnotationSummary.layer_paths`` shows the paths behind a key.
  A numbered embedding table (MusicGen's per-codebook ``embed_tokens.0``) is not a layer.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.utils import flop_counter as _torch_flop_counter
from torch.utils._pytree import tree_flatten, tree_map

from mcompile.ir import meta as M
from mcompile.ir.meta import ALIASES  # noqa: F401  (node.meta: per tensor output, whether it shares storage; re-exported)

from .meta import BYTES_READ, BYTES_WRITTEN, FLOPS, OUT_BYTES

__all__ = [
    "AnnotationSummary",
    "NodeCost",
    "annotate",
    "node_cost",
    "training_flops",
    "register_flop_formula",
    "layer_index",
    "layer_path",
    "to_sympy",
    "shape_of",
    "numel",
    "nbytes",
    "op_name",
    "BACKWARD_MULTIPLIER",
    "MATMUL_CATEGORIES",
]

aten = torch.ops.aten

ZERO = sympy.Integer(0)

# Categories a node's flops are filed under (AnnotationSummary.flops_by_category).
MATMUL_CATEGORIES = frozenset({"matmul", "attention"})
# backward flops = multiplier × forward flops, per category (training_flops).
BACKWARD_MULTIPLIER: dict[str, int] = {
    "matmul": 2,
    "attention": 2,
    "elementwise": 1,
    "norm": 1,
    "softmax": 1,
    "loss": 1,
    "reduction": 1,
    "other": 1,
    "memory": 0,
    "view": 0,
    "unknown": 0,
}

# Per-element constants (documented in the module docstring).
NORM_FLOPS_PER_ELEMENT = 5
RMS_NORM_FLOPS_PER_ELEMENT = 3
SOFTMAX_FLOPS_PER_ELEMENT = 5
VAR_FLOPS_PER_ELEMENT = 3
MSE_FLOPS_PER_ELEMENT = 3


# --------------------------------------------------------------------------- sympy helpers


def to_sympy(x: Any) -> sympy.Expr:
    """An int / SymInt / SymFloat / float / sympy value as a sympy expression."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return sympy.sympify(x.node.expr)
    if isinstance(x, sympy.Basic):
        return x
    if isinstance(x, bool):
        return sympy.Integer(int(x))
    if isinstance(x, int):
        return sympy.Integer(x)
    if isinstance(x, float):
        return sympy.Float(x)
    raise TypeError(f"to_sympy: cannot convert {type(x).__name__} {x!r}")


def shape_of(t: torch.Tensor) -> tuple[sympy.Expr, ...]:
    """The sizes of a (Fake)Tensor as sympy expressions."""
    return tuple(to_sympy(s) for s in t.shape)


def _prod(xs: Iterable[sympy.Expr]) -> sympy.Expr:
    out: sympy.Expr = sympy.Integer(1)
    for x in xs:
        out = out * x
    return out


def numel(t: torch.Tensor) -> sympy.Expr:
    """numel of a (Fake)Tensor as a sympy expression."""
    return _prod(shape_of(t))


def nbytes(t: torch.Tensor) -> sympy.Expr:
    """itemsize × numel of a (Fake)Tensor as a sympy expression."""
    return numel(t) * t.dtype.itemsize


def _footprint_bytes(t: torch.Tensor) -> sympy.Expr:
    """Bytes actually read from a tensor: stride-0 (broadcast/expanded) dims do not multiply."""
    try:
        strides = t.stride()
    except Exception:  # sparse, nested, ...: fall back to the nominal size
        return nbytes(t)
    dims = []
    for size, stride in zip(t.shape, strides):
        if to_sympy(stride) == 0:
            continue
        dims.append(to_sympy(size))
    return _prod(dims) * t.dtype.itemsize


def _tensors(v: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(v)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _is_float(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except Exception:
        return None


# --------------------------------------------------------------------------- op naming / layers


def op_name(target: Any) -> str:
    """A stable, readable name of a call_function target (``aten.add.Tensor``, ``mylib.foo.default``)."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    mod = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    return f"{mod}.{name}" if mod else name


_LAYER_SUFFIX = re.compile(r"(?:\.|\[)(\d+)\]?$")  # "...layers.3" (export) or "...layers[3]"


def _layer_of_path(path: str) -> int | None:
    m = _LAYER_SUFFIX.search(path)
    return int(m.group(1)) if m else None


def layer_path(node: fx.Node) -> str | None:
    """Module path of the node's transformer layer: the outermost ``nn_module_stack`` path whose
    last component is an integer (``m.model.layers.3``), or None."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    for value in stack.values():  # ordered outermost → innermost
        path = value[0] if isinstance(value, tuple) else value
        kind = value[1] if isinstance(value, tuple) and len(value) > 1 else None
        if isinstance(path, str) and path and _layer_of_path(path) is not None and not _is_embedding(kind):
            return path
    return None


@functools.cache
def _is_embedding(kind) -> bool:
    """Whether an ``nn_module_stack`` module type (a class or its qualified name) is an embedding table: a numbered
    one (MusicGen's per-codebook ``embed_tokens.0``) is one of a list of inputs, never a transformer layer."""
    if isinstance(kind, str):
        mod, _, name = kind.rpartition(".")
        kind = getattr(sys.modules.get(mod), name, None)
    return isinstance(kind, type) and issubclass(kind, torch.nn.Embedding | torch.nn.EmbeddingBag)


def layer_index(node: fx.Node) -> int | None:
    """The node's transformer layer index (``...layers.3`` → 3), or None outside any layer."""
    path = layer_path(node)
    return None if path is None else _layer_of_path(path)


# --------------------------------------------------------------------------- formulas

# A formula: fn(args, kwargs, out) -> int | sympy.Expr, where args/kwargs are the node's arguments
# with every fx.Node replaced by its meta["val"] (FakeTensors, SymInts, ...) and out is the node's
# meta["val"]. Use shape_of / numel / to_sympy on them.
FlopFormula = Callable[[tuple, dict, Any], Any]

_FORMULAS: dict[Any, tuple[FlopFormula, str]] = {}


def register_flop_formula(*targets: Any, category: str = "other") -> Callable[[FlopFormula], FlopFormula]:
    """Register ``fn(args, kwargs, out) -> flops`` for ops (OpOverload or OpOverloadPacket, e.g.
    ``torch.ops.mcompile.all_reduce``). ``category`` files the flops (``"matmul"`` and
    ``"attention"`` get a 2× backward in :func:`training_flops`; ``"memory"`` for zero-flop data
    movement). A later registration of the same target replaces the earlier one."""
    if category not in BACKWARD_MULTIPLIER:
        raise ValueError(f"unknown category {category!r}; one of {sorted(BACKWARD_MULTIPLIER)}")

    def deco(fn: FlopFormula) -> FlopFormula:
        for t in targets:
            _FORMULAS[t] = (fn, category)
        return fn

    return deco


def _t(x: Any) -> torch.Tensor | None:
    return x if isinstance(x, torch.Tensor) else None


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _out_numel(out: Any) -> sympy.Expr:
    return sympy.Add(*[numel(t) for t in _tensors(out)]) if _tensors(out) else ZERO


def _zero(args: tuple, kwargs: dict, out: Any) -> sympy.Expr:
    return ZERO


# Matmul class ----------------------------------------------------------------


@register_flop_formula(aten.linear, category="matmul")
def _linear_flops(args, kwargs, out):
    # y = x Wᵀ (+ b): 2 · numel(y) · in_features; the bias add is not counted (as torch's addmm).
    x, w = args[0], args[1]
    return 2 * numel(out) * shape_of(w)[-1] if w.dim() == 2 else 2 * numel(out) * shape_of(x)[-1]


@register_flop_formula(aten.matmul, aten.mv, aten.dot, aten.vdot, category="matmul")
def _matmul_flops(args, kwargs, out):
    # Every broadcasting form of matmul: each output element is a K-long dot product.
    a = args[0]
    k = shape_of(a)[-1]
    n_out = numel(out) if isinstance(out, torch.Tensor) else sympy.Integer(1)
    return 2 * n_out * k


@register_flop_formula(aten.addmv, category="matmul")
def _addmv_flops(args, kwargs, out):
    return 2 * numel(out) * shape_of(args[1])[-1]


@register_flop_formula(aten.addbmm, category="matmul")
def _addbmm_flops(args, kwargs, out):
    b1, b2 = args[1], args[2]
    bs, m, k = shape_of(b1)
    n = shape_of(b2)[-1]
    return 2 * bs * m * n * k


@register_flop_formula(aten.einsum, category="matmul")
def _einsum_flops(args, kwargs, out):
    # Two operands without ellipsis: 2 · Π sizes of all distinct indices (contracted or not).
    eq, operands = args[0], args[1]
    if len(operands) != 2 or "..." in eq:
        raise NotImplementedError(f"einsum {eq!r} with {len(operands)} operands")
    lhs = eq.split("->")[0].replace(" ", "")
    sizes: dict[str, sympy.Expr] = {}
    for spec, t in zip(lhs.split(","), operands):
        for ch, size in zip(spec, shape_of(t)):
            sizes.setdefault(ch, size)
    return 2 * _prod(sizes.values())


# Attention -------------------------------------------------------------------


def _sdpa_flops(args, kwargs, out):
    q, k, v = args[0], args[1], args[2]
    # torch's convention: QKᵀ and PV, no halving for is_causal or a mask.
    return _torch_flop_counter.sdpa_flop_count(shape_of(q), shape_of(k), shape_of(v))


register_flop_formula(aten.scaled_dot_product_attention, category="attention")(_sdpa_flops)
for _name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math"):
    if hasattr(aten, _name):
        register_flop_formula(getattr(aten, _name), category="attention")(_sdpa_flops)


# Norms, softmax, losses, reductions --------------------------------------------


@register_flop_formula(aten.layer_norm, aten.native_layer_norm, category="norm")
def _layer_norm_flops(args, kwargs, out):
    x = args[0]
    w = _t(_arg(args, kwargs, 2, "weight"))
    b = _t(_arg(args, kwargs, 3, "bias"))
    return numel(x) * (NORM_FLOPS_PER_ELEMENT + (w is not None) + (b is not None))


def _rms_norm_flops(args, kwargs, out):
    x = args[0]
    w = _t(_arg(args, kwargs, 2, "weight"))
    return numel(x) * (RMS_NORM_FLOPS_PER_ELEMENT + (w is not None))


for _name in ("rms_norm", "_fused_rms_norm"):
    if hasattr(aten, _name):
        register_flop_formula(getattr(aten, _name), category="norm")(_rms_norm_flops)


@register_flop_formula(aten.group_norm, aten.native_group_norm, category="norm")
def _group_norm_flops(args, kwargs, out):
    x = args[0]
    w_i, b_i = (2, 3) if len(args) > 2 and not isinstance(args[1], torch.Tensor) else (1, 2)
    w = _t(_arg(args, kwargs, w_i, "weight"))
    b = _t(_arg(args, kwargs, b_i, "bias"))
    return numel(x) * (NORM_FLOPS_PER_ELEMENT + (w is not None) + (b is not None))


@register_flop_formula(
    aten.batch_norm,
    aten.native_batch_norm,
    aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_no_training,
    aten._native_batch_norm_legit_functional,
    aten.instance_norm,
    category="norm",
)
def _batch_norm_flops(args, kwargs, out):
    x = args[0]
    w = _t(_arg(args, kwargs, 1, "weight"))
    b = _t(_arg(args, kwargs, 2, "bias"))
    return numel(x) * (NORM_FLOPS_PER_ELEMENT + (w is not None) + (b is not None))


@register_flop_formula(
    aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax, aten._safe_softmax, category="softmax"
)
def _softmax_flops(args, kwargs, out):
    return SOFTMAX_FLOPS_PER_ELEMENT * numel(args[0])


@register_flop_formula(aten.cross_entropy_loss, category="loss")
def _cross_entropy_flops(args, kwargs, out):
    logits, target = args[0], args[1]
    return SOFTMAX_FLOPS_PER_ELEMENT * numel(logits) + numel(target)


@register_flop_formula(
    aten.nll_loss, aten.nll_loss_forward, aten.nll_loss_nd, aten.nll_loss2d, category="loss"
)
def _nll_flops(args, kwargs, out):
    return numel(args[1])


@register_flop_formula(aten.mse_loss, category="loss")
def _mse_flops(args, kwargs, out):
    return MSE_FLOPS_PER_ELEMENT * numel(args[0])


@register_flop_formula(
    aten.binary_cross_entropy_with_logits,
    aten.binary_cross_entropy,
    aten.smooth_l1_loss,
    aten.l1_loss,
    aten.huber_loss,
    category="loss",
)
def _pointwise_loss_flops(args, kwargs, out):
    return MSE_FLOPS_PER_ELEMENT * numel(args[0])


@register_flop_formula(
    aten.sum,
    aten.mean,
    aten.nansum,
    aten.nanmean,
    aten.amax,
    aten.amin,
    aten.max,
    aten.min,
    aten.prod,
    aten.logsumexp,
    aten.cumsum,
    aten.cumprod,
    aten.argmax,
    aten.argmin,
    aten.norm,
    aten.linalg_vector_norm,
    aten.aminmax,
    aten.any,
    aten.all,
    aten.count_nonzero,
    category="reduction",
)
def _reduction_flops(args, kwargs, out):
    x = _t(args[0])
    if x is None or not _is_float(x):  # integer/bool reductions (masks, position ids)
        return ZERO
    return numel(x)


@register_flop_formula(aten.var, aten.std, aten.var_mean, aten.std_mean, category="reduction")
def _var_flops(args, kwargs, out):
    return VAR_FLOPS_PER_ELEMENT * numel(args[0])


# Elementwise (beyond Tag.pointwise) ---------------------------------------------


def _elementwise_flops(args, kwargs, out):
    ts = _tensors(out) + _tensors((args, kwargs))
    if not any(_is_float(t) for t in ts):
        return ZERO
    return _out_numel(out)


register_flop_formula(
    aten.dropout,
    aten.native_dropout,
    aten.feature_dropout,
    aten.alpha_dropout,
    aten.softplus,
    aten.hardtanh,
    aten.glu,
    aten.prelu,
    aten._prelu_kernel,
    aten.rrelu,
    aten.diff,
    category="elementwise",
)(_elementwise_flops)
for _name in (
    "__and__",
    "__or__",
    "__xor__",
    "__lshift__",
    "__rshift__",
    "__iand__",
    "__ior__",
    "__ixor__",
    "__ilshift__",
    "__irshift__",
):
    if hasattr(aten, _name):
        register_flop_formula(getattr(aten, _name), category="elementwise")(_elementwise_flops)


# Data movement / creation (0 flops, bytes only) ----------------------------------

_MEMORY_OPS = """
    cat stack hstack vstack clone copy copy_ _to_copy to contiguous reshape lift_fresh_copy lift_fresh
    pad constant_pad_nd reflection_pad1d replication_pad1d embedding index index_select gather take
    take_along_dim arange zeros ones full empty empty_strided empty_like zeros_like ones_like full_like
    rand_like randn_like new_zeros new_ones new_full new_empty new_empty_strided scalar_tensor tensor
    rand randn randint randperm bernoulli bernoulli_ uniform_ normal_ repeat repeat_interleave tile
    tril triu flip roll one_hot fill fill_ zero_ zero masked_select masked_scatter scatter scatter_
    index_put index_put_ slice_scatter select_scatter diagonal_scatter as_strided_scatter unfold_copy
    alias_copy view_copy permute_copy transpose_copy t_copy expand_copy slice_copy select_copy
    unsqueeze_copy squeeze_copy split_copy split_with_sizes_copy sort argsort topk nonzero unique_dim
    _unique2 searchsorted bucketize histc bincount type_as expand_as view_as reshape_as flatten
    unflatten movedim moveaxis swapaxes detach alias narrow narrow_copy chunk unsafe_split unsafe_chunk
    tensor_split linspace logspace eye tril_indices triu_indices
""".split()
for _name in _MEMORY_OPS:
    if hasattr(aten, _name):
        _packet = getattr(aten, _name)
        if _packet not in _FORMULAS:
            _FORMULAS[_packet] = (_zero, "memory")


# Bookkeeping ops with no data: 0 flops, 0 bytes.
_META_OPS = {
    aten.sym_size,
    aten.sym_numel,
    aten.sym_stride,
    aten.sym_storage_offset,
    aten._assert_scalar,
    aten._assert_async,
    aten._assert_tensor_metadata,
    aten.sym_constrain_range,
    aten.sym_constrain_range_for_size,
    aten.detach_,
    aten._local_scalar_dense,
    aten.item,
    aten.is_nonzero,
    aten.size,
    aten.stride,
    aten.numel,
    aten.dim,
    aten.is_contiguous,
}
for _name in (
    "_functional_assert_scalar",
    "_functional_assert_async",
    "_functional_sym_constrain_range",
    "_functional_sym_constrain_range_for_size",
    "_print",
):
    if hasattr(aten, _name):
        _META_OPS.add(getattr(aten, _name))

# Tensor-like factories: their tensor argument only supplies dtype/device/shape, nothing is read.
_NO_READ_OPS = {
    getattr(aten, n)
    for n in (
        "new_zeros",
        "new_ones",
        "new_full",
        "new_empty",
        "new_empty_strided",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
    )
    if hasattr(aten, n)
}

# Gathers: read numel(out) rows of the table, not the whole table.
_GATHER_OPS = {aten.embedding, aten.index, aten.index_select, aten.gather, aten.take, aten.take_along_dim}


# --------------------------------------------------------------------------- per-node cost


@dataclasses.dataclass(frozen=True)
class NodeCost:
    """What :func:`node_cost` works out for one node (the four meta values plus bookkeeping)."""

    flops: sympy.Expr
    bytes_read: sympy.Expr
    bytes_written: sympy.Expr
    out_bytes: sympy.Expr
    category: str  # key of BACKWARD_MULTIPLIER
    has_formula: bool  # False: flops are a 0 placeholder (op listed in no_flop_formula)
    error: str | None = None  # the formula raised this (op also has_formula=False)


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else n


def _materialize(args: Any) -> Any:
    return tree_map(lambda a: _val(a) if isinstance(a, fx.Node) else a, args)


def _input_nodes(node: fx.Node) -> list[fx.Node]:
    return list(dict.fromkeys(node.all_input_nodes))  # ordered, distinct


def _input_tensors(node: fx.Node) -> list[tuple[fx.Node, torch.Tensor]]:
    out = []
    for n in _input_nodes(node):
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            out.append((n, v))
        else:  # a list/tuple value (rare as a direct input)
            out.extend((n, t) for t in _tensors(v))
    return out


def _schema_writes(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    return any(r.alias_info is not None and r.alias_info.is_write for r in schema.returns)


def _schema_may_alias(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _lookup(target: Any) -> tuple[FlopFormula, str, str] | None:
    """(fn, category, kind) for a target, kind 'mcompile' or 'torch'."""
    if target in _FORMULAS:
        fn, cat = _FORMULAS[target]
        return fn, cat, "mcompile"
    packet = getattr(target, "overloadpacket", None)
    if packet is not None and packet in _FORMULAS:
        fn, cat = _FORMULAS[packet]
        return fn, cat, "mcompile"
    if packet is not None and packet in _torch_flop_counter.flop_registry:
        cat = "attention" if "attention" in str(packet) else "matmul"
        return _torch_flop_counter.flop_registry[packet], cat, "torch"
    return None


def _call_torch_formula(fn: Callable, args: tuple, kwargs: dict, out: Any) -> Any:
    # torch's formulas take shapes (tuples of sizes); give them tuples of sympy expressions.
    conv = lambda x: shape_of(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
    s_args, s_kwargs, s_out = tree_map(conv, (args, kwargs, out))
    return fn(*s_args, out_val=s_out, **s_kwargs)


def _flops(node: fx.Node, out: Any, alias_only: bool) -> tuple[sympy.Expr, str, bool, str | None]:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if target is operator.getitem or packet in _META_OPS:
        return ZERO, "view", True, None
    if alias_only and not _schema_writes(target):
        return ZERO, "view", True, None
    if not isinstance(target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)) and not _tensors(out):
        return ZERO, "view", True, None  # SymInt arithmetic (operator.mul, sym_max, ...)
    found = _lookup(target)
    if found is None and isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        found = (_elementwise_flops, "elementwise", "mcompile")
    if found is None:
        return ZERO, "unknown", False, None
    fn, cat, kind = found
    args, kwargs = _materialize((node.args, node.kwargs))
    try:
        if kind == "torch":
            f = _call_torch_formula(fn, args, kwargs, out)
        else:
            f = fn(args, kwargs, out)
        return sympy.sympify(to_sympy(f) if not isinstance(f, sympy.Basic) else f), cat, True, None
    except Exception as e:  # never crash annotation on a formula
        return ZERO, "unknown", False, f"{type(e).__name__}: {e}"




def output_aliases(node: fx.Node) -> list[bool] | None:
    """Per tensor output of ``node``, whether it shares storage with one of its inputs, read off the
    FakeTensors of a fresh capture (None without storage information). A serialised program loses
    storage sharing, so capture records this in ``node.meta[ALIASES]`` (mcompile.capture.cache)."""
    outs = _tensors(node.meta.get("val"))
    in_storages = {k for _, t in _input_tensors(node) if (k := _storage_key(t)) is not None}
    if not outs or not in_storages:
        return None
    return [_storage_key(t) in in_storages for t in outs]


def node_cost(node: fx.Node) -> NodeCost:
    """FLOPs/bytes of one call_function node (see the module docstring for the conventions).
    Higher-order ops with subgraphs are handled by :func:`annotate`, not here."""
    out = node.meta.get("val")
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    outs = _tensors(out)

    if target is operator.getitem or packet in _META_OPS:
        return NodeCost(ZERO, ZERO, ZERO, ZERO, "view", True)

    ins = _input_tensors(node)
    writes = _schema_writes(target)
    known = node.meta.get(ALIASES)
    if known is not None and len(known) == len(outs):
        aliased = list(known)
    elif outs and (flags := output_aliases(node)) is not None:
        aliased = flags
    elif outs and _schema_may_alias(target) and not writes:
        aliased = [True] * len(outs)  # no storage info: trust the schema
    else:
        aliased = [False] * len(outs)
    alias_only = bool(outs) and all(aliased)

    flops, cat, has, err = _flops(node, out, alias_only)

    if alias_only and not writes:  # a view: no data moves
        return NodeCost(flops, ZERO, ZERO, ZERO, cat, has, err)

    if packet in _NO_READ_OPS:
        read = ZERO
    elif packet in _GATHER_OPS:
        table = ins[0][1] if ins else None
        itemsize = table.dtype.itemsize if table is not None else 0
        idx = sympy.Add(*[_footprint_bytes(t) for n, t in ins[1:]]) if len(ins) > 1 else ZERO
        read = _out_numel(out) * itemsize + idx
    else:
        read = sympy.Add(*[_footprint_bytes(t) for _, t in ins]) if ins else ZERO
    written = sympy.Add(*[nbytes(t) for t in outs]) if outs else ZERO
    if writes:
        out_b = ZERO  # in place: writes into existing storage
    else:
        out_b = sympy.Add(*[nbytes(t) for t, a in zip(outs, aliased) if not a]) if outs else ZERO
        written = out_b
    return NodeCost(flops, read, written, out_b, cat, has, err)


# --------------------------------------------------------------------------- summary


@dataclasses.dataclass(frozen=True)
class AnnotationSummary:
    """Totals of one annotated graph; every number a sympy expression in the dynamic sizes."""

    forward_flops: sympy.Expr
    matmul_flops: sympy.Expr  # forward flops of the matmul class (categories matmul + attention)
    bytes_read: sympy.Expr
    bytes_written: sympy.Expr
    flops_per_layer: dict[int | None, sympy.Expr]
    bytes_per_layer: dict[int | None, sympy.Expr]  # read + written
    flops_by_category: dict[str, sympy.Expr]
    no_flop_formula: frozenset[str]  # op names (op_name) that got a 0-flop placeholder
    formula_errors: dict[str, str]  # op name -> error its formula raised
    layer_paths: dict[int, tuple[str, ...]]  # layer index -> module paths seen for it
    symbols: frozenset[sympy.Symbol]  # free symbols of all the totals (the dynamic sizes)

    @property
    def total_bytes(self) -> sympy.Expr:
        return sympy.expand(self.bytes_read + self.bytes_written)

    @property
    def backward_flops(self) -> sympy.Expr:
        return sympy.expand(
            sympy.Add(*[BACKWARD_MULTIPLIER.get(c, 1) * f for c, f in self.flops_by_category.items()])
        )

    @property
    def training_flops(self) -> sympy.Expr:
        return training_flops(self)

    def evaluate(self, expr: sympy.Expr, subs: dict) -> int | float:
        """``expr`` at concrete sizes; ``subs`` maps sympy symbols or their names (``"s23"``) to numbers."""
        by_name = {s.name: s for s in sympy.sympify(expr).free_symbols}
        m = {}
        for k, v in subs.items():
            name = k if isinstance(k, str) else getattr(k, "name", None)
            m[by_name.get(name, k if not isinstance(k, str) else sympy.Symbol(k))] = v
        r = sympy.sympify(expr).subs(m)
        return int(r) if r.is_integer else float(r)


def training_flops(summary: AnnotationSummary) -> sympy.Expr:
    """Forward + backward flops of one training step (no recompute): backward is 2× forward for
    the matmul class and 1× for the rest (see the module docstring)."""
    return sympy.expand(summary.forward_flops + summary.backward_flops)


class _Acc:
    def __init__(self) -> None:
        self.flops: list[sympy.Expr] = []
        self.read: list[sympy.Expr] = []
        self.written: list[sympy.Expr] = []
        self.per_layer_f: dict[int | None, list[sympy.Expr]] = {}
        self.per_layer_b: dict[int | None, list[sympy.Expr]] = {}
        self.by_cat: dict[str, list[sympy.Expr]] = {}
        self.no_formula: set[str] = set()
        self.errors: dict[str, str] = {}
        self.paths: dict[int, set[str]] = {}

    def add(
        self,
        layer: int | None,
        path: str | None,
        flops: sympy.Expr,
        read: sympy.Expr,
        written: sympy.Expr,
        cats: dict[str, sympy.Expr],
    ) -> None:
        self.flops.append(flops)
        self.read.append(read)
        self.written.append(written)
        self.per_layer_f.setdefault(layer, []).append(flops)
        self.per_layer_b.setdefault(layer, []).append(read + written)
        for c, f in cats.items():
            self.by_cat.setdefault(c, []).append(f)
        if layer is not None and path is not None:
            self.paths.setdefault(layer, set()).add(path)

    def summary(self) -> AnnotationSummary:
        s = lambda xs: sympy.expand(sympy.Add(*xs)) if xs else ZERO  # noqa: E731
        by_cat = {c: s(v) for c, v in self.by_cat.items()}
        fwd, rd, wr = s(self.flops), s(self.read), s(self.written)
        mm = sympy.expand(sympy.Add(*[by_cat.get(c, ZERO) for c in MATMUL_CATEGORIES]))
        per_f = {k: s(v) for k, v in self.per_layer_f.items()}
        per_b = {k: s(v) for k, v in self.per_layer_b.items()}
        syms = set().union(*[e.free_symbols for e in (fwd, rd, wr)])
        return AnnotationSummary(
            forward_flops=fwd,
            matmul_flops=mm,
            bytes_read=rd,
            bytes_written=wr,
            flops_per_layer=per_f,
            bytes_per_layer=per_b,
            flops_by_category=by_cat,
            no_flop_formula=frozenset(self.no_formula),
            formula_errors=dict(self.errors),
            layer_paths={k: tuple(sorted(v)) for k, v in self.paths.items()},
            symbols=frozenset(syms),
        )


def _subgraphs(gm: fx.GraphModule, node: fx.Node) -> list[fx.GraphModule]:
    subs = []
    for a in node.all_input_nodes:
        if a.op == "get_attr":
            try:
                obj = operator.attrgetter(a.target)(gm)
            except AttributeError:
                continue
            if isinstance(obj, fx.GraphModule):
                subs.append(obj)
    return subs


def _set(node: fx.Node, flops: sympy.Expr, read: sympy.Expr, written: sympy.Expr, out: sympy.Expr) -> None:
    node.meta[FLOPS] = flops
    node.meta[BYTES_READ] = read
    node.meta[BYTES_WRITTEN] = written
    node.meta[OUT_BYTES] = out


_COST = M.NODE_COST  # the NodeCost behind the keys (annotate(reuse=True) takes it as it is)


def _annotate(gm: fx.GraphModule, acc: _Acc, outer_layer: tuple[int | None, str | None] | None,
              reuse: bool = False) -> None:
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            v = node.meta.get("val")
            size = sympy.Add(*[nbytes(t) for t in _tensors(v)]) if _tensors(v) else ZERO
            _set(node, ZERO, ZERO, ZERO, size)
            continue
        if node.op != "call_function":
            _set(node, ZERO, ZERO, ZERO, ZERO)
            continue
        path = layer_path(node)
        layer = None if path is None else _layer_of_path(path)
        if layer is None and outer_layer is not None:
            layer, path = outer_layer
        subs = _subgraphs(gm, node) if isinstance(node.target, torch._ops.HigherOrderOperator) else []
        if subs:
            sub_acc = _Acc()
            for sub in subs:
                _annotate(sub, sub_acc, (layer, path))
            s = sub_acc.summary()
            base = node_cost(node)  # for OUT_BYTES of the HOP's outputs
            _set(node, s.forward_flops, s.bytes_read, s.bytes_written, base.out_bytes)
            acc.no_formula |= s.no_flop_formula
            acc.errors.update(s.formula_errors)
            for lyr, ps in s.layer_paths.items():
                acc.paths.setdefault(lyr, set()).update(ps)
            acc.add(layer, path, s.forward_flops, s.bytes_read, s.bytes_written, s.flops_by_category)
            continue
        c = node.meta.get(_COST) if reuse else None
        if c is None:
            c = node.meta[_COST] = node_cost(node)
        _set(node, c.flops, c.bytes_read, c.bytes_written, c.out_bytes)
        if not c.has_formula:
            acc.no_formula.add(op_name(node.target))
            if c.error is not None:
                acc.errors[op_name(node.target)] = c.error
        acc.add(layer, path, c.flops, c.bytes_read, c.bytes_written, {c.category: c.flops})


def annotate(gm: fx.GraphModule, reuse: bool = False) -> AnnotationSummary:
    """Set FLOPS, BYTES_READ, BYTES_WRITTEN and OUT_BYTES (sympy) on every node of ``gm`` (and of
    the subgraphs of its higher-order ops) and return the totals. Idempotent: re-running it
    overwrites the keys (run it again after a pass that inserts nodes). ``reuse``: a node annotated
    before keeps its cost (mcompile.sharding.repeat's copies of an annotated block: their FakeTensors are the
    block's, so their aliasing with the previous layer would read wrong)."""
    acc = _Acc()
    _annotate(gm, acc, None, reuse)
    return acc.summary()
