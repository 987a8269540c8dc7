"""A planned model (:class:`Compiled`, what :func:`mcompile.api.compile_plan` returns): the captured graph, its
plan, and each rank's program lowered on demand; and the sizes planning compares costs at (:func:`plan_hints`).
Below the compiler and the search, which both make one."""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from mcompile.capture.export import BATCH, SEQ, Captured
from mcompile.ir.annotate import AnnotationSummary
from mcompile.ir.mesh import Mesh
from mcompile.ir.plan import Plan
from mcompile.sharding.planner import AxisPlanResult

__all__ = ["Compiled", "plan_hints"]


@dataclass
class Compiled:
    """A planned model: the captured graph, the plan, and per-rank programs on demand."""

    captured: Captured
    plan: Plan
    mesh: Mesh
    axes: list[AxisPlanResult]
    canonical: dict = field(default_factory=dict)
    annotation: AnnotationSummary | None = None  # FLOPs / bytes of the captured graph (mcompile.ir.annotate)
    partition: object = None  # mcompile.passes.pp.stages.StagePartition when the mesh has pp > 1
    short: Captured | None = None  # the short model's capture when the layers were repeated (mcompile.sharding.repeat)
    # run of alike blocks captured whole rather than repeated ("layers[0:4]") -> why (find_block's reason)
    repeat_declined: dict = field(default_factory=dict)
    quality: list = field(default_factory=list)  # mcompile.sharding.quality.Finding: where the plan is not Megatron's
                                                 # layout
    passes: list = field(default_factory=list)  # the model passes that made it, in order (mcompile.compiler)
    _programs: dict = field(default_factory=dict)

    def axis_infos(self, rank: int):
        from mcompile.passes.lower import AxisInfo

        coords = self.mesh.coords(rank)
        return [
            AxisInfo(ap.policy.axis, ap.policy.size, coords[ap.policy.axis], ap.result,
                     inputs_presharded=ap.policy.shard_inputs_dim0,
                     loss_replicated=not ap.policy.loss_partial,
                     vocab_pad_multiple=self.plan.options.vocab_pad_multiple,
                     moe=(self.plan.options.moe_dispatcher, self.plan.options.moe_capacity_factor),
                     context_parallel=ap.policy.context_parallel,
                     cp_attention=self.plan.options.cp_attention)
            for ap in self.axes
        ]

    def program(self, rank: int = 0, device: torch.device | str | None = None) -> fx.GraphModule:
        """The per-rank program: placeholders are the captured ones (local parameters, buffers,
        constants, then the rank's user inputs); the output is the model's output. ``device``
        rewrites the graph's device literals (needed when it was captured on meta)."""
        key = (rank, str(device) if device is not None else None)
        if key not in self._programs:
            self._programs[key] = _lower(self, rank, device)
        return self._programs[key][0]

    def collectives(self, rank: int = 0):
        self.program(rank)
        return self._programs[(rank, None)][1]

    def local_state(self, rank: int, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """placeholder name -> this rank's piece of each parameter / buffer / constant."""
        state = state if state is not None else self.captured.state_values()
        coords = self.mesh.coords(rank)
        out = {}
        for ph, full in state.items():
            fqn = self.captured.params.get(ph)
            if fqn is None:
                out[ph] = full
                continue
            t = self.plan.params[fqn].local_piece(full, self.mesh, coords)
            out[ph] = t
        return out

    def run_local(self, rank: int, local_state: dict, inputs: tuple, kwargs: dict | None = None, *,
                  seed: int = 0, step: int = 0):
        """Rank ``rank``'s program on its pieces of the state and its data-parallel slice of the batch
        (``inputs``: equal slices in data-rank order); training-mode dropout draws from (``seed``, ``step``)."""
        from mcompile.ir.dropout import RNG_INPUT, rng_state

        gm = self.program(rank)
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        flat = _flat_inputs(self.captured, inputs, kwargs or {})
        user = dict(zip(self.captured.user_inputs, flat))
        if RNG_INPUT in names:  # this slice's first row in the global batch: its data rank's
            rows = next((int(t.shape[0]) for t in flat if isinstance(t, torch.Tensor) and t.ndim), 0)
            user[RNG_INPUT] = rng_state(seed, step, self.data_rank(rank) * rows)
        args = [local_state[n] if n in local_state else user[n] for n in names]
        return gm(*args)

    def data_rank(self, rank: int) -> int:
        """``rank``'s index among the ranks the batch is split over (dp, then ep: runtime/module.py's order)."""
        coords, index = self.mesh.coords(rank), 0
        for a in self.mesh.axis_names:
            if a in ("dp", "ep"):
                index = index * self.mesh.size(a) + coords[a]
        return index


def _lower(compiled: Compiled, rank: int, device=None):
    """A rank's program and its collectives: lowered from the capture, or from the short model's
    capture and then grown to the real depth (mcompile.sharding.repeat)."""
    from mcompile.passes import lower_program

    if compiled.short is None:
        return lower_program(compiled.captured, compiled.axis_infos(rank), device)
    from mcompile.ir.meta import COLLECTIVE, COLLECTIVES, ORIGIN
    from mcompile.passes.lower_dropout import rekey
    from mcompile.sharding.repeat import repeat_lowered

    gm, _ = lower_program(compiled.short, compiled.axis_infos(rank), device)
    repeat_lowered(gm, compiled.captured.blocks)
    rekey(gm, ORIGIN)  # each repeated block's dropouts draw their own masks
    specs = []
    for n in gm.graph.nodes:
        specs += [n.meta[COLLECTIVE]] if COLLECTIVE in n.meta else []
        specs += n.meta.get(COLLECTIVES, [])
    return gm, specs


def _flat_inputs(cap: Captured, inputs: tuple, kwargs: dict) -> list:
    flat = list(inputs)
    for name in cap.input_names[len(inputs):]:
        flat.append(kwargs[name])
    return flat


def plan_hints(cap: Captured, inputs, kwargs, seq, batch) -> dict:
    """Sizes at which redistribution costs are compared (the template's, unless given)."""
    first = next((t for t in list(inputs) + list((kwargs or {}).values()) if isinstance(t, torch.Tensor)), None)
    b = batch or (first.shape[0] if first is not None and first.ndim > 0 else 1)
    s = seq or (first.shape[1] if first is not None and first.ndim > 1 else 1)
    out = {}
    if BATCH in cap.symbols:
        out[cap.symbols[BATCH]] = max(int(b), 2)
    if SEQ in cap.symbols:
        out[cap.symbols[SEQ]] = max(int(s), 2)
    # any other size symbol of an input (an encoder-decoder's label length, a second sequence): its example size
    for name in cap.user_inputs:
        node = cap.placeholder(name)
        val = node.meta.get("val") if node is not None else None
        for size in (val.shape if isinstance(val, torch.Tensor) else ()):
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol) \
                    and size.node.expr not in out and size.node.hint is not None:
                out[size.node.expr] = max(int(size.node.hint), 2)
    # a data-dependent size (JetMoe's and DeepSeek-V4's count of tokens routed to an expert: an unbacked u0 with
    # no example value): costed as every token of the batch, the most it can be at top-1
    tokens = out.get(cap.symbols.get(BATCH), 1) * out.get(cap.symbols.get(SEQ), 1)
    for n in cap.gm.graph.nodes:
        v = n.meta.get("val")
        for size in (v.shape if isinstance(v, torch.Tensor) else [v] if isinstance(v, torch.SymInt) else ()):
            if isinstance(size, torch.SymInt):
                for sym in size.node.expr.free_symbols - out.keys():
                    out[sym] = max(tokens, 2)
    return out
