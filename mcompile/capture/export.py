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

Outputs: forward may return a tensor, a tuple/list of tensors, or a dict / dataclass / Hugging Face
``ModelOutput``, of which the ``loss`` is captured when present (training), else the ``logits``
(inference); anything else (a ``DynamicCache``, hidden states) is dropped (:func:`_plain_output`).
A Hugging Face model's positional example inputs are read as ``(input_ids, labels)``
(:func:`_bind_inputs`). A custom ``torch.autograd.Function`` is captured as one op that keeps its
backward (:mod:`mcompile.capture.autograd_fn`, active around the export). A Python loop over the indices ``nonzero``
selects from a static 1-D mask (the eager MoE dispatch) runs every index, each iteration's updates selected by
its mask entry (:mod:`mcompile.capture.loops`); a ``module.to(dtype)`` in forward that changes nothing returns the
module; a Hugging Face stack that builds its default mask only outside compile and fails on the ``None`` is
captured with the all-ones mask eager mode builds (:func:`_mask_left_none`). Every failure is one
:class:`CaptureError` naming its cause, the user's line and the fix for that cause (:func:`_diagnose`):
a data-dependent branch, an untraceable op, a Python side effect, an output that is not tensors, a
positional input bound to a mask, a Function that cannot be an op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import io
import re
import sys
import traceback
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import sympy
import torch
import torch.fx as fx
from torch.export import Dim
from torch.export.graph_signature import InputKind

from mcompile.capture import autograd_fn, checks, loops, values
from mcompile.ir import meta as M
from mcompile.ir.patches import Patches, Refused, exception_chain

__all__ = ["CaptureError", "CaptureWarning", "Captured", "OutputWarning", "capture", "warn_unless_loss"]

BATCH, SEQ = "batch", "seq"
_TORCH_DIR = str(Path(torch.__file__).parent)
_OWN_DIR = str(Path(__file__).parent)


class CaptureError(RuntimeError):
    """torch.export could not capture the model; the message names the cause, the user's line and the fix."""


class CaptureWarning(UserWarning):
    """The model was captured, but something forward does (a print) is not in the captured program."""


class OutputWarning(UserWarning):
    """A plan that trains has an output that is not a scalar loss (e.g. logits: no labels were given)."""


