"""mcompile.ir.annotate: symbolic FLOPs / bytes of captured graphs.

The models are captured with dynamic batch and sequence (``torch.export.Dim``), so every count is
a sympy expression in the two captured symbols; the tests compare those expressions with the
textbook transformer formula *symbolically* and, independently, with torch's ``FlopCounterMode``
run on real tensors at several concrete (batch, seq).
"""

from __future__ import annotations

import math

import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.export import Dim, export
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mcompile.ir import meta
from mcompile.ir.annotate import (
    BACKWARD_MULTIPLIER,
    AnnotationSummary,
    annotate,
    layer_index,
    node_cost,
    register_flop_formula,
    training_flops,
)

aten = torch.ops.aten
B, S = sympy.symbols("B S", positive=True, integer=True)  # common names across captures
SIZES = [(2, 2), (2, 7), (3, 16), (5, 33)]  # concrete (batch, seq) to substitute
VOCAB, HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, MAX_SEQ = 96, 32, 4, 2, 64, 3, 64


# --------------------------------------------------------------------------- models


class GPTBlock(nn.Module):
    def __init__(self, h: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln_1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln_2 = nn.LayerNorm(h)
        self.fc = nn.Linear(h, 4 * h)
        self.fc_out = nn.Linear(4 * h, h)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.n_heads, h // self.n_heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, s, h)))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh")))


class TinyGPT(nn.Module):
    """GPT-2 shaped: learned positions, pre-LN blocks in ``h``, untied lm_head."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.wpe = nn.Embedding(MAX_SEQ, HIDDEN)
        self.h = nn.ModuleList(GPTBlock(HIDDEN, HEADS) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids, labels):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for blk in self.h:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class RMSNorm(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class LlamaBlock(nn.Module):
    def __init__(self, h: int, n_heads: int, n_kv: int, ffn: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.d = n_heads, n_kv, h // n_heads
        self.input_layernorm = RMSNorm(h)
        self.q_proj = nn.Linear(h, n_heads * self.d, bias=False)
        self.k_proj = nn.Linear(h, n_kv * self.d, bias=False)
        self.v_proj = nn.Linear(h, n_kv * self.d, bias=False)
        self.o_proj = nn.Linear(n_heads * self.d, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h)
        self.gate_proj = nn.Linear(h, ffn, bias=False)
        self.up_proj = nn.Linear(h, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, h, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        y = self.input_layernorm(x)
        q = self.q_proj(y).view(b, s, self.n_heads, self.d).transpose(1, 2)
        k = self.k_proj(y).view(b, s, self.n_kv, self.d).transpose(1, 2)
        v = self.v_proj(y).view(b, s, self.n_kv, self.d).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # GQA in the kernel
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, s, h))
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class TinyLlama(nn.Module):
    """Llama shaped: RMSNorm, GQA (n_kv < n_heads), SwiGLU, blocks in ``layers``, no biases."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(LlamaBlock(HIDDEN, HEADS, KV_HEADS, FFN) for _ in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids, labels):
        x = self.embed_tokens(ids)
        for blk in self.layers:
            x = blk(x)
        return F.cross_entropy(self.lm_head(self.norm(x)).flatten(0, 1), labels.flatten())


class HFLoss(nn.Module):
    """forward(ids, labels) -> .loss of a Hugging Face causal LM."""

    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, ids, labels):
        return self.m(input_ids=ids, labels=labels, use_cache=False).loss


def hf_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_SEQ,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    return HFLoss(LlamaForCausalLM(cfg))


def hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        n_positions=MAX_SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=1,
    )
    return HFLoss(GPT2LMHeadModel(cfg))


def matmul_params(model: nn.Module) -> int:
    """N_matmul: weights that multiply activations — every nn.Linear (the lm_head included, even
    when tied to the embedding) and HF's Conv1D; not embedding tables (lookups), norms or biases."""
    n = 0
    for m in model.modules():
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D":
            n += m.weight.numel()
    return n


def capture(model: nn.Module):
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 8))
    b, s = Dim("batch", min=2), Dim("seq", min=2, max=MAX_SEQ)
    ep = export(model, (ids, ids.clone()), dynamic_shapes=({0: b, 1: s}, {0: b, 1: s}), strict=False)
    return ep.graph_module


