"""Functions the gloo worker processes run for tests/test_hf_io.py: fn(rank, world, *args).

Hugging Face checkpoints imported into parallelized models (``weights=``: a folder for a Hugging Face
model, :func:`mcompile.apps.hf_io.hf_source` for a preset), trained, and exported back with
:func:`mcompile.apps.hf_io.export_hf`.
"""

from __future__ import annotations

import torch

import mcompile as mc
from mcompile.apps.hf_io import export_hf, hf_source


def hf_config(kind: str):
    """Tiny configs. Qwen3: tied embeddings, q/k norms, head_dim 16 != hidden / heads; Mistral: GQA."""
    from transformers import LlamaConfig, MistralConfig, Qwen3Config

    if kind == "llama":
        return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=4, rope_theta=10000.0)
    if kind == "qwen3":
        return Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    return MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, sliding_window=None)


def hf_model(kind: str, device: str = "meta", seed: int = 0, wrapped: bool = True):
    """The model (wrapped: keys ``m.`` + the Hugging Face model's) on ``device``."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from mcompile.models.hf import CausalLMLoss

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(kind))
    model.eval()
    return CausalLMLoss(model) if wrapped else model


def batch(vocab: int, b: int = 4, s: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    return ids, labels


def train_and_export(rank, world, folder, out, mesh):
    """The issue's acceptance case: a Hugging Face Llama imported from ``folder`` (a meta model: every rank
    reads its pieces), trained 3 AdamW steps, exported to ``out``; then a logits program parallelized
    from ``out``. Rank 0: the trained full state dict, the losses, the logits of ``forward(ids)``."""
    model = hf_model("llama")
    ids, labels = batch(128)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), (ids, labels), weights=folder)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        losses.append(pm.train_step(ids, labels).item())
        opt.step()
        opt.zero_grad()
    trained = {k: v.clone() for k, v in pm.full_state_dict(rank=0).items()}
    export_hf(pm, out, model, max_shard_size="100KB")  # several shards and an index
    bare = hf_model("llama", wrapped=False)
    logits_pm = mc.parallelize(bare, mc.Mesh.parse(mesh), (ids,), weights=out)
    logits = logits_pm.forward(ids)
    # greedy generation from the exported folder under the same mesh (the compiler's KV cache)
    from mcompile.apps.generate import Generator

    gen = Generator(hf_model("llama", wrapped=False), mc.Mesh.parse(mesh), weights=out)
    tokens = gen.generate(ids[:2, :5], 10)
    return {"trained": trained, "losses": losses, "logits": logits, "tokens": tokens} if rank == 0 else None


def preset_import(rank, world, name, folder, mesh, out):
    """A preset built on meta, its weights read from the Hugging Face folder through hf_source (renamed,
    GPT-2's Conv1D transposed, a vocabulary padded under tp), as a logits program: its full state dict and
    ``forward(ids)``; then exported back to ``out`` from the ParallelModule."""
    from mcompile.models import get_preset

    model = get_preset(name).build(device="meta")
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), (ids,), weights=hf_source(folder, model))
    state = pm.full_state_dict(rank=0)
    logits = pm.forward(ids)
    export_hf(pm, out, model)
    return {"state": state, "logits": logits, "ids": ids} if rank == 0 else None


def hf_round_trip(rank, world, cases, not_a_folder):
    """cases: (kind, folder, mesh, out). A Hugging Face model imported from ``folder`` and exported to
    ``out`` with no step between: the files must hold the same tensors. Then two exports that fail on rank
    0 alone — its folder cannot be made (``not_a_folder`` is a file), its first shard cannot be written —
    must raise on every rank (none left waiting in a gather): the error each rank raised, per case."""
    import safetensors.torch

    errors = {}
    for kind, folder, mesh, out in cases:
        model = hf_model(kind)
        ids, labels = batch(128)
        pm = mc.parallelize(model, mc.Mesh.parse(mesh), (ids, labels), weights=folder)
        export_hf(pm, out, model)
        try:
            export_hf(pm, f"{not_a_folder}/sub", model)
        except Exception as e:  # noqa: BLE001 - the error is the result
            errors[f"{kind} folder"] = f"{type(e).__name__}: {e}"
        save_file = safetensors.torch.save_file
        if rank == 0:
            def full_disk(*args, **kwargs):
                raise OSError("No space left on device")
            safetensors.torch.save_file = full_disk
        try:
            export_hf(pm, f"{out}-2", model, max_shard_size="50KB")
        except Exception as e:  # noqa: BLE001 - the error is the result
            errors[f"{kind} write"] = f"{type(e).__name__}: {e}"
        finally:
            safetensors.torch.save_file = save_file
    return errors