class _Refused(Refused):  # raised inside the trace by our own checks, turned into a CaptureError
    pass


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
    output: str = "a tensor"  # what the captured output is, in words ("CausalLMOutputWithPast.logits", ...)
    packed: bytes | None = None  # the exported program serialised (capture(cache=True)): mcompile.capture.cache

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
    msg_frames = [f for f in re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s+(.+)', str(exc))
                  if not f[0].startswith(_OWN_DIR)]  # a call made by mcompile's capture (mcompile.capture.values): the
                                                     # user's
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
    cache: bool = False,
    pack: bool | str = False,
) -> Captured:
    """Capture ``model(*example_inputs, **example_kwargs)`` as an aten graph with lifted parameters.

    ``example_inputs`` is a template of shapes and dtypes; with ``dynamic`` the batch (dim 0) and the
    sequence (dim 1) of every tensor input become symbols, so the program accepts other sizes.
    With ``meta_dtype`` the model is captured on the meta device with its parameters in that dtype
    (:func:`on_meta`): no values are read, and ``Captured.state_values`` holds meta tensors.
    A Hugging Face model's positional inputs are ``(input_ids, labels)`` (:func:`_bind_inputs`); a
    ``ModelOutput`` is captured as its loss, else its logits (:func:`_plain_output`).
    ``cache``: look the capture up in (and add it to) the capture cache (:mod:`mcompile.capture.cache`);
    ``pack`` (implied by ``cache``): keep the serialised program in ``Captured.packed``; ``"bytes"``:
    return only those bytes (``parallelize`` broadcasts them: a cached capture is not unpacked twice).
    """
    if not isinstance(example_inputs, tuple):
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,)
    name = type(model).__name__
    # bound on the caller's values (a mask check reads them) before they become meta tensors
    example_inputs, example_kwargs = _bind_inputs(model, example_inputs, dict(example_kwargs or {}), name)
    if meta_dtype is not None:
        meta = lambda t: torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
        with on_meta(model, meta_dtype):
            return capture(model, tuple(meta(t) for t in example_inputs),
                           {k: meta(v) for k, v in example_kwargs.items()}, dynamic=dynamic, cache=cache, pack=pack)
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
    key = None
    if cache:
        from mcompile.capture import cache as capture_cache

        key = capture_cache.key(model, args, kwargs, f"dynamic={dynamic}")
        data = capture_cache.load(key)
        if data is not None:
            if pack == "bytes":
                _check_functions_importable(name, capture_cache.functions(data))
                return data
            try:
                return from_packed(data, model)
            except Exception as e:  # noqa: BLE001 - an unreadable entry is captured again and replaced
                capture_cache.log.info("capture cache entry %s unreadable (%s): capturing", key, e)
    before = _leaks(model)
    attrs = {(id(m), k) for m in model.modules() for k in vars(m)}  # what exists before forward runs
    what: list[str] = []  # what the adapted forward returned (set inside the trace)
    printed = _Tee(sys.stdout)
    failed: Exception | None = None
    for default_mask in (False, True):
        try:
            # the source files the trace ran: the cache entry lists them, its lookups check them
            with capture_cache.recording() if cache else contextlib.nullcontext(set()) as ran:
                ep, caught = _export(model, args, kwargs, shapes_named, dynamic, what, printed, default_mask)
            _drop_scratch(model, attrs)
            _refuse_side_effects(model, ep, before, caught)
            break
        except Exception as e:  # noqa: BLE001 - every export failure becomes one clear error
            if failed is None and _mask_left_none(model, kwargs, e):
                failed = e  # again with the all-ones mask eager mode builds (:func:`_plain_outputs`)
                continue
            e = failed or e
            op, cause, where, fix = _diagnose(e)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            said = "" if isinstance(e, Refused) else \
                f"  torch says: {first}\n"
            raise CaptureError(
                f"cannot capture {name} with torch.export: {cause}{f' (op {op})' if op else ''}\n"
                f"  at {where or 'an unknown location'}\n"
                f"{said}"
                f"  fix: {fix}"
            ) from e
    prints = "FakeTensor(" in printed.text
    if prints:
        _warn_prints(name)
    aliases = _record_aliases(ep)
    packed = None
    if cache or pack:
        from mcompile.capture import cache as capture_cache

        packed = capture_cache.pack(ep, what[-1] if what else "", prints, aliases, ran)
        if cache and all(t.is_meta for t in list(ep.state_dict.values()) + list(ep.constants.values())
               if isinstance(t, torch.Tensor)):
            capture_cache.store(key, packed)  # no weights in it: a meta-device capture
        if pack == "bytes":
            _check_functions_importable(name, capture_cache.functions(packed))
            return packed
    cap = _from_exported(ep, model, name)
    cap.output = what[-1] if what else cap.output
    cap.packed = packed
    return cap


def _export(model, args, kwargs, shapes_named, dynamic, what, printed, default_mask: bool):
    """torch.export (non-strict) of the adapted forward, with the capture's adaptations active; (ep, the
    warnings export raised)."""
    with _plain_outputs(model, what, default_mask), _recorded_warnings() as caught, \
            contextlib.redirect_stdout(printed), autograd_fn.wrapping(), loops.unrolling() as unrolled, \
            _unchanged_casts(), checks.asserting() as asserted:
        export = functools.partial(loops.exporting, unrolled, model, args, kwargs)
        try:
            ep = export({**shapes_named[0], **_arg_names(model, shapes_named[1])})
        except torch._dynamo.exc.UserError as e:
            if not dynamic:
                raise
            ep = _export_with_suggested_fixes(export, model, shapes_named, e)
        if ep is None:
            # The model constrains a dim (e.g. a static sequence length): let export infer it.
            auto = lambda t: None if not isinstance(t, torch.Tensor) or t.ndim == 0 else {  # noqa: E731
                d: Dim.AUTO for d in range(min(t.ndim, 2))
            }
            ep = export({**{k: auto(v) for k, v in kwargs.items()},
                         **_arg_names(model, tuple(auto(a) for a in args))})
            if dynamic:
                _unify_shared_dims(ep)
        loops.guard(ep, unrolled)  # loops over nonzero indices: each iteration selected by its mask entry
        if asserted:  # value checks that only raise: tensor assertions naming their line
            checks.tensor_asserts(ep.graph_module, asserted)
    return ep, caught


