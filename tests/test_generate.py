"""Generation with a compiler-made KV cache (mcompile.apps.generate, passes/kv_cache.py).

What each test isolates:

- greedy decoding at tp=2 (two gloo processes), the tiny HF Llama built on the meta device with its
  weights read from a ``save_pretrained`` folder, equals HF's own ``generate(do_sample=False)`` token
  for token — the cache, positions and the dropped causal mask of the decode graph, the head-sharded
  cache and the checkpoint loading together;
- at every decode step the cached program's logits equal the single-device model's full forward over
  the same prefix (no cache), for llama3-tiny and gpt2-tiny at tp=1 (in process) and tp=2 (and dp=2,
  slow): a position that did not move, a cache that lost a row or a head, would show here;
- the decode graph holds no op over the full sequence: only the cache inputs and their ``cat`` have
  the past length in their shape, every matmul reads one row per sequence; at tp=2 the cache is S(1)
  (each rank its heads: no slice in, no gather out) and one step costs 2 all-reduces per layer, the
  embedding's and the logits' all-gather;
- sampling: nucleus filtering and inverse-CDF picking on hand-made distributions; seeded runs repeat,
  agree across ranks, and top_p -> 0 is greedy;
- bad input: too long a request, a model without attention, non-causal / sliding-window / padding
  masks, more pipeline stages than layers, virtual stages: each a clear error;
- pipeline parallelism (pp=2, pp=2 x tp=2; 2 and 4 layers): greedy tokens equal the single-device
  model's (repeated full forwards, no cache) on every rank, the last stage's decode logits equal the
  full forward's at every step, each stage holds exactly its own layers' caches (shapes per rank),
  and one more generated token communicates, per stage, its layers' tp collectives, one p2p
  message per stage boundary it touches and one token broadcast (counted while running).

Tolerance: 1e-5 (fp32). The cached step computes the same dot products as the full forward, but one
query against ``P + 1`` keys in one SDPA call instead of a row of a causal SDPA over the whole
prefix, and at tp=2 sums partial products over ranks: reduction order differs, values do not.
"""

from __future__ import annotations

import pytest
import torch
from generate_cases import decode_parity, greedy_hf, pp_parity, sampling

import mcompile as mc
from mcompile.apps.generate import GenerateError, Generator, compile_generation, rank_program, sample_next
from mcompile.passes.kv_cache import KVCacheError

from conftest import build, pool

TOL = dict(rtol=1e-5, atol=1e-5)  # see the module docstring


