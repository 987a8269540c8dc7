"""Value checks in forward (``assert t.all()``, ``if t.any(): raise``) captured as runtime assertions of the
program (mcompile/capture/checks.py); a branch on values whose both sides run on is still refused, naming its line."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from checks_cases import Checked, D, V

from mcompile.capture.export import CaptureError, capture

aten = torch.ops.aten


def _grads(loss, params):
    return torch.autograd.grad(loss, params)

def _same_as_eager(m, prog, x):
    """The captured program's output and every parameter's gradient equal eager mode's on ``x``."""
    names = [n for n, _ in m.named_parameters()]
    ref, got = m(x), prog(x)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    for n, a, b in zip(names, _grads(ref, [m.get_parameter(n) for n in names]),
                       _grads(got, [prog.get_parameter(n) for n in names])):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=n)



def test_value_checks_become_runtime_assertions_naming_their_line():
    torch.manual_seed(0)
    m = Checked()
    ids = torch.randint(0, V, (2, 6))
    cap = capture(m, (ids,), pack=True)
    checks = [n for n in cap.gm.graph.nodes if n.target is aten._assert_async.msg]
    assert len(checks) == 4, cap.gm.graph  # ids >= 0, ids < V, no NaN, no inf
    assert not [n for n in cap.gm.graph.nodes if n.target in (aten.item.default, aten._assert_scalar.default)]
    prog = cap.ep.module()
    x = torch.randint(0, V, (3, 5))  # another batch, another size: the checks pass, the program is eager's
    _same_as_eager(m, prog, x)
    # a batch eager mode refuses is refused by the program, naming the check's line, not silently run
    with pytest.raises(RuntimeError, match=r"value check of forward failed.*checks_cases.py:\d+: if \(ids >= V"):
        prog(torch.full((2, 6), V))
    with pytest.raises(RuntimeError, match=r"checks_cases.py:\d+: assert torch.all\(ids >= 0\)"):
        prog(torch.full((2, 6), -1))
    # the serialised capture (what parallelize sends to the other ranks) keeps them
    from mcompile.capture.export import from_packed

    again = from_packed(cap.packed, m)
    assert len([n for n in again.gm.graph.nodes if n.target is aten._assert_async.msg]) == 4


def test_value_checks_run_at_tp2_at_parity():
    """Planned at tp=2 (the check reads the whole tensor: replicated) and run in the thread simulator: loss and
    every gradient equal the single-device model's."""
    from sim_harness import assert_sim_parity

    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh

    torch.manual_seed(0)
    m = Checked()
    ids = torch.randint(0, V, (2, 8))
    c = compile_plan(m, Mesh.fake(tp=2), (ids,))
    assert c.plan.fallbacks == []
    assert_sim_parity(c, m, (ids,), "checked")


def test_branch_on_values_is_refused_not_specialised():
    """Both sides of ``if mask.any():`` run on (FSMT's ``if not padding_mask.any(): padding_mask = None``): the
    branch depends on the batch, so it is refused, naming the line, never fixed to the example's side."""

    class Branches(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, D)

        def forward(self, ids):
            mask = ids.eq(1)
            if not mask.any():
                mask = None
            h = self.emb(ids)
            return (h if mask is None else h.masked_fill(mask[..., None], 0)).sum()

    with pytest.raises(CaptureError, match=r"(?s)bool/int/float.*test_capture_checks.py:\d+: if not mask.any\(\):"):
        capture(Branches(), (torch.randint(0, V, (2, 6)),))


