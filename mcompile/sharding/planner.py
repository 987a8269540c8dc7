"""The Megatron-style planner: Megatron-LM's tensor/sequence-parallel layout, found from the graph.

No module names are consulted. The layout follows from the rules and one policy per mesh axis
(:class:`mcompile.sharding.propagate.AxisPolicy`):

- ``tp``: every weight of a linear/matmul/embedding must be sharded, and a weight takes the
  placement that runs its op where the activation already is — so a linear reading a replicated
  (or, under SP, gathered) activation becomes column-parallel, and one reading a feature-sharded
  activation becomes row-parallel (Shoeybi et al. 2019). Embeddings are vocab-parallel and the loss
  vocab-parallel. Activations may be sharded on static dims (features, heads, vocab) and, with
  sequence parallelism, on the sequence dim (Korthikanti et al. 2022); never on the batch.
- ``dp``: inputs split on the batch dim, parameters replicated.

What the planner adds on top: checks with messages that say what to do (tp not dividing heads,
kv heads, hidden sizes), vocabulary padding, user overrides, and the assembly of the Plan.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from mcompile.capture.export import BATCH, SEQ, Captured
from mcompile.ir.mesh import Mesh
from mcompile.ir.placements import BlockShard, Replicate, Shard, parse_placement
from mcompile.ir.plan import ParamPlan, Plan, PlanError, PlanOptions
from mcompile.sharding.propagate import (
    CONTRACTION_WEIGHT_ARGS,
    AxisPolicy,
    AxisResult,
    FallbackWarning,
    _contraction,
    _weight_of,
    propagate_axis,
)

aten = torch.ops.aten
R = Replicate()

__all__ = ["PlanError", "megatron_policies", "check_divisibility", "assemble_plan", "valid_sizes"]


def valid_sizes(dims: list[int], limit: int | None = None) -> list[int]:
    g = 0
    for d in dims:
        g = math.gcd(g, int(d))
    return [t for t in range(1, (limit or g) + 1) if g % t == 0] if g else [1]


def _sdpa_heads(cap: Captured) -> list[tuple[int, int, str, str]]:
    """(query heads, kv heads, source line, module path) of every attention."""
    out = []
    for n in cap.gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.scaled_dot_product_attention.default:
            q, k = n.args[0].meta["val"], n.args[1].meta["val"]
            if isinstance(q.shape[1], int) and isinstance(k.shape[1], int):
                out.append((int(q.shape[1]), int(k.shape[1]), _where(n), _module_path(n)))
    return out


def _module_path(node) -> str:
    """The innermost module the node was traced in ("" when unknown)."""
    stack = node.meta.get("nn_module_stack")
    if not isinstance(stack, dict) or not stack:
        return ""
    last = list(stack.values())[-1]
    path = last[0] if isinstance(last, tuple) and last and isinstance(last[0], str) else ""
    return path.removeprefix("L['self'].").removeprefix("L__self__.")


def _component(path: str) -> str:
    """The model's top-level part a module path belongs to ("vision_tower", "encoder", ...; "" at the top)."""
    head = path.split(".", 1)[0]
    return head if "." in path else ""


def _where(node) -> str:
    lines = (node.meta.get("stack_trace") or "").strip().splitlines()
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("File "):
            return line
    return ""


def _weights(cap: Captured) -> tuple[list[tuple[str, tuple, tuple]], int | None]:
    """(FQN, shape, the dims tp must divide) of contraction weights, and the hidden size (embedding dim) if
    any. A linear reading the user's input itself (LLaVA's patch embedding: 3 x 14 x 14 = 588 pixel values a
    patch) is column-parallel: its input dim is never split, so tp need not divide it. Nor a dim of size 1."""
    ws, hidden, vocab_params = [], None, set()
    dependent = set(cap.params)
    for n in cap.gm.graph.nodes:
        if n.op == "call_function" and any(a.name in dependent for a in n.all_input_nodes):
            dependent.add(n.name)
    for n in cap.gm.graph.nodes:
        if n.op != "call_function" or n.target not in CONTRACTION_WEIGHT_ARGS:
            continue
        for i in CONTRACTION_WEIGHT_ARGS[n.target]:
            w = n.args[i]
            if getattr(w, "name", None) in cap.params:
                shape = tuple(int(s) for s in w.meta["val"].shape)
                if n.target is aten.embedding.default:
                    hidden = shape[1]
                    vocab_params.add(w.name)
                elif w.name not in vocab_params:
                    x = n.args[0]
                    raw = n.target is aten.linear.default and isinstance(x, torch.fx.Node) and x.name not in dependent
                    # a size-1 dim (Qwen2-MoE's [1, h] shared-expert gate: a scalar gate) is never split: the
                    # weight stays whole on that dim, so tp need not divide it
                    ws.append((cap.params[w.name], shape, tuple(d for d in (shape[:-1] if raw else shape) if d != 1)))
    return ws, hidden


def check_divisibility(cap: Captured, tp: int) -> None:
    """Megatron's constraints, stated as a user would: tp must divide heads, kv heads, hidden sizes."""
    if tp == 1:
        return
    heads = _sdpa_heads(cap)
    weights, hidden = _weights(cap)
    # replicated over tp, so nothing of theirs to divide: low-rank latents, and MoE routers (one output per expert
    # or routing class: Zaya's 4 experts + a skip class score 5, which no tp divides)
    whole = {cap.params[n] for n in {**latent_hints(cap), **router_hints(cap), **selector_hints(cap)}}
    weights = [w for w in weights if w[0] not in whole]
    dims = [d for h, k, _, _ in heads for d in (h, k)] + [d for *_, s in weights for d in s]
    ok = valid_sizes(dims)
    components = {_component(path) for *_, path in heads}
    for h, k, where, path in heads:
        part = _component(path)
        # a model of several parts (a vision tower and a language model, an encoder and a decoder) names the
        # part whose heads do not divide, and the sizes that part alone allows
        of = (f" in {part!r} (attention {path}; valid tp sizes for {part!r} alone: "
              f"{_fmt(valid_sizes([d for hh, kk, _, pp in heads if _component(pp) == part for d in (hh, kk)]))})"
              if part and len(components) > 1 else "")
        at = f"Attention {path}: {where}" if path and not of else where
        if h % tp:
            raise PlanError(f"tp={tp} does not divide num_heads={h}{of}; valid tp sizes: {_fmt(ok)}. {at}")
        if k % tp:
            raise PlanError(
                f"tp={tp} does not divide num_kv_heads={k}{of} (Megatron shards kv heads too; replicating them "
                f"would cost an extra gradient all-reduce per layer); valid tp sizes: {_fmt(ok)}. {at}"
            )
    for n in cap.gm.graph.nodes:  # the Mamba-2 scan (kernels/ssd_scan.py): heads and B/C groups split together
        if n.op == "call_function" and str(n.target) == "mcompile.ssd_scan.default":
            h, g = int(n.args[0].meta["val"].shape[2]), int(n.args[3].meta["val"].shape[2])
            if h % tp or g % tp:
                what = f"the {h} SSM heads" if h % tp else f"the {g} B/C groups"
                raise PlanError(f"tp={tp} does not divide {what} of the Mamba-2 scan (ssd_scan, {_module_path(n)}): "
                                f"tp splits its heads and groups together (Megatron's MambaMixer); valid tp sizes: "
                                f"{_fmt(valid_sizes(dims + [h, g]))}")
    for fqn, shape, checked in weights:
        for d in checked:
            if d % tp:
                what = f"hidden={d}" if d == hidden else f"the size {d} of {fqn} {list(shape)}"
                raise PlanError(f"tp={tp} does not divide {what}; valid tp sizes: {_fmt(ok)}")


def check_experts(cap: Captured, ep: int) -> dict:
    """The expert weights' ep placement (FQN -> Shard(0)), after the checks a user needs: the model
    has MoE layers (passes/ep/find_moe.py found them), and ep divides every layer's number of experts."""
    from mcompile.ir.moe import moe_layers_of

    layers = moe_layers_of(cap.gm)
    if not layers:
        routed = [n for n in cap.gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.topk.default]
        hint = (f" It has {len(routed)} top-k node(s), but no routed expert computation was recognised around them "
                "(passes/ep/find_moe.py: expert weights stored as 3-D [experts, ...] parameters, combined by the "
                "routing "
                "weights)." if routed else "")
        raise PlanError(f"ep={ep}: the model has no mixture-of-experts layer, so there is nothing to shard over ep."
                        f"{hint} Use dp={ep} for data parallelism instead.")
    out: dict = {}
    for node in layers:
        experts = node.args[3:]
        E = int(experts[0].meta["val"].shape[0])
        if E % ep:
            ok = valid_sizes([E])
            raise PlanError(f"ep={ep} does not divide the {E} experts of {node.name} ({_where(node)}): each rank "
                            f"holds E/ep experts; valid ep sizes: {_fmt(ok)}")
        for a in experts:
            out[cap.params[a.name]] = Shard(0)
    return out