def _mask_left_none(model: torch.nn.Module, kwargs: dict, e: BaseException) -> bool:
    """Whether a Hugging Face model failed on a ``None`` it was given for ``attention_mask``.

    Transformers' T5-style stacks (Switch Transformers, LongT5) build their default all-ones mask only when
    not compiling (``if attention_mask is None and not is_torchdynamo_compiling(): attention_mask = ones``);
    under torch.export the ``None`` flows on and the first use fails (``'NoneType' object is not
    subscriptable``). ``attention_mask=None`` means "attend to every token" in every Hugging Face model, so the
    capture is tried again with that mask built from ``input_ids`` inside the program (its batch and sequence
    stay symbolic): the program eager mode runs."""
    if not _hf_model(model) or kwargs.get("attention_mask") is not None or kwargs.get("input_ids") is None:
        return False
    try:
        if "attention_mask" not in inspect.signature(model.forward).parameters:
            return False
    except (TypeError, ValueError):
        return False
    return any(isinstance(x, TypeError | AttributeError) and "'NoneType' object" in str(x) for x in exception_chain(e))


def _check_functions_importable(name: str, entries: list[dict]) -> None:
    """Bytes for other processes (parallelize's ranks) must name Functions those processes can import; raised
    here, on the capturing rank, the error reaches every rank."""
    try:
        autograd_fn.check_importable(entries)
    except autograd_fn.FunctionRefused as e:
        raise CaptureError(f"cannot capture {name} for parallelize: {e.cause}\n  fix: {e.fix}") from e


def _warn_prints(name: str) -> None:
    warnings.warn(CaptureWarning(
        f"{name}.forward prints a tensor: during capture it printed a placeholder (FakeTensor(...)), and the "
        "captured program does not print at all. fix: print outside forward (e.g. the loss train_step "
        "returns), or guard the print with `if not torch.compiler.is_exporting():`."), stacklevel=3)


def _record_aliases(ep) -> dict[str, list[bool]]:
    """Which outputs of each node share storage with an input (:func:`mcompile.ir.annotate.output_aliases`),
    kept in ``node.meta`` so that a capture and its serialised copy are annotated alike."""
    from mcompile.ir.annotate import ALIASES, output_aliases

    out = {}
    for n in ep.graph_module.graph.nodes:
        if n.op == "call_function" and (flags := output_aliases(n)) is not None:
            n.meta[ALIASES] = tuple(flags)
            out[n.name] = flags
    return out


def from_packed(data: bytes, model: torch.nn.Module) -> Captured:
    """The capture serialised in ``data`` (``Captured.packed``, :mod:`mcompile.capture.cache`) of
    ``model`` — the same model (its tied parameters are read from it)."""
    from mcompile.capture import cache as capture_cache
    from mcompile.ir.annotate import ALIASES

    try:
        ep, output, prints, aliases = capture_cache.unpack(data)
    except autograd_fn.FunctionRefused as e:
        raise CaptureError(f"cannot load the capture of {type(model).__name__}: {e.cause}\n  fix: {e.fix}") from e
    for n in ep.graph_module.graph.nodes:  # storage sharing is not serialised: what the capture recorded
        if n.name in aliases:
            n.meta[ALIASES] = tuple(aliases[n.name])
        if n.op == "call_function":  # and the keys export sets with no content, as export sets them
            n.meta.setdefault("val", None)
            n.meta.setdefault("custom", {})
    ep.graph_module.graph.output_node().meta.pop("val", None)
    name = type(model).__name__
    if prints:
        _warn_prints(name)
    cap = _from_exported(ep, model, name)
    cap.output = output or cap.output
    cap.packed = data
    return cap


# -- inputs: what a user means by positional inputs ------------------------------------------------------------