def bs_symbols(gm) -> tuple[sympy.Expr, sympy.Expr]:
    """The (batch, seq) sympy symbols of a capture: the sizes of its first user input (ids)."""
    ids = next(n for n in gm.graph.find_nodes(op="placeholder") if n.meta["val"].dtype == torch.int64)
    b, s = (x.node.expr for x in ids.meta["val"].shape)
    assert isinstance(b, sympy.Symbol) and isinstance(s, sympy.Symbol)
    return b, s


def canon(gm, expr) -> sympy.Expr:
    """expr with the capture's own symbols renamed to the common B, S."""
    b, s = bs_symbols(gm)
    return sympy.expand(sympy.sympify(expr).xreplace({b: B, s: S}))


class Captured:
    def __init__(self, name: str, model: nn.Module) -> None:
        self.name, self.model = name, model
        self.gm = capture(model)
        self.summary = annotate(self.gm)


MODELS = {"gpt": TinyGPT, "llama": TinyLlama, "hf_llama": hf_llama, "hf_gpt2": hf_gpt2}


@pytest.fixture(scope="module", params=list(MODELS))
def captured(request) -> Captured:
    return Captured(request.param, MODELS[request.param]())


def forward_matmul_flops_measured(model: nn.Module, b: int, s: int) -> int:
    """Independent oracle: torch's FlopCounterMode on real tensors (math SDPA, so attention runs as
    plain matmuls and is counted by their formulas), forward only."""
    ids = torch.randint(0, VOCAB, (b, s))
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        model(ids, ids)
    return fc.get_total_flops()


# --------------------------------------------------------------------------- (a) the transformer formula


def test_matmul_flops_equal_transformer_formula(captured: Captured):
    """Forward matmul FLOPs of the whole model (lm_head included) are exactly

        2 · N_matmul · b·s   +   L · 2·2·b·s²·h

    (weight matmuls: 2 flops per MAC, one MAC per weight per token; attention: QKᵀ and PV, each
    2·b·s²·h with h = n_heads·head_dim = hidden). Causal masking is *not* halved (torch's SDPA
    convention) and biases are not counted (torch's addmm convention), so the identity is exact,
    not approximate — as a polynomial in the captured symbols, and at concrete sizes against
    FlopCounterMode."""
    sm = captured.summary
    n = matmul_params(captured.model)
    expected = 2 * n * B * S + LAYERS * 2 * 2 * B * S**2 * HIDDEN
    got = canon(captured.gm, sm.matmul_flops)
    assert sympy.expand(got - expected) == 0, (captured.name, got, expected)
    assert got.free_symbols == {B, S}
    # Everything else (norms, elementwise, loss) is extra, positive and only linear in b·s.
    rest = sympy.Poly(canon(captured.gm, sm.forward_flops - sm.matmul_flops), B, S)
    assert rest.degree(S) <= 1 and rest.degree(B) <= 1
    for b, s in SIZES:
        at = {B: b, S: s}
        assert int(got.subs(at)) == int(expected.subs(at))
        assert int(got.subs(at)) == forward_matmul_flops_measured(captured.model, b, s), (captured.name, b, s)
        assert int(canon(captured.gm, sm.forward_flops).subs(at)) > int(got.subs(at))


def test_summary_evaluate_and_training_flops(captured: Captured):
    sm = captured.summary
    bsym, ssym = bs_symbols(captured.gm)
    assert sm.symbols == {bsym, ssym}
    v = sm.evaluate(sm.matmul_flops, {bsym.name: 3, ssym: 16})
    assert v == int(canon(captured.gm, sm.matmul_flops).subs({B: 3, S: 16}))
    # Convention: backward = 2× forward for the matmul class, 1× for the rest (which here all has
    # multiplier 1 or carries 0 flops), so training = 2·forward + matmul.
    assert {c for c, f in sm.flops_by_category.items() if f != 0} <= {
        c for c, m in BACKWARD_MULTIPLIER.items() if m > 0
    }
    tr = training_flops(sm)
    assert sympy.expand(tr - (2 * sm.forward_flops + sm.matmul_flops)) == 0
    assert sympy.expand(tr - sm.training_flops) == 0
    assert sympy.expand(sm.forward_flops - sympy.Add(*sm.flops_by_category.values())) == 0


