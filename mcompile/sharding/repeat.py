"""Plans at any depth: capture, plan and lower TWO of each run of repeated blocks, then repeat them (issue 18).

Capturing an 80-layer model costs torch.export ~40 s and propagation grows faster than the depth.
The layers of a transformer are one block repeated, and the planner is a forward walk whose choice
at a node depends only on where its inputs are (mcompile.sharding.propagate): layer ``j >= 1`` sees exactly
what layer 1 sees. So:

1. :func:`find_runs` — in every ``nn.ModuleList`` (not inside another list's blocks), the runs of
   ``reps >= 3`` consecutive *groups* of ``period`` blocks that are alike: a stack of identical layers is
   one run of period 1; a hybrid stack repeats a pattern (RETRO's ``retro, plain, plain`` from layer 5,
   a Mamba hybrid's ``Mamba, MLP``); an encoder-decoder or a vision-language model has a run in each
   stack. Blocks are alike when they differ in nothing but their parameters' values and their own index
   (per-layer attention types, a dense first layer break a run). :func:`truncate_runs` makes a shallow
   copy of the model keeping two groups of each run (the blocks keep their indices: FQNs are the real
   model's).
2. Capture, canonicalise (cp's attention rewrite included: the group is located in the graph that is
   planned and repeated) and plan the short model. :func:`find_block` locates each run's second group
   in the captured graph from the dataflow — the cuts before and after it that one value of the run
   crosses (besides values made before the run: encoder memory, masks, position bias, RoPE tables,
   shared by every layer; the value the run carries into its first group, the user's input itself, counts) —
   and checks it against the module structure (its parameters are the group's, every node the module stack
   files under the group lies inside it) and against the stretch of program before it, which must be its twin
   op for op (:func:`_twin`); else that run is captured whole (issue 37).
3. :func:`repeat_graph` copies the group's nodes ``reps - 2`` times after it: the group's input (the
   first group's output) becomes the previous copy's output, its parameters become the next group's
   placeholders (named as torch.export names them), values it reads from outside stay shared, what came
   after the run reads the last copy, and a per-layer side value collected in a list after the run
   (MoE load-balancing losses stacked for their mean) is collected from every copy. The same function
   expands the captured graph (the full model's graph, as a full capture gives it), the planner's
   per-node results (:func:`repeat_axes`), and each rank's lowered program (the lowering records which
   captured node each program node was emitted for: ``gm.meta["mc_emitted_for"]``), so per-rank programs
   are never lowered at full depth.

The full capture is the reference: tests/test_repeat.py checks plans and per-rank programs of deep
models against it. ``compile_plan(..., repeat_blocks=False)`` captures the whole model.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from mcompile.capture.export import Captured
from mcompile.ir import meta as M

__all__ = ["Run", "Block", "RepeatedCapture", "find_runs", "truncate_runs", "truncate", "uniform", "find_block",
           "repeat_graph", "repeat_axes", "repeat_captured", "repeat_lowered", "EMITTED_FOR", "copy_name"]

log = logging.getLogger("mcompile.repeat")
EMITTED_FOR, VALUE_OF = M.EMITTED_FOR, M.VALUE_OF
MAX_PERIOD = 8  # longest pattern of blocks looked for


def copy_name(name: str, j: int) -> str:
    """The name of node ``name``'s copy in group ``j`` (captured and lowered graphs alike)."""
    return f"{name}_L{j}"


# --------------------------------------------------------------------------- runs of alike blocks


def _facts(mod: torch.nn.Module) -> dict:
    """What a block is besides its parameter values: per submodule its type, its parameters' and
    buffers' shapes and dtypes, and its plain attributes."""
    out = {}
    for name, sub in mod.named_modules():
        out[(name, "type")] = type(sub).__name__
        for k, t in list(sub._parameters.items()) + list(sub._buffers.items()):
            if t is not None:
                out[(name, k)] = (tuple(t.shape), t.dtype)
        for k, v in vars(sub).items():
            if not k.startswith("_") and k != "training" and \
                    isinstance(v, bool | int | float | str | type(None) | tuple | list | dict | torch.dtype):
                out[(name, k)] = repr(v)
    return out


def _fingerprints(blocks: torch.nn.ModuleList) -> list[dict]:
    """Each block's facts less its index (an attribute equal to the block's position in every block,
    ``layer_idx``)."""
    facts = [_facts(b) for b in blocks]
    index = {k for k in facts[0] if all(f.get(k) == repr(i) for i, f in enumerate(facts))}
    return [{k: v for k, v in f.items() if k not in index} for f in facts]


def uniform(blocks: torch.nn.ModuleList) -> str | None:
    """None when every block is block 0 up to parameter values and its own index; else what differs."""
    fps = _fingerprints(blocks)
    for i, f in enumerate(fps[1:], 1):
        if f != fps[0]:
            key = next(k for k in sorted(set(f) | set(fps[0]), key=str) if f.get(k) != fps[0].get(k))
            return f"block {i} differs from block 0 in {'.'.join(p for p in key if p)}"
    return None


