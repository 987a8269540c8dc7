"""Convolutional linear-attention mixers at tp=2 (mcompile/sharding/mixer_hints.py, passes/canonicalize.py
``unflatten_rowwise``), on a miniature of a gated delta net (Qwen3.5, OLMo-hybrid): a fused q | k | v
projection through a depthwise causal conv, split into heads, a per-head mix, a gated RMSNorm over rows
flattened from (token, head) pairs, the output projection.

What is isolated: the canonicalisation keeps the program's value and drops the flatten; the plan holds the
projection and the conv as the same q | k | v blocks, out_proj row-parallel, one forward all-reduce a layer
(the mixer's exit) and no all-gather; and it computes the model (loss and every gradient, thread simulator).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from sim_harness import assert_sim_parity

from mcompile.ir.placements import BlockShard, Shard

aten = torch.ops.aten


class GatedNorm(torch.nn.Module):
    """Qwen3.5's RMSNormGated over each head: rows of ``head_dim``."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, y, z):
        v = y.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (y * torch.rsqrt(v + 1e-6)) * F.silu(z.float())


class Mixer(torch.nn.Module):
    """``flat_gate``: the gate flattened straight from its projection's features, ``in_proj_z(x).reshape(-1, vd)``
    (OLMo-hybrid's ``g_proj(h).reshape(-1, head_v_dim)``), not from a (b, s, heads, vd) view of them."""

    def __init__(self, dim=16, heads=4, kd=4, vd=8, kernel=4, flat_gate=False):
        super().__init__()
        self.h, self.kd, self.vd, self.flat_gate = heads, kd, vd, flat_gate
        self.in_proj_qkv = torch.nn.Linear(dim, heads * (2 * kd + vd), bias=False)
        self.in_proj_z = torch.nn.Linear(dim, heads * vd, bias=False)
        ch = heads * (2 * kd + vd)
        self.conv1d = torch.nn.Conv1d(ch, ch, kernel, groups=ch, padding=kernel - 1, bias=False)
        self.norm = GatedNorm(vd)
        self.out_proj = torch.nn.Linear(heads * vd, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.conv1d(self.in_proj_qkv(x).transpose(1, 2))[..., :s]
        q, k, v = F.silu(qkv).transpose(1, 2).split([self.h * self.kd, self.h * self.kd, self.h * self.vd], -1)
        q, k = q.reshape(b, s, self.h, self.kd), k.reshape(b, s, self.h, self.kd)
        y = v.reshape(b, s, self.h, self.vd) * torch.sigmoid((q * k).sum(-1, keepdim=True))  # per head
        z = self.in_proj_z(x) if self.flat_gate else self.in_proj_z(x).reshape(b, s, self.h, self.vd)
        y = self.norm(y.reshape(-1, self.vd), z.reshape(-1, self.vd))
        return self.out_proj(y.reshape(b, s, -1))


class Block(torch.nn.Module):
    def __init__(self, dim, flat_gate=False):
        super().__init__()
        self.norm, self.mixer = torch.nn.RMSNorm(dim), Mixer(dim, flat_gate=flat_gate)

    def forward(self, h):
        return h + self.mixer(self.norm(h))


class Net(torch.nn.Module):
    def __init__(self, layers=4, dim=16, vocab=32, flat_gate=False):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(Block(dim, flat_gate) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, labels):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flat_gate", [False, True], ids=["gate_by_heads", "gate_flat_features"])
def test_unflatten_rowwise_keeps_the_value(flat_gate):
    """A gate flattened straight from (b, s, heads * d) to rows of d is unflattened to (b, s, heads, d): the same
    rows (it was left flattened before, and with it the norm: the heads gathered for it, OLMo-hybrid)."""
    from mcompile.passes.canonicalize import unflatten_rowwise

    m, x = Mixer(flat_gate=flat_gate).eval(), torch.randn(2, 5, 16)
    gm = torch.export.export(m, (x,), strict=False).module()
    want = gm(x)
    flat = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.reshape.default
            and n.meta["val"].ndim == 2]
    assert len(flat) == 2  # y and the gate z, rows of head_dim
    assert unflatten_rowwise(gm) == 1
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.reshape.default
                and n.meta["val"].ndim == 2]
    # the same ops on (b, s, h, d) rather than (b*s*h, d): a row's mean may sum in another order (~1 ulp)
    torch.testing.assert_close(gm(x), want, rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flat_gate", [False, True], ids=["gate_by_heads", "gate_flat_features"])
def test_gated_delta_like_mixer_layout_and_parity_tp2(flat_gate):
    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh

    torch.manual_seed(0)
    model = Net(flat_gate=flat_gate)
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = compile_plan(model, Mesh.fake(tp=2), inputs)
    assert c.plan.fallbacks == [] and not caught, [str(w.message) for w in caught]
    qkv = BlockShard(0, (16, 16, 32))  # q | k | v rows: 4 heads x (4, 4, 8)
    for i in range(4):
        for name, want in {"in_proj_qkv": qkv, "conv1d": qkv, "in_proj_z": Shard(0), "out_proj": Shard(1)}.items():
            assert c.plan.params[f"layers.{i}.mixer.{name}.weight"].placements == (want,), (i, name)
    forward = [s for s in c.plan.collectives if s.axis == "tp" and s.forward != "none" and s.layer is not None]
    for i in range(4):
        assert [s.forward for s in forward if s.layer == i] == ["all_reduce"], [(s.forward, s.origin) for s in forward]
    assert c.quality == []
    assert_sim_parity(c, model, inputs, "gated delta mixer")


class ScaledNested(torch.nn.Module):
    """Falcon-H1's in_proj: ``(in_proj(h) * mup_vector)`` cut into [z | xBC | dt], xBC through the depthwise conv
    and cut into [x | B | C] (B and C of ``groups`` groups, each read by its heads through repeat_interleave)."""

    def __init__(self, dim=16, d=32, n=4, heads=4, groups=2):
        super().__init__()
        self.d, self.n, self.heads, self.groups = d, n, heads, groups
        self.in_proj = torch.nn.Linear(dim, 2 * d + 2 * groups * n + heads, bias=False)
        self.mup = torch.nn.Parameter(torch.rand(2 * d + 2 * groups * n + heads))
        ch = d + 2 * groups * n
        self.conv1d = torch.nn.Conv1d(ch, ch, 4, groups=ch, padding=3)

    def forward(self, h):
        b, s, _ = h.shape
        z, xbc, dt = (self.in_proj(h) * self.mup).split([self.d, self.d + 2 * self.groups * self.n, self.heads], -1)
        xbc = self.conv1d(xbc.transpose(1, 2))[..., :s].transpose(1, 2)
        x, B, C = xbc.split([self.d, self.groups * self.n, self.groups * self.n], -1)
        B = B.reshape(b, s, self.groups, self.n).repeat_interleave(self.heads // self.groups, dim=2)
        x = x.reshape(b, s, self.heads, -1) * B.sum(-1, keepdim=True) * dt.unsqueeze(-1)
        return (x.reshape(b, s, -1) * F.silu(z)).sum() + C.sum()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("groups", [2, 1])
def test_nested_scaled_cut_blocks_or_whole(groups):
    """The nested cut is found through the per-channel scale: in_proj as z | x | B | C | dt blocks and the conv as
    x | B | C where tp divides the groups; both whole (and in mixer_hints.few_groups) where it does not."""
    from mcompile.capture.export import capture
    from mcompile.ir.placements import Replicate
    from mcompile.sharding.mixer_hints import few_groups, mixer_hints

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(ScaledNested(groups=groups), (torch.randn(2, 8, 16),))
    hints = {cap.params[k]: v for k, v in mixer_hints(cap, 2).items() if k in cap.params}
    bc = 2 * groups * 4 // 2
    want = (BlockShard(0, (32, 32, bc, bc, 4)), BlockShard(0, (32, bc, bc))) if groups == 2 else (Replicate(),) * 2
    assert (hints["in_proj.weight"], hints["conv1d.weight"]) == want, hints
    assert len(few_groups(cap, 2)) == (groups == 1)


class StreamConvBlock(torch.nn.Module):
    """Inkling's layer: attention-like column -> row projections, then a depthwise short conv over the residual
    stream's own channels with a skip around it (``conv(h) + h``); the next layer's projections read the stream."""

    def __init__(self, dim=16, kernel=3):
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim)
        self.q_proj = torch.nn.Linear(dim, 2 * dim, bias=False)
        self.o_proj = torch.nn.Linear(2 * dim, dim, bias=False)
        self.conv1d = torch.nn.Conv1d(dim, dim, kernel, groups=dim, padding=kernel - 1, bias=False)

    def forward(self, h):
        y = self.o_proj(F.silu(self.q_proj(self.norm(h))))
        s = y.shape[1]
        y = self.conv1d(y.transpose(1, 2))[..., :s].transpose(1, 2) + y
        return h + y



def _plan_tp2(model):
    """``model`` planned at tp=2 on a batch of token ids and labels (vocabulary 32), with no fallback."""
    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh

    g = torch.Generator().manual_seed(1)
    inputs = (torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = compile_plan(model, Mesh.fake(tp=2), inputs)
    assert c.plan.fallbacks == []
    return c, inputs

class StreamConvNet(Net):
    def __init__(self, layers=4, dim=16, vocab=32):
        super().__init__(0, dim, vocab)
        self.layers = torch.nn.ModuleList(StreamConvBlock(dim) for _ in range(layers))


@pytest.mark.timeout(60)
def test_conv_on_the_residual_stream_leaves_next_projections_column_parallel():
    """A depthwise conv over the residual stream with a skip around it (Inkling's short convs): the walk for the
    projections reading the conv's channels stops at the skip, so the next layer's q_proj is column-parallel
    (hinted row-parallel, its replicated input had no strategy: PlanError), and the model trains at parity."""

    torch.manual_seed(0)
    model = StreamConvNet()
    c, inputs = _plan_tp2(model)
    for i in range(4):
        assert c.plan.params[f"layers.{i}.q_proj.weight"].placements == (Shard(0),), i
        assert c.plan.params[f"layers.{i}.o_proj.weight"].placements == (Shard(1),), i
    assert_sim_parity(c, model, inputs, "conv on the residual stream")


class DecayMixer(torch.nn.Module):
    """The gated delta rule's decay path as Hugging Face writes it (Qwen3-Next / LaraMini / OLMo-Hybrid's
    ``torch_chunk_gated_delta_rule``, its export branch): a per-head log decay ``g = -exp(A_log) * softplus(a +
    dt_bias)``, its cumulative sum over the chunk, the pairwise decays masked to -inf above the diagonal and
    exponentiated, and the UT system's inverse built row by row in place (``x[..., i, :i] = row + ...`` of clones)."""

    def __init__(self, dim=16, heads=4, kd=4):
        super().__init__()
        self.h, self.kd = heads, kd
        self.in_proj_k = torch.nn.Linear(dim, heads * kd, bias=False)
        self.in_proj_v = torch.nn.Linear(dim, heads * kd, bias=False)
        self.in_proj_a = torch.nn.Linear(dim, heads, bias=False)
        self.A_log = torch.nn.Parameter(torch.empty(heads).uniform_(1, 16).log())
        self.dt_bias = torch.nn.Parameter(torch.ones(heads))
        self.out_proj = torch.nn.Linear(heads * kd, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        k = F.normalize(self.in_proj_k(x).reshape(b, s, self.h, self.kd), dim=-1).transpose(1, 2)
        v = self.in_proj_v(x).reshape(b, s, self.h, self.kd).transpose(1, 2)
        g = (-self.A_log.exp() * F.softplus(self.in_proj_a(x) + self.dt_bias)).transpose(1, 2)  # (b, h, s)
        cum = g.cumsum(-1)
        upper = torch.ones(s, s, dtype=torch.bool).triu(1)
        decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
        ut = -((k @ k.transpose(-1, -2)) * decay).tril(-1)
        for i in range(1, s):
            row = ut[..., i, :i].clone()
            sub = ut[..., :i, :i].clone()
            ut[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
        ut = ut + torch.eye(s, dtype=ut.dtype)
        y = (ut @ (v * cum.exp().unsqueeze(-1))).transpose(1, 2).reshape(b, s, -1)
        return self.out_proj(y)


class DecayNet(Net):
    def __init__(self, layers=2, dim=16, vocab=32):
        super().__init__(layers, dim, vocab)
        for layer in self.layers:
            layer.mixer = DecayMixer(dim)


@pytest.mark.timeout(120)
def test_gated_delta_decay_gradients_exact_float64_tp2():
    """The decay path of a gated delta layer at tp=2 in float64: A_log's and dt_bias's gradients (sums over
    batch, sequence and the pairwise decays, with cancellation) match eager autograd to float64 rounding: the
    capture (the in-place row writes, the -inf mask, the cumsum) and the tp=2 plan compute the same gradient, and
    the vocab-parallel loss keeps float64 logits in float64 (it cast them to fp32: 4e-9 off in the loss)."""
    from sim_harness import combine_grads, run_sim


    torch.manual_seed(0)
    model = DecayNet().double()
    c, inputs = _plan_tp2(model)
    ref_loss = model(*inputs)
    ref_loss.backward()
    results = run_sim(c, inputs, backward=True)
    full = combine_grads(c, [gr for _, gr, _ in results])
    for loss, _, _ in results:
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=0)
    for fqn, p in model.named_parameters():
        torch.testing.assert_close(full[fqn], p.grad, rtol=1e-10, atol=1e-12 * float(p.grad.abs().max()),
                                   msg=lambda m, fqn=fqn: f"{fqn}: {m}")


@pytest.mark.timeout(60)
def test_float64_token_weighted_loss_stays_float64_tp2():
    """The token-weighted loss rewrite (passes/loss.py, as ``parallelize`` compiles) sums a float64 model's token
    losses in float64: at least fp32, never below the logits' precision (it cast them to fp32)."""
    from sim_harness import run_sim_token_weighted

    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32, bias=False)).double()

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = model

        def forward(self, ids, labels):
            return F.cross_entropy(self.body(ids).flatten(0, 1), labels.flatten())

    net = Loss()
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = compile_plan(net, Mesh.fake(tp=2), inputs, token_weighted_loss=True)
    ref = net(*inputs)
    ref.backward()
    loss, grads = run_sim_token_weighted(c, inputs)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=0)
    for fqn, p in net.named_parameters():
        torch.testing.assert_close(grads[fqn], p.grad, rtol=1e-10, atol=1e-12 * float(p.grad.abs().max()))


