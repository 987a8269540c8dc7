"""Functions the gloo worker processes run for tests/test_weights.py: fn(rank, world, *args).

Models built on the meta device (and one with values), parallelized with ``weights=`` a checkpoint
(mcompile.runtime.weights): their full state dict, one training step's loss and gradients, the
warnings logged, and the errors raised on every rank.
"""

from __future__ import annotations

import logging

import torch

import mcompile as mc


def hf_config(kind: str):
    """Tiny configs: Llama, tied or not; GPT-2 (vocab 129: padded to 130 at tp=2, so rank 1's slice runs
    past the true vocabulary; a fused QKV ``c_attn``: BlockShard at tp; wte / lm_head tied)."""
    from transformers import GPT2Config, LlamaConfig

    if kind.startswith("llama"):
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=kind == "llama-tied")
    return GPT2Config(vocab_size=129, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0)


def hf_model(kind: str, device: str = "meta", seed: int = 0):
    """The wrapped model (keys ``m.`` + the HF model's) and (tokens, targets)."""
    from transformers import GPT2LMHeadModel, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from mcompile.models.hf import CausalLMLoss

    hf_logging.set_verbosity_error()
    cfg = hf_config(kind)
    cls = LlamaForCausalLM if kind.startswith("llama") else GPT2LMHeadModel
    torch.manual_seed(seed)
    with torch.device(device):
        model = CausalLMLoss(cls(cfg))
    model.eval()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (4, 16), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (4, 16), generator=g)
    targets[0, :5] = -100
    return model, (tokens, targets)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _parallelize(kind, mesh, path, meta=True, **options):
    model, inputs = hf_model(kind, "meta" if meta else "cpu", seed=123)
    handler = _Records()
    logger = logging.getLogger("mcompile.weights")
    logger.addHandler(handler)
    try:
        pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, weights=path, **options)
    finally:
        logger.removeHandler(handler)
    return pm, model, inputs, handler.messages


def load_cases(rank, world, cases):
    """cases: (label, kind, mesh, path, meta). Per case: the full state dict (rank 0), the first step's loss
    (every rank) and gradients (rank 0), the warnings logged, whether the model given is still on meta."""
    out = {}
    for label, kind, mesh, path, meta in cases:
        pm, model, inputs, warned = _parallelize(kind, mesh, path, meta)
        sd = {k: v.clone() for k, v in pm.full_state_dict().items()}  # collective: every rank
        loss = pm.train_step(*inputs).item()
        grads = pm.full_grads()
        out[label] = {"state": sd if rank == 0 else None, "loss": loss, "grads": grads if rank == 0 else None,
                      "warned": warned, "held": sorted(pm._params),
                      "still_meta": all(t.is_meta for t in model.state_dict().values())}
    return out


def round_trip(rank, world, kind, first_mesh, path, ckpt, second_mesh):
    """Load ``path`` at ``first_mesh``, train a step (fp32 values the HF file never held), save an mcompile
    checkpoint, load it into a new meta model at ``second_mesh``: both full state dicts (rank 0)."""
    pm, _, inputs, _ = _parallelize(kind, first_mesh, path)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm.train_step(*inputs)
    opt.step()
    pm.save_checkpoint(ckpt, opt, extra={"step": 1})
    saved = {k: v.clone() for k, v in pm.full_state_dict().items()}
    pm2, _, _, warned = _parallelize(kind, second_mesh, ckpt)
    loaded = pm2.full_state_dict()
    return {"saved": saved if rank == 0 else None, "loaded": loaded if rank == 0 else None, "warned": warned,
            "loss": pm2.train_step(*inputs).item(), "loss_saved": pm.train_step(*inputs).item()}


def load_errors(rank, world, cases, fail_reading_on=None):
    """cases: (label, kind, mesh, path). The error each parallelize raises on this rank (or "no error"), and
    whether the model given stayed wholly on meta. ``fail_reading_on``: (label, rank) whose reads of
    values fail (an I/O error after every check passed: on that rank alone)."""
    import mcompile.api as A
    from mcompile.runtime import weights as W

    out = {}
    planned = []
    compile_plan = A.compile_plan

    def recording(*a, **k):  # whether the error came before planning
        planned.append(True)
        return compile_plan(*a, **k)

    for label, kind, mesh, path in cases:
        model, inputs = hf_model(kind)
        read = W._Safetensors.read
        if fail_reading_on == (label, rank):
            def broken(self, stored, index=None):
                raise OSError(f"Input/output error reading {stored.key}")
            W._Safetensors.read = broken
        planned.clear()
        A.compile_plan = recording
        try:
            mc.parallelize(model, mc.Mesh.parse(mesh), inputs, weights=path)
            msg = "no error"
        except Exception as e:  # noqa: BLE001 - the error is the result
            msg = f"{type(e).__name__}: {e}"
        finally:
            W._Safetensors.read = read
            A.compile_plan = compile_plan
        out[label] = (msg, all(t.is_meta for t in model.state_dict().values()), bool(planned))
    return out
