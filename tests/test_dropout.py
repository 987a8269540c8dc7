"""Dropout under every layout (mcompile/ir/dropout.py, passes/lower_dropout.py): masks are a function of (seed, step,
captured node, the element's index in the single-device tensor), so a model trained with dropout gives the
same losses and gradients on every layout as mcompile's own 1-rank run with the same seed — the parity oracle
(eager PyTorch's stateful generator cannot be matched by any counter-based scheme).

What each test isolates:

* the generator is Philox-4x32-10 exactly (the published known-answer vectors), and its masks keep the rate
  asked for with no correlation between neighbouring elements, steps or nodes beyond chance;
* a rank's local piece of a mask, built from index vectors as the lowering builds them, is that piece of the
  whole tensor's mask (a shard, a block shard, a batch offset);
* eval mode keeps torch's dropout (a no-op) and adds no program input;
* HF BERT (its default dropout 0.1, attention dropout included) at tp=2 in the thread simulator, and at
  dp=2 x tp=2 and pp=2 (microbatches: their batch offsets) on gloo, equals the 1-rank run: every step's loss
  and clip norm, the unclipped gradients at 1e-5 relative. The attention key bias has a true gradient of
  exactly 0 (softmax is shift-invariant, dropout after it does not change that): rounding noise, held to 1e-6
  of the largest gradient instead (as tests/test_family_bert.py).
"""

from __future__ import annotations

import pytest
import torch

from mcompile.ir.dropout import keep_mask, node_key, philox4x32, rng_state

from conftest import pool, tiered

REL = 1e-5


def _hex(words) -> str:
    return " ".join(f"{int(w):08x}" for w in words)


def test_philox_known_answers():
    """Random123's known-answer vectors for Philox-4x32-10 (Salmon et al. 2011): zeros, all ones, pi's digits."""
    m = 0xFFFFFFFF
    assert _hex(philox4x32(0, 0, 0, 0, 0, 0)) == "6627e8d5 e169c58d bc57ac4c 9b00dbd8"
    assert _hex(philox4x32(m, m, m, m, m, m)) == "408f276d 41c83b0e a20bc7c6 6d5451fd"
    assert _hex(philox4x32(0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0)) == \
        "d16cfe09 94fdcceb 5001e420 24126ea1"


def _mask(shape, p=0.1, key=7, step=0, seed=3, offset=0, index=None, sizes=None, row_dim=0):
    index = index if index is not None else [torch.arange(n) for n in shape]
    return keep_mask(shape, rng_state(seed, step, offset), p, key, index, sizes or list(shape), row_dim, 1)


def test_masks_keep_the_rate_independently():
    """10^6 elements at p=0.1: the kept fraction is within 1% of 0.9, and the correlation of an element with
    its neighbour and with the same element in the next row is zero within 5 standard errors (1/sqrt(n)); on
    2.5 * 10^5 elements, with itself at the next step, under another node's key and under another seed."""
    whole = _mask((4, 250, 1000)).double()  # rows x the rest: 10^6
    m = whole.flatten()
    assert abs(m.mean().item() - 0.9) <= 0.009, m.mean().item()

    def corr(a, b):
        a, b = a - a.mean(), b - b.mean()
        return ((a * b).mean() / (a.std() * b.std())).item()

    assert abs(corr(m[:-1], m[1:])) < 5 / 10**3  # neighbours along the last dim (and across its ends)
    assert abs(corr(whole[:-1].flatten(), whole[1:].flatten())) < 5 / (3 * 250 * 1000) ** 0.5  # the row word
    shape = (1, 250, 1000)
    first = whole[:1].flatten()
    assert torch.equal(_mask(shape).double().flatten(), first)  # a function of its arguments, nothing else
    for other in (_mask(shape, step=1), _mask(shape, key=node_key("dropout_1")), _mask(shape, seed=4)):
        assert abs(corr(first, other.double().flatten())) < 5 / 500


