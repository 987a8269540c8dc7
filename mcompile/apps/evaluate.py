"""Evaluation: perplexity over a held-out split, and LAMBADA-style last-word accuracy.

- :func:`perplexity` ``(pm, dataset, batch_size=)``: the token-weighted mean cross-entropy over the
  batches of a held-out split, and its exponential. Each batch's loss is the model's own mean over its
  counted tokens (the targets that are not ``ignore_index``; a ParallelModule's ``forward`` reduces it
  over data parallelism the same way, mcompile's token-weighted loss), and the batches are weighted by
  their token counts, as Megatron-LM's evaluation sums loss and tokens over its evaluation iterations:

      loss = sum_b (mean_b * n_b) / sum_b n_b,     ppl = exp(loss),

  accumulated in float64.

- :func:`last_word_accuracy` ``(model_or_pm, tokenizer, jsonl)``: the LAMBADA task (Paperno et al. 2016,
  "The LAMBADA dataset: Word prediction requiring a broad discourse context", ACL): each line
  ``{"text": ...}`` of the JSONL file is a passage whose last whitespace-separated word is the target. The
  context is the text before it (stripped), encoded alone; the target is ``" " + word``, encoded alone
  and appended (so a BPE tokenizer sees the word with its leading space, as in running text). A passage
  counts as right when the greedy argmax at every target position is the target token — all the word's
  tokens, not only its first (the strict criterion of Megatron-LM's LAMBADA evaluation). The
  logits come from a logits program: ``mcompile.parallelize(model, mesh, (ids,), weights=...)`` (captured
  without targets, ``forward`` returns the logits of the whole batch on every rank), made here when a
  plain model and ``mesh=`` are given, or the plain model itself on one device.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from pathlib import Path

import torch
import torch.nn as nn

__all__ = ["last_word_accuracy", "perplexity"]


def _is_parallel(m) -> bool:
    from mcompile.runtime.module import ParallelModule

    return isinstance(m, ParallelModule)


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    """``model.eval()`` for the duration (dropout off), then the mode it had."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def _loss_of(out) -> torch.Tensor:
    loss = getattr(out, "loss", out)  # a Hugging Face ModelOutput's loss, or the tensor itself
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        raise TypeError(f"perplexity needs a model whose forward(tokens, targets) returns a scalar loss (the mean "
                        f"cross-entropy); it returned {type(out).__name__}"
                        + (f" of shape {list(out.shape)}" if isinstance(out, torch.Tensor) else ""))
    return loss


