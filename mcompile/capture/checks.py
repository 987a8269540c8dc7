"""Checks on tensor values that only raise, captured as runtime assertions (issue 37).

Input validation in a forward reads tensor values to decide whether to raise:
``assert torch.all(ids >= 0).item(), "..."`` (ProphetNet's label shift), ``if not valid.all(): raise
ValueError(...)`` (``torch.distributions``' argument checks), ``assert x.isnan().sum() == 0``. torch.export
cannot evaluate the condition (placeholder tensors have no values: a guard on a data-dependent expression), and
its own conversion of ``assert`` to a runtime assertion misses these (it looks for the user's frame one level
above ``SymBool.__bool__`` and finds ``torch/__init__.py``), so the capture failed.

While capturing (:func:`asserting`), a data-dependent guard is looked at where the user's Python code uses it:
if the bytecode instruction that asked for the bool is a conditional jump one of whose two successors leads, on
every path, to a ``raise`` (``RAISE_VARARGS``) that no ``try`` of the frame catches (building the exception and
its message may load, call, branch forward and store locals, as pytest's rewritten ``assert`` does; nothing on
the way returns, loops or stores outside the frame) and the other does not, the condition's only effect is to
raise on bad values. The capture then takes the branch that does not raise and records the condition as a runtime
assertion (torch's deferred runtime asserts: an ``_assert_scalar`` node in the program), which fails the step,
naming the check's line, whenever a batch would have raised in eager mode. Nothing is silently dropped.

Anything else that reads a value as a Python bool / int / float (a branch whose both sides run on, a size from
``.item()`` / ``.tolist()``) is left to fail as before: specialising it to the example batch would be silently
wrong for the next batch, so the capture refuses it, naming the line (``mcompile.capture.export._diagnose``).
"""

from __future__ import annotations

import contextlib
import dis
import linecache
import operator
import re
import sys
import threading
from pathlib import Path

import sympy
import torch
from torch.fx.experimental import symbolic_shapes as _ss

from mcompile.ir.patches import Patches

__all__ = ["asserting", "raising_branch", "tensor_asserts"]

aten = torch.ops.aten
_STATE = threading.local()  # .messages: unbacked symbol name -> the message of the check that made it asserted

_TORCH_DIR = str(Path(torch.__file__).parent)
_OWN_DIR = str(Path(__file__).parent)
# torch's tracing machinery between the user's instruction and the guard (SymBool.__bool__ in torch/__init__.py,
# fake tensors, proxy modes, the ShapeEnv); torch code outside these (torch.distributions' checks) is code
# that validates like the user's
_MACHINERY = tuple(str(Path(_TORCH_DIR, p)) for p in (
    "__init__.py", "_tensor.py", "overrides.py", "_ops.py", "fx", "_subclasses", "utils", "_prims", "_refs",
    "_decomp", "_meta_registrations.py", "_higher_order_ops", "_functorch", "_export", "export", "_library",
    "_dynamo", "_guards.py", "_logging", "sym", "autograd"))

_JUMPS_TRUE = {"POP_JUMP_IF_TRUE", "POP_JUMP_FORWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_TRUE"}
_JUMPS_FALSE = {"POP_JUMP_IF_FALSE", "POP_JUMP_FORWARD_IF_FALSE", "POP_JUMP_BACKWARD_IF_FALSE"}
# on the way to a raise: loading, building, formatting, calling (the exception and its message)
_QUIET = ("LOAD_", "BUILD_", "FORMAT_", "CALL", "PRECALL", "KW_NAMES", "PUSH_NULL", "CACHE", "NOP", "BINARY_OP",
          "COPY", "SWAP", "RESUME", "EXTENDED_ARG", "LIST_", "DICT_", "UNARY_", "COMPARE_OP", "CONTAINS_OP",
          "IS_OP", "POP_TOP", "BINARY_SUBSCR", "CONVERT_VALUE", "TO_BOOL", "STORE_FAST", "DELETE_FAST")


