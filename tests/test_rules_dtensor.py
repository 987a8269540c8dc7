"""Rules borrowed from DTensor (mcompile.sharding.rules.dtensor) and the hand-written ``chunk`` / ``diff``,
against single-device execution, with tests/test_rules.py's harness (``check``): every strategy a
rule returns that fits the drawn shapes runs the op on local pieces and must combine into the
single-device output, and (for differentiable ops) its gradients into single-device autograd's.
Tolerances are that harness's (float64: 1e-9; its docstring says why).

CI tier: ``chunk`` and ``diff`` (what unmodified Hugging Face models need), one bridged op per kind
(pointwise, backward-pointwise, reduction, scan, sort, data movement, stacking, a multi-output norm),
each with the strategies it MUST offer (so a bridge that drops or mistranslates DTensor's strategies
fails), the counts, the fake mesh, and the input-only fallback. Slow tier (``-m slow``): the sweep of
every bridged op over torch's OpInfo samples.

Ops without a derivative (backward ops, ``igamma``...) or with float arguments autograd refuses
(``running_mean``, ``total_weight``) are checked on values only: the harness's backward check is
replaced by a no-op for them (:func:`verify`), since a captured program never differentiates them.
"""

from __future__ import annotations

import collections
import sys
import types
import unittest
import warnings
from unittest import mock

import pytest
import test_rules as harness
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_rules import (
    NS,
    P,
    R,
    check,
    divisible_dims,
    draw_current,
    draw_shape,
    hyp,
    make,
    new_gen,
)

from mcompile.ir.placements import BlockShard, Partial, Replicate, Shard
from mcompile.sharding.rules import bridged_ops, get_rule, registered_ops, rule_source
from mcompile.sharding.rules.dtensor import DENIED, dtensor_ops, refusal

aten = torch.ops.aten


def _tensors(args, kwargs):
    return harness._tensors(args, kwargs)


def differentiable(op, args, kwargs) -> bool:
    """Whether single-device autograd differentiates ``op`` w.r.t. all its floating inputs, as the
    harness's backward check asks it to."""
    full = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in _tensors(args, kwargs)]
    if not any(t.requires_grad for t in full):
        return True
    it = iter(full)
    walk = harness._walk
    try:
        outs = harness._outputs(op(*walk(args, lambda _t: next(it)), **walk(kwargs, lambda _t: next(it))))
        outs = [o for o in outs if o.requires_grad]
        if outs:
            torch.autograd.grad(outs, [t for t in full if t.requires_grad], [torch.ones_like(o) for o in outs],
                                allow_unused=True)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def verify(op, args, kwargs=None, **kw):
    """``check`` (forward and backward), or forward values only for ops autograd cannot differentiate."""
    kwargs = dict(kwargs or {})
    if differentiable(op, args, kwargs):
        return check(op, args, kwargs, **kw)
    with mock.patch.object(harness, "check_backward", lambda *a, **k: None):
        return check(op, args, kwargs, **kw)


# ---------------------------------------------------------------------------------------------
# hand-written: chunk and diff
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["chunk", "blocks"])
@hyp(25)
@given(data=st.data())
def test_chunk(which, data):
    """chunk into k parts (uneven ones, fewer parts than asked), any other dim sharded, Partial; a
    fused [q|k|v] dim held as BlockShard(d, k) chunks into k plain shards (GPT-NeoX's QKV)."""
    n = data.draw(st.sampled_from(NS), label="n")
    gen = new_gen(data)
    shape = draw_shape(data, n, 1, 4)
    nd = len(shape)
    dim = data.draw(st.integers(0, nd - 1), label="dim")
    signed = dim - nd if data.draw(st.booleans(), label="neg") else dim
    cur = None
    if which == "blocks":
        k = data.draw(st.integers(2, 3), label="k")
        shape[dim] = k * n * data.draw(st.integers(1, 2), label="m")
        cur = BlockShard(dim, k)
    else:
        k = data.draw(st.integers(1, 4), label="chunks")
    x = make(shape, "f", gen)
    k_out = len(aten.chunk.default(x, k, signed))
    cur = cur if cur is not None else draw_current(data, x, n)
    expect = [((Shard(d),), (Shard(d),) * k_out) for d in divisible_dims(shape, n) if d != dim]
    expect.append(((P,), (P,) * k_out))
    if which == "blocks":
        expect.append(((cur,), (Shard(dim),) * k_out))
    check(aten.chunk.default, (x, k, signed), n=n, current=(cur,), gen=gen, expect=expect, current_first=True)


