"""The data layer (mcompile.apps.data): the indexed dataset, preprocess, tokenizers, sampling, blends.

What each test isolates:

- the indexed format round-trips documents exactly (bytes of the .bin included) at both token dtypes,
  and via ``preprocess`` from JSONL (plain and gzip) and from text files (each split mode): decoding a
  stored document gives back its text byte for byte;
- every kind of tokenizer file loads and round-trips (tokenizer.json shipped; a sentencepiece model
  and a tiktoken ranks file made in a temporary folder at test time);
- sampling is checked against facts computed without the sampler: a dataset whose every token id is
  unique tells, from a sample's tokens alone, which document and which stream position they came
  from; blend sources with disjoint id ranges tell which source a sample came from;
- bad input (a missing tokenizer, a truncated or corrupt index, a JSON line without the text key, a
  split shorter than one sample) is a DataError naming the file and the fix.
"""

from __future__ import annotations

import gzip
import json
import pickle
import runpy
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mcompile.apps.data import (
    DataError,
    IndexedDataset,
    SampleDataset,
    document_mask,
    load_tokenizer,
    preprocess,
    tiny_corpus,
    tiny_tokenizer,
    write_indexed,
)
from mcompile.apps.data.assets import tiny_lambada
from mcompile.apps.data.sampling import PERIOD, split_documents

ROOT = Path(__file__).resolve().parents[1]


def _docs(seed: int, n: int, vocab: int, max_len: int = 50) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(0, max_len)).tolist() for _ in range(n)]