def _prompt(vocab: int, b: int = 2, s: int = 5, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


# -- (1) HF parity at tp=2 -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    model, _ = build("hf-llama")
    path = tmp_path_factory.mktemp("gen") / "hf-llama"
    model.m.save_pretrained(path)
    return model, path


def test_greedy_tp2_equals_hf_generate(hf_folder):
    model, path = hf_folder
    prompt = _prompt(128)
    n = 10
    res = pool(2).run(greedy_hf, "tp=2", prompt, n, str(path))
    ref = model.m.generate(prompt, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(prompt),
                           pad_token_id=0)
    assert torch.equal(res[0]["tokens"], ref), (res[0]["tokens"], ref)
    assert torch.equal(res[1]["tokens"], ref)
    # the 4 kv heads are cached (not HF's repeat_kv expansion to 8), 2 per rank; after the 5 prompt tokens
    assert res[0]["cache_shapes"] == [(2, 2, 5, 8)] * 4
    assert sorted(set(res[0]["collectives"])) == ["all_gather/tp", "all_reduce/tp"]


def test_bare_hf_model_in_process(hf_folder):
    """A bare LlamaForCausalLM (not wrapped), one process: HF's greedy tokens again."""
    model, _ = hf_folder
    prompt = _prompt(128, seed=4)
    ref = model.m.generate(prompt, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(prompt),
                           pad_token_id=0)
    gen = Generator(model.m)
    assert gen.attention_heads == (4, 4)
    assert torch.equal(gen.generate(prompt, 6), ref)
    torch.testing.assert_close(gen.logits(prompt), model.m(prompt).logits, **TOL)


# -- (2) decode logits == the full forward's, every step --------------------------------------------------------


def _check_steps(res, vocab):
    for r in res:
        for cached, full, single in r["steps"]:
            assert cached.shape[-1] == vocab
            torch.testing.assert_close(cached, single, **TOL)
            torch.testing.assert_close(full, single, **TOL)


@pytest.mark.parametrize("name", ["llama3-tiny", "gpt2-tiny"])
def test_decode_logits_tp1(name):
    res = decode_parity(0, 1, name, None, _prompt(256), 6)
    _check_steps([res], 257 if name == "gpt2-tiny" else 256)
    assert res["collectives"] == []


@pytest.mark.parametrize("name,mesh", [
    ("llama3-tiny", "tp=2"), ("gpt2-tiny", "tp=2"),
    pytest.param("llama3-tiny", "dp=2", marks=pytest.mark.slow),
])
def test_decode_logits_parallel(name, mesh):
    prompt = _prompt(256)
    res = pool(2).run(decode_parity, name, mesh, prompt, 6)
    _check_steps(res, 257 if name == "gpt2-tiny" else 256)
    heads = 4 if name == "gpt2-tiny" else 4  # gpt2-tiny: 4 heads; llama3-tiny: 4 kv heads (enable_gqa: un-expanded)
    local_heads = heads // 2 if mesh == "tp=2" else heads
    batch = 2 if mesh == "tp=2" else 1  # dp=2: each rank its own sequence
    assert res[0]["cache_shapes"][0] == (batch, local_heads, 5 + 6, 64 // {"gpt2-tiny": 4, "llama3-tiny": 8}[name])
    if mesh == "tp=2":  # the tokens of both ranks agree (and are the same as tp=1's: test_decode_logits_tp1)
        assert torch.equal(res[0]["tokens"], res[1]["tokens"])
    else:
        assert torch.equal(res[0]["tokens"], res[1]["tokens"]) and res[0]["collectives"] == []


# -- (3) the decode graph really uses the cache ------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_plan_tp2():
    model, _ = build("llama3-tiny")
    return compile_generation(model, mc.Mesh.fake(tp=2))


def test_decode_graph_has_no_full_sequence_op(llama_plan_tp2):
    aten = torch.ops.aten
    cap = llama_plan_tp2.decode.captured
    past = cap.symbols["past"]
    caches = set(cap.user_inputs[1:])
    with_past = set()
    for n in cap.gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) and past in d.node.expr.free_symbols
                                               for d in v.shape):
            with_past.add(n.name)
        if n.op == "call_function" and n.target in (aten.linear.default, aten.matmul.default, aten.mm.default):
            assert n.args[0].meta["val"].shape[-2] == 1, f"{n.name} multiplies more than one row per sequence"
    cats = {u.name for c in caches for u in cap.placeholder(c).users if u.target is aten.cat.default}
    assert all(cap.placeholder(c).users for c in caches)
    assert with_past == caches | cats, with_past - caches - cats
    sdpa = [n for n in cap.gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    assert len(sdpa) == 2 and all(n.args[1].name in cats and n.args[0].meta["val"].shape[2] == 1 for n in sdpa)


def test_cache_is_head_sharded_at_tp2(llama_plan_tp2):
    from mcompile.ir.config import Config
    from mcompile.ir.placements import Shard

    dec = llama_plan_tp2.decode
    cats = [u.name for c in dec.captured.user_inputs[1:] for u in dec.captured.placeholder(c).users
            if u.target is torch.ops.aten.cat.default]
    assert len(cats) == 4
    assert all(dec.plan.activations[c] == (Shard(1),) for c in cats)
    for rank in (0, 1):
        prog = rank_program(dec, rank, Config(), "cpu", decode=True)
        assert prog.cache_local == [True] * 4
        ops = [n.target._opname for n in prog.gm.graph.nodes
               if n.op == "call_function" and getattr(n.target, "namespace", None) == "mcompile"]
        # Megatron's forward: the vocab-parallel embedding's all-reduce, 2 per layer, the logits' all-gather
        assert ops == ["all_reduce"] * (1 + 2 * 2) + ["all_gather"], ops
        pre = rank_program(llama_plan_tp2.prefill, rank, Config(), "cpu")
        assert pre.cache_local == [True] * 4


# -- (4) sampling ------------------------------------------------------------------------------------------------


def test_sample_next_nucleus_and_inverse_cdf():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    u = torch.linspace(0.0, 0.999, 1000)
    picks = torch.stack([sample_next(logits, x.view(1), 1.0, 0.7) for x in u]).flatten()
    assert set(picks.tolist()) == {0, 1}  # 0.5 < 0.7 <= 0.8: the nucleus is the two first tokens
    assert abs((picks == 0).float().mean().item() - 0.5 / 0.8) < 0.01
    picks = torch.stack([sample_next(logits, x.view(1), 1.0, 1.0) for x in u]).flatten()
    freq = torch.bincount(picks, minlength=4).float() / len(u)
    torch.testing.assert_close(freq, probs[0], atol=0.01, rtol=0)
    assert sample_next(logits, torch.tensor([0.99]), 1.0, 1e-9).item() == 0  # top_p -> 0: the argmax
    assert sample_next(logits, torch.tensor([0.99]), 0.0, 1.0).item() == 0  # temperature 0: the argmax


def test_sampling_deterministic_and_equal_across_ranks():
    prompt = _prompt(256)
    res = pool(2).run(sampling, "llama3-tiny", "tp=2", prompt, 8)
    a, b, c = res[0]["a"], res[0]["b"], res[0]["c"]
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a[:, :5], prompt)
    for key in res[0]:
        assert torch.equal(res[0][key], res[1][key]), key
    assert torch.equal(res[0]["narrow"], res[0]["greedy"])
    eos = res[0]["eos"]
    first = int(res[0]["greedy"][0, 6])
    assert (eos[0, 6:] == first).all()  # the first sequence ended at its 2nd token: eos from then on