def _fmt(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes))


def _parse_overrides(overrides: dict | None, mesh: Mesh) -> tuple[dict, dict]:
    """{"param:FQN" or "node:NAME" or FQN: "tp=S(0),dp=R" or {"tp": Shard(0)}} -> per-axis dicts."""
    params: dict[str, dict] = {a: {} for a in mesh.axis_names}
    nodes: dict[str, dict] = {a: {} for a in mesh.axis_names}
    for key, spec in (overrides or {}).items():
        kind, _, name = key.partition(":") if key.startswith(("param:", "node:")) else ("param", "", key)
        if isinstance(spec, str):
            items = {}
            for part in spec.split(","):
                ax, _, pl = part.partition("=")
                items[ax.strip()] = parse_placement(pl)
        else:
            items = dict(spec)
        for ax, pl in items.items():
            if ax not in params:
                raise PlanError(f"override {key}: unknown mesh axis {ax!r}; the mesh has {', '.join(mesh.axis_names)}")
            (params if kind == "param" else nodes)[ax][name] = pl
    return params, nodes


_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default)
_THROUGH = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _viewed_apart(node: torch.fx.Node, val: torch.Tensor) -> bool:
    """Whether a view splits its input's last dim into (k, m, ...), k >= 2, and every reader picks parts along k
    (Moshi's ``fc1(x).view(b, s, 2, -1)`` then ``[..., 0, :]`` and ``[..., 1, :]``: a fused gate/up;
    ModernBERT's ``Wqkv(x).view(b, s, 3, heads, head_dim).unbind(dim=-3)``: a fused q/k/v)."""
    out = node.meta.get("val")
    k = val.ndim - 1  # the new dim that counts the parts
    if not isinstance(out, torch.Tensor) or out.ndim < val.ndim + 1 or not isinstance(out.shape[k], int) or \
            out.shape[k] < 2 or not all(isinstance(d, int) for d in out.shape[k + 1:]) or \
            str(out.shape[k] * math.prod(out.shape[k + 1:])) != str(val.shape[-1]) or \
            [str(d) for d in out.shape[:k]] != [str(d) for d in val.shape[:-1]]:
        return False
    return bool(node.users) and all(u.target in (aten.select.int, aten.unbind.int) and len(u.args) > 1 and
                                    u.args[1] % out.ndim == k for u in node.users)


