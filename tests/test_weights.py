"""``parallelize(..., weights=PATH)``: a checkpoint read straight into each rank's pieces
(mcompile.runtime.weights).

Hugging Face checkpoints written by ``save_pretrained`` (tiny Llama untied fp32 in one file with an
extra tensor, tied bf16 in shards; GPT-2 bf16 with a fused QKV and a vocabulary padded under tp) are
loaded into models built on the meta device at tp=2, pp=2, dp=2 x tp=2 and pp=2 x tp=2 (and once,
from a checkpoint holding the tied weight only as ``lm_head.weight``, into a model with values):
``full_state_dict()`` must equal the saved tensors exactly (bf16 -> fp32 is exact), and the first
training step must give the single-device model's loss and gradients with the same weights. An
mcompile checkpoint saved at tp=2 loads at pp=2. Bad input (a missing tensor, a wrong shape, no
checkpoint, a read failing on one rank) is the same error on every rank, naming what is wrong, and
leaves the model on meta. Without processes: the slice each rank reads equals
``ParamPlan.local_piece``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from weights_cases import hf_model, load_cases, load_errors, round_trip

from mcompile.ir.mesh import Mesh
from mcompile.ir.placements import BlockShard, Replicate, Shard
from mcompile.ir.plan import ParamPlan
from mcompile.runtime.weights import Stored, WeightsError, _read_piece, open_weights, slice_of

from conftest import pool


def _saved(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    out = {}
    model, _ = hf_model("llama", "cpu", seed=0)
    model.m.save_pretrained(root / "llama")  # fp32, one file; then an extra tensor the model lacks
    sd = load_file(root / "llama" / "model.safetensors")
    save_file({**sd, "extra.unused": torch.ones(3)}, root / "llama" / "model.safetensors", metadata={"format": "pt"})
    out["llama"] = root / "llama"
    model, _ = hf_model("llama-tied", "cpu", seed=0)
    model.m.to(torch.bfloat16).save_pretrained(root / "llama-tied", max_shard_size="100KB")  # bf16, shards
    assert (root / "llama-tied" / "model.safetensors.index.json").exists()
    out["llama-tied"] = root / "llama-tied"
    # the same, with the tied weight stored only under its other name (lm_head.weight): found under any name
    alias = root / "llama-tied-alias"
    shutil.copytree(root / "llama-tied", alias)
    index = json.loads((alias / "model.safetensors.index.json").read_text())
    shard = alias / index["weight_map"].pop("model.embed_tokens.weight")
    tensors = load_file(shard)
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, shard, metadata={"format": "pt"})
    index["weight_map"]["lm_head.weight"] = shard.name
    (alias / "model.safetensors.index.json").write_text(json.dumps(index))
    out["llama-tied-alias"] = alias
    model, _ = hf_model("gpt2", "cpu", seed=0)
    model.m.to(torch.bfloat16).save_pretrained(root / "gpt2")
    out["gpt2"] = root / "gpt2" / "model.safetensors"  # the file itself
    # bad input: two tensors missing; one of another shape; a folder with no checkpoint
    (root / "missing").mkdir()
    save_file({k: v for k, v in sd.items() if k not in ("model.norm.weight", "model.layers.1.mlp.up_proj.weight")},
              root / "missing" / "model.safetensors", metadata={"format": "pt"})
    (root / "shape").mkdir()
    bad = dict(sd)
    bad["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 32)
    save_file(bad, root / "shape" / "model.safetensors", metadata={"format": "pt"})
    (root / "empty").mkdir()
    (root / "empty" / "pytorch_model.bin").write_bytes(b"not read")
    out.update(missing=root / "missing", shape=root / "shape", empty=root / "empty", nowhere=root / "nowhere",
               dcp=root / "dcp")
    return out


def _reference(kind, saved):
    """The single-device model with the saved weights (fp32): the first step's loss and gradients."""
    model, inputs = hf_model(kind, "cpu", seed=5)
    missing, unexpected = model.load_state_dict({f"m.{k}": v.float() for k, v in saved.items()}, strict=False)
    tied = {"m.lm_head.weight", "m.model.embed_tokens.weight"} if kind == "llama-tied" else {"m.lm_head.weight"}
    assert len(missing) <= 1 and set(missing) <= tied and set(unexpected) <= {"m.extra.unused"}, (missing, unexpected)
    loss = model(*inputs)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, model.state_dict()


CASES = {  # world -> (label, model, mesh, checkpoint, built on meta)
    2: [("llama tp=2", "llama", "tp=2", "llama", True),
        ("llama-tied pp=2", "llama-tied", "pp=2", "llama-tied", True),
        ("gpt2 tp=2", "gpt2", "tp=2", "gpt2", True),
        ("llama-tied tp=2 values", "llama-tied", "tp=2", "llama-tied-alias", False)],
    4: [("llama-tied dp=2,tp=2", "llama-tied", "dp=2,tp=2", "llama-tied", True),
        ("llama pp=2,tp=2", "llama", "pp=2,tp=2", "llama", True)],
}