def _user_frame():
    """The innermost frame outside torch's tracing machinery and mcompile: the instruction that asked."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(_MACHINERY) and not name.startswith(_OWN_DIR) and not name.startswith("<"):
            return f
        f = f.f_back
    return None


def _runs_into_raise(insts: list, i: int, at: dict, handled) -> bool:
    """Whether every path from instruction ``i`` reaches a ``raise`` that this frame does not catch, with no
    effect outside the frame on the way (loading, calling, building the message, storing a local: pytest's
    rewritten ``assert`` does), no return and no loop."""
    todo, seen = [i], set()
    while todo:
        k = todo.pop()
        while True:
            if k in seen:
                break
            if k >= len(insts) or len(seen) > 2000:
                return False
            seen.add(k)
            inst = insts[k]
            name = inst.opname
            if name == "RAISE_VARARGS":
                if inst.arg < 1 or handled(inst.offset):
                    return False
                break
            if "JUMP" in name:
                nxt = at.get(inst.argval)
                if nxt is None or inst.argval <= inst.offset:  # a loop
                    return False
                if "IF" in name or "OR_POP" in name:
                    todo.append(nxt)
                    k += 1
                else:
                    k = nxt
                continue
            if not name.startswith(_QUIET):
                return False
            k += 1
    return True


def raising_branch(code, lasti: int) -> bool | None:
    """For a conditional jump at byte offset ``lasti`` of ``code``: the truth value of its condition that does
    *not* raise, when exactly one of its two successors runs straight into a ``raise``; else None."""
    insts = list(dis.get_instructions(code))
    at = next((k for k, inst in enumerate(insts) if inst.offset == lasti), None)
    if at is None:
        return None
    if insts[at].opname == "TO_BOOL" and at + 1 < len(insts):  # Python >= 3.13 converts before jumping
        at += 1
    jump = insts[at]
    if jump.opname not in _JUMPS_TRUE | _JUMPS_FALSE:
        return None
    target = next((k for k, inst in enumerate(insts) if inst.offset == jump.argval), None)
    if target is None:
        return None
    offsets = {inst.offset: k for k, inst in enumerate(insts)}
    entries = getattr(dis.Bytecode(code), "exception_entries", [])  # Python >= 3.11: the try blocks

    def handled(offset):
        return any(e.start <= offset < e.end for e in entries)

    taken, fallthrough = (_runs_into_raise(insts, target, offsets, handled),
                          _runs_into_raise(insts, at + 1, offsets, handled))
    if taken == fallthrough:
        return None
    jumps_when = jump.opname in _JUMPS_TRUE  # the value for which the jump is taken
    return (not jumps_when) if taken else jumps_when


def _evaluate_expr(self, orig_expr, *args, **kwargs):
    if not _PATCHES.active():
        return _ORIG(self, orig_expr, *args, **kwargs)
    # torch's own assert conversion (trace_asserts) off: every check is judged here, by one rule, with its line
    traced, self.trace_asserts = self.trace_asserts, False
    try:
        return _ORIG(self, orig_expr, *args, **kwargs)
    except _ss.GuardOnDataDependentSymNode:
        if kwargs.get("fallback_value") is not None:
            raise
        frame = _user_frame()
        want = None if frame is None else raising_branch(frame.f_code, frame.f_lasti)
        if want is None:
            raise
        where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        del frame
        holds = orig_expr if want else sympy.Not(orig_expr)
        msg = (f"a value check of forward failed: eager mode raises here, at {where}: {code} (mcompile captured the "
               "check as a runtime assertion)")
        for s in orig_expr.free_symbols:
            _STATE.messages.setdefault(str(s), msg)
        self.guard_or_defer_runtime_assert(holds, msg)
        return sympy.true if want else sympy.false
    finally:
        self.trace_asserts = traced


_ORIG = _ss.ShapeEnv.evaluate_expr
_PATCHES = Patches((_ss.ShapeEnv, "evaluate_expr", _evaluate_expr))  # while any capture runs


@contextlib.contextmanager
def asserting():
    """Within it (on this thread), a data-dependent condition whose only effect is to raise becomes a runtime
    assertion of the captured program (module docstring). Yields the checks' messages (by unbacked symbol) for
    :func:`tensor_asserts`."""
    before = getattr(_STATE, "messages", None)
    _STATE.messages = {}
    try:
        with _PATCHES.held():
            yield _STATE.messages
    finally:
        _STATE.messages = before


_ITEMS = (aten.item.default, aten._local_scalar_dense.default)
_SYM_OPS = (torch.sym_ite, torch.sym_not, operator.eq, operator.ne, operator.ge, operator.le, operator.gt,
            operator.lt, operator.not_, operator.and_, operator.or_)


def _items_of(node, seen) -> list:
    """The ``item`` nodes a symbolic condition is computed from (through the ops torch builds around them)."""
    if not isinstance(node, torch.fx.Node) or node in seen:
        return []
    seen.add(node)
    if node.target in _ITEMS:
        return [node]
    if node.op != "call_function" or node.target not in _SYM_OPS:
        return [None]  # something else: not a check of one tensor's truth
    return [i for a in node.args for i in _items_of(a, seen)]


def _value(node, item, v):
    if not isinstance(node, torch.fx.Node):
        return node
    if node is item:
        return v
    return node.target(*(_value(a, item, v) for a in node.args))


def tensor_asserts(gm: torch.fx.GraphModule, messages: dict[str, str]) -> int:
    """Rewrite the runtime assertions :func:`asserting` recorded as tensor assertions: torch.export writes each
    as ``_assert_scalar`` over the ``item`` of the checked bool tensor (and asserts the item's 0..1 range); each
    becomes ``aten._assert_async.msg(t, message)`` on the tensor itself (or on ``logical_not(t)``), with the
    message naming the check's line, and the symbolic nodes go. Returns how many assertions it wrote."""
    g, made, dead, written = gm.graph, 0, [], set()
    for node in list(g.nodes):
        if node.target is not aten._assert_scalar.default:
            continue
        items = _items_of(node.args[0], set())
        if len(items) != 1 or items[0] is None:
            continue
        item = items[0]
        t = item.args[0]
        val = item.meta.get("val")  # the symbol it binds (its value may read True by now: the assertion's)
        names = [str(x) for x in (item.meta.get("unbacked_bindings") or {})]
        names += [str(x) for x in val.node.expr.free_symbols] if isinstance(val, torch.SymInt | torch.SymBool) else []
        names += re.findall(r"\bu\d+\b", str(node.args[1]) if len(node.args) > 1 else "")  # torch's text names it
        name = next((x for x in names if x in messages), None)
        tval = t.meta.get("val") if isinstance(t, torch.fx.Node) else None
        if name is None or not isinstance(tval, torch.Tensor) or tval.dtype != torch.bool:
            continue
        try:
            holds = [bool(_value(node.args[0], item, v)) for v in (False, True)]
        except Exception:  # noqa: BLE001 - an expression we cannot evaluate on a bool: left as torch wrote it
            continue
        if holds == [False, False]:
            continue
        if holds != [True, True] and (t, holds[1]) not in written:  # [True, True]: the item's range, any bool's
            written.add((t, holds[1]))
            with g.inserting_before(node):
                cond = t
                if holds == [True, False]:
                    cond = g.call_function(aten.logical_not.default, (t,))
                    cond.meta.update(val=torch.logical_not(tval), stack_trace=node.meta.get("stack_trace"))
                check = g.call_function(aten._assert_async.msg, (cond, messages[name]))
                check.meta.update(val=None, stack_trace=node.meta.get("stack_trace"))
            made += 1
        dead.append(node)
    for node in dead:
        g.erase_node(node)
    changed = True
    while changed:  # the symbolic nodes (and items) nothing uses now
        changed = False
        for node in reversed(list(g.nodes)):
            if node.op == "call_function" and not node.users and (node.target in _SYM_OPS or node.target in _ITEMS):
                g.erase_node(node)
                changed = True
    gm.recompile()
    return made