@dataclass(frozen=True)
class Run:
    """``reps`` consecutive groups of ``period`` alike blocks of the module list ``list_path``, the
    first group starting at its block ``start``."""

    list_path: str
    start: int
    period: int
    reps: int

    def group(self, g: int) -> range:
        """Block indices of group ``g``."""
        return range(self.start + g * self.period, self.start + (g + 1) * self.period)


def find_runs(blocks: torch.nn.ModuleList, keep: int = 2, list_path: str = "") -> list[Run]:
    """The runs of more than ``keep`` alike groups in ``blocks``, left to right: at each block the
    period (up to MAX_PERIOD) whose run leaves the most blocks out of the capture."""
    fps = _fingerprints(blocks)
    n, out, i = len(fps), [], 0
    while i < n:
        best = None  # (blocks saved, -period, reps)
        for p in range(1, min(MAX_PERIOD, (n - i) // (keep + 1)) + 1):
            r = 1
            while i + (r + 1) * p <= n and fps[i + r * p: i + (r + 1) * p] == fps[i: i + p]:
                r += 1
            if r > keep and (best is None or ((r - keep) * p, -p) > best[:2]):
                best = ((r - keep) * p, -p, r)
        if best is None:
            i += 1
            continue
        out.append(Run(list_path, i, -best[1], best[2]))
        i += best[2] * -best[1]
    return out


class _Kept(torch.nn.ModuleList):
    """A module list holding some of another's blocks under their own indices (so the short model's
    parameters have the real model's FQNs); integer indexing and slicing are by position."""

    def __getitem__(self, idx):
        mods = list(self._modules.values())
        return type(self)._of(mods[idx]) if isinstance(idx, slice) else mods[idx]

    @classmethod
    def _of(cls, mods):
        out = cls()
        for i, m in enumerate(mods):
            out._modules[str(i)] = m
        return out


def _replace(root: torch.nn.Module, path: str, new: torch.nn.Module, copied: set) -> torch.nn.Module:
    """``root`` with the submodule at ``path`` replaced, every module on the way shallow-copied once
    (``copied``: ids of the copies made so far); the user's modules are untouched."""
    if id(root) not in copied:
        root = copy.copy(root)
        root._modules = dict(root._modules)
        copied.add(id(root))
    *parts, last = path.split(".")
    cur = root
    for part in parts:
        child = cur._modules[part]
        if id(child) not in copied:
            child = copy.copy(child)
            child._modules = dict(child._modules)
            copied.add(id(child))
            cur._modules[part] = child
        cur = child
    cur._modules[last] = new
    return root


def truncate_runs(model: torch.nn.Module, keep: int = 2,
                  runs: Sequence[Run] | None = None) -> tuple[torch.nn.Module, list[Run]] | None:
    """A shallow copy of ``model`` keeping ``keep`` groups of each run (``runs``, or those of every module
    list not inside another list's blocks) and the runs; None when there is none."""
    if runs is None:
        runs, lists = [], []
        for name, mod in model.named_modules():
            if not name or not isinstance(mod, torch.nn.ModuleList) or len(mod) <= keep or \
                    any(name.startswith(p + ".") for p in lists):
                continue
            found = find_runs(mod, keep, name)
            if found:
                lists.append(name)
                runs += found
    runs = list(runs)
    if not runs:
        return None
    root, copied = model, set()
    for name in dict.fromkeys(r.list_path for r in runs):
        drop = {i for r in runs if r.list_path == name for i in range(r.start + keep * r.period,
                                                                       r.start + r.reps * r.period)}
        kept = _Kept()
        blocks = model.get_submodule(name)._modules
        for key, block in blocks.items():
            if int(key) not in drop:
                kept._modules[key] = block
        root = _replace(root, name, kept, copied)
        keep_idx = [i for i in range(len(blocks)) if i not in drop]
        memo: dict = {}
        for mod in _on_path(root, name):
            _cut_per_layer(mod, len(blocks), keep_idx, memo)
    return root, runs


def _on_path(root: torch.nn.Module, path: str) -> list[torch.nn.Module]:
    """``root`` and the modules from it down to (not including) the one at ``path``."""
    out, cur = [root], root
    for part in path.split(".")[:-1]:
        cur = cur._modules[part]
        out.append(cur)
    return out


def _cut_per_layer(mod, n: int, keep_idx: list[int], memo: dict, depth: int = 0) -> None:
    """The forward of the module holding a truncated list indexes its per-layer lists by the block's position
    (Gemma-3's ``for i, layer in enumerate(self.layers)``, then ``config.layer_types[i]`` picks the layer's
    mask and RoPE table): in the short copy, every list of ``n`` entries (one per block) it reads, directly or
    in a config object it holds, keeps the kept blocks' entries, so a block after a run still reads its own
    (a full-attention layer after three sliding ones read the sliding layers' RoPE table and mask). The
    configs are copied (``memo``: one copy of a shared config); the user's model and its blocks, which read
    the lists by their own index, keep the original."""
    for k, v in list(vars(mod).items()):
        if k.startswith("_") or isinstance(v, torch.nn.Module | torch.Tensor | type):
            continue
        if isinstance(v, list | tuple) and len(v) == n:
            vars(mod)[k] = [v[i] for i in keep_idx] if isinstance(v, list) else tuple(v[i] for i in keep_idx)
        elif depth < 2 and hasattr(v, "__dict__") and not callable(v) and not isinstance(v, torch.nn.Module) and \
                _has_per_layer(v, n, depth):
            if id(v) not in memo:
                memo[id(v)] = c = copy.copy(v)
                _cut_per_layer(c, n, keep_idx, memo, depth + 1)
            vars(mod)[k] = memo[id(v)]


def _has_per_layer(obj, n: int, depth: int) -> bool:
    for k, v in vars(obj).items():
        if k.startswith("_"):
            continue
        if isinstance(v, list | tuple) and len(v) == n:
            return True
        if depth < 1 and hasattr(v, "__dict__") and not callable(v) and \
                not isinstance(v, torch.nn.Module | torch.Tensor | type) and _has_per_layer(v, n, depth + 1):
            return True
    return False


def truncate(model: torch.nn.Module, keep: int = 2) -> tuple[torch.nn.Module, str, int] | None:
    """A shallow copy of ``model`` whose longest ``nn.ModuleList`` of same-type blocks keeps ``keep``
    of them, the list's path and its length; None when the model has no such list (the search's
    estimate of a stack's depth)."""
    best = None
    for name, mod in model.named_modules():
        if name and isinstance(mod, torch.nn.ModuleList) and len(mod) > keep and \
                len({type(c) for c in mod}) == 1 and (best is None or len(mod) > len(best[1])):
            best = (name, mod)
    if best is None:
        return None
    return _replace(model, best[0], torch.nn.ModuleList(list(best[1])[:keep]), set()), best[0], len(best[1])


# --------------------------------------------------------------------------- the block in the graph


@dataclass(frozen=True)
class Block:
    """Group ``keep-1`` of a run in a captured short model, and how many groups the real model has."""

    list_path: str  # the module list, "m.model.layers"
    keep: int  # groups captured
    depth: int  # groups of the real model
    nodes: tuple[str, ...]  # captured call_function nodes of the copied group, program order
    entry: str  # captured node whose value enters the group (the previous group's output)
    exit: str  # captured node the group ends with (its output)
    start: int = 0  # block index of the run's first group
    period: int = 1  # blocks per group

    @property
    def last(self) -> int:
        return self.keep - 1

    def index(self, i: int, j: int, groups: int = 1) -> int | None:
        """Group ``j``'s block index of the copied group's block ``i`` (None: not the group's). With
        ``groups=keep``, a block of an earlier captured group moves as far (a node the cut before the copied
        group files under the previous block, as a post-norm layer's last norm: in group ``j`` it is group
        ``j-1``'s)."""
        lo = self.start + (self.keep - groups) * self.period
        return i + (j - self.last) * self.period if lo <= i < self.start + self.keep * self.period else None

    def fqn(self, fqn: str, j: int) -> str | None:
        """Group ``j``'s name of the copied group's tensor ``fqn`` (None: not the group's own)."""
        head = self.list_path + "."
        if not fqn.startswith(head):
            return None
        idx, _, rest = fqn[len(head):].partition(".")
        new = self.index(int(idx), j) if idx.isdigit() and rest else None
        return None if new is None else f"{head}{new}.{rest}"

    def placeholder(self, name: str, fqn: str | None, j: int) -> str:
        """Group ``j``'s placeholder name, as torch.export names it (``p_<fqn with _>``)."""
        new = self.fqn(fqn, j) if isinstance(fqn, str) else None
        if new is not None:
            head = len(self.list_path) + 1
            old_h = _sanitize(f"{self.list_path}.{fqn[head:].partition('.')[0]}.")
            new_h = _sanitize(f"{self.list_path}.{new[head:].partition('.')[0]}.")
            m = re.search(rf"(?<![^_]){re.escape(old_h)}", name)
            if m:
                return name[: m.start()] + new_h + name[m.end():]
        return copy_name(name, j)

    def layer_path(self, path: str, j: int) -> str:
        """Module path ``<list>.<i>...`` of a node's ``nn_module_stack`` moved to group ``j``."""
        for sep, close in ((".", ""), ("[", "]")):
            m = re.match(rf"{re.escape(self.list_path)}{re.escape(sep)}(\d+){re.escape(close)}", path)
            if m:
                new = self.index(int(m.group(1)), j, self.keep)
                if new is not None:
                    return f"{self.list_path}{sep}{new}{close}" + path[m.end():]
        return path

    def layer(self, layer, j: int):
        """A node's layer index (M.LAYER, CollectiveSpec.layer) moved to group ``j``."""
        new = self.index(layer, j, self.keep) if isinstance(layer, int) else None
        return layer if new is None else new


def _sanitize(s: str) -> str:
    return re.sub(r"[^0-9a-zA-Z_]+", "_", s)


def _group_of(node: fx.Node, run: Run) -> int | None:
    """The block index of ``run``'s list that the node's module stack files it under (None: none)."""
    stack = node.meta.get("nn_module_stack")
    if not isinstance(stack, dict):
        return None
    pat = re.compile(rf"{re.escape(run.list_path)}(?:\.(\d+)|\[(\d+)\])(?:$|[.\[])")
    for v in stack.values():
        path = v[0] if isinstance(v, tuple) and v else v
        m = pat.match(path) if isinstance(path, str) else None
        if m:
            return int(m.group(1) or m.group(2))
    return None


def find_block(cap, run: Run, keep: int = 2) -> tuple[Block | None, str]:
    """Group ``keep-1`` of ``run`` in ``cap`` (a capture of the short model), or None and why not."""
    from mcompile.sharding.blocks import SIDE_FRACTION, _numel, _side

    g = cap.gm.graph
    nodes = [n for n in g.nodes if n.op == "call_function"]
    pos = {n: i for i, n in enumerate(nodes)}
    end = len(nodes)
    tables = {**cap.params, **cap.buffers}
    placeholders = {n.name: n for n in g.nodes if n.op == "placeholder"}

    def own(grp: int) -> set[fx.Node]:
        heads = tuple(f"{run.list_path}.{i}." for i in run.group(grp))
        return {placeholders[ph] for ph, fqn in tables.items() if fqn.startswith(heads) and ph in placeholders}

    def uses(phs) -> list[int]:
        return [pos[u] for ph in phs for u in ph.users if u in pos]

    first, second = own(keep - 2), own(keep - 1)
    u0, u1 = uses(first), uses(second)
    if not u0 or not u1:
        return None, "the short model's graph uses none of the run's parameters"
    attributed = {n: _group_of(n, run) for n in nodes}
    in_first = [pos[n] for n, b in attributed.items() if b in run.group(keep - 2)]
    f0 = min(u0 + in_first)  # the run begins: values made before it are shared by every group
    l0, f1, l1 = max(u0), min(u1), max(u1)
    if f1 <= l0:
        return None, "the run's groups interleave in the program"
    # The value the run carries into its first group (issue 37): made before the run (a user input, a view of it,
    # an embedding, a norm), read by the first group and not by the second — unlike the values every group reads
    # (masks, RoPE tables, encoder memory). It depends on no parameter when it is the user's input, and it was
    # made before the run: counted as neither, the first group's last residual add was no longer live across the
    # cut after its last parameter use, which then looked like the boundary (one value crossing), and the repeated
    # group added the raw input to the previous group's MLP output: a silent wrong loss.
    second_span = set(nodes[f1:l1 + 1]) | {n for n, b in attributed.items() if b in run.group(keep - 1)}
    before = [n for n in g.nodes if n.op == "placeholder" and n.name in cap.user_inputs] + nodes[:f0]
    carried: dict[fx.Node, int] = {}  # the run's input -> its last read in the first group
    for v in before:
        reads = [pos[u] for u in v.users if u in pos and f0 <= pos[u] < f1]
        if reads and not any(u in second_span for u in v.users):
            carried[v] = max(reads)
    dependent = set(cap.params) | {v.name for v in carried}
    for n in nodes:
        if any(a.name in dependent for a in n.all_input_nodes):
            dependent.add(n.name)
    starts = [[] for _ in range(end + 2)]
    stops = [[] for _ in range(end + 2)]
    for v, last in carried.items():
        starts[f0].append(v)
        stops[last + 1].append(v)
    for n in nodes[f0:]:
        if n.name in dependent and n.users:
            last = max(pos.get(u, end) for u in n.users)
            if last > pos[n]:
                starts[pos[n] + 1].append(n)
                stops[last + 1].append(n)
    live: dict[fx.Node, int] = {}
    crossing: dict[int, fx.Node] = {}  # cut -> the one run value crossing it (side values aside)
    for c in range(f0, end + 1):
        for n in stops[c]:
            live.pop(n, None)
        for n in starts[c]:
            live[n] = _numel(n) or 0
        if live:
            main = max(live, key=live.get)
            rest = sum(live.values()) - live[main]
            if len(live) == 1 or (live[main] > 1 and SIDE_FRACTION * rest <= live[main] and
                                  all(_side(n, main) for n in live if n is not main)):
                crossing[c] = main
    befores = [c for c in sorted(crossing) if l0 < c <= f1]  # as blocks.analyse cuts between layers
    afters = [c for c in sorted(crossing) if c > l1]
    if not befores or not afters:
        return None, "no cut before or after the run's second group that one value crosses"
    ctx = dict(g=g, nodes=nodes, pos=pos, f0=f0, tables=tables, second=second, run=run, keep=keep,
               attributed=attributed, dependent=dependent, carried=carried, crossing=crossing, constants=cap.constants)
    first_why = None
    for s1 in befores:  # the first pair of cuts whose group is the first group's twin (normally the first pair)
        for e1 in afters:
            block, why = _group_between(s1, e1, **ctx)
            if block is not None:
                return block, ""
            first_why = first_why or why
    return None, first_why


def _group_between(s1: int, e1: int, *, g, nodes, pos, f0, tables, second, run, keep, attributed, dependent,
                   carried, crossing, constants) -> tuple[Block | None, str]:
    """The group between cuts ``s1`` and ``e1`` of the call_function ``nodes`` (find_block), or None and why it
    may not be repeated."""
    members = nodes[s1:e1]
    order = {n: i for i, n in enumerate(g.nodes)}
    between = [n for n in list(g.nodes)[order[members[0]]:order[members[-1]]] if n.op != "call_function"]
    if between:  # repeat_graph copies one contiguous stretch of the program
        return None, (f"{between[0].name} ({between[0].op} {between[0].target}) lies among the second group's ops: "
                      "its nodes are not one stretch of the program")
    inside = set(members)
    entry, exit_ = crossing[s1], crossing[e1]
    if exit_ not in inside:
        return None, "the value leaving the second group is not made in it"
    used = {a for n in members for a in n.all_input_nodes if a.op == "placeholder" and a.name in tables}
    others = {a for a in used - second if tables[a.name].startswith(run.list_path + ".")}
    if others or second - used:
        return None, "the dataflow's group does not use exactly its blocks' parameters"
    for n in members:  # the cuts may move no-ops (a dtype cast, an assert) across a block boundary, never more
        b = attributed[n]
        if b is not None and b not in run.group(keep - 1) and any(
                a in carried or (a in pos and a.name in dependent and pos[a] < f0) for a in n.all_input_nodes):
            return None, f"{n.name} of block {b} lies inside the dataflow's group and reads a value from before the run"
    for n in members:
        for a in n.all_input_nodes:
            if a in pos and a not in inside and a is not entry and pos[a] >= f0 and a.name in dependent:
                return None, f"{n.name} reads {a.name}, a value the first group made besides its output"
        if n is exit_:
            continue
        for u in n.users:
            if u not in inside and (n in u.args or n in u.kwargs.values()):
                return None, f"{u.name} reads {n.name}, a value of the second group alone, after the run"
    why = _twin(nodes[:s1], members, entry, exit_, run, constants)
    if why:
        return None, why
    return Block(run.list_path, keep, run.reps, tuple(n.name for n in members), entry.name, exit_.name,
                 run.start, run.period), ""


def _twin(before: list[fx.Node], members: list[fx.Node], entry: fx.Node, exit_: fx.Node, run: Run,
          constants: dict) -> str:
    """'' when the stretch of the program ``before`` the group ends with one that computes from its input what the
    group ``members`` computes from ``entry``, op for op — so that ``entry`` is that stretch's output, and a copy of
    the group reading the previous copy's output is the next group; else why not. Tensor ops are compared (sizes
    and asserts aside: torch.export computes a symbolic size once, in the first layer that needs it, and asserts a
    no-op cast's metadata where it pleases), node for node: the ops and their non-tensor arguments are equal, and
    a tensor argument is the twin of the group's: the stretch's node in the same place for a node of the group, the
    one value the stretch reads where the group reads ``entry``, the block ``period`` earlier's parameter or buffer
    for the group's own, a lifted constant of the same shape for a constant, the same node for a value both read (a
    mask, a RoPE table); a size argument has the same value. Repetition is exact only then: a wrong boundary (issue
    37) or a layer whose program differs (given its index) gives a stretch that is not the group's twin, and the
    run is captured whole."""
    members = [m for m in members if _tensor_valued(m)]
    prev = [n for n in before if _tensor_valued(n)][-len(members):]
    if len(prev) != len(members):
        return "the program before the second group is shorter than the group: no first group to compare it with"
    index = {m: i for i, m in enumerate(members)}
    if exit_ not in index:
        return f"the value leaving the second group ({exit_.name}) is not a tensor"
    if prev[index[exit_]] is not entry:
        return (f"the value entering the second group ({entry.name}) is not the first group's counterpart of its "
                f"output ({exit_.name})")
    head = run.list_path + "."
    inputs: dict = {}  # the group's entry and constants -> the first group's
    mine = set(prev)

    def shifted(fqn) -> str | None:
        if not isinstance(fqn, str) or not fqn.startswith(head):
            return None
        idx, _, rest = fqn[len(head):].partition(".")
        return f"{head}{int(idx) + run.period}.{rest}" if idx.isdigit() and rest else None

    def same(a, b) -> bool:  # a: prev's argument, b: the group's
        if isinstance(b, fx.Node):
            if not isinstance(a, fx.Node):
                return False
            if not _tensor_valued(b):  # a size: the same value
                return a is b or (not _tensor_valued(a) and _size_key(a) == _size_key(b))
            if b in index:
                return a is prev[index[b]]
            if b is entry or b.name in constants:
                return inputs.setdefault(b, a) is a and (a not in mine if b is entry else (
                    a.name in constants and _shape(a) == _shape(b)))
            if a is b:
                return True
            fb = b.meta.get(M.PARAM_FQN) if b.op == "placeholder" else None
            return fb is not None and a.op == "placeholder" and shifted(a.meta.get(M.PARAM_FQN)) == fb
        if isinstance(b, list | tuple):
            return isinstance(a, list | tuple) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(b, dict):
            return isinstance(a, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in b)
        return type(a) is type(b) and a == b

    for p, m in zip(prev, members):
        if p.target != m.target or not same(p.args, m.args) or not same(p.kwargs, m.kwargs) or _shape(p) != _shape(m):
            return (f"{m.name} ({m.target}) of the second group is not the twin of {p.name} ({p.target}) the same "
                    "place before it: the groups compute different things (an argument that differs per layer: its "
                    "index) or their boundary is not where the dataflow put it")
    return ""


def _tensor_valued(n: fx.Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) or (isinstance(v, list | tuple) and any(isinstance(x, torch.Tensor) for x in v))


def _size_key(n: fx.Node):
    v = n.meta.get("val")
    return (type(v).__name__, str(v)) if v is not None else (n.op, str(n.target))


def _shape(n: fx.Node):
    """A node's shape and dtype as a key compared without guards: a data-dependent size (an unbacked symbol, a
    count of routed tokens) is a fresh symbol in each layer (u0 in one, u1 in its twin), so every such symbol
    reads the same; comparing the SymInts themselves would guard on the data (u0 == u1)."""
    v = n.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return None
    return tuple(d if isinstance(d, int) else re.sub(r"\bu\d+\b", "u", str(d)) for d in v.shape), v.dtype


def _expand(a, seq: dict[fx.Node, list[fx.Node]]):
    """An argument with each repeated node in a list replaced by its value in every group, and each
    repeated node given directly replaced by the last group's."""
    if isinstance(a, list | tuple):
        out = []
        for x in a:
            if isinstance(x, fx.Node) and x in seq:
                out += seq[x]
            else:
                out.append(_expand(x, seq))
        return type(a)(out)
    if isinstance(a, fx.Node) and a in seq:
        return seq[a][-1]
    return a


def repeat_graph(gm: fx.GraphModule, block: Block, members: list[fx.Node], entry: fx.Node, exit_: fx.Node,
                 origin_of=None) -> dict[str, list[str]]:
    """Copy ``members`` (group ``keep-1``'s nodes of ``gm``, contiguous) for groups ``keep..depth-1``
    after them. ``entry``: the node the group reads as its input; ``exit_``: its output. Placeholders
    of the group's own parameters and buffers get group ``j``'s (placed after the group's). Returns
    node name -> the names of its copies, group by group (placeholders included)."""
    g = gm.graph
    if not members:
        return {}
    order = {n: i for i, n in enumerate(g.nodes)}
    pos = [order[n] for n in members]
    if pos != list(range(pos[0], pos[0] + len(pos))):
        raise AssertionError("the repeated block's nodes are not contiguous in the program")
    inside = set(members)
    own = {}
    for ph in g.nodes:
        fqn = ph.meta.get(M.PARAM_FQN) if ph.op == "placeholder" else None
        if isinstance(fqn, str) and block.fqn(fqn, block.keep) is not None:
            own[ph] = fqn
    copies: dict[str, list[str]] = {n.name: [] for n in list(own) + members}
    seq: dict[fx.Node, list[fx.Node]] = {n: [n] for n in members}
    last_ph = max(own, key=lambda p: order[p]) if own else None
    prev_exit = exit_
    after = members[-1]
    paths: dict = {}
    for j in range(block.keep, block.depth):
        env: dict[fx.Node, fx.Node] = {}  # a node -> its copy in group j
        for ph, fqn in own.items():
            with g.inserting_after(last_ph):
                new = g.placeholder(block.placeholder(ph.name, fqn, j))
            new.meta.update(ph.meta)
            new.meta[M.PARAM_FQN] = block.fqn(fqn, j)
            env[ph] = new
            copies[ph.name].append(new.name)
            last_ph = new
        env[entry] = prev_exit
        for n in members:
            with g.inserting_after(after):
                new = g.node_copy(n, lambda a, env=env: env.get(a, a))
            want = copy_name(n.name, j)
            if new.name != want:
                new.name = want
            new.meta = dict(n.meta)
            _relabel(new, n, block, j, origin_of, paths)
            env[n] = new
            seq[n].append(new)
            copies[n.name].append(new.name)
            after = new
        prev_exit = env[exit_]
    # a per-group value reaching a list after the run through nodes of its own (a lowered program moves a
    # statistic split over the tokens at its consumer: all-reduce, divide) is collected through a copy of that
    # chain per group
    chains = _side_chains(g, members, inside, exit_, seq, order, block, origin_of)
    # what came after the run reads the last group; a list of per-group values, every group's
    users = {u: None for n in [*members, *chains] for u in n.users  # each once: a list may hold several
             if u not in inside and u not in chains and not u.meta.get(M.COPY)}
    for u in users:
        u.args = tuple(_expand(a, seq) for a in u.args)
        u.kwargs = {k: _expand(v, seq) for k, v in u.kwargs.items()}
    if origin_of is not None and block.depth > block.keep:  # a lowered program: what after the run is about
        names, j = set(block.nodes), block.depth - 1           # the group's values is about the last group's
        nodes = list(g.nodes)
        for n in nodes[nodes.index(after) + 1:]:
            if n in chains:  # group keep-1's own chain
                continue
            if n.meta.get(M.ORIGIN) in names:
                n.meta[M.ORIGIN] = origin_of(n.meta[M.ORIGIN], j)
                n.meta[M.LAYER] = block.layer(n.meta.get(M.LAYER), j)
            for key in (M.COLLECTIVE, M.COLLECTIVES):
                specs = n.meta.get(key)
                moved = [dataclasses.replace(sp, origin=origin_of(sp.origin, j), layer=block.layer(sp.layer, j))
                         if sp.origin in names else sp for sp in (specs if isinstance(specs, list) else [specs])
                         if sp is not None]
                if moved:
                    n.meta[key] = moved if isinstance(specs, list) else moved[0]
    _clear_copy_marks(gm)
    gm.recompile()
    return copies


def _side_chains(g: fx.Graph, members: list[fx.Node], inside: set, exit_: fx.Node, seq: dict, order: dict,
                 block: Block, origin_of) -> set[fx.Node]:
    """Per-group side values collected in a list after the run through nodes of their own, e.g. a per-token
    statistic (an MoE z-loss: the mean over the tokens of ``logsumexp(router logits)^2``) split over a data axis
    (ep, sp, cp), whose lowering all-reduces and divides it where the list reads it — nodes emitted for the
    list's consumer, outside the group. Such a chain (every node after the run, reading only group values,
    values from before the run and chain nodes) is copied once per further group, reading that group's
    values, and the list gets every group's end of it: ``seq`` grows by the chain's nodes. A chain reading the
    group's output (the stream the next group reads, e.g. per-layer hidden states) is not one. Without this the
    list would hold the last group's value once in place of every repeated group's (the chain's input is a
    group value read directly, which means the last group's). Returns the chain nodes (group ``keep-1``'s,
    the originals); a chain node read elsewhere than by the chain or a list reads the last group's copy."""
    first = order[members[0]]
    derived: set[fx.Node] = set()  # nodes after the run computed from group values (and shared ones) only
    end = order[members[-1]]
    for n in g.nodes:
        if n in inside or n.meta.get(M.COPY) or n.op != "call_function" or order.get(n, -1) <= end:
            continue
        ins = n.all_input_nodes
        if any(a in inside or a in derived for a in ins) and all(
                a in inside or a in derived or (a in order and order[a] < first) for a in ins):
            derived.add(n)
    chains: set[fx.Node] = set()
    for user in list(g.nodes):
        if user in inside or user.meta.get(M.COPY):
            continue
        lists = [a for a in (*user.args, *user.kwargs.values()) if isinstance(a, list | tuple)]
        for x in (x for lst in lists for x in lst if isinstance(x, fx.Node) and x in derived):
            if x in seq:
                continue
            chain, todo = set(), [x]  # x's ancestors among the derived nodes
            while todo:
                y = todo.pop()
                if y in derived and y not in chain:
                    chain.add(y)
                    todo += y.all_input_nodes
            if any(exit_ in y.all_input_nodes for y in chain):
                continue
            ordered = sorted(chain, key=lambda y: order[y])
            env: dict = {}
            for j in range(1, len(next(iter(seq.values())))):
                env = {m: seq[m][j] for m in inside}
                with g.inserting_before(user):
                    for y in ordered:
                        new = g.node_copy(y, lambda a, env=env: env.get(a, a))
                        new.name = copy_name(y.name, block.keep + j - 1)
                        new.meta = dict(y.meta)
                        _relabel(new, y, block, block.keep + j - 1, origin_of)
                        env[y] = new
                        seq.setdefault(y, [y]).append(new)
            for y in ordered:  # read directly (not in a list) after the run: the last group's, as a group value
                for u in list(y.users):
                    if u not in chain and not u.meta.get(M.COPY) and not any(
                            isinstance(a, list | tuple) and y in a for a in (*u.args, *u.kwargs.values())):
                        u.replace_input_with(y, env[y])
            chains |= chain
    return chains


def _relabel(new: fx.Node, old: fx.Node, block: Block, j: int, origin_of, paths: dict | None = None) -> None:
    """``paths``: a memo of ``block.layer_path`` by (path, j), shared over one repeat (a layer's nodes repeat a few
    module paths: the regular expression ran once per node and path, a third of repeating a 32-layer program)."""
    new.meta[M.COPY] = True
    stack = old.meta.get("nn_module_stack")
    if isinstance(stack, dict):
        paths = {} if paths is None else paths

        def moved_path(p: str) -> str:
            got = paths.get((p, j))
            if got is None:
                got = paths[(p, j)] = block.layer_path(p, j)
            return got

        new.meta["nn_module_stack"] = {k: (moved_path(v[0]), *v[1:]) if isinstance(v, tuple) and v
                                       and isinstance(v[0], str) else v for k, v in stack.items()}
    if old.meta.get(M.LAYER) is not None:
        new.meta[M.LAYER] = block.layer(old.meta[M.LAYER], j)
    if M.ORIGIN in old.meta and origin_of is not None:
        new.meta[M.ORIGIN] = origin_of(old.meta[M.ORIGIN], j)

    def moved(spec):
        return dataclasses.replace(spec, node=new.name, origin=origin_of(spec.origin, j) if origin_of else spec.origin,
                                   layer=block.layer(spec.layer, j))

    spec = old.meta.get(M.COLLECTIVE)
    if spec is not None:
        new.meta[M.COLLECTIVE] = moved(spec)
    if old.meta.get(M.COLLECTIVES):
        new.meta[M.COLLECTIVES] = [moved(s) for s in old.meta[M.COLLECTIVES]]


def _clear_copy_marks(gm: fx.GraphModule) -> None:
    for n in gm.graph.nodes:
        n.meta.pop(M.COPY, None)


def captured_origin(block: Block):
    """Captured name mapping of the copies: a group node -> its copy in group j; the group's entry
    (the previous group's output) -> the previous group's exit."""
    names = set(block.nodes)

    def of(name: str, j: int) -> str:
        if name in names:
            return copy_name(name, j)
        if name == block.entry:
            return block.exit if j == block.keep else copy_name(block.exit, j - 1)
        return name
    return of


def repeat_captured(cap: Captured, blocks: Sequence[Block], model: torch.nn.Module):
    """The short capture ``cap`` grown to the model's depth (``cap`` itself untouched): a
    :class:`RepeatedCapture` whose parameter and buffer tables and state (read from ``model``, whose
    blocks the short capture never saw) are the full model's; and node name -> its copies' names."""
    g = fx.Graph()
    out, out_node = g.graph_copy(cap.gm.graph, {}, return_output_node=True)
    g.output(out).meta.update(out_node.meta)
    from mcompile.passes.nodes import lazy_module

    gm = lazy_module(cap.gm, g)  # grown by repeat_graph first: its code is made when read
    if [n.name for n in g.nodes] != [n.name for n in cap.gm.graph.nodes]:
        raise AssertionError("copying the captured graph renamed its nodes")
    copies: dict[str, list[str]] = {}
    for block in blocks:
        by = {n.name: n for n in g.nodes}
        gone = [n for n in (*block.nodes, block.entry, block.exit) if n not in by]
        if gone:  # the planned graph is not the one the block was found in: repeating it would be wrong
            raise AssertionError(
                f"the repeated group of {block.list_path} names nodes the captured graph no longer has "
                f"({', '.join(gone[:3])}{', ...' if len(gone) > 3 else ''}): every rewrite of the captured graph "
                "must run before find_block (the canonicalize_attention pass of mcompile.compiler)")
        copies.update(repeat_graph(gm, block, [by[n] for n in block.nodes], by[block.entry], by[block.exit]))
    # tables in placeholder order
    params, buffers, constants = {}, {}, {}
    source = {c: k for k, v in copies.items() for c in v}
    for ph in (n for n in g.nodes if n.op == "placeholder"):
        fqn = ph.meta.get(M.PARAM_FQN)
        if ph.name in cap.params:
            params[ph.name] = cap.params[ph.name]
        elif ph.name in cap.buffers:
            buffers[ph.name] = cap.buffers[ph.name]
        elif ph.name in cap.constants:
            constants[ph.name] = cap.constants[ph.name]
        else:
            src = source.get(ph.name)
            if src in cap.params:
                params[ph.name] = fqn
            elif src in cap.buffers:
                buffers[ph.name] = fqn
            elif src in cap.constants:  # a tensor the layer makes in forward (HF attention's lifted
                constants[ph.name] = cap.constants[src]  # constants): a uniform block's copies are equal
    fields = {f.name: getattr(cap, f.name) for f in dataclasses.fields(cap)}
    fields.update(gm=gm, params=params, buffers=buffers, constants=constants)
    # a non-persistent buffer (OpenAI-GPT's per-layer causal mask) is not in the state dict, and a copied layer's is
    # not in the short model's constants either: the model's own buffers, every name
    state = {**dict(model.named_buffers(remove_duplicate=False)), **model.state_dict(keep_vars=True)}
    return RepeatedCapture(**fields, model_state=state, blocks=tuple(blocks)), copies


@dataclass
class RepeatedCapture(Captured):
    """A short model's capture grown to the real depth: ``ep`` is the short model's exported program,
    so the state comes from the model itself."""

    model_state: dict = dataclasses.field(default_factory=dict)
    blocks: tuple[Block, ...] = ()

    def state_values(self) -> dict[str, torch.Tensor]:
        out = {}
        for ph, fqn in {**self.params, **self.buffers}.items():
            out[ph] = self.model_state[fqn] if fqn in self.model_state else self.ep.constants[fqn]
        for ph, name in self.constants.items():
            out[ph] = self.ep.constants[name]
        return out


def repeat_axes(axes, copies: dict[str, list[str]]) -> None:
    """The planner's per-node results of the short capture extended to the copies (in place)."""
    for ap in axes:
        r = ap.result
        for d in (r.placements, r.strategies, r.params, r.padded, r.notes):
            for name, names in copies.items():
                if name in d:
                    for c in names:
                        d[c] = d[name]


def repeat_lowered(gm: fx.GraphModule, blocks: Sequence[Block]) -> fx.GraphModule:
    """A rank's program lowered from the short capture, grown to the model's depth (in place)."""
    emitted = gm.meta.get(EMITTED_FOR)
    value_of = gm.meta.get(VALUE_OF)
    if emitted is None or value_of is None:
        raise AssertionError("repeat_lowered needs a program from passes.lower (it records what it emitted for)")
    for block in blocks:
        names = set(block.nodes)
        members = [n for n in gm.graph.nodes if emitted.get(n.name) in names]
        by = {n.name: n for n in gm.graph.nodes}
        entry, exit_ = by[value_of[block.entry]], by[value_of[block.exit]]
        repeat_graph(gm, block, members, entry, exit_, origin_of=captured_origin(block))
    gm.meta.pop(EMITTED_FOR, None)
    gm.meta.pop(VALUE_OF, None)
    return gm
