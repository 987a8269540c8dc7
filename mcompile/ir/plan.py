"""The Plan: the one thing planners (rules, user, search) produce and the passes consume (DESIGN §4).

A plain, serialisable dataclass. Schema version 1 — frozen: later features add fields with
defaults, never change the meaning of these.

- ``mesh``: ordered mesh axes and sizes.
- ``params``: per parameter FQN, its placement per axis, full and padded shape, local shape, and
  the axes over which its gradient is Partial (reduced by the runtime once per step: SP norm
  weights) — tied FQNs listed with their canonical one.
- ``activations``: per captured-graph node name, the placement per axis of its output.
- ``collectives``: every collective of the per-rank program of rank 0, in program order, forward
  and backward: kind, axis, tensor dim, bytes (a sympy expression in ``batch`` and ``seq`` as a
  string), the backward collective it implies, and the layer it belongs to.
- ``options``: sequence parallelism and its variant, vocabulary padding.
- ``stage_cuts`` (captured nodes where pipeline stages 1..K-1 begin), ``schedule``, ``pipeline``
  (the stage table); ``recompute`` (the recomputed nodes).
- ``inputs``: the example inputs it was planned with, shapes and dtypes only (what
  :func:`mcompile.cost.workload.estimate` needs to price the plan with the model: the sequence length, and a
  template to capture the model at another tp). Absent from plans saved before it existed: empty.

``str(plan)`` is its tables (:func:`plan_text`, what ``mcompile plan`` prints): parameters, collectives per layer,
model state per rank (:func:`mcompile.ir.memory_model.memory_per_rank`).
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import asdict, dataclass, field
from enum import StrEnum

import sympy

from mcompile.ir.placements import format_placement, parse_placement

SCHEMA_VERSION = 1

# What the plan's memory table counts, and what it leaves to `--gpu` (mcompile.cost.workload.estimate's peak)
MODEL_STATE_TITLE = ("Memory per rank: model state only (parameters, fp32 gradients, AdamW state; no activations: "
                     "--gpu adds them at --batch/--seq)")


class PlanError(ValueError):
    """The model cannot be planned as asked; the message says why and what to do."""


class SPVariant(StrEnum):
    # Save the all-gathered input of each column-parallel linear for its backward:
    # per layer per step 4 all-gathers + 4 reduce-scatters (2 + 2 forward, 2 + 2 backward).
    SAVE_GATHERED = "save_gathered"
    # Megatron's choice: save the sequence-sharded input and all-gather it again in backward
    # (6 all-gathers + 4 reduce-scatters). Reserved: needs the joint-graph recompute pass.
    REGATHER = "regather"


class CollectiveKind(StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE_MAX = "all_reduce_max"
    ALL_TO_ALL = "all_to_all"
    NONE = "none"


@dataclass(frozen=True)
class CollectiveSpec:
    """One collective node of a per-rank program (stored in node.meta[mcompile.ir.meta.COLLECTIVE])."""

    op: str  # the custom op: all_reduce | all_reduce_max | all_gather | reduce_scatter | shard_slice | copy_ar_bwd
    #          | moe_ep (an MoE layer over ep: its counts, dispatch and combine all-to-alls, one spec each)
    forward: str  # CollectiveKind run in forward ("none" for f / slice)
    backward: str  # CollectiveKind its backward runs ("none" when it has no gradient or a local one)
    axis: str
    dim: int | None
    bytes: str  # sympy expression (string) in batch/seq of the full (unsharded over this axis) tensor
    node: str = ""  # the program's node name
    origin: str = ""  # the captured node whose value is moved
    layer: int | None = None
    purpose: str = ""  # e.g. "tp region exit", "vocab-parallel loss"


@dataclass(frozen=True)
class InputSpec:
    """One example input of the planned model: its name (``arg0`` or the keyword), shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str


def input_specs(names, example_inputs, example_kwargs=None) -> list[InputSpec]:
    """The :class:`InputSpec` of each tensor input: ``example_inputs`` (a tuple, a list or one tensor)
    then ``example_kwargs`` in the order of ``names`` (the capture's ``input_names``)."""
    args = example_inputs if isinstance(example_inputs, tuple | list) else (example_inputs,)
    kwargs = example_kwargs or {}
    values = list(args) + [kwargs[n] for n in list(names)[len(args):] if n in kwargs]
    out = []
    for name, v in zip(names, values):
        if hasattr(v, "shape") and hasattr(v, "dtype"):
            out.append(InputSpec(str(name), tuple(int(d) for d in v.shape), str(v.dtype).replace("torch.", "")))
    return out


