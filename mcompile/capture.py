"""Capture: a plain ``nn.Module`` + example inputs -> an aten-level fx graph (DESIGN §1, §10, §11).

``torch.export.export(strict=False)`` at its training IR (``linear``, SDPA, ``cross_entropy_loss``
and ``layer_norm`` stay whole: never ``run_decompositions()`` before sharding). Parameters, buffers
and tensor constants are lifted to placeholders. Batch (dim 0) and sequence (dim 1) of every
tensor input are captured as dynamic symbols shared by all inputs, so one program runs at any local
batch (dp, microbatches) and local sequence (sp, cp).

Traps handled here: export specialises a size-1 dim to the literal 1, so a template with batch or
sequence 1 is widened to 2 for capture; two inputs that are the same tensor object are aliased by
export, so they are copied first; tied parameters (GPT-2's wte / lm_head) come out as one
placeholder per FQN and are merged into one.
"""

from __future__ import annotations

import contextlib
import re
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import sympy
import torch
import torch.fx as fx
from torch.export import Dim
from torch.export.graph_signature import InputKind

from mcompile import meta as M

__all__ = ["CaptureError", "Captured", "capture"]

BATCH, SEQ = "batch", "seq"
_TORCH_DIR = str(Path(torch.__file__).parent)
_OWN_DIR = str(Path(__file__).parent)


class CaptureError(RuntimeError):
    """torch.export could not capture the model; the message names the op and the user's line."""


