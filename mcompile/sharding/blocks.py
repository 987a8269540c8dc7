"""Structure of a captured graph: its trunk, its narrow points and its repeated blocks.

Found from the dataflow alone, never from module names (the pipeline partitioner and the search
build on it):

- **Trunk**: the call_function nodes in program order. A node is *input-only* when it depends on
  no parameter (causal masks, position ids, RoPE tables, the token count of the labels): such
  values can be recomputed wherever they are needed, so they never have to cross a pipeline cut.
  Every other node is an *activation*.
- **Narrow point** ``i``: the cut just before trunk position ``i`` across which one activation is
  live (defined before ``i``, used at or after it) — beside, at most, *side values*: tensors whose
  size does not grow with the batch or the sequence (no symbolic dimension; in a capture of static
  shapes, single elements), together under ``1/SIDE_FRACTION`` of the activation: a layer's scalar
  load-balancing loss kept for a mean over the layers. (A norm's per-token statistic grows with the
  tokens: no cut inside a norm.) In a pre-norm transformer these are the residual stream between
  layers and, inside a layer, between attention and MLP. The pipeline sends the side values with the
  activation (passes/pp/pipeline_split.py sends whatever crosses a cut).
- **Repeated blocks**: parameters are listed in order of first use, each with a signature (its
  shape and dtype, the op that consumes it); the longest run of ``k >= 2`` repetitions of one
  period of signatures is the stack of transformer layers (``k`` layers). The first layer begins
  at the last narrow point before its first parameter is used; every other boundary (and the end
  of the last layer) is the first narrow point after the previous layer's last parameter use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch.fx as fx

__all__ = ["Trunk", "analyse"]

# side values may cross a narrow point beside its activation while together this many times smaller
SIDE_FRACTION = 4


@dataclass
class Trunk:
    nodes: list[fx.Node]  # call_function nodes, program order
    pos: dict[str, int]  # node name -> trunk position
    input_only: set[str]  # names of nodes that depend on no parameter
    narrow: list[int]  # narrow points (cut before trunk position i), increasing
    crossing: dict[int, str]  # narrow point -> the activation live across it (the largest; side values aside)
    layer_starts: list[int] = field(default_factory=list)  # narrow point where each repeated block begins
    layers_end: int | None = None  # narrow point after the last block (start of the head)
    period: int = 0  # parameters per block
    # every run of repeated blocks (the one above among them), in program order: (block starts, end)
    runs: list[tuple[list[int], int | None]] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        return len(self.layer_starts)

    def layer_of(self, position: int) -> float:
        """Where trunk ``position`` lies in layer units: 0.0 = start of the first block,
        ``num_layers`` = end of the last one; negative in the embedding, beyond in the head."""
        starts = self.layer_starts + [self.layers_end if self.layers_end is not None else len(self.nodes)]
        if not self.layer_starts:
            return 0.0
        if position < starts[0]:
            return -1.0
        for i in range(len(starts) - 1):
            if starts[i] <= position < starts[i + 1]:
                return i + (position - starts[i]) / max(1, starts[i + 1] - starts[i])
        return float(len(self.layer_starts))


def _signature(ph: fx.Node, user: fx.Node) -> tuple:
    val = ph.meta.get("val")
    shape = tuple(str(s) for s in getattr(val, "shape", ()))
    return shape, str(getattr(val, "dtype", "")), str(user.target), user.args.index(ph) if ph in user.args else -1


def analyse(gm: fx.GraphModule, params: set[str] | dict) -> Trunk:
    """Trunk, narrow points and repeated blocks of a captured graph; ``params`` are the
    placeholder names of the parameters."""
    params = set(params)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    pos = {n.name: i for i, n in enumerate(nodes)}
    end = len(nodes)
    dependent: set[str] = set(params)
    for n in nodes:
        if any(a.name in dependent for a in n.all_input_nodes):
            dependent.add(n.name)
    input_only = {n.name for n in nodes if n.name not in dependent}
    # liveness of activations across each cut: live on (def, last use]
    starts: list[list[str]] = [[] for _ in range(end + 2)]
    stops: list[list[str]] = [[] for _ in range(end + 2)]
    for n in nodes:
        if n.name not in dependent:
            continue
        uses = [pos.get(u.name, end) for u in n.users]  # the output node counts as the end
        if not uses:
            continue
        last = max(uses)
        if last > pos[n.name]:
            starts[pos[n.name] + 1].append(n.name)
            stops[last + 1].append(n.name)
    size = {n.name: _numel(n) for n in nodes}
    live: dict[str, int] = {}
    narrow, crossing = [], {}
    live_at: list[dict[str, int]] = []  # cut i -> the activations live across it
    seen_activation = False
    for i in range(end + 1):
        for k in stops[i]:
            live.pop(k, None)
        for k in starts[i]:
            live[k] = size[k]
        live_at.append(dict(live))
        if i and nodes[i - 1].name in dependent:
            seen_activation = True
        if i < end and seen_activation:
            main = _one_crossing(live, nodes, pos)
            if main is not None:
                narrow.append(i)
                crossing[i] = main
    trunk = Trunk(nodes, pos, input_only, narrow, crossing)
    _find_blocks(trunk, gm, params, live_at)
    return trunk


def _one_crossing(live: dict[str, int], nodes: list[fx.Node], pos: dict[str, int]) -> str | None:
    """The activation crossing a cut where ``live`` are live, when it is one (beside side values)."""
    if not live:
        return None
    main = max(live, key=lambda k: live[k] or 0)
    rest = sum(v or 0 for v in live.values()) - (live[main] or 0)
    side_ok = all(v is not None and _side(nodes[pos[k]], nodes[pos[main]]) for k, v in live.items()
                  if k != main)  # a size (SymInt) may not cross
    return main if len(live) == 1 or (side_ok and live[main] > 1 and SIDE_FRACTION * rest <= live[main]) else None


def _numel(n: fx.Node) -> int | None:
    """Elements of ``n``'s value (its tensors'), sizes at their example values (the capture's hints);
    None when it is not all tensors (a size)."""
    vals = n.meta.get("val")
    vals = vals if isinstance(vals, list | tuple) else [vals]
    total = 0
    for v in vals:
        shape = getattr(v, "shape", None)
        if shape is None:
            return None
        k = 1
        for d in shape:  # never int() a SymInt: that guards, specialising the capture's shapes to its hints
            k *= d if isinstance(d, int) else (getattr(d.node, "hint", None) or 1024)
        total += k
    return total


def _symbolic(n: fx.Node) -> bool:
    return any(not isinstance(d, int) for d in getattr(n.meta.get("val"), "shape", ()))


def _side(n: fx.Node, main: fx.Node) -> bool:
    """``n`` may cross a cut beside ``main`` (module docstring): its size does not grow with the tokens."""
    v = n.meta.get("val")
    if not hasattr(v, "shape") or _symbolic(n):
        return False
    return _symbolic(main) or v.numel() == 1


def _find_blocks(trunk: Trunk, gm: fx.GraphModule, params: set[str], live_at: list[dict[str, int]]) -> None:
    first_use: list[tuple[int, fx.Node, fx.Node]] = []
    for ph in gm.graph.nodes:
        if ph.op == "placeholder" and ph.name in params:
            users = [u for u in ph.users if u.name in trunk.pos]
            if users:
                u = min(users, key=lambda u: trunk.pos[u.name])
                first_use.append((trunk.pos[u.name], ph, u))
    first_use.sort(key=lambda t: t[0])
    sigs = [_signature(ph, u) for _, ph, u in first_use]
    names = [ph.name for _, ph, _ in first_use]
    last_use: dict[str, int] = {}
    for _, ph, _ in first_use:
        last_use[ph.name] = max(trunk.pos[u.name] for u in ph.users if u.name in trunk.pos)

    def add_run_cuts(start: int, period: int, k: int) -> None:
        """Narrow points of the run counting only values made since it began: what every block reads from
        before the run (a decoder's encoder memory and position bias) crosses each of its cuts beside the
        residual stream, as it travels with each microbatch through a pipeline."""
        f0, last = first_use[start][0], first_use[start + (k - 1) * period][0]
        context = {v for v in live_at[f0] if trunk.pos[v] < f0 and v in live_at[last]}
        if not context:
            return
        lo = max(trunk.pos[v] for v in context) + 1
        hi = next((c for c in range(last, len(live_at)) if not context & set(live_at[c])), len(live_at) - 1)
        for c in range(lo, hi + 1):
            if c not in trunk.crossing and c < len(trunk.nodes):
                main = _one_crossing({v: n for v, n in live_at[c].items() if v not in context}, trunk.nodes,
                                     trunk.pos)
                if main is not None:
                    trunk.crossing[c] = main
        trunk.narrow[:] = sorted(trunk.crossing)

    def before(position: int) -> int | None:
        narrow = trunk.narrow
        ok = [p for p in narrow if p <= position]
        return ok[-1] if ok else None

    def after(position: int) -> int | None:
        ok = [p for p in trunk.narrow if p > position]
        return ok[0] if ok else None

    def layers(start: int, period: int, k: int) -> tuple[list[int], int | None] | None:
        """Narrow points where each of the run's k blocks begins, and the one after the last (or None)."""
        def block_end(b: int) -> int | None:  # the first narrow point after the last use of block b's parameters
            return after(max(last_use[names[start + b * period + j]] for j in range(period)))

        starts = [before(first_use[start][0])] + [block_end(b) for b in range(k - 1)]
        if any(a is None for a in starts) or any(b <= a for a, b in zip(starts[:-1], starts[1:])):
            return None  # blocks that no narrow point separates: no layer structure to cut at
        end = block_end(k - 1)
        return starts, (None if end is not None and end <= starts[-1] else end)

    main = _best_run(sigs, names, 0, len(sigs))
    if main is None:
        return
    add_run_cuts(*main)
    found = layers(*main)
    if found is None:
        return
    trunk.layer_starts, trunk.layers_end = found
    trunk.period = main[1]
    # the other runs (a second stack: a decoder beside its encoder, a language model after its vision tower;
    # a hybrid stack's other patterns), each of blocks of >= 2 parameters, in the parameters before and after
    trunk.runs = [found]
    spans = [(0, main[0]), (main[0] + main[1] * main[2], len(sigs))]
    while spans:
        lo, hi = spans.pop()
        run = _best_run(sigs, names, lo, hi, min_period=2)
        if run is None:
            continue
        add_run_cuts(*run)
        other = layers(*run)
        if other is not None:
            trunk.runs.append(other)
        spans += [(lo, run[0]), (run[0] + run[1] * run[2], hi)]
    trunk.runs.sort()


def _best_run(sigs: list, names: list[str], lo: int, hi: int, min_period: int = 1) -> tuple[int, int, int] | None:
    """(start, period, k): the run of ``k >= 2`` repetitions of one period of signatures in ``sigs[lo:hi]``
    covering the most parameters (module docstring); None when there is none."""

    def coherence(start: int, period: int, k: int) -> int:
        """How much each block's parameters share a module: the common name prefix of its first and last
        parameter, summed. Breaks ties between alignments of equal coverage: a post-LN encoder's embedding
        LayerNorm has the signature of each layer's last LayerNorm, and the blocks shifted by it
        (embeddings.ln + layer 0 but its ln_2, ...) cover as many parameters as the layers themselves."""
        return sum(len(os.path.commonprefix([names[start + b * period], names[start + (b + 1) * period - 1]]))
                   for b in range(k))

    n = hi - lo
    best = (0, 0, 0, 0)  # (coverage, -period, coherence, -start) maximised
    for period in range(min_period, n // 2 + 1):
        run = [0] * (n + 1)  # run[j]: how many consecutive equal pairs sig[j+t] == sig[j+t+period]
        for j in range(n - period - 1, -1, -1):
            run[j] = run[j + 1] + 1 if sigs[lo + j] == sigs[lo + j + period] else 0
        for start in range(n - period):
            k = 1 + run[start] // period
            if k >= 2 and (k * period, -period) >= best[:2]:
                key = (k * period, -period, coherence(lo + start, period, k), -(lo + start))
                if key > best:
                    best = key
    if not best[0]:
        return None
    return -best[3], -best[1], best[0] // -best[1]