class HeadLoopMixer(torch.nn.Module):
    """Zamba's Mamba mixer: in_proj to the channels and their gate, a depthwise conv over the channels, then a
    Python loop over the heads, each picked by its index (``x.reshape(b, heads, d, s).transpose(0, 1)[i]``) for
    its own scan with per-head weights (``x_proj[i] @ x[i]``, a time step from ``dt_proj[i]``), gated, the
    results concatenated for out_proj."""

    def __init__(self, dim=16, heads=2, kernel=4, rank=4):
        super().__init__()
        self.heads, d = heads, 2 * dim // heads
        self.in_proj = torch.nn.Linear(dim, 4 * dim, bias=False)
        self.conv1d = torch.nn.Conv1d(2 * dim, 2 * dim, kernel, groups=2 * dim, padding=kernel - 1)
        self.x_proj = torch.nn.Parameter(torch.randn(heads, rank, d) / d ** 0.5)
        self.dt_proj = torch.nn.Parameter(torch.randn(heads, d, rank) / rank ** 0.5)
        self.D = torch.nn.Parameter(torch.rand(heads, d) + 0.5)
        self.out_proj = torch.nn.Linear(2 * dim, dim, bias=False)

    def forward(self, h):
        b, s, _ = h.shape
        u, z = self.in_proj(h).transpose(1, 2).chunk(2, 1)
        u = F.silu(self.conv1d(u)[..., :s])
        u = u.reshape(b, self.heads, -1, s).transpose(0, 1)  # (heads, b, d, s)
        z = z.reshape(b, self.heads, -1, s).transpose(0, 1)
        outs = []
        for i in range(self.heads):
            dt = F.softplus(self.dt_proj[i] @ (self.x_proj[i] @ u[i]))  # (b, d, s)
            outs.append((torch.cumsum(u[i] * dt, -1) * 0.1 + u[i] * self.D[i, :, None]) * F.silu(z[i]))
        return self.out_proj(torch.cat(outs, 1).transpose(1, 2))


