"""Planning context parallelism: which attention variant runs over cp, and what a cp plan refuses.

The runtime's side (the load-balanced token layout, the attention variants and their collectives) is
:mod:`mcompile.passes.cp.ops`; the sharding is the cp axis policy (:func:`mcompile.sharding.planner.megatron_policies`):
every activation computed from parameters is split on its tokens, parameters are replicated and their
gradients summed over cp, inputs arrive whole and input-only values (positions, RoPE tables, shifted
labels) are computed whole and sliced where they meet the split activations.
"""

from __future__ import annotations

import torch

from mcompile.capture.export import SEQ, Captured
from mcompile.ir.mesh import Mesh, check_sequence  # noqa: F401  (re-exported: an input check the runtime runs too)

__all__ = ["VARIANTS", "resolve_cp_attention", "check_sequence", "check_cp_mesh", "attention_nodes"]

VARIANTS = ("ring", "allgather", "a2a")
_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def check_cp_mesh(mesh: Mesh) -> None:
    """The layouts cp runs with today: cp alone, with dp, with tp (sequence parallel inside a cp rank) and
    with pp (each stage's ranks split the tokens; stages pass their local tokens). cp with ep is refused
    before anything is captured or run (not proven at parity yet)."""
    if mesh.size("ep") > 1:
        raise ValueError(f"context parallelism (cp={mesh.size('cp')}) with ep={mesh.size('ep')} is not supported "
                         "yet: use cp with dp, tp and pp (e.g. Mesh(dp=..., pp=..., cp=..., tp=...)), or ep without cp")


def check_cp_model(cap: Captured, mesh: Mesh) -> None:
    """What cp does not compute right yet, refused at plan time on every rank rather than trained wrong: a
    model with mixture-of-experts layers. The composition matrix (bench/compositions.py, docs/compositions.md)
    measured the Mixtral preset under cp with every partner (dp, ZeRO 1/2/3, full recompute) at the same
    wrong router gradients (0.449 relative), so the fault is cp with routed experts and their per-token
    statistics, not the pair."""
    from mcompile.ir.moe import moe_layers_of

    moe = moe_layers_of(cap.gm)
    if moe:
        raise ValueError(f"context parallelism (cp={mesh.size('cp')}) with mixture-of-experts layers ({len(moe)} "
                         "MoE layers) is not supported yet: its router gradients are wrong under cp "
                         "(docs/compositions.md). Split this model's tokens with dp, or use tp, pp and ep")


def attention_nodes(cap: Captured) -> list[torch.fx.Node]:
    return [n for n in cap.gm.graph.nodes if n.op == "call_function" and n.target is _SDPA]


def _has_mask(node) -> bool:
    return len(node.args) > 3 and node.args[3] is not None or node.kwargs.get("attn_mask") is not None


def resolve_cp_attention(choice: str, cap: Captured, mesh: Mesh, hints: dict) -> str:
    """The variant attention runs over cp: ``choice`` checked against the model, or for "auto" the cost
    model's cheapest among those that apply (an arbitrary mask: allgather only; Ulysses: heads % cp)."""
    cp, tp = mesh.size("cp"), mesh.size("tp")
    if choice not in ("auto", *VARIANTS):
        raise ValueError(f"cp_attention={choice!r}: use 'auto', 'ring', 'allgather' or 'a2a'")
    seq = hints.get(cap.symbols.get(SEQ)) if cap.symbols.get(SEQ) is not None else None
    if isinstance(seq, int):
        check_sequence(seq, cp)
        if mesh.size("tp") > 1 and (seq // cp) % tp:
            raise ValueError(f"each cp rank's {seq // cp} tokens are split over tp={tp} (sequence parallelism): "
                             f"use a sequence length that divides by {2 * cp} and by cp x tp = {cp * tp}")
    nodes = attention_nodes(cap)
    masked = [n.name for n in nodes if _has_mask(n)]
    heads = sorted({int(n.args[0].meta["val"].shape[1]) // tp for n in nodes})
    kv_heads = sorted({int(n.args[1].meta["val"].shape[1]) // tp for n in nodes})
    if masked and choice in ("ring", "a2a"):
        raise ValueError(
            f"cp_attention={choice!r} supports causal attention or none, and {', '.join(masked[:3])} take(s) a mask "
            "that is not the causal pattern (padding, a window): use cp_attention='allgather', which applies any "
            "mask to the gathered keys (or 'auto')")
    a2a_ok = all(h % cp == 0 for h in heads)
    if choice == "a2a" and not a2a_ok:
        h = heads[0] if heads else 0
        valid = [c for c in range(2, h + 1) if h % c == 0]
        where = f" (per tp rank: {h * tp} heads / tp={tp})" if tp > 1 else ""
        raise ValueError(f"cp_attention='a2a' (Ulysses) splits the {h} query heads{where} over cp={cp}: use cp in "
                         f"{{{', '.join(map(str, valid))}}} or cp_attention='ring' / 'allgather'")
    if choice != "auto":
        return choice
    if masked:
        return "allgather"
    candidates = [v for v in VARIANTS if v != "a2a" or a2a_ok]
    return _cheapest(candidates, cap, mesh, hints, heads, kv_heads, nodes)


def _cheapest(candidates, cap, mesh, hints, heads, kv_heads, nodes) -> str:
    """The cost model's pick (:func:`mcompile.cost.model.choose_cp_attention`) at the capture's sizes (the
    sequence hint; a symbolic sequence is priced at 4096 tokens a rank), among ``candidates``."""
    from mcompile.cost.model import Layout, choose_cp_attention

    if not nodes or len(candidates) == 1:
        return candidates[0]
    cp, tp = mesh.size("cp"), mesh.size("tp")
    sym = cap.symbols.get(SEQ)
    seq = hints.get(sym) if sym is not None else None
    if not isinstance(seq, int):
        seq = 4096 * cp
    q, k = nodes[0].args[0].meta["val"], nodes[0].args[1].meta["val"]
    layout = Layout(cp=cp, tp=tp, sequence_parallel=tp > 1)
    _, prices = choose_cp_attention(layout, seq=seq, heads=int(q.shape[1]), kv_heads=int(k.shape[1]),
                                    head_dim=float(q.shape[-1]), activation_bytes=q.element_size())
    priced = [v for v in candidates if v in prices]
    return min(priced, key=lambda v: (prices[v], candidates.index(v))) if priced else candidates[0]