def _feature_cuts(gm: torch.fx.GraphModule):
    """``(value, part sizes)`` for each value cut into two or more parts along its last dim: by a split /
    chunk / unbind, by slices that tile the dim (Phi-3's ``qkv[..., :q]``, ``[q:q+kv]``, ``[q+kv:]``), or by a view
    into (k, m) read part by part (Moshi's fused gate/up, :func:`_viewed_apart`). A cut of a transposed value
    along the dim that was its source's last counts as a cut of the source (LFM2's short conv:
    ``in_proj(x).transpose(-1, -2).chunk(3, dim=-2)`` into B, C and x)."""
    slices: dict = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.args[0], torch.fx.Node):
            continue
        x = node.args[0]
        val = x.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.ndim == 0:
            continue
        nd = val.ndim
        if node.target in _SPLITS:
            dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) if node.target is not \
                aten.unbind.int else (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0))
            sizes = [o.shape[dim] if node.target is not aten.unbind.int else 1 for o in node.meta["val"]]
            src = _last_dim_source(x, dim % nd)
            if src is None:  # a cut of heads the last dim was viewed into (Ergo's qkv [b, s, 4 + 2 + 2, hd])
                src, scale = _heads_view_source(x, dim % nd)
                sizes = [k * scale for k in sizes] if src is not None and all(isinstance(k, int) for k in sizes) \
                    else sizes
            if src is not None and len(sizes) >= 2:
                yield src, sizes
        elif node.target in _THROUGH and _viewed_apart(node, val):
            k = int(node.meta["val"].shape[val.ndim - 1])
            yield x, [val.shape[-1] // k] * k
        elif node.target is aten.slice.Tensor:
            dim, start = node.args[1] if len(node.args) > 1 else 0, node.args[2] if len(node.args) > 2 else 0
            end, step = node.args[3] if len(node.args) > 3 else None, node.args[4] if len(node.args) > 4 else 1
            n = val.shape[dim]
            if step == 1 and isinstance(n, int) and isinstance(start, int | None) and isinstance(end, int | None):
                slices.setdefault((x, dim % nd), set()).add((start or 0, n if end is None or end >= n else end))
    for (x, dim), bounds in slices.items():
        cuts = sorted(bounds)
        n = x.meta["val"].shape[dim]
        tiled = all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
        src = _last_dim_source(x, dim)
        if src is not None and len(cuts) >= 2 and cuts[0][0] == 0 and cuts[-1][1] == n and tiled:
            yield src, [b - a for a, b in cuts]


def _last_dim_source(x: torch.fx.Node, dim: int) -> torch.fx.Node | None:
    """The value whose last dim ``x``'s ``dim`` is: ``x`` itself when ``dim`` is its last, else the source of
    the transposes / permutes ``x`` was made by, when they moved that source's last dim to ``dim``."""
    while x.meta["val"].ndim - 1 != dim:
        if x.op != "call_function" or x.target not in (aten.transpose.int, aten.permute.default):
            return None
        nd = x.meta["val"].ndim
        if x.target is aten.transpose.int:
            a, b = x.args[1] % nd, x.args[2] % nd
            dim = b if dim == a else a if dim == b else dim
        else:
            dim = x.args[1][dim] % nd
        x = x.args[0]
    return x


def _heads_view_source(x: torch.fx.Node, dim: int) -> tuple[torch.fx.Node | None, int]:
    """``(source, m)`` when ``x`` is a view of ``source`` whose last dim it splits into ``dim`` and the static
    dims after it (their product ``m``: a head's size), the leading dims kept: a cut of ``x`` along ``dim`` into
    k, k', .. heads is a cut of the source's features into k*m, k'*m, ... Else ``(None, 1)``."""
    if x.op != "call_function" or x.target not in _THROUGH or not isinstance(x.args[0], torch.fx.Node):
        return None, 1
    out, src = x.meta["val"], x.args[0].meta.get("val")
    if not isinstance(src, torch.Tensor) or dim >= out.ndim - 1 or dim != src.ndim - 1:
        return None, 1
    rest = out.shape[dim + 1:]
    if not all(isinstance(d, int) for d in rest) or [str(d) for d in out.shape[:dim]] != \
            [str(d) for d in src.shape[:-1]] or str(out.shape[dim] * math.prod(rest)) != str(src.shape[-1]):
        return None, 1
    return _last_dim_source(x.args[0], src.ndim - 1), math.prod(rest)


_ENTRYWISE = (aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.mul.Scalar, aten.div.Scalar,
              aten._to_copy.default, aten.to.dtype)


def block_hints(cap: Captured) -> dict[str, object]:
    """Fused projections whose output is cut into parts along its features later: GPT-2's ``c_attn`` split
    into q, k, v; Phi-3's ``qkv_proj`` sliced into 4 query and 2 + 2 key/value heads; ``gate_up_proj``
    chunked into gate and up. Their weight (and bias) must shard each part, ``BlockShard`` (with the
    parts' size ratios when unequal), so the cut stays local and each rank holds its heads of q, k and
    v and its half of gate and up (Megatron's layout: otherwise the weight's plain rows put all of q on
    one rank, and every part is gathered before use). A value reached through a view that changes the
    last dim (GPT-NeoX's [b, s, heads, 3 * head_dim], cut per head) is not a fused projection's block
    layout: plain sharding by heads already keeps its cut local."""
    hints: dict[str, object] = {}
    for x, sizes in _feature_cuts(cap.gm):
        blocks = BlockShard(0, tuple(sizes) if all(isinstance(s, int) for s in sizes) else len(sizes))
        cur = x
        while isinstance(cur, torch.fx.Node) and cur.op == "call_function":
            if cur.target in _THROUGH:
                src = cur.args[0]
                if not isinstance(src, torch.fx.Node) or str(src.meta["val"].shape[-1]) != str(
                        cur.meta["val"].shape[-1]):
                    break  # the view regroups the cut dim: the parts are not blocks of the projection
                cur = src
            elif cur.target in _ENTRYWISE and isinstance(cur.args[0], torch.fx.Node):
                cur = cur.args[0]  # entry by entry, blocks stay blocks (DBRX's clip_qkv: Wqkv(x).clamp(...))
            elif cur.target is aten.add.Tensor:
                nxt = None
                for a in cur.args:
                    if getattr(a, "name", None) in cap.params and a.meta["val"].ndim == 1:
                        hints[a.name] = blocks
                    elif isinstance(a, torch.fx.Node):
                        nxt = a
                cur = nxt
            elif cur.target in (aten.linear.default, aten.matmul.default, aten.bmm.default):
                w = cur.args[1]
                if getattr(w, "name", None) in cap.params:
                    # linear: [out, in]; matmul / bmm: [.., in, out] (Llama-4's experts' gate_up_proj [E, H, 2I])
                    out = 0 if cur.target is aten.linear.default else w.meta["val"].ndim - 1
                    hints[w.name] = BlockShard(out, blocks.blocks)
                    if len(cur.args) > 2 and getattr(cur.args[2], "name", None) in cap.params:
                        hints[cur.args[2].name] = blocks
                break
            else:
                break
    return hints


def latent_hints(cap: Captured) -> dict[str, object]:
    """Low-rank down-projections that stay replicated over tp (Megatron's multi-head latent attention keeps
    linear_q_down_proj / linear_kv_down_proj whole): a linear whose whole output, before any other
    contraction, is normalised over its features (a latent with its own norm: sharding it would reduce the
    norm's statistics and make the up-projection row-parallel, two all-reduces for a small matmul) or is
    broadcast whole to every head (a key shared by the heads: MLA's decoupled RoPE key). A per-head norm
    (Qwen3's q_norm) or GQA's repeat_kv act on a head's slice, not the whole output, and do not count; nor
    does a norm whose output reaches attention before any projection (OLMo-2's k_norm over all of a GQA
    key's heads: the key itself, split by heads like the query, its norm's statistics all-reduced). A
    down-projection whose output is cut along its features counts when each part is so used (the KV latent
    and the rope key of one projection, :func:`_parts`). So does a low-rank factor read straight by an
    up-projection whose output is split into heads (:func:`_low_rank_to_heads`: Kimi-Linear's and GLM-5's
    forget gate ``f_b_proj(f_a_proj(h))`` and output gate ``g_b_proj(g_a_proj(h)).view(b, s, heads, d)``): the
    factor whole costs nothing, the up-projection column-parallel by heads; split, the pair is row-parallel and
    all-reduces a per-head gate the heads then read whole."""
    hints: dict[str, object] = {}
    cuts = {x: sizes for x, sizes in _feature_cuts(cap.gm)}
    for node, w, (width, fan_in) in _linears(cap):
        if fan_in <= width or _after_contraction(node.args[0]):
            continue  # not a down-projection, or the second half of a pair (an MLP's down, attention's out)
        if _used_whole(node, width, cap) or all(_used_whole(node, part, cap) for part in set(_parts(node, cuts))) \
                or _low_rank_to_heads(node, width, cap):
            _whole(hints, node, w, cap)
    return hints


_CASTS = (aten.to.dtype, aten._to_copy.default, aten.alias.default, aten.clone.default, aten.contiguous.default)


def _low_rank_to_heads(node: torch.fx.Node, width: int, cap: Captured) -> bool:
    """Whether every reader of ``node``'s output (through casts) is the input of a projection with ``width``
    input features whose output, before any other contraction, is viewed into heads: its last dim split
    into (k >= 2, d) with the leading dims kept."""
    todo, ups = [node], []
    while todo:
        cur = todo.pop()
        for u in cur.users:
            if u.op != "call_function" or u.target is aten._assert_tensor_metadata.default:
                continue
            if u.target in _CASTS:
                todo.append(u)
            elif u.target is aten.linear.default and u.args[0] is cur and _reads_weight(u, cap) \
                    and statically_known_true(u.args[1].meta["val"].shape[-1] == width):
                ups.append(u)
            else:
                return False
    return bool(ups) and all(_reaches(up, lambda v, x: _heads_view(v, x)) for up in ups)


def _heads_view(v: torch.fx.Node, x: torch.fx.Node) -> bool:
    """Whether the view ``v`` splits ``x``'s last dim into (k >= 2, d), keeping the dims before it."""
    if v.target not in _THROUGH:
        return False
    xv, out = x.meta.get("val"), v.meta.get("val")
    if not isinstance(xv, torch.Tensor) or not isinstance(out, torch.Tensor) or out.ndim != xv.ndim + 1:
        return False
    k, d = out.shape[-2], out.shape[-1]
    return isinstance(k, int) and isinstance(d, int) and k >= 2 and str(k * d) == str(xv.shape[-1]) and \
        [str(a) for a in out.shape[:-2]] == [str(a) for a in xv.shape[:-1]]


def _used_whole(node: torch.fx.Node, width: int, cap: Captured) -> bool:
    """Whether a value of ``width`` features computed from ``node`` (before any other contraction) is
    normalised over them on its way to a projection, or broadcast whole along a new or size-1 dim."""
    return _reaches(node, lambda u, cur: _whole_width(u, cur, width) and (
        u.target is aten.expand.default or _reaches(u, lambda v, _: _reads_weight(v, cap))))


def _parts(node: torch.fx.Node, cuts: dict) -> list:
    """The widths of the parts a linear's output is cut into along its features (through views that keep
    the last dim): Hugging Face DeepSeek-V3's ``kv_a_proj_with_mqa`` (the KV latent and the rope key in one
    projection) -> [the latent's rank, the rope key's width]; else [width]. A latent so cut is kept whole
    when every part is used whole: the latent normalised, the key broadcast to every head."""
    width, todo = node.meta["val"].shape[-1], [node]
    while todo:
        cur = todo.pop()
        if cur in cuts:
            return cuts[cur]
        todo += [u for u in cur.users if u.target in _THROUGH and u.meta["val"].shape[-1] == width]
    return [width]


_LINEAR = (aten.linear.default, aten.mm.default, aten.addmm.default, aten.matmul.default, aten.bmm.default)
_TO_WEIGHT = (*_THROUGH, aten.t.default, aten.transpose.int, aten.permute.default, aten._to_copy.default,
              aten.to.dtype)


def _reads_weight(n: torch.fx.Node, cap: Captured) -> bool:
    """Whether ``n`` is a projection: a matmul-like op with a parameter operand (through transposes,
    views and casts), as an up-projection reading a latent is and attention's q·kᵀ is not."""
    if n.target not in _LINEAR:
        return False
    for a in n.all_input_nodes:
        while a.op == "call_function" and a.target in _TO_WEIGHT:
            a = a.args[0]
        if a.name in cap.params:
            return True
    return False


_SHAPE_ONLY = (*_THROUGH, aten.transpose.int, aten.permute.default, aten.contiguous.default, aten.clone.default,
               aten.slice.Tensor, aten.unsqueeze.default, aten.squeeze.dim, aten.dropout.default)


def _attention_product(x: torch.fx.Node) -> bool:
    """Whether ``x`` is, short of views, a product of two activations (attention's probabilities times values:
    a matmul, bmm or einsum with no parameter operand, or fused attention). A sum of two such products is one
    attention's output in parts (PegasusX's block-local attention: the scores against the global tokens and
    against the block's own, each times its values, added), not a residual sum."""
    while x.op == "call_function" and x.target in _SHAPE_ONLY:
        x = x.args[0]
    if x.op != "call_function":
        return False
    if x.target is aten.scaled_dot_product_attention.default:
        return True
    if x.target not in _SCORES and not (x.target is aten.einsum.default and len(x.args[1]) == 2):
        return False
    for a in x.all_input_nodes:
        while a.op == "call_function" and a.target in _TO_WEIGHT:
            a = a.args[0]
        if a.op == "placeholder":
            return False  # a projection by a parameter (or of an input) is no attention product
    return True


def _beside_attention(operands) -> bool:
    """Whether an add of ``operands`` sums an attention product (:func:`_attention_product`) with a term of its
    own per-head shape ([b, heads, s, d]: the residual stream is never split by heads), so is one attention's
    output, not a residual sum: Nyströmformer's depthwise convolution of the values added to the attention
    (Xiong et al. 2021; Hugging Face's NystromformerSelfAttention.conv)."""
    shapes = [tuple(getattr(a.meta.get("val"), "shape", ())) for a in operands]
    return len(shapes[0]) == 4 and shapes[0] == shapes[1] and any(_attention_product(a) for a in operands)


def _after_contraction(x, whole: frozenset = frozenset()) -> bool:
    """Whether ``x`` is computed from a contraction (a linear, attention, a custom op such as a scan) by ops
    short of a residual sum: the input of an MLP's down-projection or attention's output projection is;
    the normalised residual stream a latent is projected from is not (an embedding counts as a source, and
    so does a linear whose weight is one of ``whole``, kept whole over tp: a latent, a router). An add of two
    attention products (:func:`_attention_product`), or of one and a term of its per-head shape
    (:func:`_beside_attention`), is one attention's output, not a residual sum."""
    todo, seen = [x], set()
    while todo:
        cur = todo.pop()
        if not isinstance(cur, torch.fx.Node) or cur in seen or cur.op != "call_function":
            continue
        seen.add(cur)
        if cur.target is aten.embedding.default or (cur.target is aten.linear.default and getattr(
                cur.args[1], "name", None) in whole):
            continue
        if _contraction(cur):
            return True
        # a multi-output node's value is a list (chunk -> getitem: Phi-3's gate_up_proj halves)
        tensors = [a for a in cur.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor | list | tuple)]
        if cur.target is aten.add.Tensor and len(tensors) == 2 and not any(
                a.op == "placeholder" and a.meta["val"].ndim == 1 for a in tensors) and \
                not all(_attention_product(a) for a in tensors) and not _beside_attention(tensors):
            continue  # a residual sum: the stream, not a projection's output (a 1-D parameter added is a bias)
        todo.extend(tensors)
    return False


