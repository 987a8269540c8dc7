"""KV cache as a graph pass: a captured logits forward -> a *prefill* and a *decode* graph.

Users' models hold no cache code (our presets have none; a Hugging Face model is captured with
``use_cache=False``), so the cache is the compiler's. Autoregressive decoding with a cache is the
observation that causal attention's keys and values for positions ``0..P-1`` do not change when
position ``P`` is appended (the "incremental decoding" of Vaswani et al. 2017's decoder, as
fairseq / HF ``past_key_values`` implement it); only the new position's row is computed.

:func:`add_kv_cache` rewrites the captured aten graph of ``logits = model(ids)`` (symbolic batch
and sequence) in two ways. Both are pure: the cache is an input and an output (a functional cache),
so the planner shards it like any activation and nothing is mutated.

- **prefill** = the forward unchanged, plus as extra outputs the K and V that each
  ``scaled_dot_product_attention`` reads, in SDPA's layout ``[b, heads, s, head_dim]``.
- **decode** (one new token per sequence): extra inputs ``past_k_i`` / ``past_v_i`` per attention,
  ``[b, heads, P, head_dim]`` with ``P`` symbolic; at each SDPA ``k' = cat(past_k, k, dim=-2)`` and
  ``v'`` likewise; SDPA without its causal flag or mask (the one query attends to all ``P + 1``
  keys); outputs the logits and every ``k'``, ``v'``. Position sources start at ``P =
  past_k_0.size(-2)``: ``arange(s)`` over the sequence becomes ``arange(P, P + s)`` (rotary
  angles, learned position embeddings, HF's ``cache_position``), and a slice ``table[a:s]`` of a
  parameter / buffer (a precomputed rope table) becomes ``table[P + a:P + s]``.

Masks: a causal flag (``is_causal=True``) or a mask computed only from the input's *sizes* that
evaluates to the lower-triangular pattern (Hugging Face builds one explicitly from ``arange``\\ s)
is recognised and dropped in decode. A mask that reads the input's values (padding), a parameter,
or evaluates to anything else (sliding window, bidirectional) is refused with
:class:`KVCacheError`, as is a model with no SDPA at all (attention written as matmul + softmax).

What is cached: under grouped-query attention the kv heads, never their repeats — what SDPA reads
with ``enable_gqa=True`` (our Llama preset), or, when K / V reach SDPA through Hugging Face's
``repeat_kv`` (``reshape(expand(unsqueeze(x, 2), [b, kv, rep, s, hd]))``), the ``x`` before it: the
decode graph concatenates there and repeats the ``P + s`` cached positions (``num_key_value_heads``
cached, not ``num_attention_heads``). Otherwise K and V as SDPA reads them.

:func:`keep_cache_local` is the rank pass that follows lowering: the planner places user inputs
replicated and fetches outputs replicated, so a tensor-parallel program would slice each cache input
(``shard_slice``) and all-gather each cache output; where both happen on the heads dim the pass
removes them, and each rank keeps its own heads of the cache (Megatron's attention is head-parallel,
so the cache is too).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default

__all__ = ["KVCacheError", "CacheGraphs", "add_kv_cache", "keep_cache_local", "drop_backward_only", "cache_names"]


class KVCacheError(ValueError):
    """The model's graph cannot get a KV cache; the message says why and what would work."""


@dataclass(frozen=True)
class CacheGraphs:
    prefill: fx.GraphModule  # (params..., ids) -> (logits, k_0, v_0, k_1, v_1, ...)
    decode: fx.GraphModule  # (params..., ids[b, 1], past_k_0, past_v_0, ...) -> (logits, k'_0, v'_0, ...)
    heads: tuple[int, ...]  # per attention: the heads dim of its cached K / V
    head_dims: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]  # per attention: the dtype of its K / V
    dropped_masks: int  # explicitly built causal masks recognised and dropped in decode


def cache_names(n_attn: int) -> list[str]:
    """The decode graph's cache placeholders, in order: past_k_0, past_v_0, past_k_1, ..."""
    return [f"past_{kv}_{i}" for i in range(n_attn) for kv in ("k", "v")]


def _where(node: fx.Node) -> str:
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").strip().splitlines()]
    files = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
    if not files:
        return ""
    i = files[-1]
    return f" at {lines[i]}" + (f": {lines[i + 1]}" if i + 1 < len(lines) else "")


