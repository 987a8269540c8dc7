"""Make the tiny corpus, its tokenizer and a LAMBADA-style last-word set shipped in mcompile/apps/data/assets/.

    python scripts/make_tiny_corpus.py            # rewrites the three files (deterministic)
    python scripts/make_tiny_corpus.py --check    # regenerates in memory and fails if the files differ

Nothing is downloaded: the text comes from a small template grammar of short stories (people, things,
places, counting), generated with a seeded ``random.Random`` (its stream is stable across Python
versions), so a tiny Llama's loss falls clearly within a few hundred steps. The stories carry facts
across sentences (who has which thing, how many apples) so that a model must look back to predict a
word, which is what the last-word set measures (the idea of LAMBADA: Paperno et al., 2016,
arXiv:1606.06031; the texts here are our own synthetic ones).

Outputs (under mcompile/apps/data/assets/):

- ``tiny_corpus.jsonl``: one ``{"text": story}`` per line;
- ``tokenizer.json``: a BPE trained on the corpus with Hugging Face ``tokenizers``: vocabulary exactly
  256 (llama3-tiny's), ``<|endoftext|>`` (id 0, the EOS) and ``<unk>`` (id 1) special, every printable
  ASCII character in its alphabet, a Metaspace pre-tokenizer and decoder so that
  ``decode(encode(text)) == text`` for ASCII text (other characters become ``<unk>``);
- ``tiny_lambada.jsonl``: ``{"text": ...}`` lines, held-out stories whose last word (a name or a thing
  named earlier in the story) is predictable from the context only.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "mcompile" / "apps" / "data" / "assets"
VOCAB = 256
EOS, UNK = "<|endoftext|>", "<unk>"

NAMES = ["Tom", "Anna", "Ben", "Lily", "Max", "Mia", "Sam", "Zoe", "Leo", "Ella", "Jack", "Rosa"]
THINGS = ["ball", "book", "kite", "cup", "hat", "box", "bike", "drum", "coat", "lamp"]
COLORS = ["red", "blue", "green", "yellow", "black", "white", "pink", "brown"]
PLACES = ["park", "garden", "school", "shop", "kitchen", "forest", "beach", "town"]
ANIMALS = ["cat", "dog", "bird", "fish", "horse", "duck", "frog", "rabbit"]
FEELINGS = ["happy", "sad", "tired", "hungry", "excited", "angry"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def _two(rng: random.Random, pool: list[str]) -> tuple[str, str]:
    a, b = rng.sample(pool, 2)
    return a, b


def gift(rng):
    a, b = _two(rng, NAMES)
    c, t = rng.choice(COLORS), rng.choice(THINGS)
    return (f"{a} has a {c} {t}. {b} wants to play with the {t}. {a} gives the {c} {t} to {b}. "
            f"{b} is {rng.choice(['happy', 'excited'])} and says thank you to {a}.")


def walk(rng):
    a, b = _two(rng, NAMES)
    p, n = rng.choice(PLACES), rng.choice(ANIMALS)
    f = rng.choice(FEELINGS)
    return (f"On {rng.choice(DAYS)}, {a} and {b} go to the {p}. In the {p} they see a {n}. "
            f"The {n} is {f}. {a} likes the {n}, but {b} does not like the {n}.")


def found(rng):
    a = rng.choice(NAMES)
    c, t, p = rng.choice(COLORS), rng.choice(THINGS), rng.choice(PLACES)
    return (f"{a} lost a {c} {t} in the {p}. {a} looks for the {t} all day. "
            f"At last {a} finds the {c} {t} under a tree in the {p}. Now {a} is happy again.")


def count(rng):
    a, b = _two(rng, NAMES)
    k = rng.randrange(0, 8)
    m = rng.randrange(1, 10 - k)
    return (f"{a} has {NUMBERS[k]} apples. {b} gives {a} {NUMBERS[m - 1]} more. "
            f"Now {a} has {NUMBERS[k + m]} apples. {a} eats one apple. Then {a} has {NUMBERS[k + m - 1]} apples.")


def day(rng):
    a = rng.choice(NAMES)
    f = rng.choice(FEELINGS)
    why = {"happy": "the sun is out", "sad": "it is raining", "tired": "it is late",
           "hungry": "it is time to eat", "excited": "today is a big day", "angry": "the bike is broken"}[f]
    return (f"{a} is {f} because {why}. {a} goes to the {rng.choice(PLACES)} with a {rng.choice(COLORS)} "
            f"{rng.choice(THINGS)}. When {a} comes home, {a} is not {f} any more.")


STORIES = [gift, walk, found, count, day]


# LAMBADA-style items: the last word is named earlier in the story, and only the context says which
def lambada_item(rng):
    kind = rng.randrange(3)
    a, b = _two(rng, NAMES)
    c, t, p = rng.choice(COLORS), rng.choice(THINGS), rng.choice(PLACES)
    if kind == 0:  # who says thank you to whom
        return (f"{a} has a {c} {t}. {b} wants to play with the {t}. {a} gives the {c} {t} to {b}. "
                f"{b} says thank you to {a}")
    if kind == 1:  # which thing was lost and found
        return f"{a} lost a {c} {t} in the {p}. {a} looks for it all day. At last {a} finds the {c} {t}"
    n = rng.choice(ANIMALS)  # which animal was seen
    return f"{a} and {b} go to the {p}. In the {p} they see a {n}. {a} likes the {n}, but {b} does not like the {n}"


def corpus(n_docs: int = 1400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        k = rng.randrange(1, 4)  # one to three stories per document
        docs.append(" ".join(rng.choice(STORIES)(rng) for _ in range(k)))
    return docs


def lambada(n_items: int = 300, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    return [lambada_item(rng) for _ in range(n_items)]


def train_tokenizer(docs: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="never")
    # every printable ASCII character and the newline are in the alphabet, so any ASCII text round-trips
    alphabet = [c for c in string.printable if c not in "\r\x0b\x0c"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS, UNK], initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    if tok.get_vocab_size() != VOCAB:
        raise SystemExit(f"the tokenizer has {tok.get_vocab_size()} tokens, not {VOCAB}: grow the corpus")
    for text in [*docs[:200], "".join(alphabet), "two  spaces,\n\nnew lines"]:
        if tok.decode(tok.encode(text).ids) != text:
            raise SystemExit(f"the tokenizer does not round-trip {text!r}")
    return tok


def outputs() -> dict[str, str]:
    docs = corpus()
    tok = train_tokenizer(docs)
    held = set(docs)
    items = list(dict.fromkeys(t for t in lambada() if t not in held))  # distinct, in order
    return {
        "tiny_corpus.jsonl": "".join(json.dumps({"text": d}) + "\n" for d in docs),
        "tokenizer.json": tok.to_str(pretty=True) + "\n",
        "tiny_lambada.jsonl": "".join(json.dumps({"text": t}) + "\n" for t in items),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed files differ from a fresh make")
    args = ap.parse_args()
    made = outputs()
    if args.check:
        stale = [n for n, text in made.items() if not (ASSETS / n).exists() or (ASSETS / n).read_text() != text]
        if stale:
            print(f"out of date: {', '.join(stale)} (run python scripts/make_tiny_corpus.py)", file=sys.stderr)
            return 1
        print("assets up to date")
        return 0
    ASSETS.mkdir(parents=True, exist_ok=True)
    for name, text in made.items():
        (ASSETS / name).write_text(text)
        print(f"wrote {ASSETS / name} ({len(text.encode()) / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
