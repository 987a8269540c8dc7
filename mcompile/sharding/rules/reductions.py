"""Reductions and normalisations along dims.

Reducing over a sharded dim leaves each rank a partial result: ``sum`` -> Partial(sum), ``mean``
-> Partial(avg), ``amax`` -> Partial(max). Partial(avg) is offered only where the shards are equal: the
mean of unequal shards' means is not the mean, so a static dim the axis does not divide gets no such
strategy (a padded vocabulary arrives here at its true size). A symbolic dim (the sequence under sequence
parallelism) is taken to split evenly, as every sharded symbolic dim is. Softmax-like ops, norms and scans
along a dim (``cumsum``, ``diff``) keep a shard on any dim they do not work along.
"""

from __future__ import annotations

import torch

from mcompile.ir.placements import Partial, Shard
from mcompile.sharding.rules.base import OpInfo, R, Strategy, divisible, norm_dim, rule

aten = torch.ops.aten

_KIND = {
    aten.sum.dim_IntList: "sum", aten.sum.default: "sum", aten.mean.dim: "avg", aten.mean.default: "avg",
    aten.amax.default: "max", aten.amin.default: "min",
}


def _cur(info):
    return info.current[0] if info.current else R


def _dims(dims, nd: int) -> set[int]:
    """The dims a ``dim`` argument names (an int or a list; None or [] is every dim), normalised."""
    if dims is None or dims == []:
        return set(range(nd))
    return {norm_dim(d, nd) for d in ([dims] if isinstance(dims, int) else dims)}


def _out_dim(d: int, dims: set[int], keep: bool) -> int:
    """Where input dim d (not reduced) lands in the output of a reduction over ``dims``."""
    return d if keep else d - sum(1 for r in dims if r < d)


@rule(*_KIND)
def reduce(info: OpInfo) -> list[Strategy]:
    nd = info.inputs[0].ndim
    whole = info.op in (aten.sum.default, aten.mean.default)
    dims = _dims(None if whole else info.arg(1, "dim", None), nd)
    keep = info.arg(2, "keepdim", False) if info.op not in (aten.sum.default, aten.mean.default) else False
    kind = _KIND[info.op]
    out = []
    for d in range(nd):
        if d in dims:
            if kind == "avg" and not divisible(info.inputs[0].shape[d], info.n):
                info.notes.append(f"indivisible: a mean over dim {d} of size {info.inputs[0].shape[d]} split "
                                  f"over {info.n} ranks would average unequal shards")
                continue
            out.append(Strategy((Shard(d),), (Partial(kind),), name=f"reduce_{kind}"))
        else:
            out.append(Strategy((Shard(d),), (Shard(_out_dim(d, dims, keep)),), name="other_dim"))
    out.sort(key=lambda s: s.inputs[0] != _cur(info))
    if kind in ("sum", "avg") and info.outputs[0].dtype.is_floating_point:
        out.append(Strategy((Partial(),), (Partial(),), name="partial"))
    return out + [Strategy((R,), (R,), name="replicate")]


def _named(info: OpInfo, name: str, default=None):
    """An argument by its schema name, given positionally or as a keyword."""
    names = [a.name for a in info.op._schema.arguments]
    return info.arg(names.index(name), name, default) if name in names else default


@rule(aten.logsumexp.default, aten.var.dim, aten.std.dim,  # var / std.correction: DTensor's (the bridge)
      aten.all.dim, aten.any.dim, aten.all.dims, aten.any.dims, aten.all.default, aten.any.default)
