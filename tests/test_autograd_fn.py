"""Custom torch.autograd.Functions are captured with their own backward (mcompile/capture/autograd_fn.py).

The Functions of tests/autofn_cases.py have backwards that are not their forwards' derivatives (a
straight-through estimator, a scaled gradient, a hand-written recompute that triples its result, a halved
input gradient, a shift's gradient scaled by the shift), so differentiating the ops their forwards run — what
torch.export alone captures — gives other gradients: the first test shows that it does, which is what lets the
parity checks fail. Gradients are compared at rtol 1e-5 of each gradient's largest element (fp32; the
layouts reorder sums of 16-32 terms, ~1e-7 relative).
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from autofn_cases import FUNCTIONS, forward_differentiated, quant_case, train_step
from sim_harness import combine_grads, rank_args, run_sim

from mcompile.api import compile_plan
from mcompile.capture.export import CaptureError, capture
from mcompile.compiler import joint_runner
from mcompile.ir.config import Config
from mcompile.ir.mesh import Mesh
from mcompile.runtime.sim import ThreadedWorld, run_threads
from mcompile.sharding.propagate import FallbackWarning

from conftest import pool

RTOL = 1e-5
_TRACE = threading.Lock()  # make_fx tracing is not thread-safe: each in-process rank traces under the lock


def _eager():
    model, inputs = quant_case()
    loss = model(*inputs)
    loss.backward()
    return model, inputs, loss.item(), {k: p.grad.clone() for k, p in model.named_parameters()}


def _worst(got: dict, ref: dict) -> float:
    """The largest error of any gradient, relative to that gradient's largest element."""
    return max(((got[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref)


@pytest.mark.timeout(300)
def test_functions_keep_their_own_backward_on_one_device_dp2_and_tp2():
    """Single device (tp=1), dp=2 and tp=2 in the thread simulator: loss and every gradient equal eager
    PyTorch's, whose gradients differ from the forward-differentiated ones; each Function is one op, split
    where its forward and backward are pointwise (RoundSTE, ScaleGrad, Shift:
    mcompile.sharding.rules.inferred.pointwise_rule) or row by row (ProductAndMax's amax over the last dim), else
    replicated
    and reported (Recomputed's gradient of a broadcast gain); at tp=2 the joint path (forward and backward traced
    into one graph) gives
    the autograd path's gradients to the bit, with each Function's backward traced as ops, no opaque node left."""
    model, inputs, ref_loss, ref = _eager()
    naive = forward_differentiated(model, inputs)
    assert _worst(naive, ref) > 0.1  # the Functions' backwards matter: parity below can fail
    for axes in ({"tp": 1}, {"dp": 2}, {"tp": 2}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c = compile_plan(model, Mesh.fake(**axes), inputs)
        # not pointwise, nor row by row (a broadcast gain); the others are split (ProductAndMax: its amax over the
        # last dim works row by row, mcompile.sharding.rules.inferred._rowwise)
        named = {"Recomputed"}
        assert {f.__name__ for f in FUNCTIONS} > named
        assert {op.split(".")[1].rsplit("_", 1)[0] for op in c.plan.fallbacks if op.startswith("mcompile_fn.")} \
            == named
        reported = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
        assert sum("custom torch.autograd.Function" in m for m in reported) == len(named), reported
        res = run_sim(c, inputs, backward=True)
        dp = axes.get("dp", 1)
        loss = sum(lo.item() for lo, _, _ in res) / len(res) if dp > 1 else res[0][0].item()
        assert loss == pytest.approx(ref_loss, rel=RTOL)
        assert _worst(combine_grads(c, [g for _, g, _ in res]), ref) <= RTOL, axes
    state = c.captured.state_values()

    def rank_fn(r):
        prog, args = rank_args(c, r, inputs, state)
        eager = torch.autograd.grad(prog(*args)[0], [a for a in args if a.requires_grad])
        runner = joint_runner(prog, Config())
        with _TRACE:
            jp = runner.compile(args)
        out, ctx = runner.forward(args)
        joint = runner.backward(ctx, [torch.ones_like(out[0])])
        assert "mcompile_fn" in prog.code and "mcompile_fn" not in jp.forward.code + jp.backward.code
        return all(torch.equal(a, b) for a, b in zip(joint, eager))

    assert run_threads(ThreadedWorld(c.mesh), rank_fn) == [True, True]


@pytest.mark.timeout(600)
def test_parallelize_on_the_joint_path_at_dp2():
    """End to end on two gloo processes: parallelize (rank 0 captures; rank 1 loads the capture and defines the
    Functions' ops from its list) and one training step on the joint path: loss and gradients equal eager."""
    _, _, ref_loss, ref = _eager()
    for loss, grads in pool(2).run(train_step, "dp=2", {}):
        assert loss == pytest.approx(ref_loss, rel=RTOL)
        assert _worst(grads, ref) <= RTOL


class _Base(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)


class _InPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        ctx.mark_dirty(a)
        return a.mul_(2)

    @staticmethod
    def backward(ctx, g):
        return g * 2


class _IntOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a * 2, 3

    @staticmethod
    def backward(ctx, g, _):
        return g * 2


class _Dict(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, cfg):
        return a * cfg["scale"]

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Overridden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a * 2

    @staticmethod
    def backward(ctx, g):
        return g * 3

    @classmethod
    def apply(cls, *args):  # bypasses Function.apply, where mcompile keeps the backward
        return super(torch.autograd.Function, cls).apply(*args)


class _ApplyInPlace(_Base):
    def forward(self, x):
        return _InPlace.apply(self.lin(x) * 1).sum()


class _ApplyIntOut(_Base):
    def forward(self, x):
        return _IntOut.apply(self.lin(x))[0].sum()


class _ApplyDict(_Base):
    def forward(self, x):
        return _Dict.apply(self.lin(x), {"scale": 2.0}).sum()


class _ApplyOverridden(_Base):
    def forward(self, x):
        return _Overridden.apply(self.lin(x)).sum()


@pytest.mark.slow
@pytest.mark.parametrize("cls,cause,line", [
    (_ApplyInPlace, "writes one of its inputs in place", "def forward(ctx, a):"),
    (_ApplyIntOut, "returns (Tensor, int): its op returns tensors only", "def forward(ctx, a):"),
    (_ApplyDict, "applied with argument #2 of type builtins.dict", '_Dict.apply(self.lin(x), {"scale": 2.0})'),
    (_ApplyOverridden, "without going through Function.apply", "def forward(ctx, a):"),
])
def test_what_cannot_be_wrapped_is_refused_with_cause_line_and_fix(cls, cause, line):
    """The refusals the CI tier does not draw (tests/test_capture_newuser.py has a data-dependent output shape
    and numpy in forward)."""
    with pytest.raises(CaptureError) as e:
        capture(cls(), (torch.randn(2, 4, 8),))
    msg = str(e.value)
    assert cause in msg and f"{__file__}:" in msg and line in msg and "fix: " in msg, msg


def _local_function_model():
    class Local(torch.autograd.Function):  # inside a function: no other process can import it by name
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return g * 3

    class Applies(_Base):
        def forward(self, x):
            return Local.apply(self.lin(x)).sum()

    return Applies()


@pytest.mark.slow
def test_a_function_other_processes_cannot_import_is_refused_for_parallelize_only():
    """In one process (compile_plan, the simulator) a Function defined inside a function is fine; the bytes
    parallelize sends its other ranks are refused on the capturing rank, where the error reaches every rank."""
    model, x = _local_function_model(), torch.randn(2, 4, 8)
    capture(model, (x,))
    with pytest.raises(CaptureError, match=r"_local_function_model.<locals>.Local, which another process cannot "
                                           r"import(.|\n)*fix: define the Function at the top level"):
        capture(model, (x,), pack="bytes")