@torch.no_grad()
def perplexity(pm, dataset, *, batch_size: int, max_batches: int | None = None, start: int = 0,
               ignore_index: int = -100, objective=None) -> dict:
    """``{"loss", "ppl", "tokens", "batches"}`` over the full batches of ``dataset`` (``len(dataset)`` samples,
    ``dataset.batch(first, n) -> (tokens, targets)``, such as ``mcompile.apps.data.SampleDataset(...,
    split="valid")``) from sample ``start``, ``max_batches`` at most: the token-weighted mean cross-entropy
    (see the module docstring) and its exponential. ``pm``: a ParallelModule of a loss (collective: call it on
    every rank with the same dataset; each rank gets the same numbers) or a plain module,
    ``model(tokens, targets) -> mean loss``. The targets are aligned with the tokens (the model does not shift
    them: our presets, Megatron's convention) and ``ignore_index`` targets are not counted. A last batch
    shorter than ``batch_size`` is left out (a data-parallel batch must split evenly). ``objective``: a
    :class:`mcompile.apps.train.objective.Objective` (what ``mcompile train`` trained: a Hugging Face model's labels
    convention) that turns each batch into the model's inputs and says how many targets its mean counts. A
    ParallelModule made with ``inputs="local"``: each rank reads only its share of each batch (its rows, a cp
    rank its positions of each sequence), as ``mcompile train`` does."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: give at least 1")
    from mcompile.ir.config import Inputs

    parallel = _is_parallel(pm)
    if parallel:
        dp = pm.mesh.size("dp")
        if batch_size % dp:
            raise ValueError(f"batch_size={batch_size} does not split over dp={dp}: give a multiple of {dp}")
        if not pm._token_weighted:
            raise ValueError("perplexity weights each batch by its token count, and this ParallelModule's loss is "
                             "not one mcompile recognised as a token mean (F.cross_entropy with its default "
                             "reduction and ignore_index): its per-rank means would be averaged unweighted")
    n = (len(dataset) - start) // batch_size
    if max_batches is not None:
        n = min(n, max_batches)
    if n < 1:
        raise ValueError(f"the dataset holds {len(dataset)} samples: not one batch of {batch_size} from sample "
                         f"{start}; give a smaller batch_size")
    if parallel and pm.config.inputs == Inputs.LOCAL:
        return _perplexity_local(pm, dataset, batch_size, n, start, ignore_index, objective)
    total, count = 0.0, 0
    ctx = contextlib.nullcontext() if parallel else _eval_mode(pm)
    with ctx:
        for b in range(n):
            sample = dataset.batch(start + b * batch_size, batch_size)
            if getattr(sample, "segment_ids", None) is not None:
                raise ValueError("perplexity evaluates whole samples, and this split is packed (its samples hold "
                                 "several documents that a model of (tokens, targets) would attend across): "
                                 "build the held-out split with packing=False")
            tokens, targets = torch.as_tensor(sample[0]), torch.as_tensor(sample[1])
            if objective is not None:
                args = objective.inputs(tokens, targets, start + b * batch_size)
                k = objective.counted(args)
            else:
                args, k = (tokens, targets), int((targets != ignore_index).sum())
            if k == 0:
                continue  # no counted token: the model's mean is 0/0
            loss = pm.forward(*args) if parallel else _loss_of(pm(*args))
            _loss_of(loss)
            total += float(loss.double()) * k
            count += k
    return _result(total, count, n, ignore_index)


def _result(total: float, count: int, n: int, ignore_index: int) -> dict:
    if count == 0:
        raise ValueError(f"every target of the {n} batch(es) is ignore_index={ignore_index}: nothing to evaluate")
    loss = total / count
    return {"loss": loss, "ppl": math.exp(loss), "tokens": count, "batches": n}


def _perplexity_local(pm, dataset, batch_size: int, n: int, start: int, ignore_index: int, objective) -> dict:
    """:func:`perplexity` of a ParallelModule made with ``inputs="local"``: each rank reads only its rows of each
    batch, and a cp rank only its positions of their sequences (mcompile.apps.train.reads.Reader, as ``mcompile
    train`` reads); the counts summed over the ranks in one all-reduce per batch. The same numbers as reading the
    whole batch with a ``inputs="global"`` module."""
    from mcompile.apps.train.objective import IGNORE, Objective
    from mcompile.apps.train.reads import Reader

    if getattr(dataset, "packing", False):
        raise ValueError("perplexity evaluates whole samples, and this split is packed (its samples hold several "
                         "documents that a model of (tokens, targets) would attend across): build the held-out split "
                         "with packing=False")
    if objective is None and ignore_index != IGNORE:
        raise ValueError(f"ignore_index={ignore_index}: a ParallelModule with inputs=\"local\" counts the targets "
                         f"that are not {IGNORE} (the objective's convention); use a module with inputs=\"global\"")
    seq_len = getattr(dataset, "seq_len", None)
    if seq_len is None:  # a pipeline rank that reads nothing passes zeros of the inputs' shape
        seq_len = int(torch.as_tensor(dataset.batch(start, 1)[0]).shape[1])
    reader = Reader(pm, objective or Objective("next-token"), int(seq_len), local=True)
    total, count = 0.0, 0
    for b in range(n):
        inputs, tokens = reader.read(dataset, start + b * batch_size, batch_size)
        k = reader.counted(inputs, tokens, batch_size, dataset)
        if k == 0:
            continue  # no counted token: the model's mean is 0/0
        loss = _loss_of(pm.forward(*inputs))
        total += float(loss.double()) * k
        count += k
    return _result(total, count, n, ignore_index)


# -- last-word accuracy -----------------------------------------------------------------------------
def _passages(jsonl_path, limit: int | None) -> list[str]:
    path = Path(os.fspath(jsonl_path))
    texts = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
                if not isinstance(text, str):
                    raise TypeError("not a string")
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a \"text\" string ({e})") from e
            if len(text.split()) < 2:
                raise ValueError(f"{path}:{lineno}: the passage has fewer than two words: no context for its last")
            texts.append(text)
            if limit is not None and len(texts) >= limit:
                break
    if not texts:
        raise ValueError(f"{path}: no passage (one {{\"text\": ...}} object per line)")
    return texts


def split_last_word(text: str) -> tuple[str, str]:
    """``(context, target)``: the text before the last whitespace-separated word (stripped), and that word
    with one leading space."""
    word = text.split()[-1]
    return text[: text.rstrip().rfind(word)].strip(), " " + word


def _encode(tokenizer, texts: list[str], max_seq_len: int | None) -> list[tuple[list[int], int]]:
    """Per passage: the ids (context then target, the context cut from the left to fit ``max_seq_len``)
    and how many of the last ids are the target."""
    out = []
    for text in texts:
        context, target = split_last_word(text)
        c, t = list(tokenizer.encode(context)), list(tokenizer.encode(target))
        if not t:
            raise ValueError(f"the tokenizer encodes the last word {target!r} as no token")
        if max_seq_len is not None:
            if len(t) >= max_seq_len:
                raise ValueError(f"the last word {target!r} is {len(t)} tokens, max_seq_len={max_seq_len}")
            c = c[max(0, len(c) + len(t) - max_seq_len):]
        if not c:
            raise ValueError(f"the passage {text[:60]!r} has no context tokens")
        out.append((c + t, len(t)))
    return out


def _logits_of(out) -> torch.Tensor:
    logits = getattr(out, "logits", out)
    if isinstance(logits, tuple | list) and logits:
        logits = logits[0]
    if not isinstance(logits, torch.Tensor) or logits.ndim != 3:
        what = f"a tensor of shape {list(logits.shape)}" if isinstance(logits, torch.Tensor) else type(out).__name__
        raise TypeError(f"last_word_accuracy needs logits [batch, seq, vocab] from forward(ids), got {what}: "
                        "parallelize the model with example inputs (ids,) only (no targets), so that forward "
                        "returns the logits")
    return logits


@torch.no_grad()
def last_word_accuracy(model_or_pm, tokenizer, jsonl_path, *, mesh=None, weights=None, batch_size: int = 8,
                       max_seq_len: int | None = None, pad_multiple: int = 16, limit: int | None = None) -> dict:
    """``{"accuracy", "correct", "n"}``: the LAMBADA criterion (module docstring) over the passages of
    ``jsonl_path`` (``limit``: the first ones).

    ``model_or_pm``: a logits ParallelModule (``parallelize(model, mesh, (ids,))``; collective), or a plain
    model returning logits from ``model(ids)`` (a ``ModelOutput``'s ``.logits`` too; a
    :class:`~mcompile.models.hf.CausalLMLoss` is unwrapped): with ``mesh=`` it is parallelized here
    (``weights=``: a checkpoint to read into it, as :func:`mcompile.parallelize`'s), else run on this device.
    ``tokenizer``: ``encode(text) -> list[int]``, ``eos_id`` (the padding id; padding is on the right,
    which a causal model never attends to). Passages are batched by ``batch_size`` (a multiple of dp; a
    last short batch is filled with copies that are not counted), padded to a multiple of
    ``pad_multiple`` tokens (sequence parallelism needs the length to split over tp); ``max_seq_len`` cuts
    the context from the left."""
    from mcompile.models.hf import CausalLMLoss

    if weights is not None and (mesh is None or _is_parallel(model_or_pm)):
        raise ValueError("weights= is read when the model is parallelized here: give a plain model and mesh= "
                         "(or pass weights= to your own parallelize)")
    texts = _passages(jsonl_path, limit)
    encoded = _encode(tokenizer, texts, max_seq_len)
    pad_id = getattr(tokenizer, "eos_id", None)
    pad_id = 0 if pad_id is None else int(pad_id)
    run = model_or_pm
    if isinstance(run, CausalLMLoss):
        run = run.m
    if not _is_parallel(run) and mesh is not None:
        import mcompile as mc

        if isinstance(mesh, str):
            mesh = mc.Mesh.parse(mesh)
        example = torch.full((batch_size, pad_multiple), pad_id, dtype=torch.long)
        with warnings.catch_warnings():  # a logits program is what we ask for: not worth an OutputWarning
            warnings.simplefilter("ignore", mc.OutputWarning)
            run = mc.parallelize(run, mesh, (example,), weights=weights)
    parallel = _is_parallel(run)
    if parallel and batch_size % run.mesh.size("dp"):
        raise ValueError(f"batch_size={batch_size} does not split over dp={run.mesh.size('dp')}")
    correct = 0
    ctx = contextlib.nullcontext() if parallel else _eval_mode(run)
    with ctx:
        for first in range(0, len(encoded), batch_size):
            rows = encoded[first:first + batch_size]
            length = max(len(ids) for ids, _ in rows)
            length = -(-length // pad_multiple) * pad_multiple
            ids = torch.full((batch_size, length), pad_id, dtype=torch.long)
            for r in range(batch_size):  # a short last batch: rows repeated, not counted
                seq = rows[r % len(rows)][0]
                ids[r, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            logits = _logits_of(run.forward(ids) if parallel else run(ids))
            for r, (seq, k) in enumerate(rows):
                # the logits at position p predict the token at p + 1: the target's k tokens come from
                # positions len - k - 1 .. len - 2
                pred = logits[r, len(seq) - k - 1:len(seq) - 1].argmax(-1)
                correct += bool(torch.equal(pred.cpu(), torch.tensor(seq[-k:], dtype=pred.dtype)))
    return {"accuracy": correct / len(encoded), "correct": correct, "n": len(encoded)}