def reduce_whole(info: OpInfo) -> list[Strategy]:
    """Reductions whose value over a split dim is no plain sum / mean / max of the pieces' (``logsumexp``:
    a log of the sum of exps; ``var`` / ``std``: squares about the whole mean; ``all`` / ``any``: a logical
    and / or, which no Partial expresses: BLT's patch check): a dim they reduce stays whole, any other dim may
    be sharded (Granite-SWA's attention sinks over the key dim with the heads
    split, an MoE router's z-loss over the experts with the tokens split over ep, xLSTM's group norm). No
    Partial: log and square are not linear. (A z-loss's per-token values averaged over tokens split over a
    data axis reach the per-layer list of losses as a Partial(avg) moved at the list: mcompile/sharding/repeat.py
    copies that move for every repeated layer, tests/test_repeat.py.)"""
    nd = info.inputs[0].ndim
    dims, keep = _dims(_named(info, "dim"), nd), _named(info, "keepdim", False)
    out = [Strategy((Shard(d),), (Shard(_out_dim(d, dims, keep)),), name="other_dim")
           for d in range(nd) if d not in dims]
    out.sort(key=lambda s: s.inputs[0] != _cur(info))
    return out + [Strategy((R,), (R,), name="replicate")]


_FFT = [aten.fft_fft.default, aten.fft_ifft.default, aten.fft_rfft.default, aten.fft_irfft.default,
        aten.fft_fft2.default, aten.fft_ifft2.default, aten.fft_fftn.default, aten.fft_ifftn.default,
        aten.fft_rfftn.default, aten.fft_irfftn.default]


@rule(*_FFT)
def fft(info: OpInfo) -> list[Strategy]:
    """A Fourier transform over some dims (FNet's ``fftn`` over sequence and hidden) mixes every element
    along them: only the dims it does not transform may be sharded. No Partial: a complex partial sum
    would need complex collectives."""
    nd = info.inputs[0].ndim
    names = [a.name for a in info.op._schema.arguments]
    default = info.op._schema.arguments[names.index("dim")].default_value
    dims = _named(info, "dim", default)
    if dims is None and _named(info, "s") is not None:  # fftn: the last len(s) dims (every dim without s)
        dims = list(range(nd - len(_named(info, "s")), nd))
    dims = _dims(dims, nd)
    out = [Strategy((Shard(d),), (Shard(d),), name="other_dim") for d in range(nd) if d not in dims]
    out.sort(key=lambda st: st.inputs[0] != _cur(info))
    return out + [Strategy((R,), (R,), name="replicate")]


@rule(aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int)
def softmax(info: OpInfo) -> list[Strategy]:
    nd = info.inputs[0].ndim
    dim = norm_dim(info.arg(1), nd)
    out = [Strategy((Shard(d),), (Shard(d),), name="other_dim") for d in range(nd) if d != dim]
    out.sort(key=lambda s: s.inputs[0] != _cur(info))
    return out + [Strategy((R,), (R,), name="replicate")]


@rule(aten.layer_norm.default, aten.rms_norm.default)
def layer_norm(info: OpInfo) -> list[Strategy]:
    nd = info.inputs[0].ndim
    normalized = len(info.arg(1))
    extra = len(info.inputs) - 1  # weight / bias when given
    out = [
        Strategy((Shard(d),) + (R,) * extra, (Shard(d),), name="other_dim")
        for d in range(nd - normalized)
    ]
    out.sort(key=lambda s: s.inputs[0] != _cur(info))
    return out + [Strategy((R,) * (1 + extra), (R,), name="replicate")]


@rule(aten.cumsum.default)
def cumsum(info: OpInfo) -> list[Strategy]:
    """A prefix sum along ``dim``: any other dim may be sharded; linear, so a Partial sum stays one
    (float only: an integer cumsum of pieces would be exact too, but ids are never Partial). ``dtype``
    is carried as it is."""
    nd = info.inputs[0].ndim
    dim = norm_dim(info.arg(1), nd)
    out = [Strategy((Shard(d),), (Shard(d),), name="other_dim") for d in range(nd) if d != dim]
    out.sort(key=lambda s: s.inputs[0] != _cur(info))
    if info.outputs[0].dtype.is_floating_point:
        out.append(Strategy((Partial(),), (Partial(),), name="partial"))
    return out + [Strategy((R,), (R,), name="replicate")]