@pytest.mark.timeout(120)
@hyp(40)
@given(data=st.data())
def test_diff(data):
    """diff(x, n, dim, prepend, append): float and integer (position ids) inputs, higher orders,
    prepend / append; every other dim sharded on all inputs, Partial for floats."""
    n = data.draw(st.sampled_from(NS), label="n")
    gen = new_gen(data)
    shape = draw_shape(data, n, 1, 3)
    nd = len(shape)
    dim = data.draw(st.integers(-nd, nd - 1), label="dim")
    d = dim % nd
    kind = data.draw(st.sampled_from(["f", "int"]), label="kind")
    x = make(shape, kind, gen)
    order = data.draw(st.integers(1, 3), label="order")
    kwargs = {}
    for side in ("prepend", "append"):
        if data.draw(st.booleans(), label=side):
            s = list(shape)
            s[d] = data.draw(st.integers(1, 3), label=f"{side}_len")
            kwargs[side] = make(s, kind, gen)
    total = shape[d] + sum(t.shape[d] for t in kwargs.values())
    if order > total:
        order = max(1, total)
    args = (x, order, dim)
    k = 1 + len(kwargs)
    current = (draw_current(data, x, n, partial=kind == "f", blocks=False),) + (R,) * (k - 1)
    expect = [((Shard(j),) * k, (Shard(j),)) for j in divisible_dims(shape, n) if j != d]
    if kind == "f":
        expect.append(((P,) * k, (P,)))
    check(aten.diff.default, args, kwargs, n=n, current=current, gen=gen, expect=expect)


@pytest.mark.timeout(60)
def test_chunk_diff_cumsum_are_hand_written():
    """What Hugging Face models need has a rule of ours (cumsum: tests/test_rules.py::test_cumsum)."""
    for op in (aten.chunk.default, aten.diff.default, aten.cumsum.default):
        assert rule_source(op) == "hand-written", op


# ---------------------------------------------------------------------------------------------
# the bridge: one op per kind, with the strategies it must offer
# ---------------------------------------------------------------------------------------------


def _other_dims(shape, n, skip, out_dim=lambda d: d, k_out=1, k_in=1):
    return [((Shard(d),) * k_in, (Shard(out_dim(d)),) * k_out) for d in divisible_dims(shape, n) if d not in skip]


def _reduced(dims, keep):
    return lambda d: d if keep else d - sum(1 for r in dims if r < d)


# name -> maker(draw, n, gen) -> (op, args, kwargs, expected strategies)
def _roll(draw, n, gen, shape):
    nd = len(shape)
    dims = draw(st.lists(st.integers(0, nd - 1), min_size=1, max_size=nd, unique=True), "dims")
    shifts = [draw(st.integers(-3, 3), "shift") for _ in dims]
    return aten.roll.default, (make(shape, "f", gen), shifts, dims), {}, _other_dims(shape, n, set(dims))


def _flip(draw, n, gen, shape):
    dims = draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, unique=True), "dims")
    return aten.flip.default, (make(shape, "f", gen), dims), {}, _other_dims(shape, n, set(dims))


def _sort(draw, n, gen, shape):
    dim = draw(st.integers(0, len(shape) - 1), "dim")
    x = make(shape, "f", gen)
    return aten.sort.default, (x, dim, draw(st.booleans(), "descending")), {}, _other_dims(shape, n, {dim}, k_out=2)