def _sdpa_parts(node: fx.Node) -> tuple:
    """(q, k, v, attn_mask, dropout_p, is_causal) of an SDPA call, positional or keyword."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    defaults = (None, None, None, None, 0.0, False)
    return tuple(node.args[i] if i < len(node.args) else node.kwargs.get(n, d)
                 for i, (n, d) in enumerate(zip(names, defaults)))


def _ancestors(node: fx.Node) -> list[fx.Node]:
    seen, stack = {node}, [node]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _check_causal_mask(mask: fx.Node, ids: fx.Node, user_inputs: set[str], sdpa: fx.Node) -> None:
    """Refuse unless ``mask`` is built from the input's sizes alone and is the causal pattern:
    evaluated at two sequence lengths on a copy of its subgraph."""
    anc = _ancestors(mask)
    leaves = [a for a in anc if a.op == "placeholder"]
    for leaf in leaves:
        value_uses = [u for u in leaf.users if u in anc and u.target is not aten.sym_size.int]
        if leaf.name in user_inputs and value_uses:
            raise KVCacheError(
                f"the attention mask of {sdpa.name}{_where(sdpa)} reads the values of the input {leaf.name} "
                "(a padding / attention mask): generation with mcompile's KV cache supports causal attention "
                "over unpadded prompts only. fix: pass prompts of equal length without an attention_mask "
                "(batch prompts of one length together)")
        if leaf.name not in user_inputs:
            raise KVCacheError(
                f"the attention mask of {sdpa.name}{_where(sdpa)} is computed from {leaf.name} (a parameter or "
                "buffer): only causal masks built from the sequence length are supported. fix: use "
                "is_causal=True in scaled_dot_product_attention")
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    cpu = lambda x: torch.device("cpu") if isinstance(x, torch.device) else x  # noqa: E731 - captured on meta
    for a in anc:
        env[a] = g.placeholder(a.name) if a.op == "placeholder" else g.node_copy(a, env.__getitem__)
        env[a].args, env[a].kwargs = fx.node.map_aggregate(env[a].args, cpu), fx.node.map_aggregate(env[a].kwargs, cpu)
    g.output(env[mask])
    fn = fx.GraphModule(torch.nn.Module(), g)
    for s in (3, 6):
        args = [torch.zeros(2, s, dtype=torch.long) for _ in leaves]
        try:
            m = fn(*args)
        except Exception as e:  # noqa: BLE001 - reported as an unsupported mask
            raise KVCacheError(f"cannot evaluate the attention mask of {sdpa.name}{_where(sdpa)} to check that it is "
                               f"causal ({type(e).__name__}: {e}); use is_causal=True") from e
        allowed = m if m.dtype == torch.bool else m == 0
        blocked_ok = m.dtype == torch.bool or bool((m[~allowed] < -1e30).all())
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        if allowed.shape[-2:] != (s, s) or not blocked_ok or not bool((allowed == causal).all()):
            raise KVCacheError(
                f"the attention mask of {sdpa.name}{_where(sdpa)} is not the causal mask (e.g. a sliding window "
                "or bidirectional attention): the KV cache decodes causal attention only, where position t "
                "attends to 0..t")


def _seq_nodes(graph: fx.Graph, ids: fx.Node) -> set[fx.Node]:
    return {n for n in graph.nodes if n.op == "call_function" and n.target is aten.sym_size.int
            and n.args[0] is ids and n.args[1] == 1}


def _shift_positions(graph: fx.Graph, seq: set[fx.Node], past: fx.Node, user_inputs: set[str]) -> int:
    """Make position sources start at ``past``: ``arange(s)`` -> ``arange(P, P + s)``,
    ``arange(a, s)`` -> ``arange(P + a, P + s)``, ``table[a:s]`` of a placeholder (not a user input)
    -> ``table[P + a:P + s]``. Returns how many were moved."""
    moved = 0
    for n in list(graph.nodes):
        if n.op != "call_function":
            continue
        if n.target is aten.arange.default and n.args[0] in seq:
            with graph.inserting_before(n):
                end = graph.call_function(operator.add, (past, n.args[0]))
                new = graph.call_function(aten.arange.start, (past, end, *n.args[1:]), dict(n.kwargs))
        elif n.target is aten.arange.start and n.args[1] in seq and isinstance(n.args[0], int):
            with graph.inserting_before(n):
                start = graph.call_function(operator.add, (past, n.args[0])) if n.args[0] else past
                end = graph.call_function(operator.add, (past, n.args[1]))
                new = graph.call_function(aten.arange.start, (start, end, *n.args[2:]), dict(n.kwargs))
        elif (n.target is aten.slice.Tensor and len(n.args) >= 4 and n.args[3] in seq
              and n.args[0].op == "placeholder" and n.args[0].name not in user_inputs):
            a = n.args[2] or 0
            if not isinstance(a, int):
                continue
            with graph.inserting_before(n):
                start = graph.call_function(operator.add, (past, a)) if a else past
                end = graph.call_function(operator.add, (past, n.args[3]))
                new = graph.call_function(aten.slice.Tensor, (n.args[0], n.args[1], start, end, *n.args[4:]))
        else:
            continue
        new.meta.update({k: v for k, v in n.meta.items() if k != "val"})
        n.replace_all_uses_with(new)
        graph.erase_node(n)
        moved += 1
    return moved


_VIEWS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def _repeat_kv(t: fx.Node, seq: set[fx.Node]) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node] | None:
    """(x, unsqueeze, expand, reshape) when SDPA's key / value ``t`` is grouped-query attention's kv
    heads repeated (Hugging Face's ``repeat_kv``): ``reshape(expand(unsqueeze(x, 2), [b, kv, rep, s,
    hd]), [b, kv * rep, s, hd])``, each used once. Then the cache holds ``x``: rep times smaller."""
    if not isinstance(t, fx.Node) or t.target not in _VIEWS or len(t.users) != 1:
        return None
    e = t.args[0]
    if not isinstance(e, fx.Node) or e.target is not aten.expand.default or len(e.users) != 1:
        return None
    u = e.args[0]
    if not isinstance(u, fx.Node) or u.target is not aten.unsqueeze.default or u.args[1] != 2 or len(u.users) != 1:
        return None
    big, small = list(e.args[1]), list(t.args[1])
    if len(big) != 5 or len(small) != 4 or big[3] not in seq or small[2] not in seq:
        return None
    return u.args[0], u, e, t


def add_kv_cache(gm: fx.GraphModule, ids_name: str, user_inputs: set[str] | None = None) -> CacheGraphs:
    """Prefill and decode graphs of the captured logits graph ``gm`` (see the module docstring).
    ``ids_name``: the token-ids placeholder; ``user_inputs``: every user-input placeholder name
    (default: just ``ids_name``). The graphs' node metadata is the captured graph's, stale where
    the rewrite changed shapes: re-capture them before planning (mcompile.apps.generate does)."""
    user_inputs = set(user_inputs or ()) | {ids_name}
    src_sdpa = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _SDPA]
    if not src_sdpa:
        raise KVCacheError(
            f"no scaled_dot_product_attention in the captured graph of {type(gm).__name__}: mcompile's KV cache is "
            "inserted at each SDPA call (attention written as matmul + softmax, or a model without attention, "
            "has nothing to cache). fix: compute attention with torch.nn.functional.scaled_dot_product_attention")
    src_ids = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == ids_name)
    src_seq = _seq_nodes(gm.graph, src_ids)
    # what each attention caches: its K and V as SDPA reads them, or the kv heads before a repeat_kv
    cached = [tuple((_repeat_kv(t, src_seq) or (t,))[0] for t in _sdpa_parts(n)[1:3]) for n in src_sdpa]
    heads, hds, dtypes = [], [], []
    for k, _ in cached:
        val = k.meta.get("val")
        heads.append(int(val.shape[1]) if val is not None else -1)
        hds.append(int(val.shape[-1]) if val is not None else -1)
        dtypes.append(val.dtype if val is not None else torch.float32)

    # -- prefill: K and V of every attention as extra outputs
    pre = fx.Graph()
    out_map = pre.graph_copy(gm.graph, val_map := {})
    (logits,) = _outputs(out_map)
    extra = [val_map[t] for kv in cached for t in kv]
    pre.output((logits, *extra))
    prefill = fx.GraphModule(gm, pre, class_name="Prefill")

    # -- decode
    dec = fx.Graph()
    val_map = {}
    out_map = dec.graph_copy(gm.graph, val_map)
    (logits,) = _outputs(out_map)
    dec.output(logits)  # replaced below
    ids = next(n for n in dec.nodes if n.op == "placeholder" and n.name == ids_name)
    last_ph = [n for n in dec.nodes if n.op == "placeholder"][-1]
    caches = []
    with dec.inserting_after(last_ph):
        for name in reversed(cache_names(len(src_sdpa))):
            caches.append(dec.placeholder(name))
    caches.reverse()
    with dec.inserting_after(caches[-1]):
        past_len = dec.call_function(aten.sym_size.int, (caches[0], 2))
    dropped = 0
    new_kv = []
    for i, n0 in enumerate(src_sdpa):
        n = val_map[n0]
        q, k, v, mask, dropout, causal = _sdpa_parts(n)
        if mask is not None:
            _check_causal_mask(mask, ids, user_inputs, n)
            dropped += 1
        elif not causal:
            raise KVCacheError(
                f"{n.name}{_where(n)} is not causal (is_causal=False and no mask): every position attends to the "
                "whole sequence, so appending a token changes earlier keys' outputs and a KV cache does not apply "
                "(an encoder?). Generation needs a causal decoder")
        if dropout not in (0, 0.0) and not isinstance(dropout, fx.Node):
            raise KVCacheError(f"{n.name}{_where(n)} has dropout_p={dropout}: put the model in eval mode (or build it "
                               "with dropout 0) for generation")
        read = []
        for j, t in enumerate((k, v)):
            rep = _repeat_kv(t, {val_map[x] for x in src_seq})
            x = rep[0] if rep else t
            with dec.inserting_after(x):
                # the new row made contiguous first: a cat of a transposed view has strides that depend on P,
                # which export cannot prove for every P (and the cache is kept contiguous anyway)
                x1 = dec.call_function(aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
            with dec.inserting_after(x1):
                xc = dec.call_function(aten.cat.default, ([caches[2 * i + j], x1], 2))
            new_kv.append(xc)
            if rep is None:
                read.append(xc)
                continue
            _, u, e, r = rep  # repeat the cached kv heads over P + s positions
            with dec.inserting_before(e):
                length = dec.call_function(operator.add, (past_len, e.args[1][3]))
                u2 = dec.call_function(aten.unsqueeze.default, (xc, 2))
            e.args = (u2, [*e.args[1][:3], length, *e.args[1][4:]])
            r.args = (e, [*r.args[1][:2], length, *r.args[1][3:]])
            dec.erase_node(u)
            read.append(r)
        with dec.inserting_before(n):
            kwargs = {key: val for key, val in n.kwargs.items() if key in ("scale", "enable_gqa")}
            new = dec.call_function(_SDPA, (q, *read, None, 0.0, False), kwargs)
        new.meta.update({key: val for key, val in n.meta.items() if key != "val"})
        n.replace_all_uses_with(new)
        dec.erase_node(n)
    seq = _seq_nodes(dec, ids)
    _shift_positions(dec, seq, past_len, user_inputs)
    out = next(n for n in dec.nodes if n.op == "output")
    out.args = ((logits, *new_kv),)
    dec.eliminate_dead_code()
    dec.lint()
    decode = fx.GraphModule(gm, dec, class_name="Decode")
    return CacheGraphs(prefill, decode, tuple(heads), tuple(hds), tuple(dtypes), dropped)


def _outputs(out) -> tuple:
    outs = tuple(out) if isinstance(out, tuple | list) else (out,)
    if len(outs) != 1:
        raise KVCacheError(f"the captured forward returns {len(outs)} outputs; generation needs one: the logits "
                           "[batch, seq, vocab] (call the model without targets / labels)")
    return outs


def keep_cache_local(program: fx.GraphModule, cache_inputs: list[str], cache_outputs: list[int],
                     axis: str = "tp") -> tuple[list[bool], list[bool]]:
    """Rank pass after lowering: per cache input, drop the ``shard_slice`` on dim 1 over ``axis``
    that feeds it (the rank is handed its own heads); per cache output (positions in the output
    tuple), drop the ``all_gather`` on dim 1 over ``axis`` that produces it (the rank keeps its
    heads). Returns (inputs made local, outputs made local), each a flag per cache."""
    from mcompile.ir.ops import OPS

    slices = {OPS[k] for k in ("shard_slice", "shard_slice_nograd") if k in OPS}
    g = program.graph
    phs = {n.name: n for n in g.nodes if n.op == "placeholder"}
    ins_local = []
    for name in cache_inputs:
        ph = phs[name]
        users = list(ph.users)
        cut = [u for u in users if u.target in slices and u.args[1] == 1 and u.args[2] == axis]
        others = [u for u in users if u not in cut and u.target is not aten.sym_size.int]
        if cut and not others:
            for u in cut:
                u.replace_all_uses_with(ph)
                g.erase_node(u)
            ins_local.append(True)
        else:
            ins_local.append(False)
    out = next(n for n in g.nodes if n.op == "output")
    res = list(out.args[0]) if isinstance(out.args[0], tuple | list) else [out.args[0]]
    outs_local = []
    for pos in cache_outputs:
        node = res[pos]
        if (isinstance(node, fx.Node) and node.target is OPS["all_gather"] and node.args[1] == 1
                and node.args[2] == axis and len(node.users) == 1):
            res[pos] = node.args[0]
            outs_local.append(True)
        else:
            outs_local.append(False)
    out.args = (tuple(res),)
    g.eliminate_dead_code()
    program.recompile()
    return ins_local, outs_local


def drop_backward_only(program: fx.GraphModule) -> int:
    """Inference rank pass: Megatron's *f* (``copy_ar_bwd``) is a copy forward and an all-reduce
    backward; a program that never runs backward needs neither. Returns how many were removed."""
    from mcompile.ir.ops import OPS

    n = 0
    for node in list(program.graph.nodes):
        if node.op == "call_function" and node.target is OPS["copy_ar_bwd"]:
            node.replace_all_uses_with(node.args[0])
            program.graph.erase_node(node)
            n += 1
    program.recompile()
    return n