class HeadLoopNet(Net):
    def __init__(self, layers=2, dim=16, vocab=32):
        super().__init__(0, dim, vocab)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.RMSNorm(dim), HeadLoopMixer(dim))
                                          for _ in range(layers))

    def forward(self, ids, labels):
        h = self.emb(ids)
        for layer in self.layers:
            h = h + layer(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


@pytest.mark.timeout(60)
def test_loop_over_heads_is_one_op_over_the_heads_megatron_layout_tp2():
    """The heads indexed one by one in a Python loop and concatenated (Zamba's Mamba mixer): captured unrolled,
    one copy of the body per head, each picking its head, which no tp placement of the heads survives (the plan
    gathered them: out_proj read the channels whole). passes/tp/loops.py makes the copies one computation over the
    heads dim: in_proj column-parallel (the channels and their gate as two blocks), the conv and the per-head
    weights by heads, out_proj row-parallel, one forward all-reduce a layer and nothing gathered; and the model
    trains at parity (loss and every gradient)."""
    torch.manual_seed(0)
    model = HeadLoopNet()
    c, inputs = _plan_tp2(model)
    assert c.canonical.get("vectorize_index_loops") == 2, c.canonical
    for i in range(2):
        for name, want in {"in_proj.weight": BlockShard(0, 2), "conv1d.weight": Shard(0), "x_proj": Shard(0),
                           "dt_proj": Shard(0), "D": Shard(0), "out_proj.weight": Shard(1)}.items():
            assert c.plan.params[f"layers.{i}.1.{name}"].placements == (want,), (i, name)
    forward = [s for s in c.plan.collectives if s.axis == "tp" and s.forward != "none" and s.layer is not None]
    assert [s.forward for s in forward] == ["all_reduce"] * 2, [(s.forward, s.origin) for s in forward]
    assert c.quality == []
    assert_sim_parity(c, model, inputs, "per-head loop mixer")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["heads", "stack_last", "scan_in_each", "recurrence", "index_read_outside",
                                  "first_entries_of_a_dynamic_dim"])