@dataclass
class Captured:
    """A captured model: the graph plus what each placeholder is."""

    gm: fx.GraphModule
    ep: torch.export.ExportedProgram
    params: dict[str, str]  # placeholder name -> parameter FQN (canonical one of a tied group)
    buffers: dict[str, str]  # placeholder name -> buffer FQN
    constants: dict[str, str]  # placeholder name -> lifted tensor-constant name
    user_inputs: list[str]  # placeholder names of the user's inputs, in call order (args, then kwargs)
    input_names: list[str]  # the user-facing name of each user input ("arg0", or the keyword)
    tied: dict[str, tuple[str, ...]]  # canonical FQN -> every FQN of the same storage (len > 1 only)
    symbols: dict[str, sympy.Symbol] = field(default_factory=dict)  # "batch"/"seq" -> symbol
    model_name: str = ""

    def placeholder(self, name: str) -> fx.Node:
        for n in self.gm.graph.nodes:
            if n.op == "placeholder" and n.name == name:
                return n
        raise KeyError(name)

    @property
    def param_nodes(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder" and n.name in self.params]

    def state_values(self) -> dict[str, torch.Tensor]:
        """placeholder name -> tensor (parameters, buffers, constants) from the exported program."""
        out = {}
        sd = self.ep.state_dict
        for ph, fqn in self.params.items():
            out[ph] = sd[fqn]
        for ph, fqn in self.buffers.items():
            out[ph] = sd[fqn] if fqn in sd else self.ep.constants[fqn]
        for ph, name in self.constants.items():
            out[ph] = self.ep.constants[name]
        return out


def _widen(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    for d in dims:
        if d < t.ndim and t.shape[d] < 2:
            reps = [1] * t.ndim
            reps[d] = 2
            t = t.repeat(*reps)
    return t


def _user_frame(exc: BaseException) -> str | None:
    """The deepest frame of the failure that lies in the user's code (not torch, not mcompile)."""
    frames = traceback.extract_tb(exc.__traceback__)
    user = [
        f
        for f in frames
        if not f.filename.startswith(_TORCH_DIR) and not f.filename.startswith(_OWN_DIR) and "<" not in f.filename
    ]
    msg_frames = re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s+(.+)', str(exc))
    if msg_frames:  # torch.export prints the user call that raised ("The following call raised ...")
        f, line, code = msg_frames[-1]
        return f"{f}:{line}: {code.strip()}"
    if user:
        f = user[-1]
        return f"{f.filename}:{f.lineno}: {(f.line or '').strip()}"
    return None


def _op_of(exc: BaseException) -> str:
    text = str(exc)
    if "data-dependent" in text or "GuardOnDataDependent" in type(exc).__name__:
        return "aten._local_scalar_dense (a tensor's value used as a Python bool/int: data-dependent control flow)"
    m = re.search(r"(aten[.:]{1,2}[A-Za-z_0-9]+(?:\.[A-Za-z_0-9]+)?)", text)
    if m:
        return m.group(1)
    m = re.search(r"(torch\.[A-Za-z_0-9.]+)", text)
    return m.group(1) if m else type(exc).__name__


@contextlib.contextmanager
def on_meta(model: torch.nn.Module, param_dtype: torch.dtype | None = None):
    """Temporarily replace every parameter and buffer of ``model`` by a meta tensor (parameters cast
    to ``param_dtype``, buffers keep theirs): capture needs shapes and dtypes, not values, and this
    captures the graph a lower-precision run executes without copying the model. Tied parameters
    stay one object."""
    saved: list[tuple[torch.nn.Module, str, str, torch.Tensor]] = []
    made: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in list(getattr(mod, kind).items()):
                if t is None:
                    continue
                if id(t) not in made:
                    dt = param_dtype if (kind == "_parameters" and param_dtype and t.is_floating_point()) else t.dtype
                    m = torch.empty_like(t, device="meta", dtype=dt)
                    made[id(t)] = torch.nn.Parameter(m, requires_grad=t.requires_grad) if kind == "_parameters" else m
                saved.append((mod, kind, name, t))
                getattr(mod, kind)[name] = made[id(t)]
    try:
        yield model
    finally:
        for mod, kind, name, t in saved:
            getattr(mod, kind)[name] = t


def capture(
    model: torch.nn.Module,
    example_inputs: tuple = (),
    example_kwargs: dict | None = None,
    *,
    dynamic: bool = True,
    meta_dtype: torch.dtype | None = None,
) -> Captured:
    """Capture ``model(*example_inputs, **example_kwargs)`` as an aten graph with lifted parameters.

    ``example_inputs`` is a template of shapes and dtypes; with ``dynamic`` the batch (dim 0) and the
    sequence (dim 1) of every tensor input become symbols, so the program accepts other sizes.
    With ``meta_dtype`` the model is captured on the meta device with its parameters in that dtype
    (:func:`on_meta`): no values are read, and ``Captured.state_values`` holds meta tensors.
    """
    if meta_dtype is not None:
        meta = lambda t: torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
        with on_meta(model, meta_dtype):
            return capture(model, tuple(meta(t) for t in example_inputs),
                           {k: meta(v) for k, v in (example_kwargs or {}).items()}, dynamic=dynamic)
    example_kwargs = dict(example_kwargs or {})
    if not isinstance(example_inputs, tuple):
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,)
    seen: set[int] = set()

    def prep(t):
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) in seen:  # export would alias two arguments that are one tensor object
            t = t.clone()
        seen.add(id(t))
        return _widen(t, (0, 1)) if dynamic else t

    args = tuple(prep(a) for a in example_inputs)
    kwargs = {k: prep(v) for k, v in example_kwargs.items()}
    batch, seq = Dim(BATCH, min=2), Dim(SEQ, min=2)

    def spec(t):
        if not isinstance(t, torch.Tensor) or not dynamic or t.ndim == 0:
            return None
        return {0: batch, 1: seq} if t.ndim >= 2 else {0: batch}

    shapes_named = ({k: spec(v) for k, v in kwargs.items()}, tuple(spec(a) for a in args))
    name = type(model).__name__
    try:
        try:
            ep = torch.export.export(
                model, args, kwargs, dynamic_shapes={**shapes_named[0], **_arg_names(model, shapes_named[1])},
                strict=False,
            )
        except torch._dynamo.exc.UserError as e:
            if not dynamic:
                raise
            ep = _export_with_suggested_fixes(model, args, kwargs, shapes_named, e)
        if ep is None:
            # The model constrains a dim (e.g. a static sequence length): let export infer it.
            auto = lambda t: None if not isinstance(t, torch.Tensor) or t.ndim == 0 else {  # noqa: E731
                d: Dim.AUTO for d in range(min(t.ndim, 2))
            }
            ep = torch.export.export(
                model, args, kwargs,
                dynamic_shapes={**{k: auto(v) for k, v in kwargs.items()},
                                **_arg_names(model, tuple(auto(a) for a in args))},
                strict=False,
            )
    except Exception as e:  # noqa: BLE001 - every export failure becomes one clear error
        where = _user_frame(e)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CaptureError(
            f"cannot capture {name} with torch.export: op {_op_of(e)}\n"
            f"  at {where or 'an unknown location'}\n"
            f"  torch says: {first}\n"
            "  fix: remove data-dependent Python control flow / .item() / .tolist() from forward "
            "(use torch.where, torch.cond), or make the op traceable."
        ) from e
    return _from_exported(ep, model, name)


