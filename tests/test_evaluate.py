"""Evaluation (mcompile.apps.evaluate) against single-device references computed here, independently.

Perplexity: a llama3-tiny at dp=2 x tp=2 over a held-out split whose samples ignore different numbers of
targets gives the single-device token-weighted mean cross-entropy (one sum over every counted token,
divided by their number: 1e-5; fp32 logits, the ranks sum in another order). A mean of the batch means
would differ by ~1e-2 here, so the weighting is checked.

Last-word accuracy (LAMBADA's criterion): a llama3-tiny that memorised eight passages (byte tokens,
trained here) gets those right and gets wrong four more whose last word differs from what it learnt —
three of them only in the word's last byte, which a criterion on the first target token alone would count
as right: 8/12 exactly, on one device, at dp=2 x tp=2, and as counted here passage by passage.

The dp=2 x tp=2 loss program is also exported with mcompile.apps.hf_io.export_hf: LlamaForCausalLM loads it
with the single-device model's logits (export under data parallelism; test_hf_io.py covers tp and pp).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from evaluate_cases import Bytes, Split, evaluate, preset

from mcompile.apps.evaluate import last_word_accuracy, perplexity, split_last_word

from conftest import pool

PASSAGES = ["the cat sat on the warm mat", "a dog ran far into the cold night", "she sang a quiet song of home",
            "we built a small boat from wood", "rain fell on the old tin roof", "he read the letter twice over",
            "birds flew south before the frost", "my friend baked fresh bread today"]
WRONG = ["the cat sat on the warm man", "a dog ran far into the cold nighs", "she sang a quiet song of homa",
         "rain fell on the old tin bucket"]  # the last word's last byte changed (3); another word (1)
PPL = {"split": (256, 14, 16, 3), "batch_size": 4}  # 3 full batches of 4 (2 samples left out)


@pytest.fixture(scope="module")
def memorised(tmp_path_factory):
    """A llama3-tiny trained to loss ~1e-2 on PASSAGES (100 AdamW steps, ~2 s), saved; and the JSONL."""
    root = tmp_path_factory.mktemp("evaluate")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: more threads only contend
    try:
        model = preset(seed=0).train()
        seqs = [Bytes().encode(p) for p in PASSAGES]
        ids = torch.zeros(len(seqs), 40, dtype=torch.long)
        targets = torch.full((len(seqs), 40), -100)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            targets[i, :len(s) - 1] = torch.tensor(s[1:])
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        for _ in range(100):
            loss = model(ids, targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    assert loss.item() < 0.05
    torch.save(model.state_dict(), root / "memorised.pt")
    jsonl = root / "passages.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in PASSAGES + WRONG))
    return model.eval(), root / "memorised.pt", jsonl


def _reference_correct(model, texts) -> int:
    """Passage by passage, no batching or padding: all of `` word``'s bytes predicted by argmax."""
    right = 0
    with torch.no_grad():
        for text in texts:
            context, word = text.rsplit(" ", 1)
            c, t = list(context.encode()), list((" " + word).encode())
            logits = model(torch.tensor([c + t]))[0]
            right += all(int(logits[len(c) - 1 + j].argmax()) == t[j] for j in range(len(t)))
    return right


def _reference_ppl(model, split: Split, batch_size: int) -> float:
    n = len(split) // batch_size * batch_size
    with torch.no_grad():
        logits = model(split.tokens[:n])
        total = F.cross_entropy(logits.flatten(0, 1), split.targets[:n].flatten(), reduction="sum")
    return (total / (split.targets[:n] != -100).sum()).item()


def test_split_last_word():
    assert split_last_word("  one two  three\n") == ("one two", " three")
    assert split_last_word("a b") == ("a", " b")