@dataclass
class ParamPlan:
    fqn: str
    shape: tuple[int, ...]
    dtype: str
    placements: tuple  # one per mesh axis
    local_shape: tuple[int, ...]
    padded_shape: tuple[int, ...] | None = None
    grad_partial_axes: tuple[str, ...] = ()
    tied: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def local_numel(self) -> int:
        n = 1
        for s in self.local_shape:
            n *= s
        return n

    def local_piece(self, full, mesh, coords: dict[str, int]):
        """The piece of the full (unpadded) tensor that the rank at ``coords`` of ``mesh`` holds."""
        from mcompile.ir.placements import shard_tensor

        t = full
        for ax, p in zip(mesh.axis_names, self.placements):
            padded = self.padded_shape[p.dim % len(self.shape)] if self.padded_shape and hasattr(p, "dim") else None
            t = shard_tensor(t, p, coords[ax], mesh.size(ax), padded)
        return t


@dataclass
class PlanOptions:
    sequence_parallel: bool = False
    sp_variant: SPVariant = SPVariant.SAVE_GATHERED
    vocab_pad_multiple: int = 128  # a vocab that tp does not divide: padded to a multiple of tp * this (Megatron's 128)
    moe_dispatcher: str = "alltoall"  # MoE layers over ep: "alltoall" | "allgather" (mcompile.ir.moe)
    moe_capacity_factor: float = 0.0  # 0: dropless
    cp_attention: str = "ring"  # attention over cp: "ring" | "allgather" | "a2a" (mcompile.passes.cp.ops; "auto"
                                # resolved)


@dataclass
class Plan:
    mesh: dict[str, int]
    params: dict[str, ParamPlan]
    activations: dict[str, tuple] = field(default_factory=dict)
    collectives: list[CollectiveSpec] = field(default_factory=list)
    options: PlanOptions = field(default_factory=PlanOptions)
    model: str = ""
    fallbacks: list[str] = field(default_factory=list)
    overrides: dict[str, str] = field(default_factory=dict)  # "param:FQN" / "node:NAME" -> "tp=S(0),dp=R"
    stage_cuts: list[str] = field(default_factory=list)
    recompute: list[str] = field(default_factory=list)
    schedule: str | None = None
    # pipeline (pp > 1): pp, virtual, microbatches, granularity, per-stage layers / parameters /
    # cost / activation bytes, imbalance, predicted bubble (mcompile.passes.pp.stages)
    pipeline: dict = field(default_factory=dict)
    version: int = SCHEMA_VERSION
    inputs: list[InputSpec] = field(default_factory=list)  # the example inputs: shapes and dtypes

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self.mesh)

    def placement(self, fqn: str, axis: str):
        return self.params[fqn].placements[self.axis_names.index(axis)]

    @property
    def example_batch_seq(self) -> tuple[int | None, int | None]:
        """(batch, sequence) of the first example input with both dims, else what there is."""
        for spec in self.inputs:
            if len(spec.shape) >= 2:
                return spec.shape[0], spec.shape[1]
        first = next((spec for spec in self.inputs if spec.shape), None)
        return (first.shape[0] if first else None), None

    def stage_positions(self) -> list[str]:
        """Where each pipeline stage after the first begins, in words ("after layer 3", "inside layer
        5 (...)", "before the head ..."): the layer positions of :attr:`stage_cuts`."""
        stages = self.pipeline.get("stages", [])
        if len(stages) < 2:
            return []
        n_layers = int(round(stages[-1]["layers"][1]))
        return [cut_position(st["layers"][0], n_layers) for st in stages[1:]]

    # -- serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["params"] = {
            k: {**asdict(p), "placements": [format_placement(x) for x in p.placements]}
            for k, p in self.params.items()
        }
        d["activations"] = {k: [_fmt(x) for x in v] for k, v in self.activations.items()}
        d["options"]["sp_variant"] = str(self.options.sp_variant)
        return d

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        d = json.loads(text)
        if d.get("version") != SCHEMA_VERSION:
            raise ValueError(f"plan schema version {d.get('version')} is not {SCHEMA_VERSION}")
        params = {
            k: ParamPlan(
                fqn=p["fqn"], shape=tuple(p["shape"]), dtype=p["dtype"],
                placements=tuple(parse_placement(x) for x in p["placements"]),
                local_shape=tuple(p["local_shape"]),
                padded_shape=tuple(p["padded_shape"]) if p["padded_shape"] else None,
                grad_partial_axes=tuple(p["grad_partial_axes"]), tied=tuple(p["tied"]),
            )
            for k, p in d["params"].items()
        }
        opts = d["options"]
        return cls(
            mesh=dict(d["mesh"]), params=params,
            activations={k: tuple(_parse(x) for x in v) for k, v in d["activations"].items()},
            collectives=[CollectiveSpec(**c) for c in d["collectives"]],
            options=PlanOptions(opts["sequence_parallel"], SPVariant(opts["sp_variant"]), opts["vocab_pad_multiple"],
                                opts.get("moe_dispatcher", "alltoall"), opts.get("moe_capacity_factor", 0.0),
                                opts.get("cp_attention", "ring")),
            model=d["model"], fallbacks=list(d["fallbacks"]), overrides=dict(d["overrides"]),
            stage_cuts=list(d["stage_cuts"]), recompute=list(d["recompute"]), schedule=d["schedule"],
            pipeline=dict(d.get("pipeline", {})),
            inputs=[InputSpec(i["name"], tuple(i["shape"]), i["dtype"]) for i in d.get("inputs", [])],
        )

    def diff(self, other: Plan) -> list[str]:
        """Human-readable differences (placements of parameters, options, mesh, collectives)."""
        out = []
        if self.mesh != other.mesh:
            out.append(f"mesh: {self.mesh} -> {other.mesh}")
        if self.options != other.options:
            out.append(f"options: {self.options} -> {other.options}")
        if self.inputs != other.inputs:
            out.append(f"example inputs: {[(i.name, list(i.shape)) for i in self.inputs]} -> "
                       f"{[(i.name, list(i.shape)) for i in other.inputs]}")
        for k in sorted(set(self.params) | set(other.params)):
            a, b = self.params.get(k), other.params.get(k)
            pa = a and [format_placement(x) for x in a.placements]
            pb = b and [format_placement(x) for x in b.placements]
            if pa != pb:
                out.append(f"param {k}: {pa} -> {pb}")
        ca = [(c.op, c.axis) for c in self.collectives]
        cb = [(c.op, c.axis) for c in other.collectives]
        if ca != cb:
            out.append(f"collectives: {len(ca)} -> {len(cb)}")
        return out

    # -- reporting ---------------------------------------------------------------------------
    def collectives_by_layer(self) -> dict[int | None, list[CollectiveSpec]]:
        out: dict[int | None, list[CollectiveSpec]] = {}
        for c in self.collectives:
            out.setdefault(c.layer, []).append(c)
        return out

    def __str__(self) -> str:
        return plan_text(self)