# --------------------------------------------------------------------------- (b) layers


def test_per_layer_flops_equal(captured: Captured):
    sm = captured.summary
    assert set(sm.flops_per_layer) == {None, *range(LAYERS)}
    per = [sympy.expand(sm.flops_per_layer[i]) for i in range(LAYERS)]
    assert all(sympy.expand(p - per[0]) == 0 for p in per), per
    assert all(sympy.expand(sm.bytes_per_layer[i] - sm.bytes_per_layer[0]) == 0 for i in range(LAYERS))
    assert sympy.expand(sum(sm.flops_per_layer.values()) - sm.forward_flops) == 0
    # One layer's matmuls: its share of the formula (lm_head is outside the layers).
    for i in range(LAYERS):
        paths = sm.layer_paths[i]
        assert len(paths) == 1 and paths[0].endswith(f".{i}")
    lm = [n for n in captured.gm.graph.nodes if n.op == "call_function" and n.target == aten.linear.default]
    assert layer_index(lm[-1]) is None  # the lm_head
    assert not sm.no_flop_formula, sm.no_flop_formula  # every op of these models has a formula


class _ScaledEmbedding(nn.Embedding):  # a family's own embedding class (module level, as a model's classes are)
    def forward(self, x):
        return super().forward(x) * 2.0