# dp=2 x tp=2 reads what tp=2 reads on each dp replica (the tp=2 cases prove the slices, the pp x tp case the
# composition on 4 ranks): -m slow
SLOW_CASES = {"llama-tied dp=2,tp=2"}


@pytest.fixture(scope="module")
def results(ckpts, request):
    # only the cases this session runs (the CI tier deselects SLOW_CASES): each is a parallelize on a pool
    wanted = {item.callspec.params["label"] for item in request.session.items
              if item.originalname == "test_hf_checkpoint_loads_exactly_and_trains_as_single_device"}
    out = {}
    for world, cases in CASES.items():
        args = [(lab, kind, mesh, str(ckpts[c]), meta) for lab, kind, mesh, c, meta in cases if lab in wanted]
        if not args:
            continue
        ranks = pool(world).run(load_cases, args, timeout=600)
        for lab, *_ in args:
            out[lab] = {**ranks[0][lab], "losses": [r[lab]["loss"] for r in ranks],
                        "warned_all": [r[lab]["warned"] for r in ranks],
                        "meta_all": [r[lab]["still_meta"] for r in ranks], "held_all": [r[lab]["held"] for r in ranks]}
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("label", [pytest.param(c[0], marks=[pytest.mark.slow] if c[0] in SLOW_CASES else [])
                                   for cases in CASES.values() for c in cases])
