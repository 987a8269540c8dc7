"""Custom ``torch.autograd.Function``s captured with their own backward.

torch.export (non-strict) records the ops a Function's forward runs and none of its backward: the
captured program would differentiate the forward instead, which is wrong whenever the backward is
not the forward's derivative (a straight-through estimator, a gradient scaled or clipped in
backward, a hand-written recompute). During capture (:func:`wrapping`), ``Function.apply`` of a
user's Function (not torch's own) is routed to a ``torch.library`` op of namespace ``mcompile_fn``,
one per Function class and argument signature, so the captured graph holds one opaque node:

- **fake implementation**: the Function's forward run on fake tensors with a plain context
  object (``FunctionCtx``): shapes and dtypes only, as torch.export's own trace of it would give;
- **Autograd kernel**: ``Function.apply`` itself. Wherever the program runs under autograd — the
  single-device reference, the thread simulator, ``execution="autograd"`` — this *is* the user's
  Function: its ``ctx`` (saved tensors, non-tensor attributes, ``needs_input_grad``,
  ``mark_non_differentiable``, ``set_materialize_grads``) behaves as in eager mode. The joint
  trace (``passes/joint.py``, ``make_fx`` over forward and ``autograd.grad``) goes through the same
  kernel, so it records the forward's ops and then the Function's *backward* ops as they run;
- **CompositeExplicitAutograd kernel**: the forward alone (below autograd: inference mode).

Sharding: the rule of such an op is inferred from its code where it can be proven
(:mod:`mcompile.sharding.rules.inferred`).

What cannot be wrapped is refused at capture, naming the Function (:class:`FunctionRefused`): a
forward that does not run on fake tensors (``.item()``, numpy, data-dependent branches), an output
whose shape depends on values, an input written in place, outputs or arguments an op schema cannot
carry (a Python object, a non-tensor output).

Across processes (``parallelize``: rank 0 captures, the others load its serialised program), the
ops a capture made are listed in the packed program (:func:`manifest`) and registered again from
the Function's module and qualified name before loading (:func:`ensure`).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import re
from dataclasses import dataclass

import torch
from torch.autograd.function import Function, FunctionCtx, _is_setup_context_defined

from mcompile.ir.patches import Patches, Refused

__all__ = ["NAMESPACE", "FunctionRefused", "wrapping", "is_wrapped", "manifest", "check_importable", "ensure"]

NAMESPACE = "mcompile_fn"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")  # lives as long as the process: the ops' registrations
_ORIG_APPLY = Function.__dict__["apply"].__func__  # the unpatched classmethod's function


class FunctionRefused(Refused):
    """A Function that cannot be captured as an op: cause, fix and the user's line."""


@dataclass
class _Op:
    cls: type
    args: tuple[str, ...]  # per positional argument: its schema type, with ":tuple" for a tuple of values
    outs: int  # -1: forward returns one tensor; k >= 1: a tuple of k tensors
    name: str


_OPS: dict[str, _Op] = {}  # op name -> the Function it runs (the kernels look it up at each call)
_DEFINED: set[str] = set()
# -- capture: Function.apply routed to an op -------------------------------------------------------------------


def wrapping():
    """While capturing (this thread only): ``UserFunction.apply(...)`` calls its ``mcompile_fn`` op.
    Restores ``Function.apply`` on exit (after the last capture of the process leaves)."""
    return _PATCHES.held()


def is_wrapped(cls: type) -> bool:
    """Whether a capture routed ``cls.apply`` to an op (its node in a traced autograd graph is ours)."""
    return any(op.cls is cls for op in _OPS.values())


def _own(cls: type) -> bool:
    """torch's own Functions (checkpointing, ...) are traced as torch.export traces them."""
    mod = getattr(cls, "__module__", "") or ""
    return mod == "torch" or mod.startswith("torch.")