def test_numbered_embedding_table_is_not_a_layer():
    """A list of embedding tables (MusicGen's per-codebook ``embed_tokens.0``, a subclass of nn.Embedding) ends in
    a number like a layer list but is an input: its lookup (and the vocab-parallel all-reduce after it) belongs to
    no layer. Before, it was layer 0, whose forward tp collectives then exceeded Megatron's count."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.ModuleList([_ScaledEmbedding(8, 4)])
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 4)) for _ in range(2)])

        def forward(self, x):
            h = self.embed[0](x)
            for layer in self.layers:
                h = layer(h)
            return h.sum()

    gm = export(M(), (torch.zeros(2, 3, dtype=torch.long),)).graph_module
    by_target = {n.target: n for n in gm.graph.nodes if n.op == "call_function"}
    assert layer_index(by_target[aten.embedding.default]) is None
    assert layer_index(by_target[aten.mul.Tensor]) is None  # the subclass's own forward too
    assert [layer_index(n) for n in gm.graph.nodes if n.target is aten.linear.default] == [0, 1]


# --------------------------------------------------------------------------- (c) bytes


def _placeholder(gm, name: str):
    return next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == name)


def _call_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def test_bytes_positive_and_linear_out_bytes(captured: Captured):
    gm, sm = captured.gm, captured.summary
    for b, s in SIZES:
        at = {B: b, S: s}
        assert int(canon(gm, sm.total_bytes).subs(at)) > 0
        for n in _call_nodes(gm):
            for key in (meta.FLOPS, meta.BYTES_READ, meta.BYTES_WRITTEN, meta.OUT_BYTES):
                assert isinstance(n.meta[key], sympy.Expr), (n, key)
                assert int(canon(gm, n.meta[key]).subs(at)) >= 0, (n, key)
    dense = [n for n in _call_nodes(gm) if n.target in (aten.linear.default, aten.addmm.default)]
    assert len(dense) >= 4 * LAYERS
    for n in dense:
        if n.target == aten.linear.default:
            out_features = n.args[1].meta["val"].shape[0]
        else:  # HF Conv1D: addmm(bias, x, W[in, out])
            out_features = n.args[2].meta["val"].shape[1]
        assert canon(gm, n.meta[meta.OUT_BYTES]) == B * S * out_features * 4, n
        assert canon(gm, n.meta[meta.BYTES_WRITTEN]) == B * S * out_features * 4, n
        assert int(canon(gm, n.meta[meta.BYTES_READ]).subs({B: 2, S: 2})) > 0
    # Views and bookkeeping move no data.
    zero_ops = {
        aten.view.default,
        aten.transpose.int,
        aten.unsqueeze.default,
        aten.expand.default,
        aten.sym_size.int,
        aten._assert_tensor_metadata.default,
    }
    for n in _call_nodes(gm):
        if n.target in zero_ops or n.target.__name__ == "getitem":
            assert n.meta[meta.BYTES_READ] == n.meta[meta.BYTES_WRITTEN] == n.meta[meta.OUT_BYTES] == 0, n
    # Placeholders carry their size as OUT_BYTES (parameters: static).
    for p in gm.graph.find_nodes(op="placeholder"):
        v = p.meta["val"]
        assert canon(gm, p.meta[meta.OUT_BYTES]) == canon(gm, math.prod(v.shape) * v.dtype.itemsize)


def test_gather_reads_rows_not_table():
    c = Captured("llama", TinyLlama())
    emb = next(n for n in _call_nodes(c.gm) if n.target == aten.embedding.default)
    # rows gathered (b·s·h·4) + the int64 indices (b·s·8): not the VOCAB·h table.
    assert canon(c.gm, emb.meta[meta.BYTES_READ]) == B * S * HIDDEN * 4 + B * S * 8


# --------------------------------------------------------------------------- (d) dtype


def test_bf16_halves_bytes():
    torch.manual_seed(0)
    m32 = TinyGPT()
    m16 = TinyGPT()
    m16.load_state_dict(m32.state_dict())
    a, b = Captured("gpt32", m32), Captured("gpt16", m16.to(torch.bfloat16))
    na, nb = _call_nodes(a.gm), _call_nodes(b.gm)
    assert [n.target for n in na] == [n.target for n in nb]
    halved = 0
    for x, y in zip(na, nb):
        assert canon(a.gm, x.meta[meta.FLOPS]) == canon(b.gm, y.meta[meta.FLOPS]), x
        tensors = [
            v for n in (x, *x.all_input_nodes) for v in [n.meta.get("val")] if isinstance(v, torch.Tensor)
        ]
        if tensors and all(t.dtype == torch.float32 for t in tensors):
            for key in (meta.BYTES_READ, meta.BYTES_WRITTEN, meta.OUT_BYTES):
                assert canon(b.gm, y.meta[key]) * 2 == canon(a.gm, x.meta[key]), (x, key)
            halved += 1
    assert halved > 10 * LAYERS
    # Totals: only the int64 ids/labels (and their gathers' indices) do not halve.
    t32, t16 = canon(a.gm, a.summary.total_bytes), canon(b.gm, b.summary.total_bytes)
    assert all(int(t16.subs({B: bb, S: ss})) < int(t32.subs({B: bb, S: ss})) for bb, ss in SIZES)
    linear = next(n for n in nb if n.target == aten.linear.default)
    assert canon(b.gm, linear.meta[meta.OUT_BYTES]) == B * S * 3 * HIDDEN * 2


# --------------------------------------------------------------------------- (e) unknown ops


@torch.library.custom_op("mcompile_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@mystery.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("mcompile_test::known", mutates_args=())
def known(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@known.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("mcompile_test::broken", mutates_args=())
def broken(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@broken.register_fake
def _(x):
    return torch.empty_like(x)


@register_flop_formula(torch.ops.mcompile_test.known, category="elementwise")
def _known_flops(args, kwargs, out):
    return 7 * args[0].numel()  # a SymInt product: converted to sympy by annotate


@register_flop_formula(torch.ops.mcompile_test.broken.default)
def _broken_flops(args, kwargs, out):
    raise ValueError("no idea")


class WithCustom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)

    def forward(self, x):
        y = mystery(self.lin(x))
        return broken(known(y)).sum()


def test_unknown_op_listed_not_crashing():
    x = torch.randn(2, 5, 8)
    ep = export(WithCustom(), (x,), dynamic_shapes=({0: Dim("b", min=2), 1: Dim("s", min=2)},), strict=False)
    gm = ep.graph_module
    sm = annotate(gm)
    assert "mcompile_test.mystery.default" in sm.no_flop_formula
    assert "mcompile_test.broken.default" in sm.no_flop_formula
    assert "ValueError" in sm.formula_errors["mcompile_test.broken.default"]
    assert "mcompile_test.known.default" not in sm.no_flop_formula
    b, s = (d.node.expr for d in _placeholder(gm, "x").meta["val"].shape[:2])
    node = {str(n.target): n for n in _call_nodes(gm)}
    myst = node["mcompile_test.mystery.default"]
    assert myst.meta[meta.FLOPS] == 0
    assert sympy.expand(myst.meta[meta.BYTES_READ] - b * s * 16 * 4) == 0  # bytes still counted
    assert sympy.expand(myst.meta[meta.OUT_BYTES] - b * s * 16 * 4) == 0
    assert sympy.expand(node["mcompile_test.known.default"].meta[meta.FLOPS] - 7 * b * s * 16) == 0
    assert sympy.expand(sm.matmul_flops - 2 * b * s * 8 * 16) == 0
    assert node_cost(myst).has_formula is False


# --------------------------------------------------------------------------- hypothesis: formulas


class Matmuls(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d_out, d_in))
        self.bias = nn.Parameter(torch.randn(d_out))

    def forward(self, x):
        y = F.linear(x, self.w, self.bias)  # aten.linear: our formula
        y2 = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.w.t())  # torch's registry
        y3 = torch.matmul(x, self.w.t())  # aten.matmul: our formula
        sc = torch.bmm(x, x.transpose(1, 2))  # torch's registry
        a = F.scaled_dot_product_attention(x.unsqueeze(1), x.unsqueeze(1), x.unsqueeze(1), is_causal=True)
        return y.sum() + y2.sum() + y3.sum() + sc.sum() + a.sum()


@settings(max_examples=8, deadline=None)
@given(
    b=st.integers(2, 6),
    s=st.integers(2, 12),
    d_in=st.integers(1, 40),
    d_out=st.integers(1, 40),
)
def test_matmul_formulas(b, s, d_in, d_out):
    m = Matmuls(d_in, d_out)
    x = torch.randn(b, s, d_in)
    ep = export(m, (x,), dynamic_shapes=({0: Dim("b", min=2), 1: Dim("s", min=2)},), strict=False)
    gm = ep.graph_module
    sm = annotate(gm)
    bs, ss = (d.node.expr for d in _placeholder(gm, "x").meta["val"].shape[:2])
    by_op = {}
    for n in _call_nodes(gm):
        by_op.setdefault(n.target, []).append(n.meta[meta.FLOPS])
    mm = 2 * bs * ss * d_in * d_out
    assert by_op[aten.linear.default] == [sympy.expand(mm)]
    assert by_op[aten.addmm.default] == [sympy.expand(mm)]
    assert by_op[aten.matmul.default] == [sympy.expand(mm)]
    assert by_op[aten.bmm.default] == [sympy.expand(2 * bs * ss * ss * d_in)]
    # SDPA (1 head): QKᵀ + PV = 4·b·s²·d, not halved for is_causal.
    assert by_op[aten.scaled_dot_product_attention.default] == [sympy.expand(4 * bs * ss**2 * d_in)]
    # The symbolic total at the capture's own size equals torch's FlopCounterMode on real tensors.
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        m(x)
    assert sm.evaluate(sm.matmul_flops, {bs: b, ss: s}) == fc.get_total_flops()
    assert isinstance(sm, AnnotationSummary)


@pytest.mark.parametrize("name", ["llama3-tiny", "gpt2-tiny"])
def test_training_matmul_flops_of_presets_are_6_n_tokens_plus_attention(name):
    """The standard formula: training matmul FLOPs = 6·N·tokens + 3·(4·b·s²·h per layer), N the
    parameters taking part in matmuls (all linears incl. the LM head; not embeddings' lookups, norms,
    biases); attention's QKᵀ and PV not halved for causality (torch's convention)."""
    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh
    from mcompile.models import get_preset

    pre = get_preset(name)
    model = pre.build()
    c = compile_plan(model, Mesh(tp=1), pre.example_inputs(batch=2, seq=16))
    sm = c.annotation
    cfg = pre.config
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    n_matmul = sum(m.weight.numel() for m in linears)
    b, s = (c.captured.symbols[k] for k in ("batch", "seq"))
    hidden = getattr(cfg, "n_embd", None) or cfg.dim
    layers = getattr(cfg, "n_layer", None) or cfg.n_layers
    attention = layers * 4 * b * s**2 * hidden
    assert sympy.expand(3 * sm.matmul_flops - (6 * n_matmul * b * s + 3 * attention)) == 0
