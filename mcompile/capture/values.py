"""Values forward computes from shapes and constants alone, known while capturing (issue 37).

torch.export traces placeholder tensors with no values, so reading a tensor as a Python number (``.item()``,
``bool(t)``, ``int(t)``, a tensor used as a size) is a data-dependent guard it refuses. Some of those tensors
hold no data from the inputs at all: Longformer / LED divide a size with ``torch.div(x.size(1), 2 * w,
rounding_mode="trunc")`` (a 0-d tensor made from a symbolic size) and view with the result; their encoder builds
its default mask with ``torch.ones`` and asks ``(mask > 0).any().item()``. Their values are functions of the
shapes and constants: eager mode computes the same ones for every batch of these shapes.

While capturing (:func:`tracking`, a ``TorchFunctionMode`` inside the traced forward), every tensor forward
*creates* from Python numbers or symbolic sizes (``torch.tensor``, ``scalar_tensor``, ``ones`` / ``zeros`` /
``full`` and their ``_like`` / ``new_`` forms, ``torch.div(size, k)``) carries the set of values its elements
can take: one value (possibly a symbolic size) or a few numbers. Views, copies, casts, ``pad``, ``cat``,
pointwise arithmetic and comparisons of such tensors (with numbers or other such tensors), ``where`` /
``masked_fill`` and ``any`` / ``all`` / ``max`` / ``min`` reductions carry it on (numbers computed by torch
itself on one-element tensors of the same dtypes and dimensionality, so type promotion and rounding are
torch's). A read of a tensor whose set is one value returns it: no ``item`` node, no unbacked symbol, and the
program is exact because the value is the same for every input of these shapes. Anything else is not tracked
(an input, a parameter, a buffer, what an untracked op made): its read stays data-dependent and is refused or
asserted as before (:mod:`mcompile.capture.checks`). A tensor written in place after its set was recorded (its version
counter, shared with its views, moved) is unknown unless the write itself was tracked.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import threading
import weakref

import torch
from torch.overrides import TorchFunctionMode

from mcompile.ir.patches import Refused

__all__ = ["tracking"]

_MAX = 16  # most distinct values a set keeps (a mask: 0 / 1; an additive mask: 0 / min)
_STATE = threading.local()

_CREATE_FILL = {"ones": 1, "ones_like": 1, "new_ones": 1, "zeros": 0, "zeros_like": 0, "new_zeros": 0,
                "zero_": 0}
_FULL = {"full": 1, "new_full": 2, "full_like": 1, "fill_": 1}  # name -> index of the value argument (after self)
_SAME = {"view", "reshape", "flatten", "expand", "expand_as", "permute", "transpose", "t", "unsqueeze", "squeeze",
         "contiguous", "clone", "detach", "select", "narrow", "repeat", "to", "type", "type_as",
         "float", "double", "half", "bfloat16", "long", "int", "bool", "short", "view_as", "reshape_as", "movedim",
         "unflatten", "broadcast_to", "repeat_interleave", "tile", "roll", "flip", "chunk", "split", "unbind",
         "getitem", "tensor_split", "swapaxes", "swapdims", "squeeze_", "unsqueeze_", "requires_grad_", "mT"}
_CASTS = {"to", "type", "type_as", "float", "double", "half", "bfloat16", "long", "int", "bool", "short",
          "contiguous", "clone", "detach", "requires_grad_"}  # same elements, same places
_POINTWISE = {"add", "sub", "rsub", "mul", "div", "true_divide", "floor_divide", "remainder", "fmod", "pow", "neg",
              "abs", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "logical_xor",
              "bitwise_and", "bitwise_or", "bitwise_not", "bitwise_xor", "and", "or", "xor", "invert", "mod",
              "minimum", "maximum", "clamp", "clamp_min", "clamp_max", "exp", "log", "sqrt", "rsqrt", "tanh",
              "sigmoid", "relu", "sign", "floor", "ceil", "round", "trunc", "reciprocal", "isnan", "isinf",
              "isfinite", "radd", "rmul", "rtruediv", "rdiv", "rfloordiv", "rpow", "rmod", "rand", "ror", "rxor",
              "truediv", "floordiv"}
_REDUCE = {"any", "all", "max", "min", "amax", "amin", "mean"}
_READS = {"item", "__bool__", "__int__", "__index__", "__float__", "tolist"}
_SYM = {"add": operator.add, "radd": operator.add, "sub": operator.sub, "rsub": lambda a, b: b - a,
        "mul": operator.mul, "rmul": operator.mul, "neg": operator.neg, "floor_divide": operator.floordiv,
        "floordiv": operator.floordiv, "remainder": operator.mod, "mod": operator.mod, "eq": operator.eq,
        "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge}


def _name(func) -> str:
    n = getattr(func, "__name__", "")
    if n.startswith("__") and n.endswith("__") and n not in _READS:  # __bool__ is a read, bool() a cast
        n = n[2:-2]
        n = n[1:] if n.startswith("i") and n[1:] in _POINTWISE else n  # __iadd__ -> add (written in place)
    return n


def _rec(t):
    """``(values, lineage)`` of tensor ``t`` or None: ``values`` the values its elements can take (a tuple);
    ``lineage`` ``(root, layout, table)``: ``t`` is elementwise ``table[i]`` where its root tensor (the tracked
    tensor it was computed from by views and pointwise ops) holds its ``i``-th value, the root's elements moved
    by the view ops ``layout``. Two tensors of one root and layout correspond element by element, so an op on
    both is computed value by value (``m.masked_fill(m.bool(), v)``), not over every pair of values."""
    rec = _STATE.known.get(id(t)) if isinstance(t, torch.Tensor) else None
    if rec is None or rec[0]() is not t or t._version != rec[2]:
        return None
    return rec[1], rec[3]


def _known(t):
    """The values tensor ``t``'s elements can take (a tuple), or None."""
    r = _rec(t)
    return None if r is None else r[0]


