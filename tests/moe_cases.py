"""Functions the gloo worker processes run for tests/test_moe_parallel.py (expert parallelism)."""

from __future__ import annotations

import torch

import mcompile as mc

MIXTRAL_TINY = dict(vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=128, max_seq_len=128,
                    rope_theta=1e6, n_experts=4, top_k=2)
DEEPSEEK_TINY = dict(vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=8, ffn_hidden=128, max_seq_len=128,
                     norm_eps=1e-6, rope_theta=10000.0, moe_ffn_hidden=32, n_routed_experts=8, n_shared_experts=1,
                     top_k=2, n_groups=4, topk_groups=2, first_dense_layers=1)
# unmodified Hugging Face DeepseekV3ForCausalLM: multi-head latent attention (its keys built by copy_ into
# slices of new_empty), sigmoid router with the correction bias, normalised and scaled top-k weights, one
# shared expert, fused gate_up experts; layer 0 dense, layers 1-3 MoE (captured: 0-2, layer 3 repeated)
HF_DEEPSEEK_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
LR = 0.5


def moe_model(kind: str, seed: int = 0, batch: int = 4, seq: int = 16):
    """(model, inputs): the tiny Mixtral-style / DeepSeek-style preset configs, an unmodified HF
    MixtralForCausalLM with its load-balancing loss on, or an unmodified HF DeepseekV3ForCausalLM; a batch
    of random tokens and targets."""
    torch.manual_seed(seed)
    if kind == "mixtral":
        from mcompile.models.moe_lm import Mixtral, MixtralConfig

        model = Mixtral(MixtralConfig(**MIXTRAL_TINY))
    elif kind == "deepseek":
        from mcompile.models.moe_lm import DeepSeekV3, DeepSeekV3Config

        model = DeepSeekV3(DeepSeekV3Config(**DEEPSEEK_TINY))
        with torch.no_grad():  # a skewed routing bias: the choice differs from the affinities' top-k
            for moe in model.moe_layers:
                moe.bias.copy_(torch.randn(moe.bias.shape) * 0.05)
    elif kind == "hf-mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2,
                            max_position_embeddings=128, output_router_logits=True, router_aux_loss_coef=0.02,
                            tie_word_embeddings=False)
        model = MixtralForCausalLM(cfg)
    elif kind == "hf-deepseek":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        model = DeepseekV3ForCausalLM(DeepseekV3Config(**HF_DEEPSEEK_TINY))
        with torch.no_grad():  # a skewed correction bias: the choice differs from the sigmoid scores' top-k
            for layer in model.model.layers[HF_DEEPSEEK_TINY["first_k_dense_replace"]:]:
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(HF_DEEPSEEK_TINY["n_routed_experts"]) * 0.05)
    else:
        raise ValueError(kind)
    vocab = HF_DEEPSEEK_TINY["vocab_size"] if kind == "hf-deepseek" else 256
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, vocab, (batch, seq), generator=g)
    y = torch.randint(0, vocab, (batch, seq), generator=g)
    return model, (x, y)


def ep_train(rank, world, kind, mesh, steps=2, options=None, batch=4):
    """``steps`` SGD steps: the losses, the full gradients of the first step (rank 0), the local sizes."""
    model, inputs = moe_model(kind, batch=batch)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **(options or {}))
    if (options or {}).get("zero"):  # ZeRO-1/2: state sharded over the data ranks (experts' over dp)
        from mcompile.runtime.zero import DistributedOptimizer

        opt = DistributedOptimizer(pm, torch.optim.SGD, lr=LR)
    else:
        opt = torch.optim.SGD(pm.parameters(), lr=LR)
    losses, grads = [], None
    for step in range(steps):
        loss = pm.train_step(*inputs)
        if step == 0:
            grads = pm.full_grads()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    local = {k: p.to_local().numel() for k, p in pm.named_parameters()}
    if pm._zero is not None:  # ZeRO: (group, its size, the bucket's parameters, elements this rank owns)
        local["zero"] = [(b.group, b.n, list(b.layout.fqns), b.hi - b.lo) for b in pm._zero.buckets]
    return losses, grads if rank == 0 else None, local


def global_microbatches(inputs, data: int, microbatches: int) -> list[tuple]:
    """The runtime's split of a global batch: ``data`` (dp x ep) contiguous rank slices, each cut into
    ``microbatches``; global microbatch i is every rank's i-th piece (what one step of the runtime
    computes together: its batch statistics are reduced over the data ranks)."""
    return [tuple(torch.cat([t.chunk(data)[r].chunk(microbatches)[i] for r in range(data)]) for t in inputs)
            for i in range(microbatches)]


def ep_reference(kind, steps=2, batch=4, microbatches=1, data=1):
    """The single-device model; with ``microbatches`` > 1, gradient accumulation over the runtime's global
    microbatches (:func:`global_microbatches`), the loss their mean: a model whose loss holds batch
    statistics (the load-balancing loss) computes them per microbatch, as Megatron does."""
    model, inputs = moe_model(kind, batch=batch)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], None
    for step in range(steps):
        parts = []
        for mb in global_microbatches(inputs, data, microbatches):
            out = model(input_ids=mb[0], labels=mb[1]) if kind.startswith("hf-") else model(*mb)
            parts.append(out if isinstance(out, torch.Tensor) else out.loss)
        loss = torch.stack(parts).mean()
        loss.backward()
        if step == 0:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    full = {k: p.numel() for k, p in model.named_parameters()}
    return losses, grads, full


def profiled_ep_step(rank, world, kind, mesh, options=None):
    """One train_step (after a warm-up) under torch.profiler: the c10d collectives it ran, by name, and
    the plan's MoE collective specs."""
    import collections

    from torch.profiler import ProfilerActivity, profile

    model, inputs = moe_model(kind)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **(options or {}))
    pm.train_step(*inputs)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pm.train_step(*inputs)
    names = collections.Counter(e.name for e in prof.events() if e.name.startswith("c10d::"))
    return dict(names), [(c.purpose, c.forward, c.backward, c.axis) for c in pm.plan.collectives
                         if c.purpose.startswith("moe")]
