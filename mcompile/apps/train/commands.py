"""``mcompile eval``, ``mcompile generate`` and ``mcompile export``: a trained run's checkpoint, read under any layout.

    mcompile eval CONFIG.toml [--checkpoint DIR] [--mesh tp=2] [--batches N] [--lambada FILE.jsonl] [--json]
    mcompile generate CONFIG.toml --prompt TEXT [--prompt ...] [--max-new-tokens N] [--temperature T]
                      [--top-p P] [--seed S] [--mesh tp=2] [--checkpoint DIR]
    mcompile export CONFIG.toml --hf OUT [--checkpoint DIR] [--mesh tp=2] [--dtype fp32|bf16|fp16]

All read the run's TOML config (the same file and ``--set`` overrides as ``mcompile train``) for the model and
the data, and the newest complete checkpoint in ``checkpoint.dir`` unless ``--checkpoint`` names one. The
checkpoint is read straight into each rank's pieces under the mesh given here (``--mesh``; default: the
config's), whatever layout saved it (``parallelize(..., weights=)``, mcompile.runtime.weights).

- ``eval``: the perplexity of the held-out split (``data.valid_fraction``: whole documents; token-weighted mean
  cross-entropy, mcompile.apps.evaluate.perplexity) over ``--batches`` batches of ``train.global_batch`` samples, and
  with ``--lambada FILE`` the last-word accuracy (LAMBADA's strict criterion) on that JSONL (``tiny``: the
  LAMBADA-style set mcompile ships). Rank 0 prints the figures (``--json``: one JSON object). Each rank reads
  only its share of each batch as in training (``data.read``: mcompile.apps.train.reads).
- ``generate``: the text the model continues each prompt with (a KV cache the compiler adds,
  mcompile.apps.generate.Generator), greedy at ``--temperature 0`` (default), else sampled (top-p, seeded: every rank
  draws the same tokens). The tokenizer is ``data.tokenizer``, or the one the dataset was preprocessed with.
- ``export``: a Hugging Face ``from_pretrained`` folder of the checkpoint (``model.safetensors``, ``config.json``,
  the run's tokenizer files; mcompile.apps.train.export), for a ``model.hf`` model or a llama3-* / gpt2-* preset.

Processes: one process runs in place; a mesh of N ranks is N processes started here (torch's elastic agent, as
``mcompile train``), or the processes torchrun started (``RANK`` / ``WORLD_SIZE`` in the environment).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from mcompile.apps.train.config import ConfigError, load_config, mesh_size

__all__ = ["add_parsers"]


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="the run's TOML config (as given to mcompile train)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="override a config key, as mcompile train's --set (repeatable)")
    p.add_argument("--checkpoint", default=None,
                   help="a checkpoint folder (default: the newest complete one in checkpoint.dir)")
    p.add_argument("--mesh", default=None,
                   help="the layout to run under, e.g. tp=2 (default: the config's parallel.mesh; 'auto': tp=1)")


_SHARED = ("The run's TOML config gives the model and the data; the newest complete checkpoint in checkpoint.dir "
           "is read (or --checkpoint DIR) under --mesh (default: the config's), whatever layout saved it.")
_EVAL = ("The perplexity of a trained run's checkpoint on the held-out split (data.valid_fraction: whole documents; "
         "the token-weighted mean of the run's training loss, as the run's objective defines it) and, with "
         "--lambada FILE, the LAMBADA last-word accuracy (strict: every token of the word). " + _SHARED)
_GENERATE = ("Continue each --prompt with a trained run's checkpoint (a KV cache added by the compiler): greedy at "
             "--temperature 0, else sampled with top-p, seeded (every rank draws the same tokens). The tokenizer is "
             "data.tokenizer, or the one the dataset was preprocessed with. " + _SHARED)
_EXPORT = ("Write a trained run's checkpoint as a Hugging Face from_pretrained folder (model.safetensors, "
           "config.json, generation_config.json where the model has one, and the run's tokenizer files): a model.hf "
           "model keeps its names and config; the llama3-* / gpt2-* presets become LlamaForCausalLM / "
           "GPT2LMHeadModel. " + _SHARED)


def add_parsers(subparsers) -> None:
    """Register ``eval``, ``generate`` and ``export`` on an argparse subparsers object."""
    pe = subparsers.add_parser("eval", help="perplexity on the held-out split and LAMBADA-style last-word accuracy "
                                            "of a trained run's checkpoint", description=_EVAL)
    _common(pe)
    pe.add_argument("--batches", type=int, default=None,
                    help="batches of train.global_batch samples (default: eval.batches; 0: the whole split)")
    pe.add_argument("--lambada", default=None, metavar="FILE.jsonl",
                    help="also the last-word accuracy on this JSONL ({\"text\": ...} lines; 'tiny': the shipped set)")
    pe.add_argument("--json", action="store_true", help="print one JSON object")
    pe.set_defaults(func=run_eval)
    pg = subparsers.add_parser("generate", help="continue prompts with a trained run's checkpoint (KV cache; greedy, "
                                                "temperature, top-p)", description=_GENERATE)
    _common(pg)
    pg.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    pg.add_argument("--max-new-tokens", type=int, default=32)
    pg.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    pg.add_argument("--top-p", type=float, default=1.0)
    pg.add_argument("--seed", type=int, default=0)
    pg.add_argument("--json", action="store_true", help="print one JSON object: prompts, token ids and texts")
    pg.set_defaults(func=run_generate)
    px = subparsers.add_parser("export", help="write a trained run's checkpoint as a Hugging Face from_pretrained "
                                              "folder (weights, config, tokenizer)", description=_EXPORT)
    _common(px)
    px.add_argument("--hf", required=True, metavar="OUT", help="the folder to write (created; a previous export's "
                                                               "weight files in it are replaced)")
    px.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="the stored dtype (default fp32)")
    px.set_defaults(func=run_export)


# ------------------------------------------------------------------------------------------ set-up (no torch)
def _prepare(args, what: str):
    """(cfg, checkpoint path, mesh string) or an error message."""
    from pathlib import Path

    from mcompile.apps.train.preflight import preflight

    cfg = load_config(args.config, args.overrides)
    preflight(cfg, weights=False)  # the checkpoint read is the command's own, checked below
    ckpt = args.checkpoint
    if ckpt is None:
        from mcompile.apps.train.loop import latest_checkpoint

        found = latest_checkpoint(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
        if found is None:
            raise ConfigError(f"mcompile {what}: no complete checkpoint in checkpoint.dir = {cfg.checkpoint.dir!r}: "
                              "train first (mcompile train), or pass --checkpoint DIR")
        ckpt = str(found)
    elif not (Path(ckpt) / "mcompile_plan.json").is_file():
        raise ConfigError(f"mcompile {what}: --checkpoint {ckpt} is not a complete mcompile checkpoint (no "
                          "mcompile_plan.json in it): give a step-XXXXXXX folder that mcompile train wrote")
    mesh = (args.mesh or cfg.parallel.mesh).strip()
    if mesh == "auto":
        mesh = "tp=1"
    mesh_size(mesh)  # a malformed mesh: a ConfigError here, before any process starts
    return cfg, ckpt, mesh


def _dispatch(args, what: str, entry) -> int:
    try:
        cfg, ckpt, mesh = _prepare(args, what)
    except ConfigError as e:
        print(f"mcompile {what}: error: {e}", file=sys.stderr)
        return 2
    payload = (cfg, ckpt, mesh, vars(args).copy())
    payload[3].pop("func", None)
    n = mesh_size(mesh)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun started us
        entry(*payload)
        return 0
    if n == 1:  # in place: a process group of one
        import torch.distributed as dist

        from mcompile.runtime.launch import shutdown_distributed

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            entry(*payload)
        finally:
            shutdown_distributed()
        return 0
    from mcompile.apps.train.cli import launch

    return launch(cfg, n, 0, entry, payload)


# ------------------------------------------------------------------------------------------ on every rank
def _init(cfg) -> None:
    import torch
    import torch.distributed as dist

    from mcompile.runtime.launch import init_distributed

    if not dist.is_initialized():
        init_distributed()
    torch.manual_seed(cfg.train.seed)


def _say(text: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(text, flush=True)


def _tokenizer(cfg):
    from mcompile.apps.data import load_tokenizer
    from mcompile.apps.train.export import tokenizer_path

    path = tokenizer_path(cfg)
    if not path:
        raise ConfigError(f"no tokenizer: set data.tokenizer (the dataset {cfg.data.sources} records none)")
    return load_tokenizer(path)


def _causal_only(cfg, what: str):
    """The run's objective; ``generate`` and LAMBADA need a model that predicts the next token."""
    from mcompile.apps.train.objective import resolve

    objective = resolve(cfg)
    if objective.kind not in ("next-token", "causal-lm"):
        raise ConfigError(f"{what} continues text with a causal language model, and this run trains a "
                          f"{objective.kind} model (model.objective): use mcompile eval without --lambada")
    return objective