def _apply(cls, *args, **kwargs):
    if not _PATCHES.active() or _own(cls) or torch._C._are_functorch_transforms_active():
        return _ORIG_APPLY(cls, *args, **kwargs)
    if kwargs or _is_setup_context_defined(cls.setup_context):
        try:  # as Function.apply binds them: keywords and defaults become positional
            sig = inspect.signature(cls.forward)
            bound = sig.bind(*((None,) if not _is_setup_context_defined(cls.setup_context) else ()), *args, **kwargs)
            bound.apply_defaults()
        except TypeError:
            return _ORIG_APPLY(cls, *args, **kwargs)  # the call's own error, as in eager mode
        if bound.kwargs:
            raise FunctionRefused(
                f"the custom torch.autograd.Function {cls.__qualname__} is applied with keyword-only arguments "
                f"({', '.join(bound.kwargs)}), which its op cannot carry",
                f"make them positional parameters of {cls.__qualname__}.forward", _call_site())
        args = tuple(bound.args[0 if _is_setup_context_defined(cls.setup_context) else 1:])
    kinds = tuple(_kind(cls, i, a) for i, a in enumerate(args))
    outs = _probe(cls, args)
    op = _define(cls, kinds, outs)
    out = getattr(getattr(torch.ops, NAMESPACE), op.name)(*_flatten(args, kinds))
    return out if outs == -1 else tuple(out)


_SCALARS = ((bool, "bool"), (int, "SymInt"), (torch.SymInt, "SymInt"), (float, "float"), (str, "str"),
            (torch.dtype, "ScalarType"), (torch.device, "Device"))


_PATCHES = Patches((Function, "apply", classmethod(_apply)))  # Function.apply while any capture runs


def _kind(cls: type, i: int, a) -> str:
    """The schema type of argument ``i`` (a tuple of values keeps ``:tuple``: forward gets a tuple back)."""
    if isinstance(a, torch.Tensor):
        return "Tensor"
    if a is None:
        return "Tensor?"
    for t, name in _SCALARS:  # bool before int: a bool is an int
        if isinstance(a, t):
            return name
    if isinstance(a, list | tuple):
        inner = {_kind(cls, i, x) for x in a} or {"SymInt"}
        if len(inner) == 1 and (k := inner.pop()) in ("Tensor", "SymInt", "float", "bool"):
            return f"{k}[]" + (":tuple" if isinstance(a, tuple) else "")
    if isinstance(a, dict) and (text := _constant(a)) is not None:
        return _CONST + text
    raise FunctionRefused(
        f"the custom torch.autograd.Function {cls.__qualname__} is applied with argument #{i + 1} of type "
        f"{type(a).__module__}.{type(a).__qualname__}: mcompile captures a Function as a torch.library op (to keep "
        "its backward), whose arguments are tensors, numbers, strings, dtypes, devices, None, lists of one of "
        "these, and dicts of JSON values (a configuration: part of the op, one op per value)",
        f"pass that value another way (as a constant inside {cls.__qualname__}, or as one of those types)",
        _call_site())


_CONST = "const:"  # an argument kind: a constant (a dict of JSON values, its JSON text after the prefix)


def _constant(a: dict) -> str | None:
    """The JSON text of a configuration dict that JSON gives back as it is (string keys, numbers, strings, bools,
    None, lists and dicts of these); None otherwise. Such a value is part of the op (its name hashes it), not an
    argument: a schema has no dict type, and a manifest entry carries it to other processes as text."""
    try:
        text = json.dumps(a, sort_keys=True)
    except (TypeError, ValueError):
        return None
    return text if json.loads(text) == a else None


def _flatten(args, kinds) -> list:
    return [list(a) if isinstance(a, tuple) else a for a, k in zip(args, kinds) if not k.startswith(_CONST)]


def _rebuild(op: _Op, flat) -> tuple:
    it = iter(flat)
    return tuple(json.loads(k[len(_CONST):]) if k.startswith(_CONST) else
                 (tuple(a) if k.endswith(":tuple") else a) for k in op.args for a in
                 ([None] if k.startswith(_CONST) else [next(it)]))


def _run_forward(cls: type, args: tuple, needs: tuple[bool, ...]):
    """The Function's forward without autograd, with a plain context object (what it saves is dropped)."""
    ctx = FunctionCtx()
    ctx.needs_input_grad = needs
    with torch.no_grad():
        if _is_setup_context_defined(cls.setup_context):
            out = cls.forward(*args)
            cls.setup_context(ctx, args, out)
        else:
            out = cls.forward(ctx, *args)
    return out, ctx


def _fresh(out, args):
    """An op's outputs never share storage with its inputs (a Function may return an input as it is)."""
    def storage(t):
        try:
            return t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return None
    ins = {s for a in args if isinstance(a, torch.Tensor) and (s := storage(a)) is not None}
    one = lambda t: t.clone() if storage(t) in ins else t  # noqa: E731
    return one(out) if isinstance(out, torch.Tensor) else tuple(one(t) for t in out)