_SCORES = (aten.matmul.default, aten.bmm.default)


_CASTS = (aten._to_copy.default, aten.to.dtype, aten.alias.default)


def _linears(cap: Captured):
    """``(node, weight placeholder, (out, in))`` of every linear whose weight is a 2-D parameter, read as it is
    or through a cast (DeepSeek-style routers' ``F.linear(x.float(), self.weight.float())``)."""
    for node in cap.gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        w = node.args[1]
        while isinstance(w, torch.fx.Node) and w.op == "call_function" and w.target in _CASTS:
            w = w.args[0]
        if getattr(w, "name", None) in cap.params and w.meta["val"].ndim == 2:
            yield node, w, tuple(int(d) for d in w.meta["val"].shape)


def _whole(hints: dict, node: torch.fx.Node, w: torch.fx.Node, cap: Captured):
    """Hint a linear's weight (and its bias) replicated."""
    hints[w.name] = R
    if len(node.args) > 2 and getattr(node.args[2], "name", None) in cap.params:
        hints[node.args[2].name] = R


def stacked_expert_hints(cap: Captured, tp: int) -> dict[str, object]:
    """Experts kept as one 2-D parameter and read as ``w.view(E, f, d)[e]`` (DBRX's ``w1``, ``v1``, ``w2``:
    [E * f, d]): each expert's rows are a block, ``BlockShard(0, E)``, so each rank holds its share of every
    expert's f hidden units (its view is ``Shard(1)`` of [E, f, d]) -- Megatron's expert layout under tp, each
    expert's input projections column-parallel and its output projection row-parallel -- rather than whole
    experts, which a rank that is routed a token does not hold. A parameter qualifies when every reader is
    such a view (E > 1) and f divides by tp."""
    hints: dict[str, object] = {}
    for node in cap.gm.graph.nodes:
        if node.op != "placeholder" or node.name not in cap.params or not node.users:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.ndim != 2 or not all(isinstance(s, int) for s in val.shape):
            continue
        shapes = set()
        for u in node.users:
            out = u.meta.get("val")
            if u.target not in _THROUGH or u.args[0] is not node or not isinstance(out, torch.Tensor) or out.ndim != 3:
                break
            shapes.add(tuple(out.shape))
        else:
            if len(shapes) == 1:
                e, f, d = next(iter(shapes))
                if isinstance(e, int) and e > 1 and f * e == val.shape[0] and d == val.shape[1] and f % tp == 0:
                    hints[node.name] = BlockShard(0, e)
    return hints


def router_hints(cap: Captured) -> dict[str, object]:
    """MoE routers stay replicated over tp, as Megatron keeps them (its TopKRouter's weight is whole and
    every tp rank routes its tokens from the full hidden state). A router is a linear whose scores reach,
    before any contraction, the expert choice and weights of an MoE layer (``moe_ffn``'s ``idx`` and
    ``weights``: through softmax or sigmoid, a score-correction bias, group-limited top-k's masked_fill),
    whatever its number of experts; or, where no MoE layer was found, a top-k (or top-1 ``argmax``: Switch
    Transformers, NLLB-MoE) over the scores of a linear to a few outputs (one per expert, at most half the
    input width). Sharded over its experts it would save nothing worth having and cost an all-gather of the
    scores per layer (and of each value of the routing computed from them)."""
    from mcompile.ir.moe import moe_ffn

    def routes(u, cur) -> bool:
        return u.target is moe_ffn and cur in u.args[1:3]

    hints: dict[str, object] = {}
    for node, w, (experts, width) in _linears(cap):
        if _reaches(node, routes, depth=16) or 2 * experts <= width and _reaches(
                node, lambda u, cur: u.target in (aten.topk.default, aten.argmax.default), depth=6):
            _whole(hints, node, w, cap)
    # an expert down projection's bias [E, d], read per routed slot beside moe_ffn (passes/ep/find_moe.py): whole, so
    # its
    # per-slot sum is added to the experts' output as the layer's one all-reduce leaves it (sharded over d it
    # would cost an all-gather of a token-sized value per layer)
    for node in moe_nodes(cap):
        for bias in _down_biases(node):
            if bias.name in cap.params:
                hints[bias.name] = R
    return hints


_STREAM_VIEWS = (*_THROUGH, aten.flatten.using_ints, aten.to.dtype, aten._to_copy.default, aten.alias.default,
                 aten.contiguous.default, aten.clone.default)


def stream_mix_hints(cap: Captured) -> dict[str, object]:
    """Hyper-connections' mixing projections stay replicated over tp (Zhu et al. 2024, "Hyper-Connections";
    DeepSeek-V4's and HY-V4's ``fn``: the n residual streams, flattened, projected to the 2n weights that mix
    them into a sub-block's input and its output back into the streams): a linear to at most half its input
    width whose output, short of another contraction, multiplies the very value it was projected from (the
    streams, before the flatten and casts). The streams are the residual stream, replicated as Megatron keeps
    it; their mixing weights are a few values a token, computed whole on every rank at no collective, where
    split over their handful of outputs they were gathered before each mix (one all-gather per sub-block)."""
    hints: dict[str, object] = {}
    for node, w, (width, fan_in) in _linears(cap):
        if 2 * width > fan_in:
            continue
        src, sources = node.args[0], set()
        while isinstance(src, torch.fx.Node):
            sources.add(src)
            if src.op != "call_function" or src.target not in _STREAM_VIEWS:
                break
            src = src.args[0]

        def mixes(u, cur, sources=frozenset(sources)) -> bool:
            return u.target is aten.mul.Tensor and any(a is not cur and a in sources for a in u.args)

        if _reaches(node, mixes, depth=8):
            _whole(hints, node, w, cap)
    return hints


