"""What a training step asks the model to predict: one definition per kind of model, decided here.

The data hands every step ``(tokens, targets)``: windows of ``seq_len + 1`` tokens of the corpus cut
into the first ``seq_len`` and the last ``seq_len``, so ``targets[:, t]`` is the token after
``tokens[:, t]`` (``-100`` where a packed sample's target crosses into the next document). Models do
not agree on what they want from that:

- ``next-token`` (our presets, ``model.factory`` models): ``model(tokens, targets)`` with the targets
  as they are: the model does not shift them (Megatron's convention).
- ``causal-lm`` (a Hugging Face decoder, ``model.hf``): ``model(input_ids, labels)`` where the model
  shifts ``labels`` itself (``logits[:, :-1]`` against ``labels[:, 1:]``). The labels are the tokens
  (``labels = input_ids``), with the targets' ignored positions carried over: ``labels[:, t] =
  targets[:, t - 1]``, which equals ``tokens[:, t]`` wherever the target is not ignored. The loss is
  then exactly the model's own ``model(tokens, labels=tokens).loss`` on unpacked data; the last
  position's target goes unused (HF's convention has no label for it). Handing HF the shifted targets
  would make it learn the token two ahead.
- ``masked-lm`` (a Hugging Face encoder such as BERT / RoBERTa): BERT's masking (Devlin et al. 2019,
  §3.1): 15% of the positions are chosen, of those 80% become the mask token, 10% a random token and 10%
  stay; ``labels`` holds the original token at the chosen positions and ``-100`` elsewhere. The choice
  is drawn from a generator seeded by ``(train.seed, the batch's first sample index)`` for the whole global
  batch's shape, so a resumed run and every rank mask the same positions (a rank given only its rows of the
  batch cuts its rows out of the whole batch's draws).
- ``seq2seq`` (a Hugging Face encoder-decoder such as T5): the window's first half is the encoder's
  input and the next as many tokens the decoder's labels (the model makes its decoder inputs by
  shifting them right): continuation of a prefix.

``auto`` (the default) picks ``next-token`` for presets and factories, and for ``model.hf`` reads the
config: an encoder-decoder is ``seq2seq``, an ``architectures`` entry ending in ``ForMaskedLM`` (or an
encoder-only ``model_type``) ``masked-lm``, anything else ``causal-lm``.

Nothing here imports torch at module level: the config check resolves the kind before any process starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KINDS", "Objective", "hf_kind", "resolve"]

KINDS = ("auto", "next-token", "causal-lm", "masked-lm", "seq2seq")
IGNORE = -100
# encoder-only families whose configs may not list an architecture (HF's masked-LM model types)
_ENCODERS = {"bert", "roberta", "xlm-roberta", "distilbert", "electra", "albert", "deberta", "deberta-v2",
             "camembert", "mpnet", "megatron-bert", "modernbert", "esm", "nomic_bert"}
_AUTO_CLASS = {"causal-lm": "AutoModelForCausalLM", "masked-lm": "AutoModelForMaskedLM",
               "seq2seq": "AutoModelForSeq2SeqLM"}


def _read_config(path: str) -> dict:
    p = Path(path)
    f = p if p.is_file() else p / "config.json"
    return json.loads(f.read_text())


def hf_kind(config: dict) -> str:
    """The objective of a Hugging Face config (its ``config.json`` as a dict)."""
    if config.get("is_encoder_decoder"):
        return "seq2seq"
    archs = config.get("architectures") or []
    if any(a.endswith("ForMaskedLM") for a in archs):
        return "masked-lm"
    if not archs and config.get("model_type") in _ENCODERS:
        return "masked-lm"
    return "causal-lm"


def _mask_token_from_folder(path: str) -> int | None:
    """The mask token's id from the tokenizer files of a Hugging Face model folder, if it has them."""
    p = Path(path)
    if p.is_file():
        p = p.parent
    from mcompile.apps.data.tokenizer import _hf_config

    mask = _hf_config(p / "tokenizer.json").get("mask_token")
    try:
        tj = json.loads((p / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    for tok in tj.get("added_tokens", []):
        if tok.get("content") == (mask or "[MASK]") or (mask is None and tok.get("content") == "<mask>"):
            return int(tok["id"])
    vocab = (tj.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and mask in vocab:
        return int(vocab[mask])
    return None


@dataclass(frozen=True)
class Objective:
    """The model inputs of one step from the data's ``(tokens, targets)``: see the module docstring."""

    kind: str
    seed: int = 0
    mask_token_id: int = -1  # masked-lm only
    vocab_size: int = 0  # masked-lm: the range of the random replacement tokens
    mask_prob: float = 0.15

    @property
    def auto_class(self) -> str | None:
        """The transformers Auto class that builds this kind of Hugging Face model."""
        return _AUTO_CLASS.get(self.kind)

    def describe(self) -> str:
        return {"next-token": "next token (targets as given)",
                "causal-lm": "next token (labels = input_ids, shifted by the model)",
                "masked-lm": f"masked tokens ({self.mask_prob:.0%} of positions, mask id {self.mask_token_id})",
                "seq2seq": "continuation (encoder: first half of each window, labels: second half)"}[self.kind]

    def inputs(self, tokens, targets, start: int = 0, *, rows: range | None = None, batch: int | None = None) -> tuple:
        """``(inputs, labels)`` for ``pm.train_step`` / ``pm.forward`` from one batch of the data, whose
        first sample is number ``start`` (seeds the masked-LM draw). ``rows``, ``batch``: the given tokens are
        only rows ``rows`` of that batch of ``batch`` samples (one data rank's slice); the result is those rows
        of the whole batch's (each kind is row by row, the masked-LM draw made for the whole batch's shape)."""
        import torch

        if rows is not None and (len(rows) != tokens.shape[0] or batch is None or rows.stop > batch):
            raise ValueError(f"inputs: rows {rows} of a batch of {batch} do not match {tokens.shape[0]} rows of tokens")
        if self.kind == "next-token":
            return tokens, targets
        if self.kind == "causal-lm":
            labels = tokens.clone()
            labels[:, 1:] = targets[:, :-1]  # = tokens[:, 1:] where not ignored; position 0 the model never scores
            return tokens, labels
        if self.kind == "seq2seq":
            half = tokens.shape[1] // 2  # labels = tokens[:, half:2 half] where not ignored: as long as the input
            return tokens[:, :half].contiguous(), targets[:, half - 1:2 * half - 1].contiguous()
        # masked-lm: every draw is made for the whole batch's shape, then cut to the given rows (the same masks
        # whichever rows a rank holds)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(start))
        shape = (tokens.shape[0] if rows is None else batch, *tokens.shape[1:])
        cut = slice(0, shape[0]) if rows is None else slice(rows.start, rows.stop)
        chosen = torch.rand(shape, generator=g) < self.mask_prob
        # at least one chosen position per sample: the loss of a sample with none would be 0/0 for a batch of one
        first = torch.rand(shape, generator=g).argmin(dim=1)
        chosen[torch.arange(shape[0]), first] = True
        how = torch.rand(shape, generator=g)
        random_ids = torch.randint(0, max(self.vocab_size, 1), shape, generator=g)
        chosen, how, random_ids = chosen[cut], how[cut], random_ids[cut]
        labels = torch.where(chosen, tokens, torch.full_like(tokens, IGNORE))
        ids = tokens.clone()
        ids[chosen & (how < 0.8)] = self.mask_token_id
        swap = chosen & (how >= 0.8) & (how < 0.9)
        ids[swap] = random_ids[swap]
        return ids, labels

    def window_columns(self, positions: list, seq_len: int):
        """The positions of the data's windows (``seq_len + 1`` tokens: token ``t`` is position ``t``, target ``t``
        position ``t + 1``) that :meth:`inputs` reads to fill the given positions of its results: ``positions``
        per result (an int64 tensor of positions along its dim 1, or None for all of them; a context-parallel
        rank's share, ``ParallelModule.input_positions``). A numpy array, or None for the whole window. Every kind
        is position by position (the masked-LM draw is made for the whole shape whatever is read)."""
        import numpy as np

        if any(p is None for p in positions[:2]):
            return None
        half = seq_len // 2
        # per result, the window position its position p is read from
        shift = {"next-token": (0, 1), "causal-lm": (0, 0), "masked-lm": (0, 0), "seq2seq": (0, half)}[self.kind]
        return np.unique(np.concatenate([np.asarray(p, dtype=np.int64) + k for p, k in zip(positions, shift)]))

    def counted(self, inputs: tuple, positions=None) -> int:
        """How many targets the model's mean loss averages over for these inputs (``positions``: only at these
        positions of the labels, a context-parallel rank's share)."""
        labels = inputs[1]
        scored = (labels != IGNORE)
        if self.kind == "causal-lm":
            scored[:, 0] = False  # the model scores labels[:, 1:]
        if positions is not None:
            scored = scored[:, positions]
        return int(scored.sum())


def resolve(cfg, *, vocab_size: int = 0) -> Objective:
    """The objective of a run: ``model.objective``, or for ``auto`` the model's own convention."""
    from mcompile.apps.train.config import ConfigError

    m = cfg.model
    kind = m.objective
    if kind == "auto":
        kind = hf_kind(_read_config(m.hf)) if m.hf else "next-token"
    if kind != "next-token" and not m.hf:
        raise ConfigError(f"model.objective = {kind!r} is for Hugging Face models (model.hf); presets and factories "
                          "take (tokens, targets) as they are: use \"next-token\" or \"auto\"")
    mask = m.mask_token_id
    if kind == "masked-lm" and mask < 0:
        found = _mask_token_from_folder(m.hf)
        if found is None:
            raise ConfigError(f"model.hf = {m.hf!r} trains as a masked LM, and no mask token was found (no "
                              "tokenizer.json / tokenizer_config.json with one beside its config.json): set "
                              "model.mask_token_id")
        mask = found
    return Objective(kind, seed=cfg.train.seed, mask_token_id=mask, vocab_size=vocab_size)
