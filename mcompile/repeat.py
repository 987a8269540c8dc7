"""Plans at any depth: capture, plan and lower ONE repeated block, then repeat it (issue 18).

Capturing an 80-layer model costs torch.export ~40 s and propagation grows faster than the depth.
The layers of a transformer are one block repeated, and the planner is a forward walk whose choice
at a node depends only on where its inputs are (mcompile.propagate): layer ``j >= 1`` sees exactly
what layer 1 sees. So:

1. :func:`truncate` — a shallow copy of the model whose longest ``nn.ModuleList`` of same-type blocks
   keeps ``keep`` (2) of them. :func:`uniform` refuses lists whose blocks differ in anything but their
   parameters' values and their own index (per-layer attention types, a dense first layer): those are
   captured whole.
2. Capture, canonicalise and plan the short model. :func:`find_block` locates block ``keep-1`` in the
   captured graph from the dataflow (mcompile.blocks: repeated parameter signatures between narrow
   points) and checks it is the module list's block (its parameters are ``<list>.<keep-1>.*``).
3. :func:`repeat_graph` copies the block's nodes ``depth - keep`` times after it: the block's input
   (block ``keep-2``'s output) becomes the previous copy's output, its parameters become the next
   layer's placeholders (``<list>.<j>.*``, named as torch.export names them), values it reads from
   outside (masks, RoPE tables, sizes: input-only, identical for every layer) stay shared, and what
   came after the block reads the last copy. The same function expands the captured graph (the full
   model's graph, as a full capture gives it), the planner's per-node results (:func:`repeat_axes`),
   and each rank's lowered program (the lowering records which captured node each program node was
   emitted for: ``gm.meta["mc_emitted_for"]``), so per-rank programs are never lowered at full depth.

The full capture is the reference: tests/test_repeat.py checks plans and per-rank programs of deep
models against it. ``compile_plan(..., repeat_blocks=False)`` captures the whole model.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from mcompile import meta as M
from mcompile.capture import Captured

__all__ = ["Block", "RepeatedCapture", "truncate", "uniform", "find_block", "repeat_graph", "repeat_axes",
           "repeat_captured", "repeat_lowered", "EMITTED_FOR", "copy_name"]

log = logging.getLogger("mcompile.repeat")
EMITTED_FOR, VALUE_OF = M.EMITTED_FOR, M.VALUE_OF


def copy_name(name: str, j: int) -> str:
    """The name of node ``name``'s copy in layer ``j`` (captured and lowered graphs alike)."""
    return f"{name}_L{j}"


def _longest_list(model: torch.nn.Module, keep: int):
    best = None
    for name, mod in model.named_modules():
        if name and isinstance(mod, torch.nn.ModuleList) and len(mod) > keep and \
                len({type(c) for c in mod}) == 1 and (best is None or len(mod) > len(best[1])):
            best = (name, mod)
    return best


def truncate(model: torch.nn.Module, keep: int = 2) -> tuple[torch.nn.Module, str, int] | None:
    """A shallow copy of ``model`` whose longest ``nn.ModuleList`` of same-type blocks keeps ``keep``
    of them (parameters shared, the user's module untouched), the list's path and its length; None
    when the model has no such list."""
    best = _longest_list(model, keep)
    if best is None:
        return None
    *path, last = best[0].split(".")
    root = copy.copy(model)
    root._modules = dict(root._modules)
    cur = root
    for part in path:
        child = copy.copy(cur._modules[part])
        child._modules = dict(child._modules)
        cur._modules[part] = child
        cur = child
    cur._modules[last] = torch.nn.ModuleList(list(best[1])[:keep])
    return root, best[0], len(best[1])


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


def uniform(blocks: torch.nn.ModuleList) -> str | None:
    """None when every block is block 0 up to parameter values and its own index (an attribute equal
    to the block's position in every block, ``layer_idx``); else what differs."""
    facts = [_facts(b) for b in blocks]
    index = {k for k in facts[0] if all(f.get(k) == repr(i) for i, f in enumerate(facts))}
    ref = {k: v for k, v in facts[0].items() if k not in index}
    for i, f in enumerate(facts[1:], 1):
        f = {k: v for k, v in f.items() if k not in index}
        if f != ref:
            key = next(k for k in sorted(set(f) | set(ref), key=str) if f.get(k) != ref.get(k))
            return f"block {i} differs from block 0 in {'.'.join(p for p in key if p)}"
    return None