def _topk(draw, n, gen, shape):
    dim = draw(st.integers(0, len(shape) - 1), "dim")
    k = draw(st.integers(1, shape[dim]), "k")
    return aten.topk.default, (make(shape, "f", gen), k, dim), {}, _other_dims(shape, n, {dim}, k_out=2)


def _max_dim(draw, n, gen, shape):
    dim, keep = draw(st.integers(0, len(shape) - 1), "dim"), draw(st.booleans(), "keepdim")
    return (aten.max.dim, (make(shape, "small", gen), dim, keep), {},
            _other_dims(shape, n, {dim}, _reduced({dim}, keep), k_out=2))


def _argmax(draw, n, gen, shape):
    dim, keep = draw(st.integers(0, len(shape) - 1), "dim"), draw(st.booleans(), "keepdim")
    return (aten.argmax.default, (make(shape, "f", gen), dim, keep), {},
            _other_dims(shape, n, {dim}, _reduced({dim}, keep)))


def _var(draw, n, gen, shape):
    dims = draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, unique=True), "dims")
    keep, corr = draw(st.booleans(), "keepdim"), draw(st.sampled_from([0, 1]), "correction")
    return (aten.var.correction, (make(shape, "f", gen), dims), {"correction": corr, "keepdim": keep},
            _other_dims(shape, n, set(dims), _reduced(set(dims), keep)))


def _cumprod(draw, n, gen, shape):
    dim = draw(st.integers(0, len(shape) - 1), "dim")
    return aten.cumprod.default, (make(shape, "f", gen), dim), {}, _other_dims(shape, n, {dim})


def _logcumsumexp(draw, n, gen, shape):
    dim = draw(st.integers(0, len(shape) - 1), "dim")
    return aten.logcumsumexp.default, (make(shape, "f", gen), dim), {}, _other_dims(shape, n, {dim})


def _stack(draw, n, gen, shape):
    dim = draw(st.integers(0, len(shape)), "dim")
    k = draw(st.integers(1, 3), "k")
    xs = [make(shape, "f", gen) for _ in range(k)]
    return (aten.stack.default, (xs, dim), {},
            _other_dims(shape, n, set(), lambda d: d if d < dim else d + 1, k_in=k) + [((P,) * k, (P,))])


def _expm1(draw, n, gen, shape):
    return aten.expm1.default, (make(shape, "f", gen),), {}, _other_dims(shape, n, set())


def _hypot(draw, n, gen, shape):
    return aten.hypot.default, (make(shape, "f", gen), make(shape, "f", gen)), {}, _other_dims(shape, n, set(), k_in=2)


def _sigmoid_backward(draw, n, gen, shape):
    g, y = make(shape, "f", gen), torch.sigmoid(make(shape, "f", gen))
    return aten.sigmoid_backward.default, (g, y), {}, _other_dims(shape, n, set(), k_in=2)


def _softmax_backward(draw, n, gen, shape):
    dim = draw(st.integers(0, len(shape) - 1), "dim")
    y = torch.softmax(make(shape, "f", gen), dim)
    return (aten._softmax_backward_data.default, (make(shape, "f", gen), y, dim, torch.float64), {},
            _other_dims(shape, n, {dim}, k_in=2))


def _native_layer_norm(draw, n, gen, shape):
    k = draw(st.integers(1, len(shape)), "normalized")
    norm = shape[len(shape) - k:]
    w, b = make(norm, "f", gen), make(norm, "f", gen)
    lead = [d for d in divisible_dims(shape, n) if d < len(shape) - k]
    expect = [((Shard(d), R, R), (Shard(d),) * 3) for d in lead]
    return aten.native_layer_norm.default, (make(shape, "f", gen), norm, w, b, 1e-5), {}, expect


BRIDGED_CASES = {
    "roll": _roll, "flip": _flip, "sort": _sort, "topk": _topk, "max.dim": _max_dim, "argmax": _argmax,
    "var": _var, "cumprod": _cumprod, "logcumsumexp": _logcumsumexp, "stack": _stack,
    "expm1": _expm1, "hypot": _hypot, "sigmoid_backward": _sigmoid_backward,
    "_softmax_backward_data": _softmax_backward, "native_layer_norm": _native_layer_norm,
}


