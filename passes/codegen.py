"""Code generation for partitioned forward / backward graphs: ``Config(codegen="eager" | "inductor")``.

The joint pass (:mod:`mcompile.passes.joint`) leaves each rank with two plain aten-level fx graphs: a
forward (primals -> outputs + saved tensors) and a backward (saved tensors + tangents -> gradients).
:func:`compile_graph` turns one such graph into a callable with the graph's own positional signature
and outputs:

``"eager"``
    the GraphModule itself: its ``forward`` is generated Python code that calls each op in turn (no
    fx interpreter), so this is the reference and the fallback.

``"inductor"``
    TorchInductor over the graph, without dynamo and without AOTAutograd (the graph is already
    functional aten, the output of make_fx): the graph is re-traced with fake tensors through
    Inductor's decomposition table (what ``compile_fx`` would have done inside AOTAutograd), then
    given to ``torch._inductor.compile_fx.compile_fx_inner``, which fuses the pointwise and
    reduction ops into generated kernels — C++/OpenMP on CPU, Triton on CUDA — and calls matmuls,
    attention and anything without a lowering as extern / fallback kernels. The result uses
    Inductor's boxed convention (one list of inputs, which it empties); the wrapper returned here
    takes the inputs positionally, runs under ``torch.no_grad`` as AOTAutograd runs its compiled
    graphs (gradients come from the backward graph, not from autograd through this one) and returns
    the graph's output structure (tuple or list). Inductor takes and returns flat tensors: a graph
    whose inputs or outputs nest — the joint partition saves a multi-output node such as SDPA's as
    one tuple-valued forward output and backward input — is compiled over the tensor leaves, and the
    wrapper flattens the arguments and rebuilds the outputs' structure around each call.

What stays opaque: every ``torch.ops.mcompile.*`` op — the collectives of :mod:`mcompile.ir.ops` and
the fused / FP8 kernels of :mod:`mcompile.kernels` — is a ``torch.library.custom_op`` with no
decomposition, so Inductor keeps it as a fallback kernel: the generated wrapper calls
``torch.ops.mcompile.all_reduce.default(buf, 'tp', 2)`` and the communicator bound with
:func:`mcompile.ir.ops.bind` does the work at run time, as in eager. Inductor only fuses around such
calls and keeps their order (no compute/communication reordering is enabled), so every rank issues
the same collectives in the same order as the fx graph does. ``CompiledGraph.source_code`` holds
the generated wrapper for inspection.

Started collectives (the overlap passes' ``mcompile.start_*`` / ``wait``, passes/dp/overlap.py): the
start's input is an argument of its wait (mcompile.ir.ops), so Inductor's memory planning keeps it live
and unwritten until the wait — before, it counted the input dead after the start and reused its memory
for the next kernel's output (a collective matmul's next chunk GEMM written over the partial sums the
reduce-scatter was still sending). A graph holding started collectives is compiled with Inductor's
``reorder_for_peak_memory`` off: that pass re-sorts the nodes topologically to lower the estimated
peak, and it moves each wait up to where it frees the start's input — right after its start, before
the compute it was placed to overlap with. The graph's order is mcompile's schedule (the saved set and
the overlap passes decided it), so it stands; graphs without started collectives keep the pass.

The compiled code checks its inputs' sizes and strides against the example inputs (Inductor's
``assert_size_stride``): a callable serves one input layout.

Cache: compilation costs seconds (C++ compilation on CPU), so results are kept in a process-wide
dict keyed by ``id(gm)``, the graph's code, and each input's shape, stride, dtype and device (plus a
weak reference that detects a recycled ``id``); compiling the same graph again for the same inputs
returns the cached callable at once. Inductor's own on-disk FX graph cache may also make a first
compile of an identical graph (another rank's) fast. Compilation is not thread-safe — ranks of the
in-process simulator are threads — so :func:`compile_graph` serialises it behind one lock.

Failure to compile raises :class:`CodegenError`, naming the graph and the cause; ``codegen="eager"``
runs the same graph without compiling.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

__all__ = ["CODEGENS", "CodegenError", "CompiledGraph", "compile_graph", "clear_cache", "cache_size"]

CODEGENS = ("eager", "inductor")

_LOCK = threading.RLock()
_CACHE: dict[tuple, tuple[weakref.ref, CompiledGraph]] = {}


class CodegenError(RuntimeError):
    """A graph that the chosen code generator could not compile."""


class CompiledGraph:
    """An Inductor-compiled graph, called with the GraphModule's positional arguments."""

    def __init__(self, compiled, name: str, in_spec, tensor_pos: list[int] | None, out_spec,
                 source_code: str | None, compile_s: float):
        self._compiled = compiled  # torch._inductor OutputCode: boxed, called with one list of tensors
        self.name = name
        # inputs: None when they are the compiled graph's own (flat tensors); else the pytree spec of the
        # positional arguments and where its tensor leaves are (a saved multi-output value is a tuple)
        self._in_spec, self._tensor_pos = in_spec, tensor_pos
        self._out_spec = out_spec  # the graph's output structure (tuple, list, one tensor, nested tuples)
        self.source_code = source_code  # Inductor's generated wrapper (Python), None if unavailable
        self.compile_s = compile_s

    def __call__(self, *args):
        if self._in_spec is None:
            flat = list(args)
        else:
            leaves, _ = pytree.tree_flatten(list(args))
            flat = [leaves[i] for i in self._tensor_pos]
        with torch.no_grad():
            out = self._compiled(flat)
        return pytree.tree_unflatten(list(out), self._out_spec)

    def __repr__(self):
        return f"CompiledGraph({self.name!r}, inductor, compiled in {self.compile_s:.1f}s)"