def _unique(tmp_path, n_docs=200, seed=0, name="u", lo=1, hi=60) -> tuple[str, list[np.ndarray]]:
    """A dataset whose every token id is distinct (id = its position in the .bin): a sample's tokens
    say exactly where they came from."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi, n_docs)
    ids = np.arange(int(lengths.sum()))
    docs = np.split(ids, np.cumsum(lengths)[:-1])
    prefix = str(tmp_path / name)
    write_indexed(prefix, docs, vocab_size=len(ids))
    return prefix, docs


# --- the indexed format -------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [300, 70_000])  # uint16 and int32 tokens
def test_write_read_round_trip(tmp_path, vocab):
    docs = _docs(0, 100, vocab) + [[], [vocab - 1, 0]]  # an empty document and both extreme ids
    write_indexed(tmp_path / "d", docs, vocab_size=vocab, meta={"note": "ü", "n": 3})
    ds = IndexedDataset(tmp_path / "d")
    assert len(ds) == len(docs) and ds.num_tokens == sum(map(len, docs)) and ds.vocab_size == vocab
    assert ds.meta == {"note": "ü", "n": 3}
    assert ds.dtype == (np.uint16 if vocab <= 65536 else np.int32)
    for i, d in enumerate(docs):
        assert ds[i].tolist() == d
    assert ds[-1].tolist() == docs[-1]
    dtype = "<u2" if vocab <= 65536 else "<i4"
    want = b"".join(np.asarray(d, dtype=dtype).tobytes() for d in docs)
    assert (tmp_path / "d.bin").read_bytes() == want  # byte-exact: the tokens and nothing else
    with pytest.raises(IndexError, match="out of range"):
        ds[len(docs)]
    with pytest.raises(DataError, match="outside"):
        write_indexed(tmp_path / "bad", [[1, 2, vocab]], vocab_size=vocab)
    assert not (tmp_path / "bad.idx").exists() and not (tmp_path / "bad.bin").exists()  # nothing half-written


@settings(max_examples=25, deadline=None)
@given(docs=st.lists(st.lists(st.integers(0, 2**17 - 1), max_size=20), max_size=12),
       extra=st.integers(0, 5))
def test_round_trip_property(tmp_path_factory, docs, extra):
    vocab = max([t for d in docs for t in d], default=0) + 1 + extra
    path = tmp_path_factory.mktemp("prop") / "p"
    write_indexed(path, docs, vocab_size=vocab)
    ds = IndexedDataset(path)
    assert [d.tolist() for d in ds] == docs and ds.num_tokens == sum(map(len, docs))


def test_preprocess_jsonl_and_text(tmp_path):
    tok = load_tokenizer(tiny_tokenizer())
    texts = [json.loads(line)["text"] for line in tiny_corpus().read_text().splitlines()[:40]]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(texts))
                                      + json.dumps({"body": "  "}) + "\n\n")  # an empty document, a blank line
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"body": "Tom has a red ball."}) + "\n")
    stats = preprocess([tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz"], tmp_path / "out", tok, text_key="body",
                       progress=False)
    want = texts + ["Tom has a red ball."]
    assert stats["documents"] == len(want) and stats["skipped_empty"] == 1 and stats["files"] == 2
    ds = IndexedDataset(tmp_path / "out")
    assert ds.num_tokens == stats["tokens"] and ds.meta["tokenizer"]["sha256"] == tok.sha256
    assert ds.meta["tokenizer"]["eos_id"] == tok.eos_id == 0 and ds.meta["text_key"] == "body"
    for d, text in zip(ds, want):
        assert d[-1] == tok.eos_id and tok.eos_id not in d[:-1].tolist()  # one EOS, at the end
        assert tok.decode(d[:-1]) == text  # the text back, byte for byte

    # text files: blank-line blocks, lines, whole files; and no EOS
    body = "The cat sat.\nIt was red.\n\n\nThe dog ran.\n\nA bird sang.\n"
    (tmp_path / "t.txt").write_text(body)
    split = {"blank": ["The cat sat.\nIt was red.", "The dog ran.", "A bird sang."],
             "line": ["The cat sat.", "It was red.", "The dog ran.", "A bird sang."],
             "file": [body]}
    for mode, docs in split.items():
        s = preprocess([tmp_path / "t.txt"], tmp_path / f"t_{mode}", tiny_tokenizer(), append_eos=False,
                       progress=False, txt_split=mode)
        got = IndexedDataset(tmp_path / f"t_{mode}")
        assert s["documents"] == len(docs) and [tok.decode(d) for d in got] == docs
        assert [d.tolist() for d in got] == [tok.encode(t) for t in docs]  # no EOS appended


def test_preprocess_folder_and_progress(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "2.txt").write_text("Anna has a cup.\n")
    (tmp_path / "in" / "1.jsonl").write_text(json.dumps({"text": "Ben has a hat."}) + "\n")
    (tmp_path / "in" / "notes.md").write_text("not data\n")
    stats = preprocess([tmp_path / "in"], tmp_path / "o", tiny_tokenizer(), progress=True)
    tok = load_tokenizer(tiny_tokenizer())
    assert stats["files"] == 2 and [tok.decode(d[:-1]) for d in IndexedDataset(tmp_path / "o")] == \
        ["Ben has a hat.", "Anna has a cup."]  # sorted by name, .md ignored
    assert "preprocess" in capsys.readouterr().err  # the progress bar went to stderr


# --- tokenizers ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    import base64

    import sentencepiece as spm

    root = tmp_path_factory.mktemp("tok")
    docs = [json.loads(line)["text"] for line in tiny_corpus().read_text().splitlines()[:300]]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(docs), model_prefix=str(root / "sp"), vocab_size=120,
                                   model_type="bpe", minloglevel=2, num_threads=1)
    # a tiktoken ranks file: the 256 bytes, then merges (each a pair of tokens already ranked)
    ranks = [bytes([i]) for i in range(256)] + [b"th", b"he", b"the", b" t", b" the", b"an", b"and", b" a"]
    (root / "r.tiktoken").write_text("".join(f"{base64.b64encode(b).decode()} {i}\n" for i, b in enumerate(ranks)))
    return {"tokenizers": tiny_tokenizer(), "sentencepiece": root / "sp.model", "tiktoken": root / "r.tiktoken"}


@pytest.mark.parametrize("kind", ["tokenizers", "sentencepiece", "tiktoken"])
def test_tokenizer_kinds(tokenizer_files, tmp_path, kind):
    tok = load_tokenizer(tokenizer_files[kind])
    assert tok.kind == kind and isinstance(tok.eos_id, int) and 0 <= tok.eos_id < tok.vocab_size
    text = "Tom has a red ball. Anna wants to play with the ball."
    ids = tok.encode(text)
    assert ids and all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode_batch([text, "the hat"]) == [ids, tok.encode("the hat")]
    if kind == "tiktoken":
        assert tok.encode(" the") == [256 + 4]  # the merges ran: " the" is one token
        assert tok.eos_id == 256 + 8 and tok.vocab_size == 256 + 9  # EOS after the ranks
    if kind == "sentencepiece":
        assert (tok.eos_id, tok.bos_id, tok.vocab_size) == (2, 1, 120)
    if kind == "tokenizers":  # a Hugging Face folder: tokenizer_config.json names the EOS
        (tmp_path / "hf").mkdir()
        (tmp_path / "hf" / "tokenizer.json").write_bytes(tiny_tokenizer().read_bytes())
        (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<unk>"}}))
        assert load_tokenizer(tmp_path / "hf").eos_id == 1 and tok.eos_id == 0
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": text}) + "\n")
    preprocess([tmp_path / "c.jsonl"], tmp_path / "c", tok, progress=False)
    ds = IndexedDataset(tmp_path / "c")
    assert ds[0].tolist() == ids + [tok.eos_id] and ds.meta["tokenizer"]["kind"] == kind


def test_tiny_assets():
    tok = load_tokenizer(tiny_tokenizer())
    from mcompile.models import get_preset

    assert tok.vocab_size == 256 == get_preset("llama3-tiny").config.vocab_size  # fits llama3-tiny exactly
    assert tok.encode("<|endoftext|>") == [tok.eos_id]
    lines = tiny_corpus().read_text().splitlines()
    assert 1000 <= len(lines) and tiny_corpus().stat().st_size < 500_000
    texts = [json.loads(line)["text"] for line in lines]
    assert all(tok.decode(tok.encode(t)) == t for t in texts[:200])
    items = [json.loads(line)["text"] for line in tiny_lambada().read_text().splitlines()]
    assert len(items) >= 200 and not set(items) & set(texts)
    for t in items:  # the last word was named before
        *context, last = t.split(" ")
        assert last in " ".join(context).replace(".", " ").split()
    made = runpy.run_path(str(ROOT / "scripts" / "make_tiny_corpus.py"))["outputs"]()  # the files are current
    assert made["tiny_corpus.jsonl"] == tiny_corpus().read_text()
    assert made["tokenizer.json"] == tiny_tokenizer().read_text()


# --- sampling -----------------------------------------------------------------------------------------------


def _where(docs: list[np.ndarray]):
    """token id -> document (the unique-id datasets)."""
    return np.repeat(np.arange(len(docs)), [len(d) for d in docs])


def test_samples_are_next_token_windows_of_one_epoch(tmp_path):
    prefix, docs = _unique(tmp_path)
    T, seq = sum(map(len, docs)), 16
    sd = SampleDataset(prefix, seq, seed=3, valid_fraction=0.0)
    n = (T - 1) // seq
    assert len(sd) == n and sd.num_tokens == T
    starts = {int(d[0]) for d in docs}
    tok, tgt = sd.batch(0, n)
    assert tok.shape == tgt.shape == (n, seq) and tok.dtype == torch.int64
    assert torch.equal(tok[:, 1:], tgt[:, :-1])  # targets are the next tokens
    step = tgt - tok
    jump = step != 1  # inside a document the next id is +1; elsewhere a new document starts
    assert all(int(t) in starts for t in tgt[jump])
    # one epoch: no input token twice, and all but the stream's tail of fewer than seq tokens seen
    seen = tok.flatten().numpy()
    assert len(np.unique(seen)) == n * seq and T - n * seq <= seq
    # epoch 1 is another order of the same windows... of other documents' order: the samples differ
    nxt = sd.batch(n, n).tokens
    assert not torch.equal(nxt, tok) and len(np.unique(nxt.flatten().numpy())) == n * seq
    # sd[i] is row i of a batch; a different seed gives other samples
    assert torch.equal(sd[5].tokens, tok[5]) and torch.equal(sd[5].targets, tgt[5])
    assert not torch.equal(SampleDataset(prefix, seq, seed=4, valid_fraction=0.0).batch(0, 8).tokens, tok[:8])


def test_resume_exactly(tmp_path):
    a, _ = _unique(tmp_path, 80, seed=1, name="a")
    b, _ = _unique(tmp_path, 30, seed=2, name="b")
    blend = [(a, 0.6), (b, 0.4)]
    epoch = len(SampleDataset(blend, 24, seed=7))
    for i in (0, 17, epoch - 2, 3 * epoch + 1):  # up to several epochs of both sources
        j = i + 13
        ran = SampleDataset(blend, 24, seed=7)  # a trainer that consumed samples 0..i-1, 5 at a time
        for s in range(0, i, 5):
            ran.batch(s, min(5, i - s))
        want = ran.batch(i, j - i)
        got = SampleDataset(blend, 24, seed=7).batch(i, j - i)  # restarted knowing only i
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.targets, want.targets)
        assert torch.equal(SampleDataset(blend, 24, seed=7)[j - 1].tokens, want.tokens[-1])
    # a batch is its samples stacked, however the range is cut
    whole = SampleDataset(blend, 24, seed=7).batch(0, 2 * epoch)
    parts = SampleDataset(blend, 24, seed=7)
    cut = torch.cat([parts.batch(s, 7).tokens for s in range(0, 2 * epoch, 7)])[:2 * epoch]
    assert torch.equal(cut, whole.tokens)
    # pickled (a DataLoader worker, a spawned process): reopened by prefix, not copied; the same samples
    blob = pickle.dumps(parts)
    assert len(blob) < 20_000 and torch.equal(pickle.loads(blob).batch(0, 2 * epoch).tokens, whole.tokens)


def test_blend_weights(tmp_path):
    """Three sources with disjoint id ranges: a sample's tokens say its source (counted without the blend)."""
    rng = np.random.default_rng(0)
    offsets, prefixes = [0, 1000, 2000], []
    for k, lo in enumerate(offsets):
        docs = [rng.integers(lo, lo + 1000, rng.integers(5, 80)) for _ in range(60)]
        write_indexed(tmp_path / f"s{k}", docs, vocab_size=3000)
        prefixes.append(str(tmp_path / f"s{k}"))
    for weights in ([0.5, 0.3, 0.2], [7.0, 2.0, 1.0], [0.001, 0.499, 0.5]):
        sd = SampleDataset(list(zip(prefixes, weights)), 8, seed=1)
        n = 10_000
        tokens = sd.batch(0, n).tokens
        source = (tokens // 1000).numpy()
        assert (source == source[:, :1]).all()  # every sample from one source
        counts = np.bincount(source[:, 0], minlength=3)
        want = np.asarray(weights) / sum(weights) * n
        assert np.all(np.abs(counts - want) <= 0.01 * want), (weights, counts, want)
        # the schedule's bound (mcompile.apps.data.sampling): 1/2 + S/2 samples, plus n/(2P) from rounding weights
        assert np.abs(counts - want).max() < 0.5 + 3 / 2 + n / (2 * PERIOD)
    with pytest.raises(DataError, match="too small"):
        SampleDataset([(prefixes[0], 1.0), (prefixes[1], 1e-6)], 8)
    with pytest.raises(DataError, match="positive"):
        SampleDataset([(prefixes[0], 1.0), (prefixes[1], 0.0)], 8)


def test_split_by_documents(tmp_path):
    prefix, docs = _unique(tmp_path, 300, seed=5)
    where = _where(docs)
    parts = split_documents(len(docs), 0.1)
    assert len(parts["valid"]) == 30 and not set(parts["valid"]) & set(parts["train"])
    assert sorted([*parts["valid"], *parts["train"]]) == list(range(len(docs)))
    seen = {}
    for split in ("train", "valid"):
        sd = SampleDataset(prefix, 12, seed=0, split=split, valid_fraction=0.1)
        tok = sd.batch(0, len(sd)).tokens.numpy()
        seen[split] = set(where[tok.flatten()])
        assert seen[split] <= set(parts[split])  # a split's samples hold its documents only
        # the split is independent of the seed: every run validates on the same documents
        assert set(where[SampleDataset(prefix, 12, seed=9, split=split, valid_fraction=0.1)
                         .batch(0, len(sd)).tokens.numpy().flatten()]) <= set(parts[split])
    assert not seen["train"] & seen["valid"] and len(seen["valid"]) >= 20


def test_packing(tmp_path):
    prefix, docs = _unique(tmp_path, 100, seed=3, lo=1, hi=12)  # short documents: several per window
    where = _where(docs)
    sd = SampleDataset(prefix, 32, seed=2, valid_fraction=0.0, packing=True)
    plain = SampleDataset(prefix, 32, seed=2, valid_fraction=0.0)
    b = sd.batch(0, 20)
    assert torch.equal(b.tokens, plain.batch(0, 20).tokens)  # packing changes labels, not tokens
    doc = torch.from_numpy(where[b.tokens.numpy()])
    first = torch.from_numpy(np.array([int(d[0]) for d in docs]))[doc]  # the first id of each token's document
    new_doc = torch.cat([torch.ones(20, 1, dtype=torch.bool), doc[:, 1:] != doc[:, :-1]], 1)
    assert torch.equal(b.segment_ids, new_doc.long().cumsum(1) - 1)
    # positions: offset in the document, counted from the window's start for the first piece
    offset = b.tokens - first
    assert torch.equal(b.position_ids, torch.where(b.segment_ids == 0, offset - offset[:, :1], offset))
    nxt = torch.from_numpy(where[plain.batch(0, 20).targets.numpy()])
    crossing = nxt != doc
    assert crossing.any() and torch.equal(b.targets == -100, crossing)
    assert torch.equal(b.targets[~crossing], plain.batch(0, 20).targets[~crossing])
    m = document_mask(b.segment_ids)
    assert m.shape == (20, 32, 32)
    q, k = 7, 3
    assert torch.equal(m[:, q, k], b.segment_ids[:, q] == b.segment_ids[:, k]) and not m[:, k, q].any()
    single = sd[4]
    assert len(single) == 4 and torch.equal(single.segment_ids, b.segment_ids[4])


# --- errors users see ---------------------------------------------------------------------------------------


def test_errors(tmp_path):
    with pytest.raises(DataError, match=r"no tokenizer file at .*nope\.json.*tokenizer\.json.*tiktoken.*sentencepiece"):
        load_tokenizer(tmp_path / "nope.json")
    (tmp_path / "junk.bin").write_bytes(b"\x00\x01garbage")
    with pytest.raises(DataError, match="cannot tell which tokenizer"):
        load_tokenizer(tmp_path / "junk.bin")
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match="folder without a tokenizer.json"):
        load_tokenizer(tmp_path / "folder")
    (tmp_path / "folder" / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": {}, '
                                                        '"merges": []}, "added_tokens": []}')
    with pytest.raises(DataError, match=r"no EOS token found.*pass eos="):
        load_tokenizer(tmp_path / "folder")
    assert load_tokenizer(tmp_path / "folder", eos=7).eos_id == 7
    (tmp_path / "bad.model").write_bytes(b"\n\x05junk!")
    with pytest.raises(DataError, match="not a readable sentencepiece model"):
        load_tokenizer(tmp_path / "bad.model")
    (tmp_path / "bad.tiktoken").write_text("dGhl 0\nnot base64!! x\n")
    with pytest.raises(DataError, match=r"bad\.tiktoken:2: not a tiktoken ranks line"):
        load_tokenizer(tmp_path / "bad.tiktoken")
    with pytest.raises(DataError, match="not a dataset prefix"):
        IndexedDataset(tmp_path / "missing")

    docs = _docs(1, 20, 500)
    write_indexed(tmp_path / "d", docs, vocab_size=500)
    idx, bin_ = (tmp_path / "d.idx").read_bytes(), (tmp_path / "d.bin").read_bytes()
    write_indexed(tmp_path / "m", docs, vocab_size=500, meta={"tokenizer": {"path": "t.json"}})
    meta_idx = (tmp_path / "m.idx").read_bytes()
    cases = {
        "truncated": (idx[:-5], bin_),
        "shorter than the header": (idx[:20], bin_),
        "not an mcompile token index": (b"XXXXXXXX" + idx[8:], bin_),
        "format version 9": (idx[:8] + struct.pack("<I", 9) + idx[12:], bin_),
        "checksum": (idx[:33] + bytes([idx[33] ^ 1]) + idx[34:], bin_),  # a bit flipped in vocab_size
        "checksum mismatch": (meta_idx[:49] + bytes([meta_idx[49] ^ 1]) + meta_idx[50:], bin_),  # ... in the meta
        "expected": (idx, bin_[:-2]),  # the .bin lost a token
        "corrupt document offsets": (idx[:-16] + struct.pack("<q", 10**6) + idx[-8:], bin_),
    }
    for message, (i, b) in cases.items():
        (tmp_path / "c.idx").write_bytes(i)
        (tmp_path / "c.bin").write_bytes(b)
        with pytest.raises(DataError, match=message) as e:
            IndexedDataset(tmp_path / "c")
        assert "rebuild" in str(e.value) or "version" in str(e.value)

    (tmp_path / "k.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError, match=r"k\.jsonl:2: no 'text' key \(found 'body'\).*--text-key"):
        preprocess([tmp_path / "k.jsonl"], tmp_path / "k", tiny_tokenizer(), progress=False)
    assert not (tmp_path / "k.idx").exists()
    (tmp_path / "j.jsonl").write_text("{not json\n")
    with pytest.raises(DataError, match=r"j\.jsonl:1: not a JSON line"):
        preprocess([tmp_path / "j.jsonl"], tmp_path / "j", tiny_tokenizer(), progress=False)
    with pytest.raises(DataError, match="no input file"):
        preprocess([tmp_path / "absent.jsonl"], tmp_path / "a", tiny_tokenizer(), progress=False)
    with pytest.raises(DataError, match=r"'valid' split has \d+ tokens.*lower seq_len"):
        SampleDataset(tmp_path / "d", 400, split="valid")
    with pytest.raises(DataError, match="seq_len"):
        SampleDataset(tmp_path / "d", 0)
    with pytest.raises(IndexError, match="start at 0"):
        SampleDataset(tmp_path / "d", 8)[-1]


def test_cli_in_process(tmp_path, capsys):
    import argparse

    from mcompile.apps.data import cli

    parser = argparse.ArgumentParser(prog="mcompile")
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["preprocess", str(tiny_corpus()), "--tokenizer", str(tiny_tokenizer()),
                              "--output", str(tmp_path / "tiny"), "--no-progress", "--json"])
    assert cli.run(args) == 0
    stats = json.loads(capsys.readouterr().out)
    ds = IndexedDataset(tmp_path / "tiny")
    assert stats["documents"] == len(ds) == len(tiny_corpus().read_text().splitlines())
    assert stats["tokens"] == ds.num_tokens
    tok = load_tokenizer(tiny_tokenizer())
    first = json.loads(tiny_corpus().read_text().splitlines()[0])["text"]
    assert ds[0].tolist() == tok.encode(first) + [tok.eos_id]
    args = parser.parse_args(["preprocess", str(tiny_corpus()), "--tokenizer", str(tmp_path / "no.json"),
                              "--output", str(tmp_path / "x"), "--no-eos"])
    assert cli.run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("mcompile: error: no tokenizer file at") and "\n" == err[-1]
    # python -m mcompile.apps.data.cli: the same command
    (tmp_path / "t.txt").write_text("Tom has a cup.\nAnna has a hat.\n")
    assert cli.main([str(tmp_path / "t.txt"), "--tokenizer", str(tiny_tokenizer()), "--output",
                     str(tmp_path / "t"), "--txt-split", "line", "--no-progress"]) == 0
    assert [tok.decode(d[:-1]) for d in IndexedDataset(tmp_path / "t")] == ["Tom has a cup.", "Anna has a hat."]
    assert "2 documents" in capsys.readouterr().out


def test_tiny_corpus_is_learnable(tmp_path):
    """The shipped corpus is what the trainer's demo learns from: llama3-tiny's loss falls clearly in 60
    steps on it (Adam, lr 3e-3, batch 8 x 64; about 5.5 = ln 256 at the start)."""
    from mcompile.apps.data import tiny_dataset
    from mcompile.models import get_preset

    prefix = tiny_dataset(tmp_path)
    assert tiny_dataset(tmp_path) == prefix and IndexedDataset(prefix).meta["tiny"]  # made once
    sd = SampleDataset(prefix, 64, seed=0)
    torch.manual_seed(0)
    model = get_preset("llama3-tiny").build()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 3 s alone; many threads on a shared 2-core machine take 15x longer
    try:
        for step in range(60):
            tokens, targets = sd.batch(step * 8, 8)
            loss = model(tokens, targets)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        valid = SampleDataset(prefix, 64, split="valid")
        with torch.no_grad():
            held_out = float(model(*valid.batch(0, 16)))
    finally:
        torch.set_num_threads(threads)
    assert losses[0] > 5.0 and sum(losses[-5:]) / 5 < 2.5 and held_out < 2.5, (losses[::10], held_out)