def selector_hints(cap: Captured) -> dict[str, object]:
    """Token selectors stay replicated over tp: the projections of a top-k over per-head scores summed over
    the heads (DeepSeek sparse attention's lightning indexer, Liu et al. 2025 "DeepSeek-V3.2": its own
    small query heads, one shared key and a per-head weight score every key per query, ``sum_h w[s, h] *
    relu(q[s, h] . k[t])``, and keep the top-k keys for the main attention). Found from the graph: a top-k
    whose input is computed, through ops of the top-k's module short of a projection, from an
    activation-by-activation matmul (per-head scores) with more dims than the top-k reads (the heads summed
    away); every linear those ops start from whose output goes nowhere else (:func:`_only_into`) is kept
    whole. DeepSeek's own
    tensor-parallel inference keeps the indexer's ``wq_b``, ``wk`` and ``weights_proj`` whole on every rank
    (and asserts the ranks' indices agree): the inputs are already whole there (the residual stream, the
    query latent :func:`latent_hints` keeps whole), so the selection costs no collective and picks exactly
    the single-device keys. Split by heads it would cost an all-reduce of the summed scores per layer
    (``batch * seq * keys`` fp32: 64 MiB per 4096-token sequence and layer at DeepSeek-V3.2's size), and a
    rounding difference in that sum may flip a near-tie of the top-k. Left to the propagator (no hint), the
    shared key's features were split and gathered back: three more forward collectives a layer."""
    hints: dict[str, object] = {}
    for node in cap.gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.topk.default:
            continue
        x, where = node.args[0], _module_path(node)
        if not where:
            continue  # the selector's module unknown: nothing to bound it by
        ndim = x.meta["val"].ndim if isinstance(x.meta.get("val"), torch.Tensor) else None
        linears, per_head, todo, seen = [], False, [x], set()
        while todo:
            cur = todo.pop()
            if cur in seen or not isinstance(cur, torch.fx.Node) or cur.op != "call_function":
                continue
            path = _module_path(cur)
            if path != where and not path.startswith(where + "."):
                continue  # computed outside the selector's module (its inputs): a source
            seen.add(cur)
            if _reads_weight(cur, cap):
                linears.append(cur)
                continue
            if _contraction(cur) and cur.target not in _SCORES:
                continue  # attention, a scan, an embedding: a source, as a placeholder is
            val = cur.meta.get("val")
            if cur.target in _SCORES and isinstance(val, torch.Tensor) and ndim is not None and val.ndim > ndim:
                per_head = True
            todo.extend(cur.all_input_nodes)
        if per_head:
            for lin in linears:
                w = lin.args[1]
                while isinstance(w, torch.fx.Node) and w.op == "call_function" and w.target in _CASTS:
                    w = w.args[0]
                if lin.target is aten.linear.default and getattr(w, "name", None) in cap.params and \
                        _only_into(lin, seen, node):
                    _whole(hints, lin, w, cap)
    return hints


def _only_into(lin: torch.fx.Node, region: set, topk: torch.fx.Node) -> bool:
    """Whether everything computed from ``lin`` stays in ``region`` (the selector's ops) up to ``topk``: its
    own projections do, and a projection whose output also goes on elsewhere (an earlier layer's output
    projection, reached back through the residual stream) is no selector's."""
    todo, seen = [lin], set()
    while todo:
        for u in todo.pop().users:
            if u is topk or u in seen or not isinstance(u.meta.get("val"), torch.Tensor | list | tuple) and \
                    not u.users:
                continue  # the selection itself; export's metadata asserts
            if u not in region:
                return False
            seen.add(u)
            todo.append(u)
    return True


def moe_nodes(cap: Captured) -> list:
    from mcompile.ir.moe import moe_layers_of

    return moe_layers_of(cap.gm)


def _down_biases(moe: torch.fx.Node) -> list:
    """The [E, d] parameters passes/ep/find_moe.py reads per routed slot beside ``moe``, ``moe + sum_j w[t, j] *
    b[idx[t, j]]`` (a down projection's bias): the rows gathered with the node's own routing."""
    idx, w = moe.args[1], moe.args[2]
    out = []
    for add in moe.users:
        if add.target is not aten.add.Tensor:
            continue
        for other in add.args:
            n = other
            while isinstance(n, torch.fx.Node) and n.target in (aten._to_copy.default, aten.sum.dim_IntList,
                                                                 aten.mul.Tensor):
                if n.target is aten.mul.Tensor:
                    if not any(isinstance(a, torch.fx.Node) and w in a.all_input_nodes + [a] for a in n.args):
                        break
                    n = next((a for a in n.args if isinstance(a, torch.fx.Node)
                              and a.target is aten.index.Tensor), None)
                    break
                n = n.args[0]
            if isinstance(n, torch.fx.Node) and n.target is aten.index.Tensor and n.args[1] == [idx]:
                out.append(n.args[0])
    return out


def position_bias_hints(cap: Captured) -> dict[str, object]:
    """Tables of per-head score biases split by heads over tp (T5's relative position bias: an embedding
    [buckets, heads] looked up per (query, key) pair and added to the attention scores): Megatron shards it
    with the heads, so each rank adds its heads' bias where its heads' scores are. Found from the graph: an
    embedding whose output reaches, before any contraction, attention's mask (SDPA's attn_mask) or a sum
    with scores (a q·kᵀ product), with as many columns as that attention has heads."""
    hints: dict[str, object] = {}
    for node in cap.gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.embedding.default:
            continue
        w = node.args[0]
        if getattr(w, "name", None) not in cap.params or w.meta["val"].ndim != 2:
            continue
        heads = int(w.meta["val"].shape[1])
        if _reaches(node, lambda u, cur, heads=heads: _biases_scores(u, cur, heads), depth=16):
            hints[w.name] = Shard(1)
    hints.update(bias_bank_hints(cap))
    return hints


def bias_bank_hints(cap: Captured) -> dict[str, object]:
    """A bank of bias profiles every head mixes (Inkling's relative logits: ``[b, s, heads, d] @ proj[d, extent]``,
    gathered per (query, key) distance and added to the scores) is kept whole: the per-head states are split by
    heads with the scores they bias, and each rank mixes the whole bank for its heads, no collective (a weight
    sharded like a linear's would gather the heads' states before it and its profiles after it)."""
    hints: dict[str, object] = {}
    for node in cap.gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.matmul.default:
            continue
        x, w = node.args[0], node.args[1]
        if getattr(w, "name", None) not in cap.params or w.meta["val"].ndim != 2:
            continue
        xv = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if not isinstance(xv, torch.Tensor) or xv.ndim != 4 or not isinstance(xv.shape[2], int):
            continue
        heads = int(xv.shape[2])
        if _reaches(node, lambda u, cur, heads=heads: _biases_scores(u, cur, heads), depth=16):
            hints[w.name] = Replicate()
    return hints


def _gathered_biases(cap: Captured) -> list[tuple[torch.fx.Node, frozenset[str]]]:
    """Linears of the hidden states that make a table of relative-position score biases, ``[.., buckets x heads]``,
    looked up per (query, key) pair by ``gather`` and added to attention scores (ProphetNet's n-gram
    self-attention: ``relative_pos_embeddings``, buckets outer, heads inner, rows flattened over (batch, query,
    stream, head) and, for the predict streams, re-read in another order), each with the values between it and
    the scores it is added to (through ops short of a contraction)."""
    found = []
    for node in cap.gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        if getattr(node.args[1], "name", None) not in cap.params or node.args[1].meta["val"].ndim != 2:
            continue
        region, todo, biased = {node}, [(node, 0)], False
        while todo:  # at most 16 ops on (a linear back to the residual width would walk the whole stream)
            cur, depth = todo.pop()
            for u in cur.users:
                if u.op != "call_function" or u in region or depth >= 16:
                    continue
                if u.target is aten.add.Tensor and any(
                        isinstance(a, torch.fx.Node) and a is not cur and _scores_of_two(a, cap) for a in u.args):
                    biased = True
                    continue
                if not _contraction(u):
                    region.add(u)
                    todo.append((u, depth + 1))
        if biased and any(n.target is aten.gather.default and n.args[0] in region for n in region):
            found.append((node, frozenset(n.name for n in region)))
    return found


def _scores_of_two(x: torch.fx.Node, cap: Captured) -> bool:
    """Whether ``x`` is attention scores: a product of two activations (matmul, bmm, a two-operand einsum) of
    4 or more dims, through views and scalings."""
    while x.op == "call_function" and x.target in (*_THROUGH, aten.mul.Tensor, aten.div.Tensor):
        x = x.args[0]
    val = x.meta.get("val")
    if x.op != "call_function" or not isinstance(val, torch.Tensor) or val.ndim < 4:
        return False
    if x.target is aten.einsum.default:
        ops = x.args[1]
        return len(ops) == 2 and all(getattr(o, "name", None) not in cap.params for o in ops)
    return x.target in _SCORES and all(getattr(o, "name", None) not in cap.params for o in x.args[:2])