def test_a_ranks_piece_is_the_piece_of_the_whole_mask():
    """The local mask from global index vectors — a Shard of dim 1 over 2 ranks, a BlockShard(2, 2) (two
    blocks, each halved), a batch offset (dp, microbatches) — equals that piece of the whole tensor's mask."""
    shape = (4, 6, 8)
    whole = _mask(shape)
    for r in range(2):
        idx = [torch.arange(4), torch.arange(3) + 3 * r, torch.arange(8)]
        assert torch.equal(_mask((4, 3, 8), index=idx, sizes=list(shape)), whole[:, 3 * r:3 * r + 3])
        blocks = torch.arange(8).view(2, 4)[:, 2 * r:2 * r + 2].reshape(-1)  # each block's r-th half
        idx = [torch.arange(4), torch.arange(6), blocks]
        assert torch.equal(_mask((4, 6, 4), index=idx, sizes=list(shape)), whole[:, :, blocks])
        idx = [torch.arange(2), torch.arange(6), torch.arange(8)]  # rows 2r, 2r+1 of the global batch
        assert torch.equal(_mask((2, 6, 8), index=idx, offset=2 * r), whole[2 * r:2 * r + 2])


class _Drop(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.drop = torch.nn.Dropout(0.1)
        self.b = torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.a(x)))).square().mean()


@pytest.mark.timeout(120)
def test_eval_mode_keeps_its_program():
    """model.eval(): no mask, no program input; model.train(): mcompile::dropout and the ``mc_rng`` input."""
    from mcompile.api import compile_plan
    from mcompile.ir.dropout import RNG_INPUT
    from mcompile.ir.mesh import Mesh

    x = torch.randn(4, 8, 16)
    for training in (False, True):
        prog = compile_plan(_Drop().train(training), Mesh.parse("tp=2"), (x,), for_runtime=True).program(0)
        names = [n.name for n in prog.graph.nodes if n.op == "placeholder"]
        ours = [n for n in prog.graph.nodes if n.target is torch.ops.mcompile.dropout.default]
        assert (RNG_INPUT in names, len(ours)) == ((True, 1) if training else (False, 0))


def _check_grads(grads, ref):
    top = max(g.norm().item() for g in ref.values())
    assert sorted(grads) == sorted(ref)
    for k, g in grads.items():
        err = (g - ref[k]).norm().item()
        if k.endswith("attention.self.key.bias"):  # true gradient exactly 0: rounding noise
            assert err <= 1e-6 * top, (k, err)
        else:
            assert err <= REL * ref[k].norm().item(), (k, err / ref[k].norm().item())


@pytest.mark.timeout(300)
def test_bert_tp2_equals_one_rank_in_the_simulator(tmp_path, monkeypatch):
    """HF BERT with its default dropout (hidden and attention, 0.1), 4 layers: one forward and backward at tp=2
    in the thread simulator equals the 1-rank program's loss and gradients; and the masks are really drawn
    (the loss differs from the model's at dropout 0)."""
    from bert_cases import build_hf_dropout
    from sim_harness import combine_grads, run_sim

    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh

    monkeypatch.setenv("MCOMPILE_CACHE", str(tmp_path))  # captured once, for both meshes
    model, inputs = build_hf_dropout()
    out = {}
    for mesh in ("tp=1", "tp=2"):
        c = compile_plan(model, Mesh.parse(mesh), inputs, for_runtime=True, capture_cache=True)
        ranks = run_sim(c, inputs, backward=True)
        out[mesh] = ranks[0][0], combine_grads(c, [r[1] for r in ranks])
        keys = [n.args[3] for n in c.program(0).graph.nodes if n.target is torch.ops.mcompile.dropout.default]
        assert len(keys) == 1 + 4 * 3 and len(set(keys)) == len(keys)  # every layer's masks its own (repeated)
    (loss1, g1), (loss2, g2) = out["tp=1"], out["tp=2"]
    assert loss2.item() == pytest.approx(loss1.item(), rel=REL, abs=0)
    _check_grads(g2, g1)
    with torch.no_grad():
        assert abs(model.eval()(*inputs).item() - loss1.item()) > 1e-3