def test_values_of_shapes_and_constants_are_captured_exactly():
    """A size computed as a 0-d tensor and a branch on a mask forward builds from constants
    (mcompile/capture/values.py):
    captured without an item node, the size symbolic (the program runs at another sequence length), equal to eager
    mode; the same branch on a mask given as an input is refused, never fixed to the example's side."""
    from checks_cases import WindowedMask

    torch.manual_seed(0)
    m = WindowedMask()
    cap = capture(m, (torch.randint(0, V, (2, 8)),))
    assert not [n for n in cap.gm.graph.nodes if n.target in (aten.item.default, aten._local_scalar_dense.default)]
    prog = cap.ep.module()
    for seq in (8, 12):
        x = torch.randint(0, V, (3, seq))
        torch.testing.assert_close(prog(x), m(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(CaptureError, match=r"(?s)bool/int/float.*checks_cases.py:\d+: if is_global:"):
        capture(m, (), {"ids": torch.randint(0, V, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)})


def test_values_not_followed_stay_unknown():
    """What the tracking cannot follow is unknown, so the read is refused (a wrong value would be silent): a mask
    written in place through indexing, and two pieces of one tensor (a chunk's halves are not element by element
    the same tensor)."""

    class Written(nn.Module):
        def forward(self, x):
            m = torch.ones(x.shape[0], x.shape[1])
            m[:, 0] = 0  # an untracked write: m no longer all ones
            if (m == 0).any():
                return x.sum() * 2
            return x.sum()

    class Pieces(nn.Module):
        def forward(self, x):
            p, q = torch.cat([torch.ones(2), torch.zeros(2)]).chunk(2)
            if (p != q).any():
                return x.sum() * 2
            return x.sum()

    for model in (Written(), Pieces()):
        with pytest.raises(CaptureError, match=r"(?s)bool/int/float.*test_capture_checks.py:\d+: if \("):
            capture(model, (torch.randn(2, 4),))


def test_function_with_a_config_dict_keeps_its_backward():
    """A custom autograd.Function applied with a dict of JSON values (YOSO's config): the dict is part of the op
    (one op per value), the Function's own backward runs, and the serialised capture carries it."""
    from checks_cases import Configured

    from mcompile.capture.export import from_packed

    torch.manual_seed(0)
    m = Configured([{"fwd": 2.0, "bwd": 0.5, "name": "a"}, {"fwd": 1.5, "bwd": -1.0, "name": "b"}])
    x = torch.randn(2, 3, D)
    cap = capture(m, (x,), pack=True)
    ops = {n.target for n in cap.gm.graph.nodes if getattr(n.target, "namespace", None) == "mcompile_fn"}
    assert len(ops) == 2
    for prog in (cap.ep.module(), from_packed(cap.packed, m).ep.module()):
        _same_as_eager(m, prog, x)
    with pytest.raises(CaptureError, match=r"argument #2 of type builtins.dict.*dicts of JSON values"):
        capture(Configured([{"fwd": 2.0, "bwd": torch.ones(())}]), (x,))


def test_scratch_attribute_forward_creates_is_dropped_not_refused():
    """Funnel's ``self.seq_len = x.size(1)``: an attribute forward creates for a traced value is scratch state
    of the call, removed after the capture (the module as before: torch.export itself puts back the attributes
    that existed); a traced value added to a container that existed (``self.seen.append(h)``) is still refused
    (tests/test_capture_newuser.py)."""

    class Scratch(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            self.seq_len = x.size(1)
            return self.lin(x).sum() * self.seq_len

    m = Scratch()
    cap = capture(m, (torch.randn(2, 4, D),))
    assert not hasattr(m, "seq_len")
    x = torch.randn(3, 6, D)
    torch.testing.assert_close(cap.ep.module()(x), m(x))


def test_view_of_sizes_that_depend_on_values_offers_no_shard():
    """A view between sizes whose products cannot be matched (BLT's patch count, an unbacked size) offers no
    sharded strategy, saying why, instead of failing the planner with an IndexError."""
    import sympy

    from mcompile.ir.placements import Shard
    from mcompile.sharding.rules.views import map_view_placement

    u0, u1, u2 = sympy.symbols("u0 u1 u2", integer=True, positive=True)
    notes: list[str] = []
    assert map_view_placement(Shard(0), (u0,), (u1, u2), 2, notes) is None
    assert "no grouping of dims with equal products" in notes[0]
    assert map_view_placement(Shard(0), (u0 * 4, 6), (u0, 24), 2) == Shard(0)


def test_a_parameter_written_through_data_in_forward_is_refused_naming_the_line():
    """``weight.data.clamp_(-c, c)`` in a training forward (Gemma-3n's AltUp coefficients) changes the stored
    parameter outside autograd: a captured program cannot replay it, so it is refused with the line and a fix
    (torch.export said only "a fake tensor in the constant's list", at an unknown location). A read of ``.data``
    is captured as ``detach()`` (torch.export refused it the same way), and an in-place op on a copy is no write
    to the parameter."""

    class Clamped(nn.Module):
        def __init__(self, write: bool):
            super().__init__()
            self.proj, self.write = nn.Linear(8, 8), write

        def forward(self, x):
            if self.write:
                self.proj.weight.data.clamp_(-0.1, 0.1)
            scale = self.proj.weight.data.abs().max()  # a read: allowed
            return (self.proj(x) * scale).sum() + x.detach().clone().mul_(2).sum()

    x = torch.randn(2, 8)
    with pytest.raises(CaptureError) as e:
        capture(Clamped(True), (x,))
    text = str(e.value)
    assert "writes a parameter in place through .data (clamp_)" in text
    assert "test_capture_checks.py:" in text and "optimizer.step()" in text
    m = Clamped(False)
    _same_as_eager(m, capture(m, (x,)).ep.module(), x)


def test_a_mask_from_an_unknown_condition_and_a_write_that_writes_nothing_stay_known():
    """Hugging Face Longformer's default mask: ``where(positions compared with an arange, 0, min)`` (the condition
    is not followed: an arange is not a set of values), then ``mask[attention_mask == 2] = max`` with no global
    token (an all-False index: nothing written), then ``if (mask > 0).any():``. Every element is one of the
    branches' values, and the write leaves them: the branch is known, captured without an item node. A write of a
    value through an index not known all False makes the mask its old values or the new one: still refused."""

    class Mask(nn.Module):
        def __init__(self, write: bool):
            super().__init__()
            self.write = write

        def forward(self, x):
            ones = torch.ones(x.shape[0], x.shape[1])
            ok = (torch.arange(x.shape[1]) >= 0)[None, :] & ones.bool()
            mask = torch.where(ok, torch.zeros(()), torch.finfo(torch.float32).min)
            mask[(ones == 1) if self.write else (ones == 2)] = torch.finfo(torch.float32).max
            if (mask > 0).any():
                return x.sum() * 2
            return x.sum() + mask.sum() * 0

    torch.manual_seed(0)
    m = Mask(write=False)
    cap = capture(m, (torch.randn(2, 4),))
    assert not [n for n in cap.gm.graph.nodes if n.target in (aten.item.default, aten._local_scalar_dense.default)]
    x = torch.randn(3, 6)
    torch.testing.assert_close(cap.ep.module()(x), m(x))
    with pytest.raises(CaptureError, match=r"(?s)bool/int/float.*test_capture_checks.py:\d+: if \(mask > 0\)"):
        capture(Mask(write=True), (torch.randn(2, 4),))