def _uniq(vals) -> tuple:
    """The distinct values (a symbolic size is not hashable: kept as it is)."""
    out, seen = [], set()
    for v in vals:
        if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
            out.append(v)
        elif (type(v), v) not in seen:
            seen.add((type(v), v))
            out.append(v)
    return tuple(out)


def _record(t, vals, lineage=None) -> None:
    """Record ``t``'s values: elementwise ``lineage`` (root, layout, table), else a new root of these values."""
    if not isinstance(t, torch.Tensor) or vals is None or any(v is None for v in vals):
        return
    if lineage is not None:
        vals = lineage[2]
    if len(vals) > 4 * _MAX:
        return
    if lineage is None:
        lineage = (next(_ROOTS), (), _uniq(vals))
        vals = lineage[2]
    vals = _uniq(vals)
    if not 0 < len(vals) <= _MAX:
        return
    known = _STATE.known
    key = id(t)
    known[key] = (weakref.ref(t, lambda _r, key=key: known.pop(key, None)), vals, t._version, lineage)


_ROOTS = itertools.count()


def _cast(v, dtype):
    if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
        return v if dtype in (torch.int64, torch.int32) else None
    with _real():
        return torch.tensor(v).to(dtype).item()


@contextlib.contextmanager
def _real():
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        yield


def _operand(a):
    """(the value set, the dtype, ndim) of one operand: a tracked tensor or a Python number; None if unknown."""
    if isinstance(a, torch.Tensor):
        vals = _known(a)
        return None if vals is None else (vals, a.dtype, a.ndim)
    if isinstance(a, bool | int | float | torch.SymInt | torch.SymFloat):
        return ((a,), None, None)
    return None


def _concrete(v) -> bool:
    return isinstance(v, bool | int | float)