@dataclass(frozen=True)
class Block:
    """Block ``keep-1`` of a captured short model, and how deep the real model is."""

    list_path: str  # the module list, "m.model.layers"
    keep: int  # blocks captured
    depth: int  # blocks of the real model
    nodes: tuple[str, ...]  # captured call_function nodes of the copied block, program order
    entry: str  # captured node whose value enters the block (the previous block's output)
    exit: str  # captured node the block ends with (its output)

    @property
    def last(self) -> int:
        return self.keep - 1

    def fqn(self, fqn: str, j: int) -> str | None:
        """Layer ``j``'s name of block ``keep-1``'s tensor ``fqn`` (None: not the block's own)."""
        head = f"{self.list_path}.{self.last}."
        return f"{self.list_path}.{j}.{fqn[len(head):]}" if fqn.startswith(head) else None

    def placeholder(self, name: str, j: int) -> str:
        """Layer ``j``'s placeholder name, as torch.export names it (``p_<fqn with _>``)."""
        old = _sanitize(f"{self.list_path}.{self.last}.")
        new = _sanitize(f"{self.list_path}.{j}.")
        return name.replace(old, new, 1) if old in name else copy_name(name, j)

    def layer_path(self, path: str, j: int) -> str:
        """Module path ``<list>.<keep-1>...`` of a node's ``nn_module_stack`` moved to layer ``j``."""
        for old, new in ((f"{self.list_path}.{self.last}", f"{self.list_path}.{j}"),
                         (f"{self.list_path}[{self.last}]", f"{self.list_path}[{j}]")):
            if path == old or path.startswith((old + ".", old + "[")):
                return new + path[len(old):]
        return path


def _sanitize(s: str) -> str:
    return re.sub(r"[^0-9a-zA-Z_]+", "_", s)


def find_block(cap, list_path: str, keep: int, depth: int) -> Block | None:
    """Block ``keep-1`` of ``cap`` (a capture of the short model), or None when the dataflow does not
    show ``keep`` blocks made of the list's parameters."""
    from mcompile.blocks import analyse

    trunk = analyse(cap.gm, cap.params)
    if trunk.num_layers != keep:
        return None
    starts = trunk.layer_starts + [trunk.layers_end if trunk.layers_end is not None else len(trunk.nodes)]
    a, b = starts[keep - 1], starts[keep]
    nodes = trunk.nodes[a:b]
    if not nodes or a not in trunk.crossing or b not in trunk.crossing:
        return None
    entry, exit_ = trunk.crossing[a], trunk.crossing[b]
    names = {n.name for n in nodes}
    if exit_ not in names:
        return None
    head = f"{list_path}.{keep - 1}."
    used = {p.name for n in nodes for p in n.all_input_nodes if p.op == "placeholder" and p.name in cap.params}
    own = {ph for ph, fqn in cap.params.items() if fqn.startswith(head)}
    foreign = {p for p in used - own if cap.params[p].startswith(f"{list_path}.")}  # another block's
    if not used & own or foreign or own - used:
        return None  # the dataflow's block is not the module list's block keep-1
    return Block(list_path, keep, depth, tuple(n.name for n in nodes), entry, exit_)


def repeat_graph(gm: fx.GraphModule, block: Block, members: list[fx.Node], entry: fx.Node, exit_: fx.Node,
                 origin_of=None) -> dict[str, list[str]]:
    """Copy ``members`` (block ``keep-1``'s nodes of ``gm``, contiguous) for layers ``keep..depth-1``
    after them. ``entry``: the node the block reads as its input; ``exit_``: its output. Placeholders
    of the block's own parameters and buffers get layer ``j``'s (placed after the block's). Returns
    node name -> the names of its copies, layer by layer (placeholders included)."""
    g = gm.graph
    if not members:
        return {}
    order = {n: i for i, n in enumerate(g.nodes)}
    pos = [order[n] for n in members]
    if pos != list(range(pos[0], pos[0] + len(pos))):
        raise AssertionError("the repeated block's nodes are not contiguous in the program")
    inside = set(members)
    phs = [n for n in g.nodes if n.op == "placeholder"]
    own = {}
    for ph in phs:
        fqn = ph.meta.get(M.PARAM_FQN)
        if isinstance(fqn, str) and block.fqn(fqn, block.keep) is not None:
            own[ph] = fqn
    copies: dict[str, list[str]] = {n.name: [] for n in list(own) + members}
    last_ph = max(own, key=lambda p: order[p]) if own else None
    prev_exit = exit_
    after = members[-1]
    env: dict[fx.Node, fx.Node] = {}  # a node -> its copy in the layer being made (the last one, after)
    for j in range(block.keep, block.depth):
        env = {}
        for ph, fqn in own.items():
            with g.inserting_after(last_ph):
                new = g.placeholder(block.placeholder(ph.name, j))
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
            _relabel(new, n, block, j, origin_of)
            env[n] = new
            copies[n.name].append(new.name)
            after = new
        prev_exit = env[exit_]
    # what came after the block reads the last layer
    for n in members:
        final = env.get(n, n)
        for u in list(n.users):
            if u not in inside and not u.meta.get("_mc_copy"):
                u.replace_input_with(n, final)
    gm.recompile()
    return copies