def _whole_with_bias(hints: dict, node: torch.fx.Node, cap: Captured) -> None:
    """Hint projection ``node``'s weight whole, and its bias added after it (canonicalize.split_linear_bias)."""
    _whole(hints, node, node.args[1], cap)
    for u in node.users:
        if u.target is aten.add.Tensor:
            for a in u.args:
                if getattr(a, "name", None) in cap.params and a.meta["val"].ndim == 1:
                    hints[a.name] = R


def gathered_bias_hints(cap: Captured) -> dict[str, object]:
    """The projections of :func:`_gathered_biases` (and their biases) kept whole: their output is bucket-major
    (``view(.., buckets, heads)``), so a column split would give each rank buckets, not heads, and gather them
    all again for the lookup; the predict streams even re-read the rows in an order that mixes the heads with
    the queries. Whole, each rank computes the table from the replicated hidden states (no collective) and takes
    its heads of the looked-up bias where it meets its heads' scores (:func:`gathered_bias_sliced`)."""
    hints: dict[str, object] = {}
    for node, _ in _gathered_biases(cap):
        _whole_with_bias(hints, node, cap)
    return hints


def gathered_bias_sliced(cap: Captured) -> frozenset[str]:
    """The values between a projection :func:`gathered_bias_hints` keeps whole and the scores its lookup is
    added to: a rank may take its heads of them by a local slice."""
    out: set[str] = set()
    for _, region in _gathered_biases(cap):
        out |= region
    return frozenset(out)


def kv_hints(cap: Captured, tp: int) -> dict[str, object]:
    """Key/value projections of attentions with fewer key/value heads than tp divides (multi-query attention's
    one head: GPTBigCode, Falcon) stay whole on every tp rank, as Megatron replicates a query group a rank
    needs: each rank computes the key/value heads and attends its own query heads with them, and the layer
    keeps Megatron's two exits (split, the head would be gathered before the attention). A projection fused
    with the queries (one weight for q, k and v) is kept whole with them: a placement cannot shard part of a
    weight and replicate the rest; each rank then slices its query heads from it (:func:`kv_sliced`)."""
    hints: dict[str, object] = {}
    for node in _few_kv_projections(cap, tp):
        _whole_with_bias(hints, node, cap)
    return hints


def kv_sliced(cap: Captured, tp: int) -> frozenset[str]:
    """The values between a projection :func:`kv_hints` keeps whole and its attention, or between a mixer's
    fused projection kept whole for its few B/C groups (:func:`mcompile.sharding.mixer_hints.few_groups`, through its
    depthwise conv: per channel) and its scan: a rank may take its heads of them by a local slice (the query
    heads of a fused projection; the propagator otherwise shards heads only by a contraction)."""
    from mcompile.sharding.channels import depthwise
    from mcompile.sharding.mixer_hints import few_groups

    out, todo = set(), [*_few_kv_projections(cap, tp), *few_groups(cap, tp)]
    while todo:
        cur = todo.pop()
        for u in cur.users:
            if u.op == "call_function" and u.name not in out and (not _contraction(u) or depthwise(u) is not None):
                out.add(u.name)
                todo.append(u)
    return frozenset(out)


def mask_sliced(cap: Captured) -> frozenset[str]:
    """Attention masks computed from parameters (Doge's dynamic mask: a projection of the values to one score
    per key/value head, ``exp(A * softplus(.))``, broadcast to [b, heads, q, k]) and what they are computed
    from back to the contraction that made them, that included: a rank may take its heads of them (the
    contraction's partial sum reduce-scattered over the heads, a whole value sliced), as it takes its heads of
    an input mask, so the attention runs on the rank's heads (the propagator otherwise shards heads only by a
    contraction, and the whole attention ran on every rank with q, k and v gathered)."""
    out: set[str] = set()
    for n in cap.gm.graph.nodes:
        if n.op != "call_function" or n.target is not aten.scaled_dot_product_attention.default:
            continue
        mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
        todo = [mask] if isinstance(mask, torch.fx.Node) else []
        while todo:
            cur = todo.pop()
            if cur.op != "call_function" or cur.name in out:
                continue
            out.add(cur.name)
            if not _contraction(cur):
                todo.extend(cur.all_input_nodes)
    return frozenset(out)


def gate_sliced(cap: Captured) -> frozenset[str]:
    """Activations that multiply, entry by entry, a projection's output on its way to another projection
    (Gemma-3n / Gemma-4's per-layer input: ``per_layer_projection(gelu(per_layer_input_gate(h)) * per_layer_input)``,
    the per-layer embedding computed before the layers and held whole): a rank may take its features of them by a
    local slice, so the product stays column-parallel and the second projection row-parallel -- Megatron's region,
    one all-reduce at its exit. The propagator otherwise shards a static dim of an activation only by a
    contraction: it gathered the gate, ran the second projection column-parallel from the whole product and
    gathered its output too (two all-gathers forward and an all-reduce backward where Megatron runs one
    all-reduce). Only a factor that is not itself a projection's output in the region qualifies (SwiGLU's two
    halves are both sharded by their projections already)."""
    def into_projection(u, cur) -> bool:
        return u.op == "call_function" and _weight_of(u) is not None and u.args[0] is cur

    out: set[str] = set()
    for n in cap.gm.graph.nodes:
        if n.op != "call_function" or n.target is not aten.mul.Tensor or len(n.args) != 2 or \
                not all(isinstance(a, torch.fx.Node) for a in n.args):
            continue
        shapes = [getattr(v.meta.get("val"), "shape", None) for v in (n, *n.args)]
        if shapes[0] is None or any(s is None or [str(d) for d in s] != [str(d) for d in shapes[0]] for s in shapes):
            continue  # a broadcast factor (a scale, a gate per head) is not sliced
        for x, y in (n.args, n.args[::-1]):
            if _after_contraction(x) and not _after_contraction(y) and _reaches(n, into_projection, depth=4):
                out.add(y.name)
    return frozenset(out)


_HEAD_KEEP = (aten.contiguous.default, aten.clone.default, aten._to_copy.default, aten.to.dtype, aten.alias.default)


def _heads_of(x: torch.fx.Node, dim: int) -> torch.fx.Node | None:
    """The attention whose heads ``x``'s ``dim`` is (followed back through transposes, permutes, copies, views
    that keep it, and a cat along another dim: DiffLlama's two attentions joined along head_dim), or None."""
    while isinstance(x, torch.fx.Node) and x.op == "call_function":
        nd = x.meta["val"].ndim if isinstance(x.meta.get("val"), torch.Tensor) else None
        if nd is None:
            return None
        if x.target is aten.scaled_dot_product_attention.default:
            return x if dim == 1 else None
        if x.target is aten.transpose.int:
            a, b = x.args[1] % nd, x.args[2] % nd
            dim = b if dim == a else a if dim == b else dim
        elif x.target is aten.permute.default:
            dim = list(x.args[1])[dim] % nd
        elif x.target in _THROUGH:
            src = x.args[0].meta["val"]
            if src.ndim != nd or str(src.shape[dim]) != str(x.meta["val"].shape[dim]):
                return None
        elif x.target in (aten.cat.default, aten.concat.default):
            if (x.args[1] if len(x.args) > 1 else 0) % nd == dim:
                return None
            x = x.args[0][0]
            continue
        elif x.target not in _HEAD_KEEP:
            return None
        x = x.args[0]
    return None


def _query_projection(x: torch.fx.Node, cap: Captured) -> torch.fx.Node | None:
    """The linear an attention's query [b, heads, s, d] is projected by: back through its transpose, entrywise
    ops on the value itself (RoPE's ``q * cos + rotate(q) * sin``, a scale) and the view of the projection's
    features into (heads, head_dim)."""
    while isinstance(x, torch.fx.Node) and x.op == "call_function":
        if x.target is aten.linear.default:
            return x if getattr(x.args[1], "name", None) in cap.params else None
        if x.target in _THROUGH:
            src, out = x.args[0].meta["val"], x.meta["val"]
            if out.ndim != src.ndim + 1 or str(out.shape[-1] * out.shape[-2]) != str(src.shape[-1]):
                return None
        elif x.target in (aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor):
            same_shape = [a for a in x.args if isinstance(a, torch.fx.Node) and
                          [str(d) for d in a.meta["val"].shape] == [str(d) for d in x.meta["val"].shape]]
            if not same_shape:
                return None
            x = same_shape[0]
            continue
        elif x.target not in (aten.transpose.int, aten.permute.default, *_HEAD_KEEP):
            return None
        x = x.args[0]
    return None


