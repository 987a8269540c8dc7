"""mcompile's collective ops (mcompile/ir/ops.py), each forward and backward against its definition.

What is isolated: one op on one mesh axis of n ranks, run in n threads (mcompile.runtime.sim), with
a different input and a different output gradient on every rank, so that taking another rank's
chunk, skipping a reduction or reducing twice changes the result. The models' parity tests exercise
most pairs only in the combinations a plan produces (none of the test models' plans contains an
``all_gather(..., "split")``, whose backward went untested: mutation testing found it).

Values are float64 and every check is exact up to the summation order (rtol 1e-12).
"""

from __future__ import annotations

import pytest
import torch

from mcompile.ir import ops
from mcompile.ir.mesh import Mesh
from mcompile.runtime.sim import ThreadedWorld, run_threads

F64 = torch.float64


def _chunk(t: torch.Tensor, dim: int, n: int, r: int) -> torch.Tensor:
    return t.chunk(n, dim)[r]


def _run(n: int, fn):
    return run_threads(ThreadedWorld(Mesh.parse(f"tp={n}")), fn)


def _widened(n, dim):
    """One rank's input of an op that divides ``dim`` by n."""
    return tuple(k * n if d == dim else k for d, k in enumerate((2, 4, 3)))


def _per_rank(n, shape, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, dtype=F64, generator=g) for _ in range(n)]


# op -> (call, input shape of one rank given (n, dim), forward reference, backward reference): the
# references take every rank's inputs xs (or gradients gs) and the rank r
CASES = {
    "all_reduce": (
        lambda x, dim, n: ops.all_reduce(x, "tp", n), lambda n, dim: (2, 4, 3),
        lambda xs, dim, n, r: sum(xs), lambda gs, dim, n, r: gs[r],  # Megatron's g: identity backward
    ),
    "copy_ar_bwd": (
        lambda x, dim, n: ops.copy_ar_bwd(x, "tp", n), lambda n, dim: (2, 4, 3),
        lambda xs, dim, n, r: xs[r], lambda gs, dim, n, r: sum(gs),  # Megatron's f
    ),
    "all_gather_reduce_scatter": (
        lambda x, dim, n: ops.all_gather(x, dim, "tp", n, "reduce_scatter"), lambda n, dim: (2, 4, 3),
        lambda xs, dim, n, r: torch.cat(xs, dim), lambda gs, dim, n, r: _chunk(sum(gs), dim, n, r),
    ),
    "all_gather_split": (
        lambda x, dim, n: ops.all_gather(x, dim, "tp", n, "split"), lambda n, dim: (2, 4, 3),
        lambda xs, dim, n, r: torch.cat(xs, dim), lambda gs, dim, n, r: _chunk(gs[r], dim, n, r),
    ),
    "reduce_scatter": (
        lambda x, dim, n: ops.reduce_scatter(x, dim, "tp", n), _widened,
        lambda xs, dim, n, r: _chunk(sum(xs), dim, n, r), lambda gs, dim, n, r: torch.cat(gs, dim),
    ),
    "shard_slice": (
        lambda x, dim, n: ops.shard_slice(x, dim, "tp", n), _widened,
        lambda xs, dim, n, r: _chunk(xs[r], dim, n, r), lambda gs, dim, n, r: torch.cat(gs, dim),
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_collective_forward_and_backward(name, n, dim):
    call, shape_of, fwd_ref, bwd_ref = CASES[name]
    xs = _per_rank(n, shape_of(n, dim), seed=1)
    out_shape = fwd_ref(xs, dim, n, 0).shape
    gs = _per_rank(n, out_shape, seed=2)

    def rank(r):
        x = xs[r].clone().requires_grad_(True)
        y = call(x, dim, n)
        (gx,) = torch.autograd.grad(y, x, gs[r])
        return y.detach(), gx

    for r, (y, gx) in enumerate(_run(n, rank)):
        torch.testing.assert_close(y, fwd_ref(xs, dim, n, r), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gx, bwd_ref(gs, dim, n, r), rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 4])
def test_all_reduce_max(n):
    xs = _per_rank(n, (3, 5), seed=3)
    out = _run(n, lambda r: ops.all_reduce_max(xs[r], "tp", n))
    for y in out:
        assert torch.equal(y, torch.stack(xs).amax(0))
