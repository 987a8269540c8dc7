"""The ``moe_ffn`` op: a routed mixture-of-experts feed-forward as one node (issue 15).

``moe_ffn(x, idx, weights, *expert_weights, form=...)`` computes
``y[t] = sum_j weights[t, j] * FFN_{idx[t, j]}(x[t])``; ``form`` (:class:`ExpertForm`) says how the
expert weights are read. passes/ep/find_moe.py finds MoE regions in captured graphs and replaces each with
this node; the planner shards it as a unit (its rule: :mod:`mcompile.sharding.rules.moe`); the lowering runs it as
local grouped GEMMs (:func:`moe_local`, ordinary aten ops under tracing) or, over an ``ep`` axis, as the
all-to-all dispatch of :mod:`mcompile.runtime.moe`.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

aten = torch.ops.aten
__all__ = ["ExpertForm", "expert_ffn", "moe_local", "moe_ffn", "moe_layers_of", "moe_reference"]

_ACTS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda t: F.relu(t).square(),  # squared ReLU (So et al. 2021, Primer; NemotronH's and Ergo's experts)
}
_ACT_OPS = {aten.silu.default: "silu", aten.gelu.default: "gelu", aten.relu.default: "relu"}


def _oai(text: str):
    """``oai:ALPHA:LIMIT``, gpt-oss's clamped SwiGLU: gate clamped above at LIMIT, up to [-LIMIT, LIMIT],
    ``(up + 1) * gate * sigmoid(ALPHA * gate)`` (OpenAI's gpt-oss model card, 2025); None for another act."""
    if not text.startswith("oai:"):
        return None
    _, alpha, limit = text.split(":")
    return float(alpha), float(limit)


def _softcap(text: str):
    """``softcap:G:U``, a SwiGLU whose linear factors are soft-capped: ``cap_G(gate) * sigmoid(gate) *
    cap_U(up)`` with ``cap_c(t) = c * tanh(t / c)`` (the sigmoid sees the raw gate; Inkling2's experts; the
    tanh soft cap of Gemma 2's logits, Gemma Team 2024); None for another act."""
    if not text.startswith("softcap:"):
        return None
    _, gate_cap, up_cap = text.split(":")
    return float(gate_cap), float(up_cap)


def gated_only(act: str) -> bool:
    """An activation of a gate and an up projection together (no form without a gate runs it)."""
    return _oai(act) is not None or _softcap(act) is not None


@dataclass(frozen=True)
class ExpertForm:
    """How one expert's FFN reads its weights. ``kind``: ``sep`` (gate, up, down), ``fused_gu`` /
    ``fused_ug`` (one [gate; up] or [up; gate] weight, then down), ``fused_il`` (one weight whose output
    features interleave gate and up: gate = ``h[..., 0::2]``, up = ``h[..., 1::2]``; gpt-oss), ``plain``
    (up, down: no gate). ``transposed``: weights stored (E, in, out) (``x @ w``) rather than (E, out, in)
    (``x @ w.T``). ``bias``: the input projections (gate and up, or the fused one, or plain's up) add a
    per-expert bias ``[E, out]``, given after the weight matrices (a down projection's bias is no part of
    the node: passes/ep/find_moe.py adds ``sum_j w[t, j] * b[idx[t, j]]`` beside it, an ordinary gather the planner
    places like any other, so an expert-TP output stays a plain partial sum). ``act``: a name of
    ``_ACTS``, or ``oai:ALPHA:LIMIT`` (:func:`_oai`) or ``softcap:G:U`` (:func:`_softcap`), gated kinds only."""

    act: str
    kind: str
    transposed: bool
    bias: bool = False

    def text(self) -> str:
        return f"{self.act}/{self.kind}/{'io' if self.transposed else 'oi'}{'+b' if self.bias else ''}"

    @classmethod
    def parse(cls, text: str) -> ExpertForm:
        act, kind, layout = text.split("/")
        layout, plus, _ = layout.partition("+b")
        return cls(act, kind, layout == "io", bool(plus))

    @property
    def n_matrices(self) -> int:
        return 3 if self.kind == "sep" else 2

    @property
    def n_weights(self) -> int:
        """The node's expert tensors: the weight matrices, then the input projections' biases."""
        return self.n_matrices + (self.n_matrices - 1 if self.bias else 0)

    def hidden_dims(self) -> tuple[int, ...]:
        """Per expert tensor, the dim that holds the expert's hidden units (what expert-TP shards)."""
        inner, outer = (2, 1) if self.transposed else (1, 2)
        mats = (inner, inner, outer) if self.kind == "sep" else (inner, outer)
        return mats + (1,) * (self.n_weights - len(mats))

    def gated(self, h: torch.Tensor) -> torch.Tensor:
        """A fused input projection's output -> the expert's hidden activation."""
        if self.kind == "fused_il":
            gate, up = h[..., 0::2], h[..., 1::2]
        else:
            a, b = h.chunk(2, dim=-1)
            gate, up = (a, b) if self.kind == "fused_gu" else (b, a)
        return self.glu(gate, up)

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        oai = _oai(self.act)
        if oai is not None:
            alpha, limit = oai
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
            return (up + 1) * (gate * torch.sigmoid(gate * alpha))
        caps = _softcap(self.act)
        if caps is not None:
            gate_cap, up_cap = caps
            return torch.tanh(gate / gate_cap) * gate_cap * torch.sigmoid(gate) * (torch.tanh(up / up_cap) * up_cap)
        return _ACTS[self.act](gate) * up


def expert_ffn(xs: torch.Tensor, ws: list[torch.Tensor], form: ExpertForm, offs: torch.Tensor,
               grouped=None) -> torch.Tensor:
    """The experts on rows ``xs`` grouped by expert (group ends ``offs``): (N, d) -> (N, d)."""
    if grouped is None:
        # one grouped GEMM per projection (kernels/grouped_gemm.py): its Triton kernels on CUDA, torch._grouped_mm
        # (padded to its alignment) on the CPU
        from mcompile.kernels.grouped_gemm import experts_mm as grouped
    nm = form.n_matrices
    mats, biases = ws[:nm], ws[nm:]
    eid = None
    if biases:  # each row's expert, from the group ends: row r belongs to the first group ending after r
        rows = torch.arange(xs.shape[0], device=xs.device, dtype=offs.dtype)
        eid = torch.searchsorted(offs, rows, right=True).clamp_max(mats[0].shape[0] - 1)

    def lin(x, j):
        w = mats[j]
        out = grouped(x, w if form.transposed else w.transpose(1, 2), offs)
        return out + biases[j][eid].to(out.dtype) if j < len(biases) else out

    if form.kind == "sep":
        h = form.glu(lin(xs, 0), lin(xs, 1))
    elif form.kind.startswith("fused"):
        h = form.gated(lin(xs, 0))
    else:
        h = _ACTS[form.act](lin(xs, 0))
    return lin(h, nm - 1)


def moe_local(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, ws: list[torch.Tensor],
              form: ExpertForm) -> torch.Tensor:
    """``y[t] = sum_j weights[t, j] * FFN_{idx[t, j]}(x[t])`` with every expert local: the slots sorted
    by expert (stable), rows gathered, one grouped GEMM per projection, weighted, added back.
    Static shapes only (traceable with symbolic token counts)."""
    E, k = ws[0].shape[0], idx.shape[1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = torch.div(order, k, rounding_mode="floor")
    counts = torch.zeros(E, dtype=torch.long, device=flat.device).scatter_add(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0)
    ys = expert_ffn(x[token], ws, form, offs)
    ys = ys * weights.reshape(-1)[order].unsqueeze(-1).to(ys.dtype)
    return torch.zeros_like(x).index_add(0, token, ys.to(x.dtype))


def moe_ffn(x, idx, weights, *ws, form: str):
    """The node the pass leaves in the captured graph (see the module docstring)."""
    return moe_local(x, idx, weights, list(ws), ExpertForm.parse(form))


def moe_layers_of(gm) -> list:
    """The graph's ``moe_ffn`` nodes (what passes/ep/find_moe.py left), in order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is moe_ffn]


def moe_reference(x, idx, weights, ws, form: ExpertForm, down_bias=None) -> torch.Tensor:
    """An independent oracle: a Python loop over the experts with masks (tests and verification);
    ``down_bias`` ([E, d]): the down projection's bias, added per routed slot."""
    E = ws[0].shape[0]
    nm = form.n_matrices
    mats, biases = ws[:nm], ws[nm:]
    out = torch.zeros_like(x)
    for e in range(E):
        hit = idx == e
        rows = hit.any(1).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        w_e = [w[e] if form.transposed else w[e].t() for w in mats]  # (in, out)
        b_e = [b[e] for b in biases] + [0] * (nm - len(biases))
        xe = x[rows]
        if form.kind == "sep":
            h = form.glu(xe @ w_e[0] + b_e[0], xe @ w_e[1] + b_e[1])
        elif form.kind.startswith("fused"):
            h = form.gated(xe @ w_e[0] + b_e[0])
        else:
            h = _ACTS[form.act](xe @ w_e[0] + b_e[0])
        ye = h @ w_e[-1]
        if down_bias is not None:
            ye = ye + down_bias[e]
        scale = (weights * hit).sum(1)[rows].unsqueeze(1).to(ye.dtype)
        out = out.index_add(0, rows, (ye * scale).to(x.dtype))
    return out


def _flops(args, kwargs, out):
    """Every routed slot runs one expert: 2 FLOPs per weight element per slot (T * k * sum of the
    expert weights' per-expert sizes), the grouped GEMMs' work; the gather, weighting and scatter are
    memory traffic. Megatron's MoE FLOPs count the same k experts per token."""
    from mcompile.ir.annotate import numel, shape_of

    T, k = shape_of(args[1])
    per_expert = sum(numel(w) / shape_of(w)[0] for w in args[3:])
    return 2 * T * k * per_expert


def _register() -> None:
    from mcompile.ir.annotate import register_flop_formula

    register_flop_formula(moe_ffn, category="matmul")(_flops)


_register()


# --------------------------------------------------------------------------- expert parallelism

def _rank_key():
    """The communicator bound for this rank (``ops.bind``): the in-process simulator runs several ranks
    as threads of one process, so per-rank state is kept per communicator (None: none bound)."""
    from mcompile.ir import ops

    try:
        return ops.current()
    except RuntimeError:
        return None


def _handle_key(handle: torch.Tensor) -> tuple:
    """The stash key of an ``moe_ep`` handle: where its one element lives, not its value — reading a device
    tensor's value would stall the host on a GPU. Distinct among live handles (each holds its own
    allocation from its forward to its backward, which saves it); a dead handle's address reused by a
    new forward replaces the stale entry (a forward without backward), as :meth:`_Stash.put` does."""
    return handle.device.type, handle.device.index, handle.data_ptr()


class _Stash:
    """What an ``moe_ep`` forward keeps for its backward, behind the int64 handle it returns: the
    routing permutations and split sizes (data-dependent sizes, which a traced program cannot
    carry) and the local experts' autograd graph. Entries go when their backward runs;
    :func:`clear_stash` drops the rest of a rank's (a forward without backward: evaluation)."""

    def __init__(self) -> None:
        self.items: dict[tuple, dict] = {}
        self.owner: dict[tuple, object] = {}
        self.lock = threading.Lock()

    def put(self, key: tuple, item: dict) -> None:
        with self.lock:
            self.items[key] = item
            self.owner[key] = _rank_key()

    def clear(self, owner) -> None:
        with self.lock:
            for h in [h for h, o in self.owner.items() if o is owner]:
                self.items.pop(h, None)
                self.owner.pop(h, None)

    def pop(self, handle: tuple) -> dict:
        try:
            with self.lock:
                self.owner.pop(handle, None)
                return self.items.pop(handle)
        except KeyError:
            raise RuntimeError(f"moe_ep backward: no forward state under handle {handle} (was the step's forward "
                               "run twice, or the stash cleared between forward and backward?)") from None


STASH = _Stash()


def clear_stash(comm=None) -> None:
    """Drop what ``comm``'s rank (default: the bound communicator's) stashed, and reset its dropped count."""
    comm = comm if comm is not None else _rank_key()
    STASH.clear(comm)
    MoEStats.reset(comm)


def _a2a(x: torch.Tensor, out_rows: list[int], in_rows: list[int], axis: str) -> torch.Tensor:
    from mcompile.ir import ops

    return ops.current().all_to_all(x.contiguous(), out_rows, in_rows, axis)


def _local_experts(form: ExpertForm, offs: torch.Tensor):
    """The local experts as a function of (rows grouped by local expert, *expert weights), for
    ``torch.func.vjp``: inside a custom op autograd records nothing, so the backward comes from the vjp."""
    def run(xl, *lw):
        return expert_ffn(xl, list(lw), form, offs)

    return run


def capacity_keep(idx: torch.Tensor, n_experts: int, factor: float) -> torch.Tensor:
    """(T, k) bool: the routed slots an expert takes under a capacity of ``ceil(factor * T * k / E)``
    slots (GShard, Lepikhin et al. 2020; Megatron's ``--moe-expert-capacity-factor`` with the
    "position" drop policy: an expert keeps its first slots in token order, the rest are dropped:
    their tokens get nothing from it). ``factor <= 0``: dropless, every slot kept."""
    T, k = idx.shape
    if factor <= 0:
        return torch.ones_like(idx, dtype=torch.bool)
    cap = math.ceil(factor * T * k / n_experts)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    starts = torch.cumsum(counts, 0) - counts  # (bincount would read its size back from the device)
    place = torch.empty_like(flat)
    place[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    return (place < cap).view(T, k)


class MoEStats:
    """Routed slots dropped by capacity, per rank (per bound communicator), since :meth:`reset` (the
    runtime resets it at every train_step: ``pm.moe_dropped`` is this rank's count of the last step)."""

    _by_rank: dict = {}
    _lock = threading.Lock()

    @classmethod
    def add(cls, n: int) -> None:
        key = _rank_key()
        with cls._lock:
            cls._by_rank[key] = cls._by_rank.get(key, 0) + n

    @classmethod
    def of(cls, comm) -> int:
        """``comm``'s rank's count."""
        with cls._lock:
            return cls._by_rank.get(comm, 0)

    @classmethod
    def total(cls) -> int:
        """Every rank's (of this process: the simulator's ranks together)."""
        with cls._lock:
            return sum(cls._by_rank.values())

    @classmethod
    def reset(cls, comm=None) -> None:
        """Zero ``comm``'s count (None: every rank's)."""
        with cls._lock:
            if comm is None:
                cls._by_rank.clear()
            else:
                cls._by_rank.pop(comm, None)


def _routed(idx: torch.Tensor, n_experts: int, capacity: float, lo: int = 0, n_local: int | None = None):
    """The routed slots sorted for dispatch, on the device: ``order`` (every slot, the kept ones of experts
    ``[lo, lo + n_local)`` first, by expert, in token order within one), ``counts`` (kept slots per expert of
    that range) and ``dropped`` (slots the capacity drops, a 0-d tensor; None when dropless). Sorting on a
    key (the sentinel ``n_local`` after every expert for a slot not kept) gives fixed-size outputs: no
    boolean mask, no data-dependent size (a device sync each on a GPU)."""
    n_local = n_experts if n_local is None else n_local
    flat = idx.reshape(-1)
    key = flat - lo
    mine = (key >= 0) & (key < n_local)  # (a slot dropped before the gather is routed to -1)
    dropped = None
    if capacity > 0:
        keep = capacity_keep(idx, n_experts, capacity).reshape(-1)
        dropped = (~keep).sum()
        mine = mine & keep
    key = torch.where(mine, key, n_local)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(n_local + 1, dtype=torch.long, device=flat.device).scatter_add_(0, key, torch.ones_like(key))
    return order, counts[:n_local], dropped


def _alltoall_forward(x, idx, weights, ws, form, n_experts, axis, n, capacity):
    """Megatron's all-to-all token dispatcher (Megatron Core ``MoEAlltoAllTokenDispatcher``, our
    code): each rank holds experts ``[r E/n, (r+1) E/n)``. The (token, choice) slots are sorted by
    expert (so by destination rank); the counts per expert are exchanged first (one all-to-all of
    E integers), then the tokens (all-to-all with variable splits), grouped by local expert on
    arrival, run through the local experts as grouped GEMMs, sent back (the second all-to-all),
    weighted and added to their tokens.

    Host reads of device values: exactly one per call (a layer's forward, per microbatch), none in its
    backward. ``all_to_all_single`` takes its split sizes as host integers, so the rows sent to and
    received from each rank (2n integers, with the dropped count under a capacity) come back in one
    device-to-host transfer; everything else is sized from shapes or from those integers (the
    receive-side ``repeat_interleave`` gets its ``output_size``). At ``n == 1`` and dropless, the one
    split is every slot (T k, a shape): no read at all."""
    from mcompile.ir import ops

    comm = ops.current()
    E_l, k = n_experts // n, idx.shape[1]
    order, counts, dropped = _routed(idx, n_experts, capacity)
    recv = comm.all_to_all(counts.view(n, E_l).contiguous(), [1] * n, [1] * n, axis)  # (n, E_l): from s to my e
    if n == 1 and dropped is None:
        send_rows = recv_rows = [order.numel()]
    else:
        sizes = [counts.view(n, E_l).sum(1), recv.sum(1)] + ([dropped.view(1)] if dropped is not None else [])
        sizes = torch.cat(sizes).tolist()  # the one host read (see the docstring)
        send_rows, recv_rows = sizes[:n], sizes[n:2 * n]
        if dropped is not None:
            MoEStats.add(sizes[2 * n])
            order = order[:sum(send_rows)]  # the kept slots sort first: dropped slots are not sent
    token = torch.div(order, k, rounding_mode="floor")
    xr = _a2a(x[token], recv_rows, send_rows, axis)
    expert_of_row = torch.repeat_interleave(torch.arange(E_l, device=x.device).repeat(n), recv.reshape(-1),
                                            output_size=sum(recv_rows))
    perm = torch.argsort(expert_of_row, stable=True)
    yl, vjp = torch.func.vjp(_local_experts(form, torch.cumsum(recv.sum(0), 0)), xr[perm], *ws)
    yr = torch.empty_like(yl)
    yr[perm] = yl
    ys = _a2a(yr, send_rows, recv_rows, axis)
    wsorted = weights.reshape(-1)[order]
    out = torch.zeros_like(x).index_add(0, token, (ys * wsorted.unsqueeze(-1).to(ys.dtype)).to(x.dtype))
    return out, {"kind": "alltoall", "order": order, "token": token, "send": send_rows, "recv": recv_rows,
                 "perm": perm, "ys": ys, "wsorted": wsorted, "vjp": vjp, "shape": weights.shape}


def _alltoall_backward(g, state, axis: str):
    order, token, perm = state["order"], state["token"], state["perm"]
    send_rows, recv_rows = state["send"], state["recv"]
    ys, wsorted = state["ys"], state["wsorted"]
    gt = g[token].to(ys.dtype)
    dweights = torch.zeros(state["shape"].numel(), dtype=wsorted.dtype, device=g.device)
    dweights = dweights.index_put_((order,), (gt * ys).sum(-1).to(wsorted.dtype)).view(state["shape"])
    gyr = _a2a(gt * wsorted.unsqueeze(-1).to(ys.dtype), recv_rows, send_rows, axis)
    dxl, *dws = state["vjp"](gyr[perm].contiguous())
    dxr = torch.empty_like(dxl)
    dxr[perm] = dxl
    dxs = _a2a(dxr, send_rows, recv_rows, axis)
    dx = torch.zeros(g.shape, dtype=dxs.dtype, device=g.device).index_add(0, token, dxs).to(g.dtype)
    return dx, dweights, list(dws)


def _allgather_forward(x, idx, weights, ws, form, n_experts, axis, n, capacity):
    """Megatron's all-gather token dispatcher (``MoEAllGatherTokenDispatcher``), for small ep: every
    rank gathers all ranks' tokens, routings and weights, runs its own experts on the slots routed to
    them, and the outputs are reduce-scattered back (each slot is computed on exactly one rank). No
    data-dependent split sizes, more bytes: ``n`` times the tokens instead of the routed slots.

    Host reads: one per call, none in backward: the number of gathered slots routed to this rank's
    experts (with the dropped count under a capacity, in the same transfer), which sizes the rows the
    local experts run on."""
    from mcompile.ir import ops

    comm = ops.current()
    E_l, k = n_experts // n, idx.shape[1]
    keep = capacity_keep(idx, n_experts, capacity)
    x_all = comm.all_gather(x.contiguous(), 0, axis)
    idx_all = comm.all_gather(torch.where(keep, idx, -1).contiguous(), 0, axis)
    w_all = comm.all_gather(weights.contiguous(), 0, axis).reshape(-1)
    lo = comm.rank(axis) * E_l
    order, counts, _ = _routed(idx_all, n_experts, 0.0, lo, E_l)  # a dropped slot's -1 is no expert of mine
    sizes = [counts.sum().view(1)] + ([(~keep).sum().view(1)] if capacity > 0 else [])
    sizes = torch.cat(sizes).tolist()  # the one host read (see the docstring)
    if capacity > 0:
        MoEStats.add(sizes[1])
    order = order[:sizes[0]]  # this rank's slots sort first
    token = torch.div(order, k, rounding_mode="floor")
    offs = torch.cumsum(counts, 0)
    yl, vjp = torch.func.vjp(_local_experts(form, offs), x_all[token], *ws)
    wsorted = w_all[order]
    out_all = torch.zeros_like(x_all).index_add(0, token, (yl * wsorted.unsqueeze(-1).to(yl.dtype)).to(x.dtype))
    out = comm.reduce_scatter(out_all, 0, axis)
    return out, {"kind": "allgather", "order": order, "token": token, "ys": yl, "wsorted": wsorted, "vjp": vjp,
                 "rows": x_all.shape[0], "k": k}


def _allgather_backward(g, state, axis: str):
    from mcompile.ir import ops

    comm = ops.current()
    order, token, ys, wsorted = state["order"], state["token"], state["ys"], state["wsorted"]
    gt = comm.all_gather(g.contiguous(), 0, axis)[token].to(ys.dtype)
    dw_all = torch.zeros(state["rows"] * state["k"], dtype=wsorted.dtype, device=g.device)
    dw_all = dw_all.index_put_((order,), (gt * ys).sum(-1).to(wsorted.dtype)).view(state["rows"], state["k"])
    dweights = comm.reduce_scatter(dw_all, 0, axis)
    dxs, *dws = state["vjp"]((gt * wsorted.unsqueeze(-1).to(ys.dtype)).contiguous())
    dx_all = torch.zeros((state["rows"], g.shape[1]), dtype=dxs.dtype, device=g.device).index_add(0, token, dxs)
    return comm.reduce_scatter(dx_all, 0, axis).to(g.dtype), dweights, list(dws)


_DISPATCHERS = {"alltoall": (_alltoall_forward, _alltoall_backward),
                "allgather": (_allgather_forward, _allgather_backward)}


@torch.library.custom_op("mcompile::moe_ep", mutates_args=())
def moe_ep(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, ws: list[torch.Tensor], form: str,
           n_experts: int, axis: str, n: int, dispatcher: str, capacity: float) -> tuple[torch.Tensor, torch.Tensor]:
    forward, _ = _DISPATCHERS[dispatcher]
    out, state = forward(x, idx, weights, ws, ExpertForm.parse(form), n_experts, axis, n, capacity)
    handle = x.new_empty((1,), dtype=torch.int64)  # on x's device, as the fake says; its value is never read
    STASH.put(_handle_key(handle), state)
    return out, handle


@moe_ep.register_fake
def _(x, idx, weights, ws, form, n_experts, axis, n, dispatcher, capacity):
    return torch.empty_like(x), x.new_empty((1,), dtype=torch.int64)


@torch.library.custom_op("mcompile::moe_ep_backward", mutates_args=())
def moe_ep_backward(g: torch.Tensor, handle: torch.Tensor, weights: torch.Tensor, ws: list[torch.Tensor],
                    axis: str) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    state = STASH.pop(_handle_key(handle))
    return _DISPATCHERS[state["kind"]][1](g, state, axis)


@moe_ep_backward.register_fake
def _(g, handle, weights, ws, axis):
    return torch.empty_like(g), torch.empty_like(weights), [torch.empty_like(w) for w in ws]


def _ep_setup(ctx, inputs, output):
    ctx.axis = inputs[6]
    ctx.save_for_backward(output[1], inputs[2], *inputs[3])


def _ep_backward(ctx, g, _g_handle):
    handle, weights, *ws = ctx.saved_tensors
    dx, dweights, dws = moe_ep_backward(g.contiguous(), handle, weights, list(ws), ctx.axis)
    return dx, None, dweights, list(dws), None, None, None, None, None, None


torch.library.register_autograd("mcompile::moe_ep", _ep_backward, setup_context=_ep_setup)


def moe_ep_call(x, idx, weights, *ws, form: str, n_experts: int, axis: str, n: int, dispatcher: str = "alltoall",
                capacity: float = 0.0):
    """What an ``ep`` lowering emits: the dispatch op's output (its handle goes to the backward)."""
    return moe_ep(x, idx, weights, list(ws), form, n_experts, axis, n, dispatcher, float(capacity))[0]