def _fmt(x):
    """One axis's placement of a node: a placement, a tuple of them (multi-output), or None."""
    if x is None:
        return None
    if isinstance(x, tuple):
        return [format_placement(y) for y in x]
    return format_placement(x)


def _parse(x):
    if isinstance(x, list):
        return tuple(parse_placement(y) for y in x)
    return parse_placement(x) if x is not None else None


# -- text: what ``str(plan)`` prints (mcompile.apps.report has the views of a compiled program) ---------

def _gib(b: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b} B"


def collective_bytes(expr: str, symbols: dict[str, int]) -> int:
    e = sympy.sympify(expr)
    subs = {s: symbols.get(str(s), 1) for s in e.free_symbols}
    return int(e.subs(subs))


def _group(fqn: str) -> str:
    return re.sub(r"\.(\d+)\.", ".*.", fqn, count=1)


def plan_tables(plan: Plan, sizes: dict[str, int] | None = None, dtype: str | None = None):
    """Rich renderables: parameter table, collectives table, memory table."""
    from rich.table import Table

    axes = list(plan.mesh)
    params = Table(title="Parameters (repeated layers folded to *)", show_lines=False)
    for col in ("parameter", "count", "shape", *axes, "local shape", "grad partial over"):
        params.add_column(col)
    seen: dict[str, list] = {}
    for fqn, pp in plan.params.items():
        key = _group(fqn)
        row = (str(list(pp.shape)), *[format_placement(x) for x in pp.placements], str(list(pp.local_shape)),
               ",".join(pp.grad_partial_axes) or "-")
        if key in seen and seen[key][1] == row:
            seen[key][0] += 1
        else:
            seen[fqn if key in seen else key] = [1, row]
    for key, (count, row) in seen.items():
        params.add_row(key, str(count), *row)

    colls = Table(title="Collectives per step of rank 0 (forward and what each implies in backward)")
    for col in ("layer", "op", "axis", "forward", "backward", "bytes", "purpose"):
        colls.add_column(col)
    by_layer = plan.collectives_by_layer()
    layers = [k for k in by_layer if k is not None]
    sizes = sizes or {}
    shown_layers = layers[:1]
    for layer in [None] + shown_layers:
        for c in by_layer.get(layer, []):
            label = "outside layers" if layer is None else f"{layer} (each of {len(layers)})"
            colls.add_row(label, c.op, c.axis, c.forward, c.backward, _fmt_bytes(c.bytes, sizes), c.purpose)

    from mcompile.ir.memory_model import memory_per_rank

    mem = memory_per_rank(plan, dtype)
    memt = Table(title=MODEL_STATE_TITLE)
    for col in ("parameters", "gradients", "optimizer state", "total"):
        memt.add_column(col)
    memt.add_row(_gib(mem.params), _gib(mem.grads), _gib(mem.optimizer), _gib(mem.total))
    return params, colls, memt