# ops whose sharded strategies the CI cases above verify (OpInfo's samples may never fit them)
CASE_OPS = {aten.roll.default, aten.flip.default, aten.sort.default, aten.topk.default, aten.max.dim,
            aten.argmax.default, aten.var.correction, aten.cumprod.default, aten.logcumsumexp.default,
            aten.stack.default, aten.expm1.default, aten.hypot.default, aten.sigmoid_backward.default,
            aten._softmax_backward_data.default, aten.native_layer_norm.default}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", list(BRIDGED_CASES))
@hyp(12)
@given(data=st.data())
def test_bridged_op(which, data):
    n = data.draw(st.sampled_from(NS), label="n")
    gen = new_gen(data)
    shape = draw_shape(data, n, 1, 3)
    op, args, kwargs, expect = BRIDGED_CASES[which](lambda s, label: data.draw(s, label=label), n, gen, shape)
    assert rule_source(op) == "dtensor", f"{op}: {rule_source(op)} (the case list tests the bridge)"
    tensors = _tensors(args, kwargs)
    current = tuple(draw_current(data, t, n, partial=False, blocks=False) if i == 0 else R
                    for i, t in enumerate(tensors))
    verify(op, args, kwargs, n=n, current=current, gen=gen, expect=expect)


@pytest.mark.timeout(60)
def test_bridge_translation():
    """What the bridge keeps of DTensor's placements: _NormPartial (a p-norm's partial, not a sum) and
    Partial(avg) are dropped; the current placement comes first; uneven shards are not offered."""
    x = torch.randn(4, 6, dtype=torch.float64)
    info = harness._info(aten.linalg_vector_norm.default, (x, 2.0, [1]), 2, (Shard(1),))
    strategies = get_rule(aten.linalg_vector_norm.default)(info)
    assert all(type(p) in (Replicate, Shard, Partial) for s in strategies for p in s.inputs + s.outputs)
    assert all(not isinstance(p, Partial) for s in strategies for p in s.outputs if s.inputs == (Shard(1),))
    info = harness._info(aten.roll.default, (x, [1], [0]), 2, (Shard(1),))
    assert get_rule(aten.roll.default)(info)[0].inputs == (Shard(1),)
    info = harness._info(aten.roll.default, (torch.randn(3, 5, dtype=torch.float64), [1], [0]), 2, (R,))
    assert all(s.inputs[0] in (R, P, Partial("max")) for s in get_rule(aten.roll.default)(info))


@pytest.mark.timeout(60)
def test_bridge_counts():
    """Which ops get DTensor's strategies, and that hand-written rules keep priority."""
    ours = set(registered_ops())
    bridged = set(bridged_ops())
    dt = dtensor_ops()
    assert not ours & bridged
    assert bridged <= dt
    assert len(bridged) >= 200, len(bridged)  # torch 2.13: 215 (bench/results/op_coverage.json)
    for op in list(bridged)[:50]:
        assert rule_source(op) == "dtensor" and refusal(op) is None
    # refused kinds, each with its reason
    assert "mutates" in refusal(aten.add_.Tensor)
    assert "random" in refusal(aten.bernoulli.default)
    assert "localizer" in refusal(aten.view.default)  # hand-written here: the bridge never sees it
    assert rule_source(aten.view.default) == "hand-written"
    assert rule_source(aten.renorm.default) is None  # no DTensor strategy, no rule: runs replicated
    # DTensor's own strategies that our property tests found wrong are not used
    assert "keepdim ignored" in refusal(aten.logsumexp.default)
    assert "wrong" in refusal(aten.threshold.default)  # Partial(max) through threshold(x, t, v > t)
    for name, why in DENIED.items():
        assert why, name


