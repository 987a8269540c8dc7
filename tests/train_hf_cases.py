"""Tiny Hugging Face models saved with ``save_pretrained``, and what the gloo workers of
tests/test_train_hf.py run: ``mcompile train`` on them, then ``mcompile eval`` / ``generate`` on the run's
checkpoint in the same processes.

The configs are tiny but as they come: the decoder has 4 layers (block repetition on), untied head, GQA.
Dropout is 0 so that the loss a step reports can be compared with the Hugging Face model's own loss.
"""

from __future__ import annotations

from pathlib import Path

VOCAB = 256  # the shipped tiny tokenizer's


def save_hf(kind: str, folder: Path, seed: int = 0) -> Path:
    """A tiny ``kind`` model ("llama" | "bert" | "t5") written with save_pretrained into ``folder``."""
    import torch
    import transformers as hf
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(seed)
    if kind == "llama":
        model = hf.LlamaForCausalLM(hf.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False))
    elif kind == "bert":
        model = hf.BertForMaskedLM(hf.BertConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    elif kind == "t5":
        model = hf.T5ForConditionalGeneration(hf.T5Config(
            vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    else:
        raise ValueError(kind)
    model.save_pretrained(folder)
    return folder


def train_then_read(rank, world, tree: dict, read: bool):
    """Train as ``tree`` says; with ``read``, then ``mcompile eval`` and a greedy ``mcompile generate`` of the
    run's newest checkpoint under the run's mesh (the commands' own entry functions)."""
    from mcompile.apps.train.commands import _eval_entry, _generate_entry
    from mcompile.apps.train.config import parse_config
    from mcompile.apps.train.loop import latest_checkpoint, train

    cfg = parse_config(tree, "test")
    summary = train(cfg)
    if not read:
        return {"summary": summary}
    ckpt = str(latest_checkpoint(cfg.checkpoint.dir))
    mesh = cfg.parallel.mesh
    evaluated = _eval_entry(cfg, ckpt, mesh, {"batches": cfg.eval.batches, "lambada": None, "json": True})
    generated = _generate_entry(cfg, ckpt, mesh, {"prompt": ["The old dog"], "max_new_tokens": 8,
                                                 "temperature": 0.0, "top_p": 1.0, "seed": 0, "json": True})
    return {"summary": summary, "eval": evaluated, "generate": generated}