def test_vectorize_index_loops_keeps_the_value_or_leaves_the_loop(case):
    """The rewrite keeps the program's value (at the captured sizes and at others: batch and sequence dynamic), and
    leaves as they are a recurrence (copy i reads copy i-1: not copies of one body), a loop whose per-entry value is
    read outside it, and a loop over the first entries of a dynamic dim whose captured size happens to be the loop's
    length (``x.select(1, i)`` for i < 3 at a sequence of 3: a symbolic size is never taken for the loop's)."""
    from mcompile.passes.tp.loops import vectorize_index_loops

    class Loop(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 8) * 0.3)

        def forward(self, x):  # x: (b, s, 3, 8)
            xs = x.permute(2, 0, 1, 3)
            if case == "heads":
                outs = [torch.softmax(xs[i] * self.w[i], -1) @ self.w[i].unsqueeze(-1) for i in range(3)]
                return torch.cat(outs, -1)
            if case == "stack_last":
                # each copy makes its own zeros (from outside the loop: alike copies of one value)
                return torch.stack([(xs[i].cumsum(1) + x.new_zeros(x.shape[0], x.shape[1], 8)).sum(-1)
                                    for i in range(3)], -1)
            if case == "scan_in_each":  # a recurrence over another dim inside each copy (Mamba's scan per head)
                outs = []
                for i in range(3):
                    state, steps = torch.zeros_like(xs[i][..., 0]), []
                    for t in range(4):
                        state = state * self.w[i, t] + xs[i][..., t]
                        steps.append(state)
                    outs.append(torch.stack(steps, -1))
                return torch.cat(outs, -1)
            if case == "recurrence":
                state, outs = torch.zeros_like(xs[0]), []
                for i in range(3):
                    state = state * 0.5 + xs[i] * self.w[i]
                    outs.append(state)
                return torch.cat(outs, -1)
            if case == "first_entries_of_a_dynamic_dim":
                return torch.cat([x.select(1, i).tanh() for i in range(3)], -1)
            picked = [xs[i].tanh() for i in range(3)]
            return torch.cat(picked, -1) + picked[0].sum()

    dims = ({0: torch.export.Dim("b"), 1: torch.export.Dim("s", min=3)},)
    example = torch.randn(2, 3 if case == "first_entries_of_a_dynamic_dim" else 5, 3, 8)
    gm = torch.export.export(Loop(), (example,), strict=False, dynamic_shapes=dims).module()
    xs = [torch.randn(2, 5, 3, 8), torch.randn(3, 7, 3, 8)]
    want = [gm(x) for x in xs]
    done = vectorize_index_loops(gm)
    assert done == (1 if case in ("heads", "stack_last", "scan_in_each") else 0)
    moved = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.permute.default)
    picks = [u for u in moved.users if u.target is aten.select.int and u.args[1] == 0]  # x[i] of the loop
    assert (not picks) if done else len(picks) >= 3 or case == "first_entries_of_a_dynamic_dim"
    for x, w in zip(xs, want):
        torch.testing.assert_close(gm(x), w, rtol=1e-6, atol=1e-7)


