"""Capture (dynamic dims, keyword inputs, meta models, tied weights) and the errors users see."""

from __future__ import annotations

import pytest
import torch

from mcompile import Mesh
from mcompile.api import compile_plan, plan
from mcompile.capture.export import CaptureError, capture
from mcompile.ir.placements import Shard
from mcompile.ir.plan import Plan
from mcompile.models import get_preset
from mcompile.runtime.sim import ThreadedWorld, run_threads
from mcompile.sharding.propagate import PlanError

from conftest import build


def test_batch_and_sequence_are_symbols_shared_by_all_inputs():
    model, inputs = build("llama3-tiny")
    cap = capture(model, inputs)
    assert set(cap.symbols) == {"batch", "seq"}
    ids, tgt = (cap.placeholder(n).meta["val"] for n in cap.user_inputs)
    assert ids.shape[0].node.expr == tgt.shape[0].node.expr == cap.symbols["batch"]
    # the captured program runs at other sizes
    gm = cap.ep.module()
    for b, s in [(3, 7), (5, 33)]:
        x = torch.randint(0, 256, (b, s))
        assert torch.allclose(gm(x, x), model(x, x))


def test_size_one_template_is_widened():
    """export bakes a size-1 dim to the literal 1 (DESIGN §11): a batch-1 template still gives a symbol."""
    model, (ids, tgt) = build("gpt2-tiny")
    cap = capture(model, (ids[:1], tgt[:1]))
    assert "batch" in cap.symbols


def test_keyword_inputs():
    model, (ids, tgt) = build("hf-llama")
    hf = model.m

    class WithMask(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = hf

        def forward(self, input_ids, labels, attention_mask=None):
            return self.m(input_ids=input_ids, labels=labels, attention_mask=attention_mask).loss

    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding on one row
    wrapped = WithMask()
    c = compile_plan(wrapped, Mesh(tp=2), (ids, tgt), {"attention_mask": mask})
    assert c.captured.input_names == ["input_ids", "labels", "attention_mask"]
    assert c.plan.fallbacks == []
    # a padding mask reads attention_mask's values: not the causal pattern, kept as a tensor (passes/attention)
    assert c.canonical["causal_masks"] == 0
    sdpa = [n for n in c.program(0).graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert sdpa and all(len(n.args) > 3 or n.kwargs.get("attn_mask") is not None for n in sdpa)
    ref = wrapped(ids, tgt, attention_mask=mask)
    state = c.captured.state_values()
    out = run_threads(ThreadedWorld(c.mesh),
                      lambda r: c.run_local(r, c.local_state(r, state), (ids, tgt), {"attention_mask": mask})[0])
    for loss in out:
        assert torch.allclose(loss, ref, rtol=1e-6, atol=0)


def test_tied_weights_are_one_parameter():
    model, inputs = build("gpt2-tiny")
    cap = capture(model, inputs)
    fqns = set(cap.params.values())
    assert "transformer.wte.weight" in fqns and "lm_head.weight" not in fqns
    assert cap.tied["transformer.wte.weight"] == ("transformer.wte.weight", "lm_head.weight")


def test_meta_device_model_plans_without_memory():
    pre = get_preset("llama3-8b")
    model = pre.build(device="meta")
    p = plan(model, Mesh.fake(dp=8, tp=8), pre.example_inputs(device="meta"))
    wq = p.params["layers.0.attention.wq.weight"]
    assert wq.local_shape == (512, 4096)
    assert str(wq.placements) == "(Replicate(), Shard(dim=0))"


def test_vocab_that_does_not_divide_is_padded():
    model, inputs = build("gpt2-tiny")  # vocab 257
    p = plan(model, Mesh(tp=4), inputs)  # by default to a multiple of tp * 128 (tests/test_alignment.py)
    wte = p.params["transformer.wte.weight"]
    assert wte.padded_shape == (512, 64) and wte.local_shape == (128, 64)
    wte = plan(model, Mesh(tp=4), inputs, vocab_pad_multiple=1).params["transformer.wte.weight"]
    assert wte.padded_shape == (260, 64) and wte.local_shape == (65, 64)  # a multiple of tp only


@pytest.mark.parametrize("name", ["llama3-tiny", "gpt2-tiny"])
def test_plan_json_round_trip_and_diff(name):
    model, inputs = build(name)
    a = plan(model, Mesh(dp=2, tp=2), inputs)
    b = Plan.from_json(a.to_json())
    assert b.to_json() == a.to_json()
    assert a.diff(b) == []
    c = plan(model, Mesh(dp=2, tp=2), inputs, sequence_parallel=True)
    d = a.diff(c)
    assert any(line.startswith("options:") for line in d) and any("collectives" in line for line in d)


def test_user_override_of_a_placement():
    """Pin the LM head replicated: the plan follows, the logits are then vocab-whole."""
    model, inputs = build("llama3-tiny")
    c = compile_plan(model, Mesh(tp=2), inputs, overrides={"output.weight": "tp=R"})
    assert str(c.plan.params["output.weight"].placements) == "(Replicate(),)"
    assert all("vocab-parallel loss" not in s.purpose for s in c.plan.collectives)
    with pytest.raises(PlanError, match="unknown mesh axis 'xp'"):
        compile_plan(model, Mesh(tp=2), inputs, overrides={"output.weight": "xp=R"})


class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, y):
        h = self.lin(x)
        if h.sum() > 0:  # the line the error must name
            h = h * 2
        return (h - y).pow(2).mean()


def test_untraceable_model_names_op_and_line():
    x = torch.randn(2, 4, 8)
    with pytest.raises(CaptureError) as e:
        capture(DataDependent(), (x, x.clone()))
    msg = str(e.value)
    assert "_local_scalar_dense" in msg
    assert f"{__file__}:" in msg and "if h.sum() > 0" in msg


def _llama(n_heads, n_kv, dim=64, ffn=128):
    from mcompile.models import Llama, LlamaConfig

    torch.manual_seed(0)
    m = Llama(LlamaConfig(vocab_size=64, dim=dim, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv, ffn_hidden=ffn,
                          max_seq_len=64))
    x = torch.randint(0, 64, (2, 8))
    return m, (x, x)


@pytest.mark.parametrize(
    "cfg,tp,needle",
    [
        ((8, 4), 3, "tp=3 does not divide num_heads=8; valid tp sizes: 1, 2, 4"),
        ((8, 2), 4, "tp=4 does not divide num_kv_heads=2"),
        ((6, 6, 48, 96), 4, "tp=4 does not divide num_heads=6; valid tp sizes: 1, 2"),
    ],
)
def test_tp_that_does_not_divide_lists_valid_sizes(cfg, tp, needle):
    m, inputs = _llama(*cfg)
    with pytest.raises(PlanError, match=needle.replace("(", r"\(")):
        plan(m, Mesh(tp=tp), inputs)


def test_tp_not_dividing_the_heads_of_one_part_names_that_part():
    """A model of two parts (a 4-head "vision" tower feeding an 8-head "lm"): tp=8 divides the language model's
    heads but not the tower's; the error names the part, its attention and the sizes it allows."""
    F = torch.nn.functional

    class Attn(torch.nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.h, self.qkv, self.o = h, torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
            return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))

    class Tower(torch.nn.Module):
        def __init__(self, h):
            super().__init__()
            self.layers = torch.nn.ModuleList([Attn(64, h)])

        def forward(self, x):
            return x + self.layers[0](x)

    class TwoParts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vision, self.lm = Tower(4), Tower(8)

        def forward(self, x):
            return self.lm(self.vision(x)).sum()

    with pytest.raises(PlanError, match=r"tp=8 does not divide num_heads=4 in 'vision' \(attention vision.layers.0; "
                                        r"valid tp sizes for 'vision' alone: 1, 2, 4\); valid tp sizes: 1, 2, 4"):
        plan(TwoParts(), Mesh(tp=8), (torch.randn(2, 16, 64),))
    plan(TwoParts(), Mesh(tp=4), (torch.randn(2, 16, 64),))  # both parts divide