@rule(aten.diff.default)
def diff(info: OpInfo) -> list[Strategy]:
    """``diff(x, n, dim, prepend, append)``: n-th forward differences along ``dim`` of
    ``cat(prepend, x, append)``. Any other dim may be sharded on every tensor input (``prepend`` and
    ``append`` match ``x`` off ``dim``). Linear in the concatenation, so Partial sums stay one when
    every input is Partial (floats: a bool diff is an xor)."""
    nd = info.inputs[0].ndim
    dim = norm_dim(info.arg(2, "dim", -1), nd)
    k = len(info.inputs)
    out = [Strategy((Shard(d),) * k, (Shard(d),), name="other_dim") for d in range(nd) if d != dim]
    out.sort(key=lambda s: s.inputs[0] != _cur(info))
    if info.outputs[0].dtype.is_floating_point:
        out.append(Strategy((Partial(),) * k, (Partial(),), name="partial"))
    return out + [Strategy((R,) * k, (R,), name="replicate")]


_ZEROS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}


@rule(aten.scatter_add.default)
def scatter_add(info: OpInfo) -> list[Strategy]:
    """``self.scatter_add(dim, index, src)``: index and src split on another dim than ``dim`` keep
    that split when self has it; split on ``dim`` itself into a self of zeros (a histogram, e.g. the
    tokens routed to each expert), each rank's sum is a Partial(sum) of the whole one — valid only
    because self is zero (every rank would add it once otherwise)."""
    nd = info.inputs[0].ndim
    dim = norm_dim(info.arg(1), nd)
    out = []
    src_nd = info.inputs[1].ndim
    self_node = info.node.args[0] if info.node is not None else None
    zero_self = getattr(self_node, "target", None) in _ZEROS or (
        getattr(self_node, "target", None) is aten.full.default and self_node.args[1] == 0)
    if zero_self:
        for d in range(src_nd):
            out.append(Strategy((R, Shard(d), Shard(d)), (Partial("sum"),), name="histogram"))
    for d in range(min(nd, src_nd)):
        if d != dim and info.inputs[0].shape[d] == info.inputs[1].shape[d]:
            out.append(Strategy((Shard(d), Shard(d), Shard(d)), (Shard(d),), name="other_dim"))
    return out + [Strategy((R, R, R), (R,), name="replicate")]


@rule(aten.scatter_reduce.two)
def scatter_reduce(info: OpInfo) -> list[Strategy]:
    """``self.scatter_reduce(dim, index, src, reduce, include_self)`` (BLT's max-pooling of bytes into patches):
    element ``i`` of ``index``/``src`` along any dim other than ``dim`` lands at ``i`` of ``self`` on that dim, so
    the three split alike there keep that split when their sizes agree. ``sum`` and ``mean`` are linear in
    ``self`` and ``src`` together (whether or not ``self`` is included, every rank hits the same places, the index
    being whole), so two Partial(sum)s give one; ``prod``, ``amax`` and ``amin`` are not."""
    nd = info.inputs[0].ndim
    dim = norm_dim(info.arg(1), nd)
    index, src = info.inputs[1], info.inputs[2]
    out = [Strategy((Shard(d),) * 3, (Shard(d),), name="other_dim")
           for d in range(nd) if d != dim and index.ndim == src.ndim == nd
           and info.inputs[0].shape[d] == index.shape[d] == src.shape[d]]
    out.sort(key=lambda s: s.inputs[0] != _cur(info))
    if info.outputs[0].dtype.is_floating_point and info.arg(4, "reduce") in ("sum", "mean"):
        out.append(Strategy((Partial(), R, Partial()), (Partial(),), name="partial"))
    return out + [Strategy((R, R, R), (R,), name="replicate")]