class LowRankGateMixer(torch.nn.Module):
    """Kimi-Linear's gates: low-rank pairs read per head, ``g_b(g_a(h)).view(b, s, heads, d)`` and
    ``(f_b(f_a(h)).float() + bias).view(b, s, heads, d)``, gating a per-head value before out_proj."""

    def __init__(self, dim=16, heads=4, d=4):
        super().__init__()
        self.heads, self.d = heads, d
        self.v_proj = torch.nn.Linear(dim, heads * d, bias=False)
        self.g_a, self.g_b = torch.nn.Linear(dim, d, bias=False), torch.nn.Linear(d, heads * d, bias=False)
        self.f_a, self.f_b = torch.nn.Linear(dim, d, bias=False), torch.nn.Linear(d, heads * d, bias=False)
        self.bias = torch.nn.Parameter(torch.rand(heads * d))
        self.out_proj = torch.nn.Linear(heads * d, dim, bias=False)

    def forward(self, h):
        b, s, _ = h.shape
        v = self.v_proj(h).view(b, s, self.heads, self.d)
        f = (self.f_b(self.f_a(h)).float() + self.bias).view(b, s, self.heads, self.d)
        g = self.g_b(self.g_a(h)).view(b, s, self.heads, self.d)
        y = torch.cumsum(v * F.logsigmoid(f).exp(), 1) * torch.sigmoid(g)
        return self.out_proj(y.reshape(b, s, -1))