@pytest.mark.timeout(60)
def test_bridge_needs_no_process_group():
    """DTensor's op-strategy functions get a 1-D DeviceMesh that owns no process group: asking them
    creates none, and a real process group started afterwards in the same process works."""
    import torch.distributed as dist

    x = torch.randn(4, 6, dtype=torch.float64)
    before = dist.is_initialized()  # another test of this process may hold a group already
    groups = dist.distributed_c10d._world.pg_map.copy() if before else {}
    check(aten.sort.default, (x, 1), n=2, expect=[((Shard(0),), (Shard(0), Shard(0)))])
    assert dist.is_initialized() == before
    if before:
        assert dist.distributed_c10d._world.pg_map == groups  # the bridge made no group
        return
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        from torch.distributed.tensor import DTensor, init_device_mesh

        mesh = init_device_mesh("cpu", (1,))
        d = DTensor.from_local(x, mesh, [Replicate()])
        assert torch.equal(torch.sort(d, 1).values.full_tensor(), torch.sort(x, 1).values)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# the propagator: input-only values run replicated without a warning
# ---------------------------------------------------------------------------------------------


class _RenormModel(torch.nn.Module):
    """``renorm`` has no rule (nor a DTensor strategy): on input-only values (a table made from the
    ids) it is free; on an activation it forces a gather and is reported."""

    def __init__(self, on_activation: bool):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8, bias=False)
        self.on_activation = on_activation

    def forward(self, x, ids):
        table = torch.renorm(ids.float().unsqueeze(-1).expand(-1, -1, 8), 2, 0, 1.0)
        h = self.lin(x)
        if self.on_activation:
            h = torch.renorm(h, 2, 0, 1.0)
        return (h * table).sum()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on_activation", [False, True], ids=["input_only", "activation"])