def _eval_entry(cfg, ckpt, mesh, args) -> dict:

    import mcompile as mc
    from mcompile.apps.evaluate import last_word_accuracy, perplexity
    from mcompile.apps.train.loop import _dataset, _options, build_model, example_inputs
    from mcompile.apps.train.objective import resolve

    _init(cfg)
    t = cfg.train
    if args["lambada"]:
        _causal_only(cfg, "--lambada")
    model, vocab, example = build_model(cfg)
    objective = resolve(cfg, vocab_size=vocab or 0)
    # data.read = "local" (the default): each rank reads its share of each batch, as in training
    options = {k: v for k, v in _options(cfg).items() if k in ("dtype", "init_seed", "inputs")}
    if example is None:
        example = example_inputs(cfg, objective, vocab, batch=t.global_batch)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), example, weights=ckpt, **options)
    valid = _dataset(cfg, "valid")
    batches = cfg.eval.batches if args["batches"] is None else args["batches"]
    out = {"checkpoint": ckpt, "mesh": mesh, "objective": objective.kind,
           "valid": perplexity(pm, valid, batch_size=t.global_batch, max_batches=batches or None,
                               objective=objective)}
    del pm
    if args["lambada"]:
        from mcompile.apps.data import tiny_lambada

        path = str(tiny_lambada()) if args["lambada"] == "tiny" else args["lambada"]
        fresh, _, _ = build_model(cfg)
        out["lambada"] = {"file": path, **last_word_accuracy(fresh, _tokenizer(cfg), path, mesh=mesh, weights=ckpt,
                                                             max_seq_len=t.seq_len)}
    if args["json"]:
        _say(json.dumps(out))
    else:
        v = out["valid"]
        _say(f"{ckpt} under {mesh}: valid loss {v['loss']:.4f}, perplexity {v['ppl']:.3f} "
             f"({v['tokens']} tokens, {v['batches']} batches)")
        if "lambada" in out:
            a = out["lambada"]
            _say(f"last-word accuracy {a['accuracy']:.3f} ({a['correct']} of {a['n']}, {a['file']})")
    return out