class LowRankGateNet(Net):
    def __init__(self, layers=2, dim=16, vocab=32):
        super().__init__(0, dim, vocab)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.RMSNorm(dim), LowRankGateMixer(dim))
                                          for _ in range(layers))

    def forward(self, ids, labels):
        h = self.emb(ids)
        for layer in self.layers:
            h = h + layer(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


@pytest.mark.timeout(60)
def test_low_rank_gate_pairs_keep_the_factor_whole_and_the_heads_split():
    """A low-rank factor read straight by an up-projection viewed into heads (Kimi-Linear's forget and output
    gates) stays whole (planner.latent_hints), the up-projection column-parallel by heads: one all-reduce a
    layer, the mixer's exit (before: the pairs row-parallel, each gate all-reduced and the heads gathered for
    it, 3 forward collectives a layer), at parity."""
    from mcompile.ir.placements import Replicate

    torch.manual_seed(0)
    model = LowRankGateNet()
    c, inputs = _plan_tp2(model)
    for i in range(2):
        pl = {k.split(f"layers.{i}.1.", 1)[1]: v.placements[0] for k, v in c.plan.params.items()
              if f"layers.{i}.1." in k}
        assert pl["g_a.weight"] == Replicate() and pl["f_a.weight"] == Replicate(), pl
        assert pl["g_b.weight"] == Shard(0) and pl["f_b.weight"] == Shard(0) and pl["out_proj.weight"] == Shard(1), pl
    forward = [s for s in c.plan.collectives if s.axis == "tp" and s.forward != "none" and s.layer is not None]
    for i in range(2):
        assert [s.forward for s in forward if s.layer == i] == ["all_reduce"], [(s.forward, s.origin) for s in forward]
    assert c.quality == []
    assert_sim_parity(c, model, inputs, "low-rank gates")



class ChunkWrites(torch.nn.Module):
    """HF's chunked gated delta rule's output (``core_attn_out = zeros_like(...)``, then ``core_attn_out[:, :, i] =
    ...`` per chunk): writes into selects of a fresh tensor, one per index of the chunk dim (one chunk or more)."""

    def __init__(self, chunks):
        super().__init__()
        self.chunks = chunks
        self.w = torch.nn.Parameter(torch.randn(4))

    def forward(self, x):  # (b, heads, chunks, chunk, d)
        out = torch.zeros_like(x)
        for i in range(self.chunks):
            out[:, :, i] = x[:, :, i] * self.w
        return out.reshape(x.shape[0], x.shape[1], -1, x.shape[-1]).sum(2)


@pytest.mark.parametrize("chunks", [1, 3])
def test_select_writes_into_a_fresh_tensor_become_a_cat(chunks):
    """passes/canonicalize: the writes become a cat of the chunks (unsqueezed), no write left, same value, also when
    the capture reaches the select through no-op slices. Left a write, LaraMini's planned program (at tp=1 and 2)
    took the destination by heads and the source whole; the lowering's slice of the destination was a copy the
    write went into, so the mixer's output was zeros (dt_bias / A_log gradients off by 1.0 relative)."""
    from mcompile.passes.canonicalize import canonicalize

    m, x = ChunkWrites(chunks), torch.randn(2, 4, chunks, 3, 4)
    gm = torch.export.export(m, (x,), strict=False).module()
    want = gm(x)
    done = canonicalize(gm)
    assert done["tiled_writes_to_cat"] == 1
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.copy_.default]
    torch.testing.assert_close(gm(x), want, rtol=0, atol=0)