def _fmt_bytes(expr: str, sizes: dict[str, int]) -> str:
    if not sizes:
        return expr
    b = collective_bytes(expr, sizes)
    return f"{b:,} ({expr})"


def plan_text(plan: Plan, sizes: dict[str, int] | None = None, dtype: str | None = None, width: int = 160) -> str:
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None)
    head = " x ".join(f"{a}={n}" for a, n in plan.mesh.items())
    sp = f"on ({plan.options.sp_variant})" if plan.options.sequence_parallel else "off"
    console.print(f"Plan for {plan.model or 'model'} on mesh {head}; sequence parallel: {sp}")
    cp_line = cp_text(plan, sizes)
    if cp_line:
        console.print(cp_line)
    if plan.fallbacks:
        console.print(f"Replicated because no sharding rule exists: {', '.join(plan.fallbacks)}")
    for t in plan_tables(plan, sizes, dtype):
        console.print(t)
    return buf.getvalue()


def cp_summary(plan: Plan, sizes: dict[str, int] | None = None) -> dict | None:
    """The sequence split of a context-parallel plan (None without cp): the attention variant, the chunks, and
    at ``sizes`` the tokens of each sequence a rank holds (and between tp regions under sequence parallelism)."""
    cp, tp = plan.mesh.get("cp", 1), plan.mesh.get("tp", 1)
    if cp <= 1:
        return None
    d = {"cp": cp, "attention": plan.options.cp_attention, "chunks": 2 * cp, "chunks_of_rank": "r and 2cp-1-r"}
    seq, batch = (sizes or {}).get("seq"), (sizes or {}).get("batch", 1)
    if isinstance(seq, int):
        d.update(seq=seq, tokens_per_sequence_per_rank=seq // cp, chunk_tokens=seq // (2 * cp),
                 tokens_per_rank=batch * seq // cp)
        if plan.options.sequence_parallel and tp > 1:
            d["tokens_between_tp_regions"] = seq // cp // tp
    return d


def cp_text(plan: Plan, sizes: dict[str, int] | None = None) -> str:
    """:func:`cp_summary` in a line ("" without cp)."""
    d = cp_summary(plan, sizes)
    if d is None:
        return ""
    n = d["chunks"]
    head = (f"Context parallel: cp={d['cp']}, attention {d['attention']!r}; each sequence is cut into {n} chunks "
            f"and cp rank r holds chunks r and {n - 1}-r (load-balanced causal attention)")
    if "seq" not in d:
        return head
    sp = (f"; {d['tokens_between_tp_regions']} between tensor-parallel regions (sequence parallel over "
          f"tp={plan.mesh.get('tp', 1)})" if "tokens_between_tp_regions" in d else "")
    return (f"{head}: of each {d['seq']}-token sequence a rank holds {d['tokens_per_sequence_per_rank']} tokens "
            f"({d['chunk_tokens']} a chunk){sp}; {d['tokens_per_rank']} tokens per rank per step at batch "
            f"{(sizes or {}).get('batch', 1)}")


def cut_position(x: float, n_layers: int) -> str:
    """Where a stage boundary lies, in words: ``x`` in layer units (mcompile.sharding.blocks.Trunk.layer_of: 0 =
    start of layer 0, ``n_layers`` = end of the last layer, negative = in the embedding)."""
    if x < 0:
        return "inside the embedding"
    if float(x).is_integer():
        k = int(x)
        if k == 0:
            return "before layer 0 (after the embedding)"
        return "before the head (after the last layer)" if k >= n_layers else f"after layer {k - 1}"
    k = int(x)
    return f"inside layer {k} ({x - k:.0%} of its ops before the cut)"
