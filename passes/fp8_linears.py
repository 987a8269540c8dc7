"""FP8: run the linears of a per-rank program as mcompile's FP8 linear (``Config(fp8=...)``).

Runs after lowering (and after fusion), so it sees the rank's local weight shapes: a weight sharded
by tensor parallelism is judged by its local piece. Per-tensor scales are per rank and per piece,
which needs no communication: a row-parallel linear's partial sums are each dequantized with their
own scales before the all-reduce adds them (Micikevicius et al. 2022, "FP8 Formats for Deep
Learning", for the formats and the per-tensor scaling; the math is in :mod:`mcompile.kernels.fp8`).

Candidates are the matmuls with a 2-d weight parameter:

    linear(x, W[, b])      -> fp8_linear(x, W)[0] (+ b)
    matmul(x, W), mm(x, W) -> fp8_linear(x, t(W))[0]          (W stored (in, out): HF Conv1D)

Kept in higher precision, each with its reason in the report:

- the LM head (a weight shaped like the token embedding's, vocabulary × hidden) and any weight tied
  to an embedding: the logits feed the softmax directly and the tied embedding's rows are read as they
  are; Transformer Engine's and Megatron's FP8 recipes keep the output layer in BF16 likewise;
- a weight whose local (out, in) dims are not multiples of 16, which ``torch._scaled_mm``
  requires on CUDA (e.g. the kv projections of a small model at a large tp).

Recipes: ``current`` (scales from each tensor's own amax, no state) and ``delayed`` (scales from an
amax history; each converted linear gets a zeroed (3, history_len) buffer registered on the
GraphModule and read through a ``get_attr`` node — see the kernel module for why the state lives
there). Converted nodes carry ``node.meta["mc_fp8"]`` = the recipe, with the ``mc_origin`` and
``mc_layer`` of the linear they replace, so ``mcompile show`` prints them and recompute groups them.

``backend="te"`` (NVIDIA Transformer Engine) is an optional backend, never a hard import.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from mcompile.ir import meta as M

aten = torch.ops.aten
FP8 = M.FP8  # str on converted nodes: the scaling recipe ("current" | "delayed")
RECIPES = ("current", "delayed")
BACKENDS = ("mcompile", "te")
MULTIPLE = 16  # torch._scaled_mm on CUDA: both dims of the weight multiples of 16
_MATMULS = {aten.matmul.default, aten.mm.default}


@dataclass(frozen=True)
class Fp8Linear:
    """One candidate linear: the program node, its weight, the local (out, in) shape, and why it was
    kept in higher precision ("" when converted)."""

    node: str
    fqn: str
    local_shape: tuple[int, int]
    reason: str = ""


@dataclass
class Fp8Report:
    recipe: str
    converted: list[Fp8Linear] = field(default_factory=list)
    skipped: list[Fp8Linear] = field(default_factory=list)
    # node -> amax history (delayed); under pp a rank runs (and checkpoints) only its stages' ones:
    # ParallelModule.fp8_histories()
    histories: dict[str, torch.Tensor] = field(default_factory=dict)

    def to_dict(self) -> dict:
        row = lambda c: {"node": c.node, "weight": c.fqn, "local_shape": list(c.local_shape)}  # noqa: E731
        return {"recipe": self.recipe, "converted": [row(c) for c in self.converted],
                "skipped": [{**row(c), "reason": c.reason} for c in self.skipped]}

    def text(self) -> str:
        """Human-readable summary; repeated layers folded (``layers.*.attention.wq.weight x32``)."""
        lines = [f"FP8 ({self.recipe} scaling; E4M3 weights and activations, E5M2 gradients): "
                 f"{len(self.converted)} linears in FP8, {len(self.skipped)} kept in higher precision"]
        for title, items in (("fp8 ", self.converted), ("kept", self.skipped)):
            folded: dict[tuple, int] = {}
            for c in items:
                key = (re.sub(r"\.\d+\.", ".*.", c.fqn), c.local_shape, c.reason)
                folded[key] = folded.get(key, 0) + 1
            for (name, shape, reason), n in folded.items():
                times = f" x{n}" if n > 1 else ""
                lines.append(f"  {title} {name}{times}  local {tuple(shape)}" + (f": {reason}" if reason else ""))
        return "\n".join(lines)


def _placeholder_param(node, params: dict[str, str]) -> str | None:
    if isinstance(node, fx.Node) and node.op == "placeholder" and node.name in params:
        return params[node.name]
    return None


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"fp8_backend={backend!r}: use one of {BACKENDS}")
    if backend == "te":
        try:
            import transformer_engine.pytorch  # noqa: F401
        except ImportError as e:
            raise RuntimeError(
                "fp8_backend='te' needs NVIDIA Transformer Engine, which is not importable here "
                f"({e}); install it on a CUDA machine (pip install mcompile[te]) or use fp8_backend='mcompile'"
            ) from e
        raise NotImplementedError(
            "fp8_backend='te': Transformer Engine is importable, but routing linears through it is not "
            "implemented yet (no machine with Transformer Engine to test it on); use fp8_backend='mcompile'")


def convert_fp8(gm: fx.GraphModule, plan, params: dict[str, str], *, recipe: str = "current",
                amax_history_len: int = 16, margin: int = 0, backend: str = "mcompile",
                device: torch.device | str | None = None, user_inputs=None) -> Fp8Report:
    """Rewrite the per-rank program ``gm`` in place (see the module docstring); returns what was
    converted and what was kept, and why. ``plan``: the Plan the program was lowered from (local and
    global weight shapes, tied weights); ``params``: placeholder name -> parameter FQN;
    ``user_inputs``: the placeholders of the model's inputs (default: every non-parameter one), which
    tell token embeddings (indexed by input data) from position embeddings (indexed by arange)."""
    from mcompile.kernels import fp8 as kernels

    if recipe not in RECIPES:
        raise ValueError(f"fp8={recipe!r}: use one of {RECIPES}")
    _check_backend(backend)
    g = gm.graph
    embeddings, tokens = _embeddings(g, params, plan, user_inputs)
    report = Fp8Report(recipe)
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.linear.default:
            x, w, bias = node.args[0], node.args[1], (node.args[2] if len(node.args) > 2 else None)
            transposed = False
        elif node.target in _MATMULS and len(node.args) == 2:
            (x, w), bias, transposed = node.args, None, True
        else:
            continue
        fqn = _placeholder_param(w, params)
        if fqn is None or len(plan.params[fqn].shape) != 2:
            continue  # not a matmul with a weight parameter (attention scores, ...)
        local = tuple(plan.params[fqn].local_shape)
        out_in = local[::-1] if transposed else local
        reason = _keep_reason(fqn, plan, embeddings, tokens, out_in)
        if reason:
            report.skipped.append(Fp8Linear(node.name, fqn, out_in, reason))
            continue
        with g.inserting_before(node):
            new = []
            if transposed:
                w = g.call_function(aten.t.default, (w,))
                new.append(w)
            if recipe == "current":
                op = g.call_function(torch.ops.mcompile.fp8_linear.default, (x, w, margin))
            else:
                attr = f"fp8_history_{node.name}"
                report.histories[node.name] = kernels.new_amax_history(amax_history_len, device)
                gm.register_buffer(attr, report.histories[node.name])
                hist = g.get_attr(attr)
                op = g.call_function(torch.ops.mcompile.fp8_linear_delayed.default, (x, w, hist, margin))
                new.append(hist)
            out = g.call_function(operator.getitem, (op, 0))
            new += [op, out]
            if bias is not None:
                out = g.call_function(aten.add.Tensor, (out, bias))
                new.append(out)
        for n in new:
            n.meta.update({M.ORIGIN: node.meta.get(M.ORIGIN), M.LAYER: node.meta.get(M.LAYER)})
        op.meta[FP8] = out.meta[FP8] = recipe
        node.replace_all_uses_with(out)
        g.erase_node(node)
        report.converted.append(Fp8Linear(node.name, fqn, out_in))
    g.lint()
    gm.recompile()
    return report


def _embeddings(g: fx.Graph, params: dict[str, str], plan, user_inputs) -> tuple[set[str], dict[str, tuple]]:
    """(FQNs of every embedding weight, {FQN: global shape} of the token embeddings): an embedding is
    a token embedding when its indices depend on the model's inputs by value (a dependence only
    through sizes, ``sym_size`` -> ``arange``, is a position embedding's)."""
    data: set[fx.Node] = set()
    embeddings, tokens = set(), {}
    for n in g.nodes:
        if n.op == "placeholder":
            if n.name not in params and (user_inputs is None or n.name in user_inputs):
                data.add(n)
        elif n.op == "call_function" and n.target is not aten.sym_size.int:
            if any(a in data for a in n.all_input_nodes):
                data.add(n)
            if n.target is aten.embedding.default and (fqn := _placeholder_param(n.args[0], params)):
                embeddings.add(fqn)
                if n.args[1] in data:
                    tokens[fqn] = tuple(plan.params[fqn].shape)
    return embeddings, tokens


def _keep_reason(fqn: str, plan, embeddings: set[str], tokens: dict[str, tuple], out_in: tuple[int, int]) -> str:
    tied = set(plan.params[fqn].tied) | {fqn}
    shared = sorted(tied & embeddings)
    if shared:
        return f"weight shared with the embedding {shared[0]}: stays in higher precision"
    shape = tuple(plan.params[fqn].shape)
    for emb, emb_shape in tokens.items():
        if shape in (emb_shape, emb_shape[::-1]):
            return f"LM head (shaped like the embedding {emb}): the output layer stays in higher precision"
    if any(d % MULTIPLE for d in out_in):
        return f"local dims not multiples of {MULTIPLE} (torch._scaled_mm)"
    return ""