def _apply(name, func, args, kwargs, out, combos, ops):
    """``func`` on each combination of operand values (one-element real tensors of each operand's dtype and
    dimensionality, so promotion and rounding are torch's); symbolic sizes through Python's operators."""
    got = []
    if all(_concrete(v) for c in combos for v in c):
        with _real():
            for c in combos:
                real = [torch.full((1,) * o[2], v, dtype=o[1]) if o[1] is not None else v for v, o in zip(c, ops)]
                r = func(*real, **kwargs)
                if not isinstance(r, torch.Tensor) or r.numel() != 1:
                    return None
                got.append(r.to(out.dtype).item())
        return got
    if out.dtype not in (torch.int64, torch.int32, torch.bool):
        return None
    for c in combos:
        if name in ("div", "true_divide") and len(c) == 2 and set(kwargs) <= {"rounding_mode"}:
            r = _sym_div(*c, kwargs.get("rounding_mode"), out)
        elif name in _SYM and not kwargs:
            r = [_SYM[name](*c)]
        else:
            return None
        if r is None:
            return None
        got.extend(r)
    return got


def _pointwise(name, func, args, kwargs, out):
    """(values, lineage) of a pointwise op's result, or None."""
    ops = [_operand(a) for a in args]
    if any(o is None for o in ops):  # torch.div(size, k) has no tensor operand: its result is still a tensor
        return None
    if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        return None
    lines = {(r[1][0], r[1][1]) for a in args if isinstance(a, torch.Tensor) and (r := _rec(a)) is not None}
    if len(lines) == 1:  # one root and layout: value by value
        root, layout = next(iter(lines))
        table = next(_rec(a)[1][2] for a in args if isinstance(a, torch.Tensor))
        combos = [tuple(_rec(a)[1][2][i] if isinstance(a, torch.Tensor) else a for a in args)
                  for i in range(len(table))]
        got = _apply(name, func, args, kwargs, out, combos, ops)
        return None if got is None else (got, (root, layout, tuple(got)))
    combos = list(itertools.product(*[o[0] for o in ops]))
    if len(combos) > 64:
        return None
    got = _apply(name, func, args, kwargs, out, combos, ops)
    return None if got is None else (got, None)


