"""Attention as the kernels and context parallelism need to see it (a canonicalisation of every capture).

Rewrites of ``aten.scaled_dot_product_attention`` nodes, each exact:

* **A causal mask built from sizes becomes ``is_causal=True``** (on every mesh, one rank included).
  Hugging Face models pass an explicit ``[b, 1, s, s]`` mask built from ``arange`` comparisons
  (transformers' ``sdpa_mask``). With a mask tensor SDPA cannot take a flash kernel (on CUDA, flash
  attention takes no ``attn_mask``: PyTorch's SDPA backend selection falls back to the memory-efficient
  or math kernel, and the ``[b, 1, s, s]`` mask itself is quadratic memory); with ``is_causal=True`` it
  can. Under cp a rank holds a load-balanced piece of the queries and of the keys, so a whole-sequence
  mask has no meaning on it; causality does (mcompile.passes.cp.ops computes it from the tokens' global positions). A
  mask is
  recognised as causal from how it is built, not from its name: it must be computed from no parameter
  and read no input's values (only sizes), and evaluating its subgraph at two sizes must give exactly
  the causal pattern (boolean: keep where key <= query; additive float: 0 there, <= the dtype's
  lowest / 2 elsewhere). Anything else (padding from an ``attention_mask``, a sliding window) is kept
  as a mask and takes the path that supports one (cp_attention="allgather").
* **A cache appended to from empty is the value appended.** ``cat([empty, k], dim)`` (transformers'
  DynamicCache in a training forward) is ``k``: a cat along the split sequence has no rule over cp.
* **Grouped-query attention keeps its K/V heads** (``gqa=True``: under cp only). ``repeat_kv``
  (unsqueeze, expand, reshape of ``[b, hkv, s, d]`` to ``[b, hkv*g, s, d]``) before the attention is
  undone and ``enable_gqa=True`` set: the same result, and the K/V that cp moves between ranks are g
  times smaller. Not done on other meshes: tensor parallelism may shard the repeated heads where it
  cannot shard the K/V heads (tp not dividing the K/V heads), so the planner sees ``repeat_kv`` there.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from mcompile.capture.export import BATCH, SEQ, Captured

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_NOOP_SLICE_END = 2**63 - 1


def canonicalize_attention(cap: Captured, gqa: bool = True) -> dict[str, int]:
    """Rewrite the captured graph in place; returns counts of what changed. ``gqa``: undo ``repeat_kv``
    too (``mcompile.api.compile_plan`` asks for it when the mesh has cp)."""
    # (an empty cache cat before the attention was dropped for every mesh: canonicalize.drop_empty_cats)
    counts = {"causal_masks": 0} | ({"gqa_unrepeated": 0} if gqa else {})
    for node in list(cap.gm.graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        args = list(node.args) + [None] * (8 - len(node.args))
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        a = {k: node.kwargs.get(k, args[i]) for i, k in enumerate(names)}
        a["dropout_p"] = a["dropout_p"] or 0.0
        a["is_causal"] = bool(a["is_causal"])
        a["enable_gqa"] = bool(a["enable_gqa"])
        changed = False
        mask = a["attn_mask"]
        if isinstance(mask, fx.Node) and not a["is_causal"] and _is_causal_mask(cap, mask):
            a["attn_mask"], a["is_causal"] = None, True
            counts["causal_masks"] += 1
            changed = True
        k0, gk = _unrepeated(a["key"]) if gqa else (None, 0)
        v0, gv = _unrepeated(a["value"]) if gqa else (None, 0)
        if k0 is not None and v0 is not None and gk == gv:
            a["key"], a["value"], a["enable_gqa"] = k0, v0, True
            counts["gqa_unrepeated"] += 1
            changed = True
        if changed:
            kwargs = {"dropout_p": a["dropout_p"], "is_causal": a["is_causal"], "scale": a["scale"],
                      "enable_gqa": a["enable_gqa"]}
            if a["attn_mask"] is not None:
                kwargs["attn_mask"] = a["attn_mask"]
            node.args = (a["query"], a["key"], a["value"])
            node.kwargs = kwargs
    if any(counts.values()):
        cap.gm.graph.eliminate_dead_code()
        cap.gm.recompile()
    return counts


def _only_nonempty(node: fx.Node) -> fx.Node | None:
    """The one input of ``cat`` that is not empty along the cat dim (a key/value cache created empty and
    appended to, as transformers' DynamicCache does in a training forward), or None."""
    xs = node.args[0]
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % val.ndim
    rest = []
    for x in xs:
        v = x.meta.get("val") if isinstance(x, fx.Node) else None
        if v is None:
            return None
        if v.ndim == val.ndim and isinstance(v.shape[dim], int) and v.shape[dim] == 0:
            continue
        if v.ndim == 1 and isinstance(v.shape[0], int) and v.shape[0] == 0:
            continue  # torch.cat skips 1-D empty tensors whatever the dim
        rest.append(x)
    if len(rest) != 1 or rest[0].meta["val"].shape != val.shape or rest[0].meta["val"].dtype != val.dtype:
        return None
    return rest[0]


def _unrepeated(x) -> tuple[fx.Node | None, int]:
    """``(k0, g)`` when ``x`` is ``repeat_kv(k0, g)``: reshape(expand(unsqueeze(k0, 2)))."""
    if not isinstance(x, fx.Node) or x.target not in (aten.reshape.default, aten.view.default,
                                                        aten._unsafe_view.default):
        return None, 0
    e = x.args[0]
    if not isinstance(e, fx.Node) or e.target is not aten.expand.default:
        return None, 0
    u = e.args[0]
    while isinstance(u, fx.Node) and u.target is aten.slice.Tensor and u.args[2:4] in ((0, _NOOP_SLICE_END),
                                                                                        [0, _NOOP_SLICE_END]):
        u = u.args[0]
    if not isinstance(u, fx.Node) or u.target is not aten.unsqueeze.default or u.args[1] != 2:
        return None, 0
    k0 = u.args[0]
    ev, kv, xv = e.meta.get("val"), k0.meta.get("val"), x.meta.get("val")
    if ev is None or kv is None or xv is None or kv.ndim != 4 or ev.ndim != 5 or xv.ndim != 4:
        return None, 0
    g = ev.shape[2]
    if not isinstance(g, int) or ev.shape[1] != kv.shape[1] or xv.shape[1] != kv.shape[1] * g:
        return None, 0
    return k0, g


def _is_causal_mask(cap: Captured, mask: fx.Node) -> bool:
    val = mask.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.ndim < 2:
        return False
    seq = cap.symbols.get(SEQ)
    if seq is None or any(not _is(s, seq) for s in val.shape[-2:]):
        return False
    for s in (5, 7):
        m = _evaluate(cap, mask, batch=2, seq=s)
        if m is None:
            return False
        tril = torch.ones(s, s, dtype=torch.bool).tril()
        if m.dtype == torch.bool:
            ok = torch.equal(m, tril.expand_as(m))
        elif m.dtype.is_floating_point:
            low = torch.finfo(m.dtype).min / 2
            ok = bool(((m == 0) == tril).all()) and bool((m[..., ~tril] <= low).all())
        else:
            ok = False
        if not ok:
            return False
    return True


def _is(size, sym) -> bool:
    return isinstance(size, torch.SymInt) and size.node.expr == sym


def _evaluate(cap: Captured, target: fx.Node, batch: int, seq: int) -> torch.Tensor | None:
    """The value of an input-only node at a concrete batch and sequence, or None when it reads a
    parameter, a buffer or any input's values (not only its sizes)."""
    need: list[fx.Node] = []
    seen: set[fx.Node] = set()
    stack = [target]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        need.append(n)
        stack.extend(n.all_input_nodes)
    subs = {cap.symbols[k]: v for k, v in ((BATCH, batch), (SEQ, seq)) if k in cap.symbols}
    env: dict[fx.Node, object] = {}
    for n in cap.gm.graph.nodes:
        if n not in seen:
            continue
        if n.op == "placeholder":
            if n.name not in cap.user_inputs:
                return None  # a parameter, buffer or constant
            if any(u in seen and u.target is not aten.sym_size.int for u in n.users):
                return None  # the mask reads the input's values (an attention_mask): not structural
            v = n.meta.get("val")
            if not isinstance(v, torch.Tensor):
                return None
            try:
                shape = [int(s.node.expr.subs(subs)) if isinstance(s, torch.SymInt) else int(s) for s in v.shape]
            except TypeError:
                return None  # a size symbol other than batch and seq
            env[n] = torch.zeros(shape, dtype=v.dtype)
            continue
        if n.op != "call_function":
            return None
        args = fx.node.map_arg(n.args, lambda x: env[x])
        kwargs = {k: (torch.device("cpu") if isinstance(v, torch.device) else v)
                  for k, v in fx.node.map_arg(n.kwargs, lambda x: env[x]).items()}
        try:
            env[n] = n.target(*args, **kwargs) if n.target is not operator.getitem else args[0][args[1]]
        except Exception:  # noqa: BLE001 - an op that does not run on CPU: not recognised, kept as a mask
            return None
    out = env[target]
    return out if isinstance(out, torch.Tensor) else None