def _probe(cls: type, args: tuple) -> int:
    """Run forward on the capture's fake inputs, outside the trace, to learn its outputs and refuse what
    an op cannot be: -1 for one tensor, k for a tuple of k tensors."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    name, where = cls.__qualname__, source_of(cls.forward)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    versions = [t._version for t in tensors]
    needs = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    try:
        # outside the trace: no proxy mode records its ops, and no torch-function mode (export's pre-dispatch
        # one) records its grad-mode switches
        with disable_proxy_modes_tracing(), torch._C.DisableTorchFunction():
            out, ctx = _run_forward(cls, args, needs)
    except FunctionRefused:
        raise
    except Exception as e:  # noqa: BLE001 - named with the Function and the line that failed
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        text = f"{type(e).__name__}: {e}"
        if "DynamicOutputShape" in text or "data-dependent" in text or "DataDependent" in text:
            why, fix = ": it depends on tensor values", (
                f"keep {name}.forward free of .item(), .tolist() and Python branches on tensor values: compute "
                "both branches and select with torch.where, and give outputs shapes known from the inputs")
        elif ".numpy()" in text or "__array__" in text or "data pointer" in text:
            why, fix = ": numpy needs values", f"write {name}.forward with torch ops instead of numpy (torch.tanh, ...)"
        else:
            why, fix = "", f"write {name}.forward with torch ops that run on tensors without values (fake tensors)"
        raise FunctionRefused(
            f"the forward of the custom torch.autograd.Function {name} cannot run on placeholder tensors "
            f"({type(e).__name__}: {first}){why}", fix, _user_line(e) or where) from e
    if getattr(ctx, "dirty_tensors", None) or any(t._version != v for t, v in zip(tensors, versions)):
        raise FunctionRefused(
            f"the forward of the custom torch.autograd.Function {name} writes one of its inputs in place "
            "(mark_dirty, or an in-place op on an input): its op would hide the write from the captured program",
            f"return a new tensor from {name}.forward instead of modifying the input", where)
    outs = (out,) if isinstance(out, torch.Tensor) else out
    if not isinstance(outs, tuple) or not outs or not all(isinstance(t, torch.Tensor) for t in outs):
        kind = lambda v: "Tensor" if isinstance(v, torch.Tensor) else type(v).__name__  # noqa: E731 - not FakeTensor
        got = kind(out) if not isinstance(out, tuple) else "(" + ", ".join(kind(t) for t in out) + ")"
        raise FunctionRefused(
            f"the forward of the custom torch.autograd.Function {name} returns {got}: its op returns tensors only",
            f"return a tensor or a tuple of tensors from {name}.forward (keep other values on ctx)", where)
    for t in outs:
        if any(free_unbacked_symbols(s) for s in t.shape if isinstance(s, torch.SymInt)):
            raise FunctionRefused(
                f"the forward of the custom torch.autograd.Function {name} returns a tensor whose shape depends on "
                "tensor values (e.g. x[x > 0], nonzero, unique): the captured program must know every shape from "
                "the inputs' shapes",
                f"give {name}.forward outputs of fixed shape (torch.where(mask, x, 0) instead of x[mask])", where)
    return -1 if isinstance(out, torch.Tensor) else len(outs)


# -- the op: defined once per Function and signature -----------------------------------------------------------


def _op_name(cls: type, kinds: tuple[str, ...], outs: int) -> str:
    """Stable across processes for a class importable by name; a class defined inside a function (not
    importable) also keys on the object, since two such classes may share a qualified name."""
    what = f"{cls.__module__}|{cls.__qualname__}|{kinds}|{outs}"
    if "<locals>" in cls.__qualname__:
        what += f"|{id(cls)}"
    base = re.sub(r"\W", "_", cls.__qualname__.replace(".<locals>.", "_"))[:48]
    return f"{base}_{hashlib.sha256(what.encode()).hexdigest()[:10]}"


def _define(cls: type, kinds: tuple[str, ...], outs: int) -> _Op:
    name = _op_name(cls, kinds, outs)
    op = _OPS[name] = _Op(cls, kinds, outs, name)  # a class defined again (a re-run cell) replaces the old one
    if name in _DEFINED:
        return op
    params = ", ".join(f"{k.split(':')[0]} a{i}" for i, k in enumerate(kinds) if not k.startswith(_CONST))
    ret = "Tensor" if outs == -1 else "(" + ", ".join(["Tensor"] * outs) + ")"
    _LIB.define(f"{name}({params}) -> {ret}")

    def run(fn):  # each kernel reads the registry at call time: the op's Function is the latest of its name
        def kernel(*flat):
            o = _OPS[name]
            args = _rebuild(o, flat)
            return _fresh(fn(o.cls, args), args)
        return kernel

    def below_autograd(cls, args):
        return _run_forward(cls, args, tuple(False for _ in args))[0]

    _LIB.impl(name, run(lambda c, a: _ORIG_APPLY(c, *a)), "Autograd")
    _LIB.impl(name, run(below_autograd), "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", run(below_autograd), lib=_LIB)
    _DEFINED.add(name)
    return op


# -- across processes -------------------------------------------------------------------------------------------


def manifest(ep) -> list[dict]:
    """The ``mcompile_fn`` ops an exported program calls, with what defines them again elsewhere."""
    names = sorted({n.target._opname for n in ep.graph.nodes if n.op == "call_function"
                    and getattr(n.target, "namespace", None) == NAMESPACE})
    return [{"op": n, "module": _OPS[n].cls.__module__, "qualname": _OPS[n].cls.__qualname__,
             "args": list(_OPS[n].args), "outs": _OPS[n].outs} for n in names if n in _OPS]


def _resolve(entry: dict) -> type | None:
    """The Function of a manifest entry, imported by module and qualified name, if that names it."""
    if "<locals>" in entry["qualname"]:
        return None
    try:
        cls = importlib.import_module(entry["module"])
        for part in entry["qualname"].split("."):
            cls = getattr(cls, part)
    except (ImportError, AttributeError):
        return None
    ok = isinstance(cls, type) and issubclass(cls, Function) and \
        _op_name(cls, tuple(entry["args"]), entry["outs"]) == entry["op"]
    return cls if ok else None


def _not_importable(entry: dict) -> FunctionRefused:
    return FunctionRefused(
        f"the captured program applies the custom torch.autograd.Function {entry['module']}.{entry['qualname']}, "
        "which another process cannot import by that name, and every rank (process) must run it",
        "define the Function at the top level of an importable module (or of the script that runs)", None)


def check_importable(entries: list[dict]) -> None:
    """Before a capture is sent to other processes (``parallelize``): each Function can be found there.
    Raised on the capturing rank, the error reaches every rank (a failure on rank 0 is broadcast)."""
    for e in entries:
        cls = _resolve(e)
        if cls is None or (e["op"] in _OPS and _OPS[e["op"]].cls is not cls):  # a name that finds another class
            raise _not_importable(e)


def ensure(entries: list[dict]) -> None:
    """Define the ops of a packed program in this process (before it is loaded): each Function imported
    by module and qualified name. Raises FunctionRefused when one cannot be found."""
    for e in entries:
        if e["op"] in _DEFINED:
            continue
        cls = _resolve(e)
        if cls is None:
            raise _not_importable(e)
        _define(cls, tuple(e["args"]), e["outs"])


# -- where ------------------------------------------------------------------------------------------------------


def source_of(fn) -> str | None:
    """file:line: the ``def`` line of a function (past its decorators)."""
    try:
        fn = inspect.unwrap(fn)
        lines, start = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return None
    at = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith(("def ", "async def "))), 0)
    return f"{inspect.getsourcefile(fn)}:{start + at}: {lines[at].strip()}"


def _outside(filename: str) -> bool:
    from pathlib import Path

    return not filename.startswith((str(Path(torch.__file__).parent), str(Path(__file__).parent)))


def _call_site() -> str | None:
    """The user's line that applied the Function (the innermost frame outside torch and mcompile)."""
    import traceback

    frames = [f for f in traceback.extract_stack() if _outside(f.filename)]
    return f"{frames[-1].filename}:{frames[-1].lineno}: {(frames[-1].line or '').strip()}" if frames else None


def _user_line(e: BaseException) -> str | None:
    """The deepest frame of ``e`` outside torch and mcompile: the user's line in forward that failed."""
    import traceback

    frames = [f for f in traceback.extract_tb(e.__traceback__) if _outside(f.filename)]
    return f"{frames[-1].filename}:{frames[-1].lineno}: {(frames[-1].line or '').strip()}" if frames else None