def _sym_div(a, b, mode, out):
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if mode not in ("trunc", "floor") or out.dtype not in (torch.int64, torch.int32):
        return None
    if not isinstance(b, int) or b <= 0:
        return None
    if mode == "floor" or statically_known_true(a >= 0):  # trunc == floor for a non-negative size
        return [a // b]
    return None



def _reduce(name, args, kwargs, out):
    vals = _known(args[0])
    if vals is None or any(not _concrete(v) for v in vals) and len(vals) != 1:
        return None
    if name in ("max", "min", "amax", "amin", "mean"):
        if isinstance(out, tuple):  # max(dim) -> (values, indices): the values
            return None
        return vals if name != "mean" or len(vals) == 1 else None
    truth = {bool(v) for v in vals}
    if truth == {False}:
        return [False]
    if truth == {True}:
        return [True]
    return None  # some true, some false: which element holds which is not known


def _refuse_data_write(name: str, t: torch.Tensor):
    """An in-place op on ``p.data`` of a trained tensor (Gemma-3n's AltUp ``weight.data.clamp_(-c, c)`` in
    training mode): a write to a parameter outside autograd, which the captured program (a function of the
    parameters, which the optimizer owns) cannot replay; torch.export meets it as a fake constant."""
    from mcompile.capture.checks import _user_frame

    f = _user_frame()
    where = f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else None
    raise Refused(
        f"forward writes a parameter in place through .data ({name}): a change to the parameter's stored value "
        "outside autograd, which a captured program (a function of the parameters) cannot replay",
        "move the constraint out of forward (apply it after optimizer.step(), or with "
        "torch.nn.utils.parametrize), or switch it off for training (a config option, if the model has one)", where)


_DATA = torch.Tensor.data  # the descriptor: TorchFunctionMode sees ``p.data`` as its __get__


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if (getattr(func, "__self__", None) is _DATA and args and isinstance(args[0], torch.Tensor)
                and args[0].requires_grad):
            # ``p.data`` of a trained tensor: read as ``p.detach()`` (the same values, outside autograd, which
            # torch.export traces; its .data is a constant it cannot lift); an in-place write to it is refused
            out = args[0].detach()
            _STATE.data_of[id(out)] = weakref.ref(out)
            return out
        if (name.endswith("_") and not name.startswith("_") and args and isinstance(args[0], torch.Tensor)
                and (ref := _STATE.data_of.get(id(args[0]))) is not None and ref() is args[0]):
            _refuse_data_write(name, args[0])
        if name in _READS and args and isinstance(args[0], torch.Tensor):
            vals = _known(args[0])
            if vals is not None and len(vals) == 1 and args[0].numel() == 1:
                (v,) = vals
                conv = {"item": lambda x: x, "tolist": lambda x: x, "__bool__": bool, "__int__": int,
                        "__index__": int, "__float__": float}[name]
                if name != "__index__" or args[0].dtype not in (torch.float16, torch.float32, torch.float64,
                                                                 torch.bfloat16, torch.bool):
                    if name != "tolist" or args[0].ndim == 0:
                        return conv(v)
        if name in _SIZES:  # a size or index given as a tracked 0-d tensor: torch reads it in C++ (no __index__)
            method = args and isinstance(args[0], torch.Tensor) and "Tensor" in getattr(func, "__qualname__", "")
            args = tuple(a if method and i == 0 else _as_size(a) for i, a in enumerate(args))
            kwargs = {k: _as_size(v) for k, v in kwargs.items()}
        before = _rec(args[0]) if name == "setitem" and args and isinstance(args[0], torch.Tensor) else None
        out = func(*args, **kwargs)
        if before is not None:
            try:
                _written(args, before)
            except Exception:  # noqa: BLE001 - a write we cannot follow leaves the tensor unknown (its version)
                pass
        try:
            self._track(name, func, args, kwargs, out)
        except Exception:  # noqa: BLE001 - a value we cannot follow is simply not known
            pass
        return out

    def _track(self, name, func, args, kwargs, out):
        outs = list(out) if isinstance(out, tuple | list) else [out]
        tensors = [o for o in outs if isinstance(o, torch.Tensor)]
        if not tensors:
            return
        base = name.rstrip("_") if name.endswith("_") and not name.endswith("__") else name
        vals = lineage = None
        if name in ("tensor", "as_tensor", "scalar_tensor"):
            x = args[0] if args else kwargs.get("data")
            flat = list(_flatten(x))
            if flat is not None and flat and all(isinstance(v, bool | int | float | torch.SymInt) for v in flat):
                vals = [_cast(v, out.dtype) for v in flat]
        elif name in _CREATE_FILL:
            vals = [_cast(_CREATE_FILL[name], tensors[0].dtype)]
        elif name in _FULL:
            v = args[_FULL[name]] if len(args) > _FULL[name] else kwargs.get("fill_value", kwargs.get("value"))
            if isinstance(v, torch.Tensor):
                kv = _known(v)
                v = next(iter(kv)) if kv is not None and len(kv) == 1 else None
            vals = None if v is None else [_cast(v, tensors[0].dtype)]
        elif name in _SAME:
            r = _rec(args[0]) if args else None
            if r is not None:
                root, layout, table = r[1]
                if name not in _CASTS:  # the elements move: a layout of its own
                    layout = (*layout, (name, repr([a for a in args[1:] if not isinstance(a, torch.Tensor)]),
                                        repr(sorted(kwargs.items()))))
                table = tuple(_cast(v, tensors[0].dtype) for v in table)
                lineage = (root, layout, table)
                if any(v is None for v in table):
                    lineage = None
        elif name == "pad":
            kv, v = _known(args[0]), kwargs.get("value", args[3] if len(args) > 3 else 0)
            vals = None if kv is None or kwargs.get("mode", "constant") != "constant" else \
                [_cast(x, out.dtype) for x in (*kv, 0 if v is None else v)]
        elif name in ("cat", "concat", "concatenate", "stack", "hstack", "vstack"):
            parts = [_known(t) for t in args[0]]
            vals = None if any(p is None for p in parts) else [_cast(x, out.dtype) for p in parts for x in p]
        elif base in _POINTWISE or base in ("where", "masked_fill"):
            # written in place (add_): the values of the out-of-place op, recorded at the tensor's new version
            got = _pointwise(base, func if base == name else getattr(torch.Tensor, base), args, kwargs, tensors[0])
            if got is not None:
                vals, lineage = got
            elif base == "where" and len(args) == 3 and not kwargs:
                # a condition not known (a mask of positions compared with an arange): every element is one of
                # the two branches' values, whichever it takes (HF's mask builders: where(mask, 0, min))
                branches = [_operand(a) for a in args[1:]]
                if all(b is not None for b in branches):
                    vals = [_cast(v, tensors[0].dtype) for b in branches for v in b[0]]
        elif name in _REDUCE and len(args) >= 1:
            vals = _reduce(name, args, kwargs, out)
        if lineage is not None:
            vals = lineage[2]
        if vals is None or any(v is None for v in vals):
            return
        for i, t in enumerate(tensors):  # the pieces of a chunk / split / unbind: each a layout of its own
            _record(t, vals, lineage if len(tensors) == 1 or lineage is None else
                    (lineage[0], (*lineage[1], ("piece", i)), lineage[2]))


def _written(args, before) -> None:
    """``t[index] = value`` on a tracked ``t`` (``before``: its values and lineage before the write): an index
    that is a boolean mask known all False writes nothing (Longformer's ``mask[attention_mask == 2] = max`` with no
    global token), so ``t`` keeps its values element by element; otherwise ``t`` holds its old values or the
    written ones (a set, no lineage). Views of ``t`` taken before stay unknown (their version moved)."""
    t, index, value = args[0], args[1], args[2] if len(args) > 2 else None
    if isinstance(index, torch.Tensor) and index.dtype == torch.bool and _known(index) == (False,):
        _record(t, before[0], before[1])
        return
    new = _operand(value)
    if new is not None:
        _record(t, [*before[0], *(_cast(v, t.dtype) for v in new[0])])


_SIZES = {"view", "reshape", "expand", "repeat", "new_zeros", "new_ones", "new_empty", "new_full", "zeros", "ones",
          "empty", "full", "arange", "narrow", "as_strided", "unflatten", "split", "tensor_split", "select",
          "permute", "transpose", "unsqueeze", "squeeze", "flatten", "getitem", "setitem", "pad", "roll",
          "movedim", "tile", "chunk", "randn", "rand", "randint", "linspace"}


def _as_size(a):
    """A tracked 0-d integer tensor of one value -> that value (an argument, an element of a size list, a slice's
    bound)."""
    if isinstance(a, torch.Tensor):
        if a.ndim == 0 and not a.dtype.is_floating_point and a.dtype != torch.bool and not a.dtype.is_complex:
            vals = _known(a)
            if vals is not None and len(vals) == 1:
                return next(iter(vals))
        return a
    if isinstance(a, slice):
        return slice(_as_size(a.start), _as_size(a.stop), _as_size(a.step))
    if isinstance(a, list | tuple) and not any(isinstance(x, torch.Tensor) and x.ndim > 0 for x in a):
        return type(a)(_as_size(x) for x in a)
    return a


def _flatten(x):
    if isinstance(x, list | tuple):
        for y in x:
            yield from _flatten(y)
    else:
        yield x


@contextlib.contextmanager
def tracking():
    """Within it (on this thread), values made from shapes and constants alone are known (module docstring)."""
    before = getattr(_STATE, "known", None)
    before_data = getattr(_STATE, "data_of", None)
    _STATE.known = {}  # id(tensor) -> (weakref, value set, version): tensors compare elementwise, not as keys
    _STATE.data_of = {}  # id(t.data) -> weakref of it, for t that requires grad (_refuse_data_write)
    try:
        with _Mode():
            yield
    finally:
        _STATE.known, _STATE.data_of = before, before_data