def head_blocks(cap: Captured, tp: int) -> dict[torch.fx.Node, tuple[int, torch.fx.Node]]:
    """Attentions whose heads are paired (or grouped) after the attention: the output cut into k equal parts along
    its heads (DiffLlama: ``torch.chunk(attn_output, 2, dim=2)``, head i subtracted with head i + heads / 2) ->
    ``{attention: (k, the query projection)}``. Split plainly by heads, a rank would hold half of the pairs
    and the cut gathers; in blocks (``BlockShard(0, k)`` on the query projection's rows) each rank holds whole
    pairs, and the attention, the cut and what follows stay local up to the row-parallel output projection. Only
    where the key/value heads then need no split of their own (fewer key/value head groups than tp: kept whole
    with :func:`kv_hints`, each rank slicing its share of every block)."""
    out: dict = {}
    if tp <= 1:
        return out
    from mcompile.passes.attention import _unrepeated

    for node in cap.gm.graph.nodes:
        if node.op != "call_function" or node.target not in (aten.chunk.default, aten.split.Tensor) or \
                not isinstance(node.args[0], torch.fx.Node):
            continue
        x = node.args[0]
        nd = x.meta["val"].ndim
        dim = (node.args[2] if len(node.args) > 2 else 0) % nd
        parts = node.meta.get("val")
        if not isinstance(parts, list | tuple) or len(parts) < 2 or \
                len({str(p.shape[dim]) for p in parts}) != 1:
            continue
        attn = _heads_of(x, dim)
        if attn is None:
            continue
        k, q = len(parts), _query_projection(attn.args[0], cap)
        heads = attn.args[0].meta["val"].shape[1]
        kv = _unrepeated(attn.args[1])[0] or attn.args[1]
        kv_heads = kv.meta["val"].shape[1]
        if q is None or not all(isinstance(h, int) for h in (heads, kv_heads)) or heads % (k * tp) or \
                kv_heads % k or (kv_heads // k) % tp == 0:
            continue
        out[attn] = (k, q)
    return out


def head_block_sliced(cap: Captured, tp: int) -> frozenset[str]:
    """The values between the key/value projections of :func:`head_blocks`' attentions (kept whole) and those
    attentions, which each rank slices to its share of every block of heads there."""
    blocks = head_blocks(cap, tp)
    if not blocks:
        return frozenset()
    projections = {n for n in _few_kv_projections(cap, tp)}
    out, todo = set(), list(projections)
    while todo:
        cur = todo.pop()
        for u in cur.users:
            if u.op == "call_function" and u.name not in out and not _contraction(u):
                out.add(u.name)
                todo.append(u)
    return frozenset(out)


def head_block_hints(cap: Captured, tp: int) -> dict[str, object]:
    """The query projections of :func:`head_blocks`' attentions: ``BlockShard(0, k)``, each rank its share of
    every block of heads (and of its bias)."""
    hints: dict[str, object] = {}
    for k, q in head_blocks(cap, tp).values():
        hints[q.args[1].name] = BlockShard(0, k)
        for u in q.users:  # its bias, added after it (canonicalize.split_linear_bias)
            if u.target is aten.add.Tensor:
                for a in u.args:
                    if getattr(a, "name", None) in cap.params and a.meta["val"].ndim == 1:
                        hints[a.name] = BlockShard(0, k)
    return hints


def _few_kv_projections(cap: Captured, tp: int) -> list[torch.fx.Node]:
    """The linears a key or value with fewer heads than ``tp`` divides is computed from: what reaches
    ``repeat_kv`` (unsqueeze, expand, reshape) before an attention, through ops short of a contraction."""
    from mcompile.passes.attention import _unrepeated

    found: list[torch.fx.Node] = []
    if tp <= 1:
        return found
    blocks = head_blocks(cap, tp)
    for n in cap.gm.graph.nodes:
        if n.op != "call_function" or n.target is not aten.scaled_dot_product_attention.default:
            continue
        k = blocks[n][0] if n in blocks else 1  # head pairs: a rank needs its share of each block's kv heads
        for kv in n.args[1:3]:
            k0, _ = _unrepeated(kv)
            heads = k0.meta["val"].shape[1] if k0 is not None else None
            if not isinstance(heads, int) or (heads % (tp * k) == 0 and n not in blocks):
                continue
            todo, seen = [k0], set()
            while todo:
                cur = todo.pop()
                if cur in seen or cur.op != "call_function":
                    continue
                seen.add(cur)
                if cur.target is aten.linear.default and getattr(cur.args[1], "name", None) in cap.params:
                    if cur not in found:
                        found.append(cur)
                elif not _contraction(cur):
                    todo.extend(cur.all_input_nodes)
    return found


def _biases_scores(u: torch.fx.Node, x: torch.fx.Node, heads: int) -> bool:
    """Whether ``u`` uses ``x`` as the mask of an attention of ``heads`` heads or adds it to its scores."""
    if u.target is aten.scaled_dot_product_attention.default:
        mask = u.args[3] if len(u.args) > 3 else u.kwargs.get("attn_mask")
        return mask is x and int(u.args[0].meta["val"].shape[1]) == heads
    return u.target is aten.add.Tensor and any(
        isinstance(a, torch.fx.Node) and a is not x and _from_scores(a, heads) for a in u.args)


def _reaches(node: torch.fx.Node, test, depth: int = 12) -> bool:
    """Whether some op using ``node``'s value, directly or through ops short of a contraction (at most
    ``depth`` of them), passes ``test(op, the value it reads)``."""
    seen, todo = set(), [(node, 0)]
    while todo:
        cur, d = todo.pop()
        for u in cur.users:
            if u in seen or u.op != "call_function" or d > depth:
                continue
            seen.add(u)
            if test(u, cur):
                return True
            if not _contraction(u):
                todo.append((u, d + 1))
    return False


def _from_scores(x: torch.fx.Node, heads: int) -> bool:
    """Whether ``x`` is attention scores (a matmul's [.., heads, q, k] output, through views), or a two-operand
    einsum's of activations with the heads third from last (LongT5's local attention over blocks:
    ``...qhd,...khd->...hqk``, [b, blocks, heads, q, k])."""
    while x.op == "call_function" and x.target in (*_THROUGH, aten.mul.Tensor, aten.div.Tensor):
        x = x.args[0]
    val = x.meta.get("val")
    if x.op != "call_function" or not isinstance(val, torch.Tensor):
        return False
    if x.target is aten.einsum.default:
        ops = x.args[1]
        return len(ops) == 2 and all(isinstance(o, torch.fx.Node) and o.op != "placeholder" for o in ops) and \
            val.ndim >= 4 and isinstance(val.shape[-3], int) and int(val.shape[-3]) == heads
    return x.target in _SCORES and val.ndim == 4 and int(val.shape[1]) == heads


def _whole_width(u: torch.fx.Node, x: torch.fx.Node, width: int) -> bool:
    """Whether ``u`` normalises its input ``x`` over a last dim of ``width`` features, or broadcasts such
    an ``x`` along a new or size-1 dim (expand)."""
    val = x.meta.get("val")
    # a size counted from the routing (tokens an expert got, data-dependent) is never compared by value
    if not isinstance(val, torch.Tensor) or val.ndim == 0 or not statically_known_true(val.shape[-1] == width):
        return False
    if u.target in (aten.rms_norm.default, aten.layer_norm.default, aten.native_layer_norm.default):
        return True
    if u.target in (aten.mean.dim, aten.sum.dim_IntList, aten.var.correction, aten.var.dim):
        dims = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim")
        dims = [dims] if isinstance(dims, int) else list(dims or [])
        return bool(dims) and all(d % val.ndim == val.ndim - 1 for d in dims)
    if u.target is aten.expand.default:
        out = u.meta.get("val")
        return isinstance(out, torch.Tensor) and out.ndim >= val.ndim and any(
            int(o) > 1 and (d < out.ndim - val.ndim or int(val.shape[d - (out.ndim - val.ndim)]) == 1)
            for d, o in enumerate(out.shape[:-1]) if isinstance(o, int))
    return False


def megatron_policies(mesh: Mesh, sequence_parallel: bool, overrides: dict | None = None,
                      experts: dict | None = None) -> list[AxisPolicy]:
    p_over, n_over = _parse_overrides(overrides, mesh)
    pols = []
    for ax in mesh.axis_names:
        n = mesh.size(ax)
        if ax == "dp":
            pols.append(AxisPolicy(ax, n, shard_inputs_dim0=True, allowed_symbols=frozenset({BATCH}),
                                   allow_static_dims=False, params_replicated=True, partial_passthrough=False,
                                   param_overrides=p_over[ax], node_overrides=n_over[ax]))
        elif ax == "tp":
            pols.append(AxisPolicy(ax, n, allowed_symbols=frozenset({SEQ}) if sequence_parallel else frozenset(),
                                   allow_static_dims=True, shard_contraction_weights=True,
                                   prefer_seq_reduce_scatter=sequence_parallel,
                                   param_overrides=p_over[ax], node_overrides=n_over[ax]))
        elif ax == "ep":
            # Megatron folds expert parallelism into data parallelism: the dense parts see ep as more
            # data-parallel ranks (inputs split on the batch, parameters replicated); the expert
            # weights of every MoE node are split over it (E/ep experts a rank): expert_overrides
            pols.append(AxisPolicy(ax, n, shard_inputs_dim0=True, allowed_symbols=frozenset({BATCH}),
                                   allow_static_dims=False, params_replicated=True, partial_passthrough=False,
                                   param_overrides={**(experts or {}), **p_over[ax]}, node_overrides=n_over[ax],
                                   expert_parallel=True))
        elif ax == "cp":
            # context parallelism: the tokens of every sequence split over cp (load-balanced chunks), parameters
            # replicated and their gradients summed over cp like dp's (mcompile.passes.cp.ops)
            pols.append(AxisPolicy(ax, n, allowed_symbols=frozenset({SEQ}), allow_static_dims=False,
                                   params_replicated=True, partial_passthrough=False, context_parallel=True,
                                   param_overrides=p_over[ax], node_overrides=n_over[ax]))
        elif ax == "pp":
            continue  # pipeline stages split the graph itself (mcompile.passes.pp.stages); nothing is sharded over pp
        else:
            raise PlanError(
                f"mesh axis {ax}={n}: this planner handles dp, pp, cp, ep and tp; use a mesh like "
                "Mesh(dp=..., pp=..., cp=..., tp=...)"
            )
    return pols


@dataclass
class AxisPlanResult:
    policy: AxisPolicy
    result: AxisResult


def plan_axes(cap: Captured, mesh: Mesh, sequence_parallel: bool, overrides: dict | None,
              hints: dict) -> list[AxisPlanResult]:
    if "tp" in mesh.axis_names:
        check_divisibility(cap, mesh.size("tp"))
    if sequence_parallel and mesh.size("tp") == 1:
        sequence_parallel = False
    out = []
    from mcompile.sharding.mixer_hints import mixer_hints

    tp = mesh.size("tp") if "tp" in mesh.axis_names else 1
    blocks = {**block_hints(cap), **mixer_hints(cap, tp), **latent_hints(cap), **router_hints(cap),
              **selector_hints(cap), **stream_mix_hints(cap), **position_bias_hints(cap), **gathered_bias_hints(cap),
              **kv_hints(cap, tp), **head_block_hints(cap, tp),
              **stacked_expert_hints(cap, tp)}
    experts = check_experts(cap, mesh.size("ep")) if "ep" in mesh.axis_names else None
    for pol in megatron_policies(mesh, sequence_parallel, overrides, experts):
        if pol.shard_contraction_weights:
            pol.param_hints = dict(blocks)
            pol.sliced_static = kv_sliced(cap, tp) | mask_sliced(cap) | gathered_bias_sliced(cap) | gate_sliced(cap)
            pol.whole_broadcast = head_block_sliced(cap, tp)
        out.append(AxisPlanResult(pol, propagate_axis(cap, pol, hints)))
    for op in sorted(set().union(*(ap.result.fallbacks for ap in out))):  # one warning per op
        if op.startswith("mcompile_fn."):  # a user's autograd.Function (mcompile.capture.autograd_fn): no rule to add
            warnings.warn(f"no sharding rule for {op}, the custom torch.autograd.Function of that name: it runs "
                          "replicated (a split is inferred only when its forward and backward are pointwise: "
                          "mcompile.sharding.rules.inferred.pointwise_rule)",
                          FallbackWarning, stacklevel=3)
            continue
        warnings.warn(f"no sharding rule for {op}: it runs replicated (add a rule in mcompile/sharding/rules)",
                      FallbackWarning, stacklevel=3)
    return out


def assemble_plan(cap: Captured, mesh: Mesh, axes: list[AxisPlanResult], options: PlanOptions,
                  overrides: dict | None) -> Plan:
    names = mesh.axis_names
    params: dict[str, ParamPlan] = {}
    # axes over which a replicated parameter's gradient is Partial: it feeds an op whose output is
    # not replicated on that axis (every parameter on dp; SP norm weights on tp)
    partial: dict[str, set[str]] = {}
    for ap in axes:
        res = ap.result
        loss_axis_partial = ap.policy.loss_partial
        for node in cap.gm.graph.nodes:
            s = res.strategies.get(node.name)
            if s is None:
                continue
            from mcompile.sharding.rules import tensor_input_nodes

            for a, p in zip(tensor_input_nodes(node), s.inputs):
                if a.name in cap.params and isinstance(p, Replicate):
                    out = s.outputs[0] if s.outputs else R
                    if not isinstance(out, Replicate) or loss_axis_partial:
                        partial.setdefault(a.name, set()).add(ap.policy.axis)
    for node in cap.param_nodes:
        fqn = cap.params[node.name]
        val = node.meta["val"]
        shape = tuple(int(s) for s in val.shape)
        by_axis = {ap.policy.axis: ap for ap in axes}
        pls = tuple(by_axis[a].result.params.get(node.name, R) if a in by_axis else R for a in names)
        padded = list(shape)
        local = list(shape)
        for ax, p in zip(names, pls):
            if isinstance(p, Shard | BlockShard):
                d = p.dim % len(shape)
                n = mesh.size(ax)
                if shape[d] % n:
                    if node.name not in ap_padded(axes):
                        raise PlanError(f"{fqn} {list(shape)}: dim {d} does not divide by {ax}={n}")
                    multiple = options.vocab_pad_multiple if isinstance(p, Shard) else 1
                    padded[d] = n * vocab_local_size(shape[d], n, multiple)
                local[d] = padded[d] // n
        params[fqn] = ParamPlan(
            fqn=fqn, shape=shape, dtype=str(val.dtype).replace("torch.", ""), placements=pls,
            local_shape=tuple(local), padded_shape=tuple(padded) if padded != list(shape) else None,
            grad_partial_axes=tuple(a for a in names if a in partial.get(node.name, ())),
            tied=cap.tied.get(fqn, ()),
        )
    acts = {}
    for node in cap.gm.graph.nodes:
        if node.op == "call_function" and any(node.name in ap.result.placements for ap in axes):
            by_axis = {ap.policy.axis: ap for ap in axes}
            acts[node.name] = tuple(by_axis[a].result.placements.get(node.name) if a in by_axis else R
                                    for a in names)
    fallbacks = sorted(set().union(*(ap.result.fallbacks for ap in axes))) if axes else []
    return Plan(mesh=dict(mesh.axes), params=params, activations=acts, options=options,
                model=cap.model_name, fallbacks=fallbacks,
                overrides={k: str(v) for k, v in (overrides or {}).items()})


def vocab_local_size(size: int, n: int, multiple: int = 1) -> int:
    """Each rank's share of a static dim of ``size`` sharded over ``n`` ranks. A dim that divides is
    split evenly; one that does not (a vocabulary: only vocab-parallel embeddings and heads are
    sharded on such dims) is padded to a multiple of ``n * multiple`` (Megatron's
    ``--make-vocab-size-divisible-by``, 128 by default, times tp), so each rank's slice is a multiple
    of ``multiple``: GPT-2's 50257 at tp=8 becomes 51200, 6400 a rank. The planner
    (``ParamPlan.padded_shape``) and the lowering (local sizes, the vocab-parallel embedding and
    loss) both size padded dims with this function."""
    if not isinstance(multiple, int) or isinstance(multiple, bool) or multiple < 1:
        raise ValueError(f"vocab_pad_multiple={multiple!r} must be a positive integer (1: pad only to a multiple of "
                         "tp; 128, the default: each tp rank's vocabulary slice a multiple of 128)")
    if size % n == 0:
        return size // n
    return math.ceil(size / (n * multiple)) * multiple


def ap_padded(axes: list[AxisPlanResult]) -> set[str]:
    return set().union(*(ap.result.padded for ap in axes)) if axes else set()