def _generate_entry(cfg, ckpt, mesh, args) -> dict:
    import torch

    import mcompile as mc
    from mcompile.apps.generate import Generator
    from mcompile.apps.train.loop import build_model

    _init(cfg)
    _causal_only(cfg, "mcompile generate")
    tok = _tokenizer(cfg)
    model, _, _ = build_model(cfg)
    gen = Generator(model, mc.Mesh.parse(mesh), weights=ckpt)
    if not args["json"]:
        _say(f"{ckpt} under {mesh}:")
    results = []
    for prompt in args["prompt"]:
        ids = tok.encode(prompt)
        if not ids:
            raise ConfigError(f"--prompt {prompt!r} encodes to no token: give some text")
        out = gen.generate(torch.tensor([ids]), args["max_new_tokens"], temperature=args["temperature"],
                           top_p=args["top_p"], seed=args["seed"], eos_id=tok.eos_id)
        new = [int(i) for i in out[0, len(ids):]]
        if tok.eos_id in new:
            new = new[:new.index(tok.eos_id)]
        results.append({"prompt": prompt, "ids": new, "text": tok.decode(new)})
    if args["json"]:
        _say(json.dumps({"checkpoint": ckpt, "mesh": mesh, "results": results}))
    else:
        for r in results:
            _say(f"{r['prompt']}{r['text']}")
    return {"results": results}


def _export_entry(cfg, ckpt, mesh, args) -> dict:
    import torch

    import mcompile as mc
    from mcompile.apps.train.export import export_run
    from mcompile.apps.train.loop import build_model, example_inputs
    from mcompile.apps.train.objective import resolve

    _init(cfg)
    model, vocab, example = build_model(cfg)
    if example is None:
        example = example_inputs(cfg, resolve(cfg, vocab_size=vocab or 0), vocab)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), example, weights=ckpt, init_seed=cfg.train.seed)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args["dtype"]]
    out = export_run(cfg, pm, args["hf"], dtype=dtype)
    _say(f"exported {ckpt} to {out}: load it with from_pretrained({str(out)!r})")
    return {"checkpoint": ckpt, "folder": str(out)}


def run_export(args) -> int:
    return _dispatch(args, "export", _export_entry)


def run_eval(args) -> int:
    return _dispatch(args, "eval", _eval_entry)


def run_generate(args) -> int:
    return _dispatch(args, "generate", _generate_entry)