def _export_with_suggested_fixes(model, args, kwargs, shapes_named, error) -> torch.export.ExportedProgram | None:
    """Export again with the dims refined as torch suggests (a bound such as ``seq <= 40`` from a
    learned position table), keeping batch and sequence shared by all inputs; None when torch
    suggests nothing usable (the caller then lets export infer every dim on its own)."""
    from torch.export.dynamic_shapes import refine_dynamic_shapes_from_suggested_fixes

    msg = str(error)
    if "Suggested fixes:" not in msg:
        return None
    head, fixes = msg.split("Suggested fixes:", 1)
    fixes = "\n".join(line for line in fixes.strip().split("\n\n")[0].splitlines() if " = " in line)
    shapes = {**shapes_named[0], **_arg_names(model, shapes_named[1])}
    try:
        refined = refine_dynamic_shapes_from_suggested_fixes(f"{head}Suggested fixes:\n{fixes}", shapes)
        return torch.export.export(model, args, kwargs, dynamic_shapes=refined, strict=False)
    except Exception:  # noqa: BLE001 - fall back to export's own inference
        return None


def _arg_names(model: torch.nn.Module, specs: tuple) -> dict:
    """dynamic_shapes keyed by forward()'s parameter names (export wants one structure)."""
    import inspect

    params = [
        p
        for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return {p.name: s for p, s in zip(params, specs)}


def _from_exported(ep: torch.export.ExportedProgram, model: torch.nn.Module, name: str) -> Captured:
    gm = ep.graph_module
    params, buffers, constants, user_inputs = {}, {}, {}, []
    for s in ep.graph_signature.input_specs:
        if s.kind == InputKind.PARAMETER:
            params[s.arg.name] = s.target
        elif s.kind == InputKind.BUFFER:
            buffers[s.arg.name] = s.target
        elif s.kind == InputKind.CONSTANT_TENSOR:
            constants[s.arg.name] = s.target
        elif s.kind == InputKind.USER_INPUT:
            user_inputs.append(s.arg.name)
    # Tied parameters: one storage, several FQNs. Keep the first FQN in named_parameters() order.
    groups: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(fqn)
    canon = {f: fs[0] for fs in groups.values() for f in fs}
    tied = {fs[0]: tuple(fs) for fs in groups.values() if len(fs) > 1}
    by_canon: dict[str, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "placeholder" or node.name not in params:
            continue
        c = canon.get(params[node.name], params[node.name])
        if c in by_canon:
            node.replace_all_uses_with(by_canon[c])
            gm.graph.erase_node(node)
            del params[node.name]
        else:
            by_canon[c] = node
            params[node.name] = c
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            fqn = params.get(node.name) or buffers.get(node.name) or constants.get(node.name)
            if fqn:
                node.meta[M.PARAM_FQN] = fqn
    gm.recompile()
    symbols: dict[str, sympy.Symbol] = {}
    for ph_name in user_inputs:
        node = next(n for n in gm.graph.nodes if n.name == ph_name)
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            for d, key in ((0, BATCH), (1, SEQ)):
                if d < val.ndim and isinstance(val.shape[d], torch.SymInt) and key not in symbols:
                    expr = val.shape[d].node.expr
                    if isinstance(expr, sympy.Symbol):
                        symbols[key] = expr
    input_names = _input_names(ep, len(user_inputs))
    return Captured(
        gm=gm, ep=ep, params=params, buffers=buffers, constants=constants, user_inputs=user_inputs,
        input_names=input_names, tied=tied, symbols=symbols, model_name=name,
    )


def _input_names(ep, n: int) -> list[str]:
    names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    return names[:n]