def test_input_only_fallback_is_silent(on_activation):
    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh
    from mcompile.sharding.propagate import FallbackWarning

    model = _RenormModel(on_activation)
    inputs = (torch.randn(2, 16, 8), torch.randint(0, 5, (2, 16)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = compile_plan(model, Mesh.fake(tp=2), inputs)
    targets = [str(n.target) for n in c.captured.gm.graph.nodes]
    assert targets.count("aten.renorm.default") == 1 + on_activation, targets
    reported = [w for w in caught if issubclass(w.category, FallbackWarning)]
    if on_activation:
        assert c.plan.fallbacks == ["aten.renorm.default"] and len(reported) == 1
    else:
        assert c.plan.fallbacks == [] and not reported


# ---------------------------------------------------------------------------------------------
# slow: every bridged op over torch's OpInfo samples
# ---------------------------------------------------------------------------------------------


def _op_db():
    """torch's OpInfo database. Its module imports ``expecttest`` (a test-runner dependency of torch's
    own suite, not of ours) for a TestCase base class only: a stand-in is enough when it is absent."""
    try:
        import expecttest  # noqa: F401
    except ImportError:
        stub = types.ModuleType("expecttest")
        stub.TestCase, stub.ACCEPT = unittest.TestCase, False
        sys.modules["expecttest"] = stub
    from torch.testing._internal.common_methods_invocations import op_db

    return op_db


def _complex(args, kwargs, out) -> bool:
    ts = _tensors(args, kwargs) + harness._outputs(out)
    return any(t.is_complex() for t in ts)


def _clone(a):
    return harness._walk(a, lambda t: t.detach().clone())


def collect_samples(targets: set, per_op: int = 8) -> dict:
    """op -> [(OpInfo name, args, kwargs)]: the aten calls of every OpInfo sample (float64, CPU, forward
    and backward, seen by a dispatch mode); an op the dispatcher decomposes before any mode sees it
    (``square``, ``chunk``...) is called directly with the samples of the OpInfo of its name. Complex
    values are skipped: captured programs are real-valued."""
    from torch.utils._python_dispatch import TorchDispatchMode

    samples: dict = collections.defaultdict(list)

    class Capture(TorchDispatchMode):
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func in targets and len(samples[func]) < per_op and not _complex(args, kwargs, out):
                samples[func].append((self.name, _clone(args), _clone(kwargs)))
            return out

    by_name = collections.defaultdict(list)
    for info in _op_db():
        if torch.float64 not in info.supported_dtypes("cpu"):
            continue
        try:
            cases = list(info.sample_inputs("cpu", torch.float64, requires_grad=info.supports_autograd))[:6]
        except Exception:  # noqa: BLE001 - a sample generator that needs what this machine lacks
            continue
        by_name[info.name.split(".")[-1]].append(cases)
        for s in cases:
            mode = Capture()
            mode.name = info.name
            try:
                with mode:
                    out = info.op(s.input, *s.args, **s.kwargs)
                    outs = [o for o in harness._outputs(out if isinstance(out, list | tuple) else [out])
                            if o.requires_grad and o.is_floating_point()]
                    if outs:
                        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            except Exception:  # noqa: BLE001 - samples that error on purpose (error_inputs) or need CUDA
                continue
    for op in targets:
        if samples.get(op):
            continue
        for cases in by_name.get(op._schema.name.split("::")[-1], []):
            for s in cases:
                args = (s.input, *s.args) if isinstance(s.input, torch.Tensor) else (*s.input, *s.args)
                try:
                    out = op(*_clone(args), **_clone(s.kwargs))
                except Exception:  # noqa: BLE001 - another overload's arguments
                    continue
                if not _complex(args, s.kwargs, out) and len(samples[op]) < per_op:
                    samples[op].append((f"{op} direct", _clone(args), _clone(s.kwargs)))
    return samples


def tiled(args, kwargs, factor: int):
    """Every tensor repeated ``factor`` times along each dim of size > 1: the same op on shapes whose
    dims the axis divides (sizes 5, 7 in OpInfo samples never shard), values and indices still valid."""
    def rep(t):
        if t.ndim == 0:
            return t.clone()
        return t.repeat(*[factor if s > 1 else 1 for s in t.shape]).detach().clone()

    return harness._walk(args, rep), harness._walk(kwargs, rep)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_every_bridged_op_against_single_device():
    """Every op the bridge offers (and chunk / diff / cumsum), on every OpInfo sample that reaches it,
    as given (n = 2, 3) and tiled so that its dims divide (n = 2): all strategies correct, and at
    least one sharded or Partial strategy verified per op. An op that fails, has no sample, or never
    fits a sharded strategy belongs in mcompile.sharding.rules.dtensor.DENIED with the reason."""
    targets = set(bridged_ops()) | {aten.chunk.default, aten.diff.default, aten.cumsum.default}
    samples = collect_samples(targets)
    failures, verified = {}, collections.Counter()
    for op, cases in samples.items():
        for name, args, kwargs in cases:
            variants = [(args, kwargs, 2), (args, kwargs, 3), (*tiled(args, kwargs, 2), 2)]
            for a, k, n in variants:
                try:
                    op(*_clone(a), **_clone(k))
                except Exception:  # noqa: BLE001 - a tiled sample the op does not accept
                    continue
                try:
                    tested = verify(op, _clone(a), _clone(k), n=n)
                except Exception as e:  # noqa: BLE001 - collected and reported together
                    failures.setdefault(str(op), f"{name} n={n}: {type(e).__name__}: {str(e)[:300]}")
                    continue
                verified[op] += sum(1 for s in tested if s.name != "replicate")
    assert not failures, "strategies wrong against single-device execution:\n" + "\n".join(
        f"  {op}: {msg}" for op, msg in sorted(failures.items()))
    missing = sorted(str(op) for op in targets if not samples.get(op))
    assert not missing, f"bridged ops with no OpInfo sample (deny them, or add a sample): {missing}"
    untested = sorted(str(op) for op in targets if samples.get(op) and not verified[op] and op not in CASE_OPS)
    assert not untested, f"bridged ops whose samples never fit a sharded / Partial strategy: {untested}"