def _hf_model(model: torch.nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (without importing transformers for models that are not)."""
    mu = sys.modules.get("transformers.modeling_utils")  # imported by every transformers model class
    return mu is not None and isinstance(model, mu.PreTrainedModel)


def _has_values(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type != "meta" and not is_fake(t)


def _looks_like_mask(t) -> bool:
    """A 0/1 (or bool) tensor. Without values (meta) only a bool tensor is known to be a mask."""
    if not isinstance(t, torch.Tensor):
        return False
    if t.dtype == torch.bool:
        return True
    return t.dtype.is_floating_point is False and _has_values(t) and bool(((t == 0) | (t == 1)).all())


def _bind_inputs(model: torch.nn.Module, args: tuple, kwargs: dict, name: str) -> tuple[tuple, dict]:
    """The example inputs as forward will see them.

    A Hugging Face model's forward reads ``(input_ids, attention_mask, ...)`` positionally, so
    ``model(ids, labels)`` would take the labels for a mask and plan a model without a loss. The rule:
    a ``PreTrainedModel``'s positional inputs are ``(input_ids, labels)`` (the second a 0/1 or bool
    tensor stays ``attention_mask``, as in Python); the others go by keyword. Any other model binds
    as Python does, but an integer tensor that lands on a ``*mask*`` parameter must hold only 0 and 1."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return args, kwargs
    positional = [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if _hf_model(model) and len(args) >= 2 and "labels" in sig.parameters and positional:
        if len(args) > 2:
            raise CaptureError(
                f"cannot capture {name} with torch.export: {len(args)} positional example inputs for a Hugging Face "
                "model; mcompile reads them as (input_ids, labels) only\n"
                f"  at {_def_line(model)}\n"
                "  fix: pass the others by keyword, e.g. compile_plan(model, mesh, (ids, labels), "
                "{'attention_mask': mask})")
        if not _looks_like_mask(args[1]):
            if "labels" in kwargs:
                raise CaptureError(
                    f"cannot capture {name} with torch.export: labels given twice (the second positional example "
                    "input of a Hugging Face model is its labels, and labels= is given too)\n"
                    f"  at {_def_line(model)}\n"
                    "  fix: pass (input_ids,) and labels=..., or (input_ids, labels) without labels=")
            first = positional[0]
            return (), {first: args[0], "labels": args[1], **{k: v for k, v in kwargs.items() if k != first}}
    for i, (a, pname) in enumerate(zip(args, positional)):
        if ("mask" in pname.lower() and isinstance(a, torch.Tensor) and not a.dtype.is_floating_point
                and a.dtype != torch.bool and _has_values(a) and not _looks_like_mask(a)):
            lo, hi = int(a.min()), int(a.max())
            raise CaptureError(
                f"cannot capture {name} with torch.export: positional example input #{i + 1} ({a.dtype}, values "
                f"{lo}..{hi}) binds to forward's parameter '{pname}', but it is not a 0/1 mask (labels or token "
                "ids in the wrong place would plan a model without its loss)\n"
                f"  at {_def_line(model)}\n"
                f"  fix: pass it by keyword under the name forward gives it (e.g. {{'labels': labels}} as "
                f"example_kwargs); if it is the {pname}, pass it as {{'{pname}': ...}}")
    return args, kwargs


def _def_line(model: torch.nn.Module) -> str:
    """file:line of ``def forward`` (errors about inputs and outputs have no failing line of their own)."""
    return _source_of(type(model).forward) or f"{type(model).__qualname__}.forward"


# -- outputs: what a user's forward returns -> tensors -----------------------------------------------------------


@contextlib.contextmanager
def _plain_outputs(model: torch.nn.Module, what: list, default_mask: bool = False):
    """Temporarily route ``model.forward`` through :func:`_plain_output` (an instance attribute, removed
    on exit: the parameter names stay the model's own). A Hugging Face forward also gets
    ``use_cache=False`` unless the caller set it: the cache would be dropped anyway (a training step
    never uses it), and building it adds concatenations to the traced graph. With ``default_mask`` a forward
    called without ``attention_mask`` gets the all-ones mask of its ``input_ids`` (:func:`_mask_left_none`)."""
    inner = model.forward
    try:
        no_cache = _hf_model(model) and "use_cache" in inspect.signature(inner).parameters
    except (TypeError, ValueError):
        no_cache = False

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if no_cache:
            kwargs.setdefault("use_cache", False)
        if default_mask and kwargs.get("attention_mask") is None and kwargs.get("input_ids") is not None:
            kwargs["attention_mask"] = torch.ones_like(kwargs["input_ids"])
        try:
            with values.tracking():  # values made from shapes and constants alone are known (mcompile.capture.values)
                result = inner(*args, **kwargs)
            out, described = _plain_output(result)
        except _Refused as r:  # about what forward returns: point at forward
            r.where = r.where or _def_line(model)
            raise
        what.append(described)
        return out

    had = model.__dict__.get("forward", _MISSING)
    model.__dict__["forward"] = forward
    try:
        yield
    finally:
        if had is _MISSING:
            del model.__dict__["forward"]
        else:
            model.__dict__["forward"] = had


_MISSING = object()
_OUTPUT_FIX = ("return the loss tensor from forward (training), or the tensors you need as a tuple (inference); "
               "a Hugging Face ModelOutput's loss (with labels) or logits is taken as it is")


def _plain_output(out) -> tuple[object, str]:
    """(the tensors to capture, what they are in words). Raises _Refused for what cannot be an output."""
    if isinstance(out, torch.Tensor):
        _refuse_custom_functions(out)
        return out, "a tensor"
    fields = _fields(out)
    if fields is not None:
        kind = type(out).__name__
        present = {k: v for k, v in fields.items() if v is not None}
        tensors = [k for k, v in present.items() if isinstance(v, torch.Tensor)]
        key = next((k for k in ("loss", "logits") if k in tensors), tensors[0] if len(tensors) == 1 else None)
        if key is None:
            raise _Refused(
                f"forward returns a {kind} with {_keys(present)}, none of them a 'loss' or 'logits' tensor "
                "(mcompile takes the loss, else the logits, else the only tensor field)",
                "return the loss from forward (or a dict/ModelOutput with a 'loss' or 'logits' tensor); "
                "for several outputs return a tuple of tensors")
        _refuse_custom_functions(present[key])
        return present[key], f"{kind}.{key}"
    if isinstance(out, tuple | list):
        import torch.utils._pytree as pytree

        leaves, _ = pytree.tree_flatten_with_path(out)
        for path, leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                raise _Refused(
                    f"forward returns a {type(out).__name__} whose element output{pytree.keystr(path)} is "
                    f"{_a(leaf)}, not a tensor",
                    f"return only tensors (drop output{pytree.keystr(path)} from forward's result); {_OUTPUT_FIX}")
            _refuse_custom_functions(leaf)
        if not leaves:
            raise _Refused(f"forward returns an empty {type(out).__name__}", _OUTPUT_FIX)
        return out, f"a {type(out).__name__} of {len(leaves)} tensors"
    raise _Refused(f"forward returns {_a(out)}, not a tensor", _OUTPUT_FIX)


def _fields(out) -> dict | None:
    if isinstance(out, Mapping):
        return dict(out)
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    return None


def _keys(d: dict) -> str:
    kind = lambda v: "Tensor" if isinstance(v, torch.Tensor) else type(v).__name__  # noqa: E731 - not FakeTensor
    return "fields " + ", ".join(f"{k} ({kind(v)})" for k, v in d.items()) if d else "no fields set"


def _a(x) -> str:
    return "None" if x is None else f"a {type(x).__module__}.{type(x).__qualname__}".replace("builtins.", "")


def _refuse_custom_functions(out: torch.Tensor) -> None:
    """A custom ``torch.autograd.Function`` that reached the trace without going through
    :func:`mcompile.capture.autograd_fn.wrapping` (a subclass with its own ``apply``): torch.export would keep its
    forward's ops and none of its backward. Its node in the traced autograd graph names the Function."""
    todo, seen = [out.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        cls = getattr(fn, "_forward_cls", None)
        if cls is not None and not cls.__module__.startswith("torch.") and not autograd_fn.is_wrapped(cls):
            raise _Refused(
                f"forward applies the custom torch.autograd.Function {cls.__qualname__} without going through "
                "Function.apply (its class overrides apply), so mcompile cannot keep its backward: the captured "
                "program would differentiate its forward instead, and gradients would silently differ",
                "call the Function through torch.autograd.Function.apply (do not override apply), or write it as a "
                "torch.library.custom_op with register_fake and register_autograd",
                _source_of(cls.forward))
        todo.extend(f for f, _ in fn.next_functions)


_source_of = autograd_fn.source_of  # file:line of a function's ``def`` (shared with the Function refusals)


# -- side effects: what forward does that a captured program cannot --------------------------------------------


class _Tee(io.TextIOBase):
    """stdout that passes everything through and keeps a copy (to see a print of a traced tensor)."""

    def __init__(self, out):
        self.out, self.parts = out, []

    def write(self, s):
        self.parts.append(s)
        return self.out.write(s)

    def flush(self):
        self.out.flush()

    @property
    def text(self) -> str:
        return "".join(self.parts)


def _apply_unless_unchanged(self, fn, recurse=True):
    """``Module._apply`` (``module.to(dtype)``, ``.float()``, ...) that returns the module as it is when ``fn``
    changes none of its tensors. A forward that casts a submodule to the dtype it already has (Switch
    Transformers' and NLLB-MoE's routers: ``self.classifier = self.classifier.to(self.dtype)``) is a no-op in
    eager mode, but export's fake parameters cannot be swapped in place, so the no-op failed the capture. A cast
    that changes a tensor still goes through torch (and fails, clearly: forward cannot re-create parameters)."""
    if _CASTS.active():
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

        mods = self.modules() if recurse else [self]
        tensors = [t for m in mods for d in (m._parameters, m._buffers) for t in d.values() if t is not None]
        # probed on plain 0-d tensors of each dtype and device, outside the trace (fn on a traced parameter
        # would record a cast and rebind the parameter to its detached result)
        with unset_fake_temporarily(), disable_proxy_modes_tracing(), torch.no_grad():
            probes = [torch.empty((), dtype=t.dtype, device=t.device) for t in tensors]
            if all(fn(p) is p for p in probes):
                return self
    return _ORIG_APPLY(self, fn, recurse)


_ORIG_APPLY = torch.nn.Module._apply
_CASTS = Patches((torch.nn.Module, "_apply", _apply_unless_unchanged))  # Module._apply while any capture runs


def _unchanged_casts():
    return _CASTS.held()


@contextlib.contextmanager
def _recorded_warnings():
    """Warnings raised during export, kept aside; the ones that are not ours to judge are re-issued."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
    for w in caught:
        if not _ASSIGNED.search(str(w.message)):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, registry=_REISSUED)


_ASSIGNED = re.compile(r"tensor attribute (\S+) was assigned during export")
_REISSUED: dict = {}  # the warnings registry of re-issued warnings: "default" shows each once, as it would have


def _is_traced(v) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(v, FakeTensor | torch.SymInt | torch.SymFloat | torch.SymBool)


def _leaks(model: torch.nn.Module) -> dict[str, str]:
    """Where a traced value (a FakeTensor, a symbolic size) sits outside the model's parameters: in a
    module attribute (``self.seen.append(h)``) or a global of the module that defines a forward;
    each with the ``def forward`` line of the module it belongs to."""
    found: dict[str, str] = {}
    mod: torch.nn.Module = model

    def scan(v, where, depth):
        if _is_traced(v):
            found.setdefault(where, _def_line(mod))
        elif depth and isinstance(v, list | tuple | set | dict):
            items = list(v.items()) if isinstance(v, dict) else list(enumerate(v))
            for k, x in items[:256]:
                scan(x, f"{where}[{k!r}]", depth - 1)

    globals_seen: set[int] = set()
    for path, mod in model.named_modules():
        for k, v in vars(mod).items():
            if k not in ("_parameters", "_buffers", "_modules"):
                scan(v, f"self{'.' + path if path else ''}.{k}", 3)
        fn = getattr(type(mod).forward, "__globals__", None)
        if fn is not None and id(fn) not in globals_seen and not fn.get("__name__", "").startswith("torch."):
            globals_seen.add(id(fn))
            for k, v in list(fn.items()):
                if not k.startswith("__"):
                    scan(v, f"global {k}", 2)
    return found


_NO_VALUE_WRITES = {torch.ops.aten.detach_.default, torch.ops.aten.requires_grad_.default}  # autograd flags only


def _empty(t) -> bool:
    return isinstance(t, torch.Tensor) and t.numel() == 0


def _drop_scratch(model: torch.nn.Module, attrs: set) -> None:
    """A module attribute forward *created* to hold a traced value (Funnel's ``self.seq_len = x.size(1)``) is
    scratch state of the call: the captured program reads no Python attribute, and nothing read it before forward
    made it (it did not exist), so it is removed again, the module as it was before the capture. Code that reads it
    after a step gets an AttributeError, never a placeholder. An attribute that existed before (a counter, a
    cache a later call reads) is still refused by :func:`_refuse_side_effects`."""
    for mod in model.modules():
        for k, v in list(vars(mod).items()):
            if (id(mod), k) not in attrs and _is_traced(v):
                delattr(mod, k)


def _refuse_side_effects(model: torch.nn.Module, ep, before: set[str], caught) -> None:
    """Python state forward changes (a list on self, a global, a tensor attribute) changes once, at
    capture, with placeholder values; the captured program never does it again."""
    fix = ("keep forward free of Python side effects: return what you need from forward, or register state as a "
           "buffer (self.register_buffer) and update it with an in-place op, which the program carries")
    leaks = _leaks(model)
    leaked = sorted(set(leaks) - set(before))
    assigned = [m.group(1) for w in caught if (m := _ASSIGNED.search(str(w.message)))]
    if leaked or assigned:
        what = ", ".join(dict.fromkeys(assigned + leaked))
        where = leaks[leaked[0]] if leaked else _owner_line(model, assigned[0])
        raise _Refused(f"forward stores a traced value outside the model ({what}): a Python side effect that "
                       "happens once, at capture, with placeholder values, and never in the captured program",
                       fix, where)
    constants = {s.arg.name: s.target for s in ep.graph_signature.input_specs if s.kind == InputKind.CONSTANT_TENSOR}
    for node in ep.graph_module.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable or node.target in _NO_VALUE_WRITES:
            continue
        if all(_empty(ep.constants.get(constants.get(getattr(a, "name", None)))) for a in node.args
               if getattr(a, "name", None) in constants):
            continue  # an empty tensor forward creates (a Hugging Face cache's placeholder): no value to lose
        for a, arg in zip(schema.arguments, node.args):
            if a.alias_info is not None and a.alias_info.is_write and getattr(arg, "name", None) in constants:
                raise _Refused(
                    f"forward updates the tensor attribute self.{constants[arg.name]} in place: it is neither a "
                    "parameter nor a buffer, so the captured program holds a copy of it and the update is lost "
                    "(the model's tensor was updated once, at capture)",
                    "register it as a buffer (self.register_buffer(name, tensor)), or compute it outside forward",
                    _node_line(node))


def _owner_line(model: torch.nn.Module, attr: str) -> str:
    """The ``def forward`` line of the module that owns ``self.<path>.<name>`` (torch's warning's name)."""
    path = attr.removeprefix("self.").split("[")[0].rsplit(".", 1)[0] if "." in attr.removeprefix("self.") else ""
    try:
        return _def_line(model.get_submodule(path))
    except AttributeError:
        return _def_line(model)


def _node_line(node: fx.Node) -> str | None:
    frames = re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s+(.+)', node.meta.get("stack_trace") or "")
    user = [f for f in frames if not f[0].startswith(_TORCH_DIR) and not f[0].startswith(_OWN_DIR)]
    if user:
        f, line, code = user[-1]
        return f"{f}:{line}: {code.strip()}"
    return None


# -- failures: cause and fix by class --------------------------------------------------------------------------


def _diagnose(e: BaseException) -> tuple[str | None, str, str | None, str]:
    """(op, cause, where, fix) of a failed capture, by class of failure."""
    chain = list(exception_chain(e))
    ours = next((x for x in chain if isinstance(x, Refused)),
                None)
    if ours is not None:
        return None, ours.cause, ours.where or _user_frame(e), ours.fix
    text = "\n".join(str(x) for x in chain)
    names = {type(x).__name__ for x in chain}
    where = _user_frame(e)
    if "GuardOnDataDependentSymNode" in names or "data-dependent" in text:
        return ("aten._local_scalar_dense", "a tensor's value is used as a Python bool/int/float "
                "(data-dependent control flow, .item(), .tolist()): the captured program holds no values, and this "
                "value depends on the inputs' (or parameters') values, so fixing it to the example batch's would be "
                "silently wrong for the next batch (a check that only raises becomes a runtime assertion, and a "
                "value made from shapes and constants alone is known: mcompile.capture.checks, "
                "mcompile.capture.values)", where,
                "remove data-dependent Python control flow / .item() / .tolist() from forward: compute both "
                "branches and select with torch.where (or use torch.cond), and keep values as tensors")
    if ".numpy()" in text or "__array__" in text or "Cannot access data pointer" in text:
        return (None, "forward converts a tensor to numpy (or reads its data): torch.export traces placeholder "
                "tensors that have no data, and numpy code is not traceable", where,
                "replace the numpy call with the torch op of the same name (torch.tanh, torch.clip, ...), "
                "which the captured program can run and shard")
    m = re.search(r"no fake impl registered for <CustomOpDef\(([\w:.]+)\)>", text) or \
        re.search(r"^([\w]+\.[\w]+(?:\.[\w]+)?)$", str(next((x for x in chain if type(x).__name__ in (
            "UnsupportedOperatorException", "DynamicOutputShapeException")), "")), re.M)
    if m or "UnsupportedOperatorException" in names or "fake impl" in text or "Meta' backend" in text:
        op = m.group(1) if m else _op_of(e)
        return (op, f"the op {op} has no fake (meta) kernel, so torch.export cannot trace it: it has to know the "
                "shapes and dtypes of its outputs without running it", where,
                f"register a fake kernel for {op} (torch.library.register_fake, or @op.register_fake for a "
                "torch.library.custom_op) that returns empty tensors of the right shapes, or write it with torch ops")
    return (None, f"forward raised {type(e).__name__} on the example inputs", where,
            "check that model(*example_inputs, **example_kwargs) runs in eager mode with these inputs (shapes, "
            "dtypes, argument names); if it does, the call at the line above cannot be traced by torch.export: "
            "rewrite it with torch ops")


def _unify_shared_dims(ep: torch.export.ExportedProgram) -> None:
    """After the fallback export (each dim ``Dim.AUTO``): every input's dim 0 is the batch and dim 1 the
    sequence, as ``capture``'s shared ``batch`` / ``seq`` Dims say and the runtime feeds them (it splits every
    input's dim 0 alike), so one symbol each. The fallback gives each input symbols of its own (torch 2.11 on
    the meta device takes it for llama3-tiny: a guard ``min(8*seq, 16*seq) == 8*seq`` its solver cannot prove
    for the shared Dim): ``tokens`` (s95, s75), ``targets`` (s24, s13), nothing relating them, so sizes
    mixing two inputs (the loss's) named symbols other than the capture's ``batch`` / ``seq`` (pipeline
    partitioning could not evaluate them; the compat run, docs/testing.md). Another input's symbol of the same
    example size is replaced by the first input's in the program's ShapeEnv (kept through the capture
    cache's bytes: ``capture_cache.pack``'s ``same_sizes``)."""
    from mcompile.capture.cache import _shape_env_of
    from mcompile.ir.compat import size_hints

    env = _shape_env_of(ep)
    if env is None:
        return
    users = {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
    first: dict[int, sympy.Symbol] = {}
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        if node.op != "placeholder" or node.name not in users or not isinstance(val, torch.Tensor):
            continue
        for d in range(min(val.ndim, 2)):
            size = val.shape[d]
            if not isinstance(size, torch.SymInt) or not isinstance(size.node.expr, sympy.Symbol):
                continue
            sym = size.node.expr
            want = first.setdefault(d, sym)
            if sym != want and size_hints(env).get(sym) == size_hints(env).get(want):
                env._set_replacement(sym, want, "mcompile.capture.export: the same batch / seq Dim")


def _export_with_suggested_fixes(export, model, shapes_named, error) -> torch.export.ExportedProgram | None:
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
        return export(refined)
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


def warn_unless_loss(cap: Captured) -> None:
    """Warn (:class:`OutputWarning`) when the captured output is not one scalar: a plan that trains
    (``compile_plan``, ``plan``, ``parallelize``) differentiates one loss, and a model that returns logits
    (a Hugging Face model without labels) or several tensors has none. ``ParallelModule.forward`` still
    returns such outputs (inference); ``train_step`` needs the loss."""
    out = cap.gm.graph.output_node().args[0]
    vals = [n.meta.get("val") if isinstance(n, fx.Node) else n for n in out]
    if len(vals) == 1 and isinstance(vals[0], torch.Tensor) and vals[0].ndim == 0:
        return
    names = {str(sym): key for key, sym in cap.symbols.items()}
    dims = lambda v: "[" + ", ".join(names.get(str(d), str(d)) for d in v.shape) + "]"  # noqa: E731
    shapes = ", ".join(dims(v) if isinstance(v, torch.Tensor) else type(v).__name__ for v in vals)
    why = "the model got no labels" if "logits" in cap.output else "forward returns no loss"
    warnings.warn(OutputWarning(
        f"{cap.model_name}'s output is {cap.output} of shape {shapes}, not a scalar loss ({why}): the plan is for a "
        "training step, which differentiates one scalar loss (ParallelModule.forward still returns this output "
        "as it is, for inference). fix: return the loss from forward, or pass labels (a Hugging Face model: "
        "example inputs (ids, labels), or labels=... as a keyword)"), stacklevel=3)