def test_tp_not_dividing_hidden():
    """A model with no attention, whose hidden size 10 does not divide tp=4."""

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 10)
            self.up = torch.nn.Linear(10, 10)
            self.head = torch.nn.Linear(10, 16)

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.head(self.up(self.emb(x))).flatten(0, 1), y.flatten())

    x = torch.randint(0, 16, (2, 8))
    with pytest.raises(PlanError, match=r"tp=4 does not divide hidden=10; valid tp sizes: 1, 2"):
        plan(MLP(), Mesh(tp=4), (x, x))


def test_tp_need_not_divide_the_inputs_of_a_linear_reading_raw_features():
    """A linear on the user's input itself (a patch embedding on 6 pixel values) is column-parallel: tp=4 need
    not divide its 6 inputs, only its outputs. A hidden linear's input size still counts."""

    class Patches(torch.nn.Module):
        def __init__(self, hidden=16):
            super().__init__()
            self.embed = torch.nn.Linear(6, hidden)
            self.up = torch.nn.Linear(hidden, 32)
            self.down = torch.nn.Linear(32, hidden)
            self.head = torch.nn.Linear(hidden, 16)

        def forward(self, x, y):
            h = self.down(torch.relu(self.up(self.embed(x))))
            return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())

    x, y = torch.randn(2, 8, 6), torch.randint(0, 16, (2, 8))
    c = plan(Patches(), Mesh(tp=4), (x, y))
    assert c.params["embed.weight"].placements == (Shard(0),) and c.params["embed.weight"].local_shape == (4, 6)
    with pytest.raises(PlanError, match=r"tp=4 does not divide the size 10"):
        plan(Patches(hidden=10), Mesh(tp=4), (x, y))


def test_mesh_errors():
    with pytest.raises(ValueError, match="unknown mesh axis 'xp'"):
        Mesh(xp=2)
    with pytest.raises(ValueError, match="positive integer"):
        Mesh(tp=0)
    # cp (once refused here) plans now: tests/test_cp.py