def test_hf_checkpoint_loads_exactly_and_trains_as_single_device(ckpts, results, label):
    kind, ckpt, meta = next((k, c, m) for cases in CASES.values() for lab, k, _, c, m in cases if lab == label)
    folder = ckpts[ckpt] if ckpts[ckpt].is_dir() else ckpts[ckpt].parent
    saved = _saved(folder)
    loss, grads, ref_sd = _reference(kind, saved)
    r = results[label]
    assert list(r["state"]) == list(ref_sd)  # the model's keys, tied ones both present
    tied = ["model.embed_tokens.weight" if kind.startswith("llama") else "transformer.wte.weight", "lm_head.weight"]
    for k, v in r["state"].items():  # exactly the saved values (bf16 -> fp32 is exact)
        # a tied weight is saved under one of its names (HF leaves lm_head out)
        stored = saved[k[2:]] if k[2:] in saved else saved[next(n for n in tied if n != k[2:] and n in saved)]
        assert v.dtype == torch.float32 and torch.equal(v, stored.float()), k
    # the first step: the single-device loss, on every rank (fp32; only the reduction order differs)
    assert r["losses"] == pytest.approx([loss] * len(r["losses"]), rel=1e-5)
    for n, g in r["grads"].items():  # gradients too: a loss can be right with a gradient wrong
        torch.testing.assert_close(g, grads[n], rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    assert all(r["meta_all"]) == meta  # a meta model is never materialised; nothing read into the user's
    if "pp=2" in label:  # each pipeline rank reads its own stages' parameters only
        assert all(0 < len(h) < len(r["grads"]) for h in r["held_all"]) and r["held_all"][0] != r["held_all"][-1]
    if ckpt == "llama":  # the extra tensor: ignored, named in one warning, on rank 0 only
        assert len(r["warned_all"][0]) == 1 and "extra.unused" in r["warned_all"][0][0]
        assert all(not w for w in r["warned_all"][1:])
    else:
        assert not any(r["warned_all"])


@pytest.mark.timeout(600)
def test_mcompile_checkpoint_loads_under_another_plan(ckpts):
    """GPT-2 at tp=2 (its fused QKV saved as blocks, its vocabulary padded to 130) trained one step, saved
    with pm.save_checkpoint, loads into a new meta model at pp=2: the same values exactly."""
    ranks = pool(2).run(round_trip, "gpt2", "tp=2", str(ckpts["gpt2"]), str(ckpts["dcp"]), "pp=2", timeout=600)
    r0 = ranks[0]
    assert list(r0["loaded"]) == list(r0["saved"])
    for k, v in r0["saved"].items():
        assert torch.equal(r0["loaded"][k], v), k
    assert not torch.equal(r0["saved"]["m.transformer.h.0.attn.c_attn.weight"],
                           _saved(ckpts["gpt2"].parent)["transformer.h.0.attn.c_attn.weight"].float())  # trained
    assert all(not r["warned"] for r in ranks)  # optimizer state is not weights: not "extra"
    assert [r["loss"] for r in ranks] == pytest.approx([r0["loss_saved"]] * 2, rel=1e-5)


@pytest.mark.timeout(600)
def test_bad_weights_are_the_same_error_on_every_rank(ckpts):
    cases = [(name, "llama", "tp=2", str(ckpts[name])) for name in ("missing", "shape", "empty", "nowhere")]
    cases.append(("io", "llama", "tp=2", str(ckpts["llama"])))  # every check passes; rank 1's reads fail
    ckpts["io"] = ckpts["llama"]
    ranks = pool(2).run(load_errors, cases, ("io", 1), timeout=600)
    for name, *_ in cases:
        msgs = [r[name][0] for r in ranks]
        assert len(set(msgs)) == 1, msgs  # the same error everywhere: no rank left waiting
        assert all(r[name][1] for r in ranks)  # the model given stayed on meta
        msg = msgs[0]
        assert msg.startswith("WeightsError: weights=") and str(ckpts[name]) in msg, msg
    assert "2 tensor(s) of the model are missing" in ranks[0]["missing"][0]
    assert "model.norm.weight" in ranks[0]["missing"][0]
    assert "model.layers.1.mlp.up_proj.weight" in ranks[0]["missing"][0]
    assert "model.layers.0.self_attn.o_proj.weight: [64, 32] in the checkpoint, [64, 64] in the model" \
        in ranks[0]["shape"][0]
    assert "found no checkpoint" in ranks[0]["empty"][0] and "expected a Hugging Face" in ranks[0]["empty"][0]
    assert "pytorch_model.bin" in ranks[0]["empty"][0] and "pickles" in ranks[0]["empty"][0]
    assert "no such file or folder" in ranks[0]["nowhere"][0]
    # no checkpoint at the path: refused on every rank before anything is captured or planned
    assert not any(r[name][2] for r in ranks for name in ("empty", "nowhere"))
    assert all(r[name][2] for r in ranks for name in ("missing", "shape", "io"))
    assert "reading failed on rank 1: OSError: Input/output error reading" in ranks[0]["io"][0]


# -- without processes ------------------------------------------------------------------------------
class _Array:
    """A checkpoint in memory that records what was read: whole tensors or slices."""

    sliceable = True

    def __init__(self, t):
        self.t, self.reads = t, []

    def read(self, stored, index=None):
        self.reads.append("full" if index is None else tuple((i.start, i.stop) for i in index))
        return self.t if index is None else self.t[index]


LAYOUTS = [  # (mesh, shape, padded shape, placements, read as a slice)
    ("tp=2", (6, 4), None, (Shard(0),), True),
    ("tp=2", (6, 4), None, (Shard(1),), True),
    ("tp=4", (129, 4), (132, 4), (Shard(0),), True),  # padded: rank 3 reads 30 rows and 3 zero rows
    ("tp=4", (3, 4), (4, 4), (Shard(0),), True),  # rank 3 reads nothing: all padding
    ("dp=2,tp=2", (4, 6), None, (Shard(0), Shard(1)), True),
    ("dp=2,tp=2", (4, 6), None, (Replicate(), Shard(1)), True),
    ("tp=2", (4, 6), None, (Replicate(),), False),
    ("tp=2", (4, 12), None, (BlockShard(1, 3),), False),  # fused QKV: strided in the file
    ("dp=2,tp=2", (8, 6), None, (Shard(0), Shard(0)), False),  # one dim over two axes
]


@pytest.mark.parametrize("mesh,shape,padded,placements,sliced", LAYOUTS)
def test_each_rank_reads_exactly_its_local_piece(mesh, shape, padded, placements, sliced):
    m = Mesh.parse(mesh, fake=True)
    pplan = ParamPlan("w", shape, "float32", placements, shape, padded_shape=padded)
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.bfloat16).reshape(shape)
    for rank in range(m.size()):
        coords = m.coords(rank)
        src = _Array(full)
        piece = _read_piece(src, Stored("w", shape, "BF16", "float"), pplan, m, coords, None)
        assert torch.equal(piece, pplan.local_piece(full, m, coords)), (rank, piece.shape)
        assert (slice_of(pplan, m, coords) is not None) == sliced
        if sliced:  # only the rank's own box was read (at most its local size)
            assert "full" not in src.reads and len(src.reads) <= 1
        else:
            assert src.reads == ["full"]


def test_formats_are_recognised_or_named(tmp_path):
    save_file({"a": torch.zeros(2, 3)}, tmp_path / "one.safetensors", metadata={"format": "pt"})
    assert open_weights(tmp_path / "one.safetensors").entries["a"].shape == (2, 3)
    assert open_weights(tmp_path).entries["a"].dtype == "F32"  # the folder's only .safetensors
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}))
    with pytest.raises(WeightsError, match=r"1 shard file\(s\) named by model.safetensors.index.json .*two.safet"):
        open_weights(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"b": "one.safetensors"}}))
    with pytest.raises(WeightsError, match="puts 1 tensor.* in one.safetensors, whose header does not have them: b"):
        open_weights(tmp_path)
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(WeightsError, match="not a readable safetensors file"):
        open_weights(tmp_path / "bad.safetensors")
    data = (tmp_path / "one.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-8])  # truncated: caught from the header, before reading
    with pytest.raises(WeightsError, match="not a readable safetensors file"):
        open_weights(tmp_path / "cut.safetensors")
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "mcompile_plan.json").write_text("{}")
    with pytest.raises(WeightsError, match=r"metadata \(.metadata\) cannot be read"):
        open_weights(tmp_path / "ck")