def _relabel(new: fx.Node, old: fx.Node, block: Block, j: int, origin_of) -> None:
    new.meta["_mc_copy"] = True
    stack = old.meta.get("nn_module_stack")
    if isinstance(stack, dict):
        new.meta["nn_module_stack"] = {k: (block.layer_path(v[0], j), *v[1:]) if isinstance(v, tuple) and v
                                       and isinstance(v[0], str) else v for k, v in stack.items()}
    if old.meta.get(M.LAYER) == block.last:
        new.meta[M.LAYER] = j
    if M.ORIGIN in old.meta and origin_of is not None:
        new.meta[M.ORIGIN] = origin_of(old.meta[M.ORIGIN], j)
    def moved(spec):
        return dataclasses.replace(spec, node=new.name, origin=origin_of(spec.origin, j) if origin_of else spec.origin,
                                   layer=j if spec.layer == block.last else spec.layer)

    spec = old.meta.get(M.COLLECTIVE)
    if spec is not None:
        new.meta[M.COLLECTIVE] = moved(spec)
    if old.meta.get(M.COLLECTIVES):
        new.meta[M.COLLECTIVES] = [moved(s) for s in old.meta[M.COLLECTIVES]]


def _clear_copy_marks(gm: fx.GraphModule) -> None:
    for n in gm.graph.nodes:
        n.meta.pop("_mc_copy", None)


def captured_origin(block: Block):
    """Captured name mapping of the copies: a block node -> its copy in layer j; the block's entry
    (the previous layer's output) -> the previous layer's exit."""
    names = set(block.nodes)

    def of(name: str, j: int) -> str:
        if name in names:
            return copy_name(name, j)
        if name == block.entry:
            return block.exit if j == block.keep else copy_name(block.exit, j - 1)
        return name
    return of


def repeat_captured(cap: Captured, block: Block, model: torch.nn.Module):
    """The short capture ``cap`` grown to the model's depth (``cap`` itself untouched): a
    :class:`RepeatedCapture` whose parameter and buffer tables and state (read from ``model``, whose
    blocks the short capture never saw) are the full model's; and node name -> its copies' names."""
    g = fx.Graph()
    out, out_node = g.graph_copy(cap.gm.graph, {}, return_output_node=True)
    g.output(out).meta.update(out_node.meta)
    gm = fx.GraphModule(cap.gm, g)
    if [n.name for n in g.nodes] != [n.name for n in cap.gm.graph.nodes]:
        raise AssertionError("copying the captured graph renamed its nodes")
    by = {n.name: n for n in g.nodes}
    members = [by[n] for n in block.nodes]
    copies = repeat_graph(gm, block, members, by[block.entry], by[block.exit])
    _clear_copy_marks(gm)
    # tables in placeholder order
    phs = [n for n in g.nodes if n.op == "placeholder"]
    params, buffers, constants = {}, {}, {}
    for ph in phs:
        fqn = ph.meta.get(M.PARAM_FQN)
        if ph.name in cap.params:
            params[ph.name] = cap.params[ph.name]
        elif ph.name in cap.buffers:
            buffers[ph.name] = cap.buffers[ph.name]
        elif ph.name in cap.constants:
            constants[ph.name] = cap.constants[ph.name]
        else:
            src = next((k for k, v in copies.items() if ph.name in v), None)
            if src in cap.params:
                params[ph.name] = fqn
            elif src in cap.buffers:
                buffers[ph.name] = fqn
            elif src in cap.constants:  # a tensor the layer makes in forward (HF attention's lifted
                constants[ph.name] = cap.constants[src]  # constants): a uniform block's copies are equal
    fields = {f.name: getattr(cap, f.name) for f in dataclasses.fields(cap)}
    fields.update(gm=gm, params=params, buffers=buffers, constants=constants)
    return RepeatedCapture(**fields, model_state=model.state_dict(keep_vars=True), block=block), copies


@dataclass
class RepeatedCapture(Captured):
    """A short model's capture grown to the real depth: ``ep`` is the short model's exported program,
    so the state comes from the model itself."""

    model_state: dict = dataclasses.field(default_factory=dict)
    block: Block | None = None

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


def repeat_lowered(gm: fx.GraphModule, block: Block) -> fx.GraphModule:
    """A rank's program lowered from the short capture, grown to the model's depth (in place)."""
    emitted = gm.meta.get(EMITTED_FOR)
    value_of = gm.meta.get(VALUE_OF)
    if emitted is None or value_of is None:
        raise AssertionError("repeat_lowered needs a program from passes.lower (it records what it emitted for)")
    names = set(block.nodes)
    members = [n for n in gm.graph.nodes if emitted.get(n.name) in names]
    by = {n.name: n for n in gm.graph.nodes}
    entry, exit_ = by[value_of[block.entry]], by[value_of[block.exit]]
    repeat_graph(gm, block, members, entry, exit_, origin_of=captured_origin(block))
    _clear_copy_marks(gm)
    gm.meta.pop(EMITTED_FOR, None)
    gm.meta.pop(VALUE_OF, None)
    return gm