@rule(aten.index_add.default)
def index_add(info: OpInfo) -> list[Strategy]:
    """``self.index_add(dim, index, source)`` (JetMoE's experts' outputs added back to their tokens): linear in
    ``self`` and ``source`` together, so two Partial(sum)s give one; a ``self`` of zeros (adding it on every rank
    adds nothing) takes a Partial ``source`` whole. ``self`` and ``source`` split alike on a dim other than
    ``dim`` keep that split (the index, 1-D along ``dim``, is whole)."""
    nd = info.inputs[0].ndim
    dim = norm_dim(info.arg(1), nd)
    src = info.inputs[2]
    out = [Strategy((Shard(d), R, Shard(d)), (Shard(d),), name="other_dim")
           for d in range(nd) if d != dim and src.ndim == nd and src.shape[d] == info.inputs[0].shape[d]]
    out.sort(key=lambda s: s.inputs[0] != _cur(info))
    if info.outputs[0].dtype.is_floating_point:
        self_node = info.node.args[0] if info.node is not None else None
        if getattr(self_node, "target", None) in _ZEROS:
            out.append(Strategy((R, R, Partial()), (Partial(),), name="partial_into_zeros"))
        out.append(Strategy((Partial(), R, Partial()), (Partial(),), name="partial"))
    return out + [Strategy((R, R, R), (R,), name="replicate")]


@rule(aten.histc.default)
def histc(info: OpInfo) -> list[Strategy]:
    """A histogram with fixed bounds of a split input is the sum of the pieces' histograms (Partial);
    bounds taken from the data (min == max) are the data's own, so the input must be whole."""
    lo, hi = info.arg(2, "min", 0), info.arg(3, "max", 0)
    out = []
    if lo != hi:
        out = [Strategy((Shard(d),), (Partial("sum"),), name="histogram") for d in range(info.inputs[0].ndim)]
        out.sort(key=lambda s: s.inputs[0] != _cur(info))
    return out + [Strategy((R,), (R,), name="replicate")]


@rule(aten.one_hot.default)
def one_hot(info: OpInfo) -> list[Strategy]:
    """One class dim appended: every dim of the indices keeps its shard (a row's classes are its own)."""
    return [Strategy((Shard(d),), (Shard(d),), name=f"one_hot_S{d}") for d in range(info.inputs[0].ndim)] + [
        Strategy((R,), (R,), name="replicate")]


@rule(aten.nonzero.default, aten.where.default)
def nonzero(info: OpInfo) -> list[Strategy]:
    """The coordinates of the nonzero entries (how many: a data-dependent size) are the whole tensor's: the input
    must be whole (a piece's coordinates are local, its count partial). One-argument ``torch.where`` is nonzero
    as a tuple of one index tensor per dim (an eager MoE's token selection): each of them whole."""
    return [Strategy((R,), (R,) * len(info.outputs), name="replicate")]


def _pair(v, default) -> tuple:
    """A pooling argument as one value per spatial dim (an int, a 1-list or an empty stride mean the same
    for both)."""
    if v is None or (isinstance(v, list | tuple) and len(v) == 0):
        v = default
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    return v * 2 if len(v) == 1 else v


@rule(aten.max_pool2d.default)
def max_pool2d(info: OpInfo) -> list[Strategy]:
    """``max_pool2d(x, kernel, stride, padding, dilation, ceil_mode)`` over the last two dims of [N, C, H, W] or
    [C, H, W]: each window lies within one index of every other dim, so any leading dim may be split, and a
    spatial dim whose window is that one index (kernel 1, stride 1, no padding, dilation 1) too (Funnel pools
    its [b, 1, s, h] hidden states over the sequence with a (2, 1) window: the hidden dim stays split). No
    Partial: a max of sums is no sum of maxes."""
    nd = info.inputs[0].ndim
    kernel = _pair(info.arg(1, "kernel_size"), 1)
    stride = _pair(info.arg(2, "stride"), kernel)
    padding = _pair(info.arg(3, "padding", 0), 0)
    dilation = _pair(info.arg(4, "dilation", 1), 1)
    dims = list(range(nd - 2))
    dims += [nd - 2 + i for i in range(2) if (kernel[i], stride[i], padding[i], dilation[i]) == (1, 1, 0, 1)]
    out = [Strategy((Shard(d),), (Shard(d),), name="other_dim") for d in dims]
    out.sort(key=lambda s: s.inputs[0] != _cur(info))
    return out + [Strategy((R,), (R,), name="replicate")]