_CASES = [("dp=2,tp=2", {}), ("pp=2", {"microbatches": 2})]
# both slow: a 1-rank and a 2- or 4-rank gloo pool, each building HF BERT and training 3 steps, take minutes on 2
# shared cores (pp=2: 58 s plus 71 s for the 1-rank oracle measured, 166 + 105 s under a load of 19), not the
# < 15 s a CI real-process case may cost; the simulator case above is the CI tier's parity check
_CI: list = []


@pytest.fixture(scope="module")
def one_rank():
    """3 AdamW steps of HF BERT with dropout on one gloo rank: the oracle."""
    from bert_cases import train_dropout

    return pool(1).run(train_dropout, "tp=1", {}, 3, 4, timeout=600)[0]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mesh,options", tiered(_CASES, _CI))
def test_bert_with_dropout_trains_as_one_rank(one_rank, mesh, options):
    """3 AdamW steps: every rank's losses and clip norms, and the unclipped gradients of the last step, equal
    the 1-rank run's (each data rank's rows and each microbatch's offset in the global batch draw that row's
    masks; the step counter gives each step its own)."""
    from bert_cases import train_dropout
    from runtime_cases import world_of

    ref_losses, ref_grads, _, ref_norms = one_rank
    assert len(set(ref_losses)) == 3
    results = pool(world_of(mesh)).run(train_dropout, mesh, options, 3, 4, timeout=600)
    for losses, _, _, norms in results:
        assert losses == pytest.approx(ref_losses, rel=REL, abs=0)
        assert norms == pytest.approx(ref_norms, rel=REL, abs=0)
    _check_grads(results[0][1], ref_grads)


class _Sampler(torch.nn.Module):
    """A column-parallel projection whose output gets random numbers of every kind (``torch.rand_like``,
    ``Tensor.uniform_``, ``Tensor.exponential_``: Gumbel noise), then a row-parallel one and a mean loss."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        h = self.up(x)
        gumbel = -torch.empty_like(h).exponential_().log()
        keep = (torch.rand_like(h) > 0.3) | (torch.empty_like(h).uniform_(-1.0, 1.0) > 0.5)
        return self.down((h + 0.1 * gumbel) * keep).pow(2).mean()


def test_random_ops_draw_the_one_rank_numbers_on_a_sharded_layout():
    """Random ops on a tp-sharded value have a rule (no fallback) and draw from the counter of each element's
    place in the whole tensor: at tp=2 (the projection's output split over its features) the loss and every
    gradient are the 1-rank program's; the numbers are random (uniform in (0, 1), exponential with mean 1)."""
    import warnings

    from sim_harness import combine_grads, run_sim

    from mcompile.api import compile_plan
    from mcompile.ir.dropout import draws
    from mcompile.ir.mesh import Mesh
    from mcompile.ir.placements import Shard
    from mcompile.sharding.propagate import FallbackWarning

    torch.manual_seed(0)
    model, x = _Sampler().train(), torch.randn(4, 8, 16)
    out = {}
    for mesh in ("tp=1", "tp=2"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)
            c = compile_plan(model, Mesh.parse(mesh), (x,), for_runtime=True)
        ops = [n for n in c.program(0).graph.nodes if n.target is torch.ops.mcompile.random_like.default]
        assert sorted(n.args[2] for n in ops) == ["exponential", "uniform", "uniform"]
        ranks = run_sim(c, (x,), backward=True)
        out[mesh] = ranks[0][0], combine_grads(c, [r[1] for r in ranks])
    assert {k: v for k, v in c.plan.activations.items() if k.startswith(("rand_like", "uniform", "exponential"))} \
        == dict.fromkeys(("rand_like", "uniform_default", "exponential_default"), (Shard(2),))
    (loss1, g1), (loss2, g2) = out["tp=1"], out["tp=2"]
    assert loss2.item() == pytest.approx(loss1.item(), rel=REL, abs=0)
    _check_grads(g2, g1)
    u = (draws((64, 1024), torch.tensor([1, 2, 0]), 7, [torch.arange(64), torch.arange(1024)], [0, 1024], 0, 1)
         .double() + 0.5) / 2**32
    assert 0 < u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01 and abs((-u.log()).mean() - 1) < 0.02