def test_last_word_accuracy_on_one_device(memorised):
    model, _, jsonl = memorised
    assert _reference_correct(model, PASSAGES + WRONG) == 8
    r = last_word_accuracy(model, Bytes(), jsonl, batch_size=5)  # 3 batches, the last one short
    assert r == {"accuracy": 8 / 12, "correct": 8, "n": 12}
    assert last_word_accuracy(model, Bytes(), jsonl, batch_size=4, limit=8)["accuracy"] == 1.0
    assert model.training is False


def test_perplexity_on_one_device_is_token_weighted():
    model = preset(seed=1, sharp=True)
    split = Split(*PPL["split"])
    ref = _reference_ppl(model, split, PPL["batch_size"])
    r = perplexity(model, split, batch_size=PPL["batch_size"])
    assert r["loss"] == pytest.approx(ref, rel=1e-6) and r["batches"] == 3
    assert r["tokens"] == int((split.targets[:12] != -100).sum())
    # ppl is exp of the reported loss (float64), which equals the reference to 1e-6 (above): an fp32 exp
    # of the reference would differ from it by up to the loss's tolerance times the loss (~13 here)
    assert r["ppl"] == pytest.approx(math.exp(r["loss"]), rel=1e-12)
    means = [model(*split.batch(b * 4, 4)).item() for b in range(3)]
    assert abs(sum(means) / 3 - ref) > 1e-3  # an unweighted mean of batch means would be caught
    assert perplexity(model, split, batch_size=4, max_batches=1)["batches"] == 1


def test_perplexity_of_a_sample_dataset_valid_split(tmp_path):
    """The real held-out split (mcompile.apps.data: the shipped tiny corpus and tokenizer), one device."""
    data = pytest.importorskip("mcompile.apps.data")
    try:
        split = data.SampleDataset(data.tiny_dataset(tmp_path), seq_len=32, seed=0, split="valid")
    except AttributeError as e:  # mcompile.apps.data without its samples yet
        pytest.skip(f"mcompile.apps.data has no SampleDataset / tiny_dataset: {e}")
    model = preset(seed=1, sharp=True)
    r = perplexity(model, split, batch_size=8, max_batches=3)
    tokens, targets = split.batch(0, 24)
    with torch.no_grad():
        ref = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).item()  # no ignored target here
    assert r["tokens"] == 24 * 32 and r["loss"] == pytest.approx(ref, rel=1e-5)


def test_bad_input_is_named(tmp_path, memorised):
    model, _, _ = memorised
    (tmp_path / "bad.jsonl").write_text('{"text": "fine words here"}\n{"txt": "x y"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object with a \"text\" string"):
        last_word_accuracy(model, Bytes(), tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="not one batch of 64"):
        perplexity(model, Split(256, 4, 8), batch_size=64)
    with pytest.raises(ValueError, match="weights= is read when the model is parallelized here"):
        last_word_accuracy(model, Bytes(), tmp_path / "bad.jsonl", weights="x")


@pytest.mark.timeout(600)
def test_parallel_evaluation_equals_single_device(memorised, tmp_path):
    model, state, jsonl = memorised
    ranks = pool(4).run(evaluate, "dp=2,tp=2", PPL, str(state), str(jsonl), str(tmp_path / "hf"), timeout=600)
    sharp = preset(seed=1, sharp=True)
    ref = _reference_ppl(sharp, Split(*PPL["split"]), PPL["batch_size"])
    for r in ranks:  # every rank the same numbers
        assert r["ppl"]["loss"] == pytest.approx(ref, rel=1e-5), r["ppl"]
        assert r["acc"] == {"accuracy": 8 / 12, "correct": 8, "n": 12}
    # exported at dp=2 x tp=2 (vocabulary-sharded embedding and output, replicated norms): the same model
    from transformers import LlamaForCausalLM

    ids = Split(*PPL["split"]).tokens[:2]
    with torch.no_grad():
        hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
        torch.testing.assert_close(hf(ids).logits, sharp(ids), rtol=1e-5, atol=1e-5)