def _signature(example_inputs: Sequence) -> tuple:
    sig = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            sig.append((tuple(x.shape), tuple(x.stride()), x.dtype, x.device.type, x.device.index))
        else:
            sig.append((type(x).__name__, x if isinstance(x, (int, float, bool, str, type(None))) else id(x)))
    return tuple(sig)


def _graph_name(gm: fx.GraphModule, name: str | None) -> str:
    if name:
        return name
    n = sum(1 for _ in gm.graph.nodes)
    return f"{type(gm).__name__}@{id(gm):#x} ({n} nodes)"


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence, codegen: str = "eager", *,
                  name: str | None = None) -> Callable[..., tuple | list]:
    """A callable running ``gm``: same positional arguments, same outputs.

    ``codegen="eager"`` returns ``gm`` itself; ``"inductor"`` compiles it with TorchInductor (see the
    module docstring), mcompile's custom ops kept opaque. ``example_inputs`` are tensors of the shapes,
    strides, dtypes and devices the callable will be called with (real tensors; nothing is run on
    them). ``name`` labels the graph in errors and logs. Raises :class:`CodegenError` when Inductor
    fails; ``codegen="eager"`` is the fallback.
    """
    if codegen not in CODEGENS:
        raise ValueError(f"codegen={codegen!r}: use one of {', '.join(map(repr, CODEGENS))}")
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"compile_graph takes a torch.fx.GraphModule, got {type(gm).__name__}")
    if codegen == "eager":
        return gm
    key = (id(gm), codegen, hash(gm.code), _signature(example_inputs))
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None and hit[0]() is gm:
            return hit[1]
        label = _graph_name(gm, name)
        try:
            compiled = _inductor(gm, list(example_inputs), label)
        except Exception as e:  # noqa: BLE001 - every failure of Inductor is reported the same way
            raise CodegenError(
                f'codegen="inductor" could not compile graph {label}: {type(e).__name__}: {_first_lines(e)}\n'
                'codegen="eager" is the fallback: it runs the same graph without compiling.'
            ) from e
        _CACHE[key] = (weakref.ref(gm, lambda _, k=key: _CACHE.pop(k, None)), compiled)  # dropped with gm
        return compiled


def clear_cache() -> None:
    """Forget every compiled graph (Inductor's on-disk cache is left alone)."""
    with _LOCK:
        _CACHE.clear()


def cache_size() -> int:
    with _LOCK:
        return sum(1 for ref, _ in _CACHE.values() if ref() is not None)


def _first_lines(e: BaseException, n: int = 6) -> str:
    lines = str(e).strip().splitlines()
    return "\n".join(lines[:n]) + (" ..." if len(lines) > n else "")


def _fake_inputs(example_inputs: list) -> list:
    # nothing may require grad: the re-trace is of the graph's own ops, never of their autograd
    return [x.detach() if isinstance(x, torch.Tensor) else x for x in example_inputs]


def _inductor(gm: fx.GraphModule, example_inputs: list, label: str) -> CompiledGraph:
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    import mcompile.ir.ops  # noqa: F401 - the collectives must be registered (with fake impls) to re-trace

    t0 = time.perf_counter()
    # Inductor takes flat tensors and returns flat values: a graph whose inputs or outputs nest (the joint
    # partition saves a multi-output node such as SDPA's as one tuple-valued output / input) is compiled
    # over the tensor leaves, its non-tensor leaves baked in, and the structure restored around each call
    leaves, in_spec = pytree.tree_flatten(list(example_inputs))
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    plain = len(leaves) == len(example_inputs) == len(tensor_pos) and \
        all(isinstance(x, torch.Tensor) for x in example_inputs)
    inputs = _fake_inputs([leaves[i] for i in tensor_pos])
    spec: list = []

    def flat(*tensors):
        vals = list(leaves)
        for i, t in zip(tensor_pos, tensors):
            vals[i] = t
        out_leaves, out_spec = pytree.tree_flatten(gm(*pytree.tree_unflatten(vals, in_spec)))
        spec.append(out_spec)
        return tuple(out_leaves)

    # The re-trace: a new graph (Inductor's passes rewrite the graph they get in place, and the eager
    # one must stay as it is), fake tensors (nothing runs, no collective is called), and Inductor's
    # decomposition table (compile_fx traces through it inside AOTAutograd, and Inductor's lowerings
    # expect its output). mcompile's ops have no decomposition and are recorded as they are, through
    # their fake implementations.
    with torch.no_grad():
        traced = make_fx(flat, decomposition_table=select_decomp_table(), tracing_mode="fake",
                         _allow_non_fake_inputs=False)(*inputs)
    is_backward = any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes)
    with _keep_schedule(traced):
        compiled = compile_fx_inner(traced, inputs, is_backward=is_backward)
    return CompiledGraph(compiled, label, None if plain else in_spec, None if plain else tensor_pos, spec[-1],
                         _source_code(compiled), time.perf_counter() - t0)


def has_started_collectives(gm: fx.GraphModule) -> bool:
    import mcompile.ir.ops as ops

    starts = set(ops.STARTS.values())
    return any(n.op == "call_function" and n.target in starts for n in gm.graph.nodes)


def _keep_schedule(gm: fx.GraphModule):
    """Inductor's config for ``gm``: the peak-memory reordering off where the graph holds started
    collectives (module docstring), so every wait stays where the overlap pass placed it."""
    if not has_started_collectives(gm):
        return contextlib.nullcontext()
    from torch._inductor import config as inductor_config

    return inductor_config.patch(reorder_for_peak_memory=False)


def _source_code(compiled) -> str | None:
    return getattr(compiled, "source_code", None)  # CompiledFxGraph keeps its generated wrapper
