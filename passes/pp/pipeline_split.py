"""Pipeline split: cut a per-rank program into the stage programs of a :class:`StagePartition`.

Runs after lowering (the program already has its tensor-parallel collectives and local shapes),
so one pass serves every tp/sp layout. Each node of the program is given a stage:

- an *input-only* node (it depends on no parameter: masks, positions, RoPE tables, the labels'
  token count) gets none: every stage that needs it computes it again from the user inputs, which
  every pipeline rank has — no communication;
- a node implementing a captured node (``mc_origin``) takes that node's stage;
- a node the lowering added without an origin takes the latest stage of its inputs (or, with
  parameter inputs only, the earliest stage of its users), and no node comes before an input.

Stage ``t``'s program takes: the parameters, buffers and user inputs it uses, then the values it
*receives* — every activation made by a stage before ``t`` and used by ``t`` or later (normally
just the residual stream). It returns what it *sends*: every activation made by stages ``<= t``
and used after ``t``; the last stage returns the model's outputs. A value that is not a tensor
(a size) may not cross a cut: the pass raises, naming it. State the program reads through
``get_attr`` (the FP8 amax histories) goes to the stages that read it, and only to those, as the
same tensor: a stage's updates are the program's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from mcompile.ir import meta as M
from mcompile.passes.nodes import lazy_module

__all__ = ["StageProgram", "split_stages", "PipelineSplitError"]

STAGE = M.STAGE  # int | None on every call_function node of a split program's source


class PipelineSplitError(RuntimeError):
    pass


@dataclass
class StageProgram:
    index: int
    gm: fx.GraphModule
    inputs: list[str]  # placeholder names in call order: state/user placeholders, then received values
    received: list[str]  # names (in the per-rank program) of the values this stage receives, in order
    sent: list[str]  # names of the values it sends to the next stage, in order (empty: last stage)
    params: list[str] = field(default_factory=list)  # parameter placeholders used
    user_inputs: list[str] = field(default_factory=list)
    state: list[str] = field(default_factory=list)  # buffer / constant placeholders used

    @property
    def is_last(self) -> bool:
        return not self.sent


def _assign(prog: fx.GraphModule, stage_of_origin, params: set[str]) -> dict[str, int | None]:
    nodes = [n for n in prog.graph.nodes if n.op == "call_function"]
    dependent: set[str] = set(params)
    for n in nodes:
        if any(a.name in dependent for a in n.all_input_nodes):
            dependent.add(n.name)
    stage: dict[str, int | None] = {}
    pending = []
    for n in nodes:
        if n.name not in dependent:
            stage[n.name] = None
            continue
        ins = [stage[a.name] for a in n.all_input_nodes if stage.get(a.name) is not None]
        own = stage_of_origin(n.meta.get(M.ORIGIN)) if n.meta.get(M.ORIGIN) else None
        if own is None and not ins:
            pending.append(n)  # parameter inputs only: decided by its users
            stage[n.name] = None
            continue
        stage[n.name] = max([s for s in [own, *ins] if s is not None])
    for n in reversed(pending):
        users = [stage[u.name] for u in n.users if stage.get(u.name) is not None]
        stage[n.name] = min(users) if users else 0
    for n in nodes:  # monotone: never before an input's stage
        if stage[n.name] is not None:
            ins = [stage[a.name] for a in n.all_input_nodes if stage.get(a.name) is not None]
            stage[n.name] = max([stage[n.name], *ins])
    return stage


def split_stages(prog: fx.GraphModule, partition, params: set[str] | dict, user_inputs: list[str],
                 only: set[int] | None = None) -> list[StageProgram | None]:
    """All stages of ``prog`` (or just the indices in ``only``; the others are None)."""
    params = set(params)
    k = partition.num_stages
    stage = _assign(prog, partition.stage_of, params)
    for n in prog.graph.nodes:
        if n.op == "call_function":
            n.meta[STAGE] = stage[n.name]
    nodes = [n for n in prog.graph.nodes if n.op == "call_function"]
    output = next(n for n in prog.graph.nodes if n.op == "output")
    # last stage that uses each activation (the output node belongs to the last stage)
    last_use: dict[str, int] = {}
    for n in nodes + [output]:
        s = k - 1 if n.op == "output" else stage[n.name]
        if s is None:
            continue
        for a in n.all_input_nodes:
            if stage.get(a.name) is not None:
                last_use[a.name] = max(last_use.get(a.name, -1), s)
    # input-only values an output needs are computed by the last stage
    by_name = {n.name: n for n in prog.graph.nodes}
    out = []
    for t in range(k):
        if only is not None and t not in only:
            out.append(None)
            continue
        out.append(_build(prog, by_name, nodes, output, stage, last_use, t, k, params, user_inputs))
    return out


def _build(prog, by_name, nodes, output, stage, last_use, t, k, params, user_inputs) -> StageProgram:
    recv = [n.name for n in nodes if stage[n.name] is not None and stage[n.name] < t
            and last_use.get(n.name, -1) >= t]
    send = [] if t == k - 1 else [n.name for n in nodes if stage[n.name] is not None and stage[n.name] <= t
                                   and last_use.get(n.name, -1) > t]
    for name in recv + send:
        val = by_name[name].meta.get("val")
        if val is not None and not isinstance(val, torch.Tensor):
            raise PipelineSplitError(
                f"{name} ({type(val).__name__}) would cross into stage {t if name in recv else t + 1}: only tensors "
                "can be sent between pipeline stages; pin the cuts elsewhere")
    own = [n for n in nodes if stage[n.name] == t]
    # the input-only nodes this stage needs, transitively
    need: set[str] = set()
    roots = own + ([output] if t == k - 1 else [])
    stack = [a for n in roots for a in n.all_input_nodes]
    while stack:
        a = stack.pop()
        if a.op == "call_function" and stage.get(a.name) is None and a.name not in need:
            need.add(a.name)
            stack.extend(a.all_input_nodes)
    body = [n for n in nodes if n.name in need or stage[n.name] == t]
    body_set = set(body) | ({output} if t == k - 1 else set())
    used_ph = []
    seen = set()
    for n in body + ([output] if t == k - 1 else []):
        for a in n.all_input_nodes:
            if a.op == "placeholder" and a.name not in seen:
                seen.add(a.name)
    for n in prog.graph.nodes:
        if n.op == "placeholder" and n.name in seen:
            used_ph.append(n)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for ph in used_ph:
        env[ph] = g.placeholder(ph.name)
        env[ph].meta = dict(ph.meta)
    for name in recv:
        src = by_name[name]
        env[src] = g.placeholder(f"recv_{name}")
        env[src].meta = dict(src.meta)
    for n in prog.graph.nodes:  # state read through get_attr (FP8 amax histories): only where used
        if n.op == "get_attr" and any(u in body_set for u in n.users):
            env[n] = g.get_attr(n.target)
            env[n].meta = dict(n.meta)
    recv_set = set(recv)
    for n in body:
        if n.name in recv_set:
            continue
        env[n] = g.node_copy(n, lambda a: env[a])
    if t == k - 1:
        g.output(fx.node.map_arg(output.args[0], lambda a: env[a]))
    else:
        g.output(tuple(env[by_name[s]] for s in send))
    gm = lazy_module(prog, g)  # traced by its joint runner: code made only if it is called (eager execution)
    ph_names = [p.name for p in used_ph]
    return StageProgram(
        index=t, gm=gm, inputs=ph_names + [f"recv_{r}" for r in recv], received=recv, sent=send,
        params=[p for p in ph_names if p in params], user_inputs=[p for p in ph_names if p in user_inputs],
        state=[p for p in ph_names if p not in params and p not in user_inputs],
    )