# -- (5) bad input -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_gen():
    model, _ = build("llama3-tiny")
    return Generator(model)


def test_too_long_request(llama_gen):
    with pytest.raises(GenerateError, match=r"5 tokens \+ max_new_tokens=124 = 129 positions exceeds max_seq_len=128"):
        llama_gen.generate(_prompt(256), 124)
    with pytest.raises(GenerateError, match="integer tensor"):
        llama_gen.generate(torch.zeros(2, 3), 1)
    with pytest.raises(GenerateError, match="exceeds the model's limit of 128"):
        compile_generation(build("llama3-tiny")[0], max_seq_len=200)


class _Toy(torch.nn.Module):
    """A one-layer decoder whose attention is ``kind``: none, non-causal, a sliding window, a padding mask."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = torch.nn.Embedding(16, 8)
        self.qkv = torch.nn.Linear(8, 24)
        self.out = torch.nn.Linear(8, 16)

    def forward(self, ids):
        h = self.emb(ids)
        if self.kind == "none":
            return self.out(h)
        q, k, v = (t.unsqueeze(1) for t in self.qkv(h).split(8, -1))
        s = ids.shape[1]
        i = torch.arange(s, device=ids.device)
        if self.kind == "bidirectional":
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        elif self.kind == "window":
            d = i[:, None] - i[None, :]
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=(d >= 0) & (d < 2))
        else:  # padding: the mask reads the ids
            mask = (i[:, None] >= i[None, :]) & (ids != 0)[:, None, None, :]
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.squeeze(1))


@pytest.mark.parametrize("kind,match", [
    ("none", "no scaled_dot_product_attention"),
    ("bidirectional", "is not causal"),
    ("window", "is not the causal mask"),
    ("padding", "reads the values of the input"),
])
def test_unsupported_attention(kind, match):
    with pytest.raises(KVCacheError, match=match):
        compile_generation(_Toy(kind), max_seq_len=32)


def test_pipeline_limits_refused():
    model = build("llama3-tiny")[0]
    with pytest.raises(GenerateError, match=r"cannot split generation into pp=3 stages by layer: .*2 layers"):
        compile_generation(model, mc.Mesh.fake(pp=3))
    with pytest.raises(GenerateError, match="one stage per pipeline rank; use virtual_stages=1"):
        compile_generation(model, mc.Mesh.fake(pp=2), config=mc.Config(virtual_stages=2, schedule="interleaved"))


# -- (6) pipeline parallelism: stage-local caches, one microbatch --------------------------------------------------


def _greedy_reference(model, prompt, n):
    """Greedy continuation by repeated full forwards of the single-device model (no cache)."""
    seq = prompt
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    return seq


@pytest.mark.parametrize("name,mesh", [
    ("llama3-tiny", "pp=2"), ("llama3-tiny-deep", "pp=2,tp=2"),  # 1 and 2 layers per stage; with and without tp
    pytest.param("llama3-tiny", "pp=2,tp=2", marks=pytest.mark.slow),
    pytest.param("llama3-tiny-deep", "pp=2", marks=pytest.mark.slow),
    pytest.param("llama3-tiny", "dp=2,pp=2", marks=pytest.mark.slow),
])
def test_pipeline_generation(name, mesh):
    """Greedy tokens at pp=2 (x tp=2) equal the single-device model's; at every decode step the last stage's
    logits equal the full forward's; each stage holds the caches of its own layers only; one generated token
    costs per stage its layers' tp all-reduces, one p2p message per stage boundary and one token broadcast."""
    model, _ = build(name)
    layers = model.config.n_layers
    sizes = dict(p.split("=") for p in mesh.split(","))
    tp, dp, pp = (int(sizes.get(a, 1)) for a in ("tp", "dp", "pp"))
    prompt, n = _prompt(256), 6
    ref = _greedy_reference(model, prompt, n)
    res = pool(tp * dp * pp).run(pp_parity, name, mesh, prompt, n)
    per_stage = layers // pp
    kv_heads, head_dim = 4, 8  # llama3-tiny(-deep): 4 kv heads (cached un-repeated) of 8
    for r in res:
        s, last = r["stage"], r["stage"] == pp - 1
        assert torch.equal(r["tokens"], ref), (s, r["tokens"], ref)
        torch.testing.assert_close(r["logits"], model(prompt).detach(), **TOL)
        # the decode logits of every step (last stage only: the others have none)
        assert len(r["steps"]) == (n if last else 0)
        for cached, single in r["steps"]:
            torch.testing.assert_close(cached, single, **TOL)
        # the caches of this stage's layers (k and v per layer), never another stage's
        assert r["caches"] == list(range(2 * per_stage * s, 2 * per_stage * (s + 1)))
        local = (2 // dp, kv_heads // tp, None, head_dim)
        assert r["after_prefill"] == [local[:2] + (5,) + local[3:]] * 2 * per_stage
        assert r["cache_shapes"] == [local[:2] + (5 + n,) + local[3:]] * 2 * per_stage
        # one more token: this stage's tp collectives, a p2p message per boundary it touches, the token broadcast
        ar = 2 * per_stage + (1 if s == 0 else 0)  # 2 per layer; the vocab-parallel embedding's on stage 0
        expect = ["all_reduce/tp"] * ar + (["all_gather/tp"] if last else []) if tp > 1 else []
        # (under dp the new tokens are also all-gathered over dp, by the communicator: not an mcompile op)
        assert r["step"]["collectives"] == sorted(expect), (s, r["step"])
        p2p = ["broadcast/pp"] + (["recv/pp"] if s > 0 else []) + (["send/pp"] if not last else [])
        assert r["step"]["p2p"] == sorted(p2p), (s, r["step"])
        assert sorted(r["declared"]) == sorted(p2p + expect)


@pytest.mark.slow
def test_generator_from_trained_module(tmp_path):
    """Generator.from_module takes a trained ParallelModule's current weights (not the model's initial ones);
    Generator(weights=) reads the same from the mcompile checkpoint into a model built on meta."""
    from generate_cases import from_trained

    prompt = _prompt(256)
    res = pool(2).run(from_trained, "llama3-tiny", "tp=2", prompt, 6, str(tmp_path / "ckpt"))
    model, _ = build("llama3-tiny")
    before = Generator(model).generate(prompt, 6)
    model.load_state_dict(res[0]["state"])
    after = Generator(model).generate(prompt, 6)
    assert torch.equal(res[0]["tokens"], after) and torch.equal(res[1]["tokens"], after)
    assert torch.equal(res[0]["ckpt_tokens"], after) and torch.equal(res[1]["ckpt_tokens"], after)
    assert not torch.equal(before, after)  # the step changed the greedy continuation (lr 0.5): the test can fail
