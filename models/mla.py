"""Decoder-only transformer with DeepSeek's multi-head latent attention (plain, single device).

Multi-head latent attention (MLA): DeepSeek-AI 2024, "DeepSeek-V2" (arXiv:2405.04434) §2.1.2-2.1.3, as
used by DeepSeek-V3 (arXiv:2412.19437 §2.1.1). Per token x (dim):

* queries: a low-rank down-projection ``wq_a`` (dim -> q_lora_rank), RMSNorm, an up-projection ``wq_b``
  to n_heads x (qk_nope_head_dim + qk_rope_head_dim); the last qk_rope_head_dim of each head get RoPE.
  ``q_lora_rank=None`` (DeepSeek-V2-Lite) projects the queries directly (``wq``).
* keys / values: a shared compressed latent ``wkv_a`` (dim -> kv_lora_rank), RMSNorm, an up-projection
  ``wkv_b`` to n_heads x (qk_nope_head_dim + v_head_dim): each head's key "nope" part and its value.
* a decoupled RoPE key ``wk_rope`` (dim -> qk_rope_head_dim), one for all heads (broadcast over them).
* attention of q = [q_nope, rope(q_rope)] over k = [k_nope, rope(k_rope)] (scale 1/sqrt(nope + rope)),
  values of v_head_dim, output projection ``wo`` from n_heads x v_head_dim.

DeepSeek's reference code fuses the rope key into the KV down-projection (one linear to kv_lora_rank +
qk_rope_head_dim, then split); here it is a linear of its own, the same function. RoPE is the
rotate-half form of models/llama.py (DeepSeek's interleaved form is the same up to a fixed permutation
of the rope dims of wq_b and wk_rope). The rest is Llama: pre-norm RMSNorm, SwiGLU MLP, untied head.

Megatron Core's MLA (megatron/core/transformer/multi_latent_attention.py) splits it over tp as:
linear_q_down_proj and linear_kv_down_proj (with the rope key) not split, linear_q_up_proj and
linear_kv_up_proj column-parallel by heads, linear_proj row-parallel: one all-reduce per attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .llama import FeedForward, RMSNorm, apply_rotary, rope_inv_freq
from .presets import Preset

__all__ = ["MLAConfig", "MLATransformer", "MLAttention", "PRESETS"]


@dataclass(kw_only=True)
class MLAConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    q_lora_rank: int | None  # None: queries projected directly (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    ffn_hidden: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 4096

    def __post_init__(self) -> None:
        if self.qk_rope_head_dim % 2 != 0:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even for rotary embeddings")
        for field in ("dim", "n_layers", "n_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "ffn_hidden"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank must be >= 1 or None, got {self.q_lora_rank}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class MLAttention(nn.Module):
    def __init__(self, config: MLAConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.nope = config.qk_nope_head_dim
        self.rope = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        qk_out = config.n_heads * config.qk_head_dim
        if config.q_lora_rank is None:
            self.wq = nn.Linear(config.dim, qk_out, bias=False)
        else:
            self.wq_a = nn.Linear(config.dim, config.q_lora_rank, bias=False)  # down to the query latent
            self.q_norm = RMSNorm(config.q_lora_rank, config.norm_eps)
            self.wq_b = nn.Linear(config.q_lora_rank, qk_out, bias=False)  # up, by heads
        self.wkv_a = nn.Linear(config.dim, config.kv_lora_rank, bias=False)  # down to the shared KV latent
        self.kv_norm = RMSNorm(config.kv_lora_rank, config.norm_eps)
        self.wkv_b = nn.Linear(config.kv_lora_rank, config.n_heads * (self.nope + self.v_head_dim), bias=False)
        self.wk_rope = nn.Linear(config.dim, self.rope, bias=False)  # the decoupled key, shared by all heads
        self.wo = nn.Linear(config.n_heads * self.v_head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.size()
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(b, s, self.n_heads, self.nope + self.rope).transpose(1, 2)  # (b, nh, s, nope + rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(self.wkv_a(x)))
        kv = kv.view(b, s, self.n_heads, self.nope + self.v_head_dim).transpose(1, 2)  # (b, nh, s, nope + v)
        k_nope, v = kv.split([self.nope, self.v_head_dim], dim=-1)
        k_rope = self.wk_rope(x).view(b, 1, s, self.rope)  # (b, 1, s, rope): one head, broadcast
        q_rope = apply_rotary(q_rope, cos, sin)
        k_rope = apply_rotary(k_rope, cos, sin)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, self.n_heads, -1, -1)), dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, nh, s, v)
        y = y.transpose(1, 2).contiguous().view(b, s, self.n_heads * self.v_head_dim)
        return self.wo(y)


class MLABlock(nn.Module):
    def __init__(self, config: MLAConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = MLAttention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        x = x + self.feed_forward(self.ffn_norm(x))
        return x


class MLATransformer(nn.Module):
    def __init__(self, config: MLAConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList([MLABlock(config) for _ in range(config.n_layers)])
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config.qk_rope_head_dim, config.rope_theta), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """(Re)compute the RoPE ``inv_freq`` buffer in place, e.g. after ``to_empty()`` from meta."""
        cfg = self.config
        self.inv_freq.copy_(rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, device=self.inv_freq.device))

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, 0.02) init; residual output projections scaled by 1/sqrt(2*n_layers) (as models/llama.py)."""
        std_proj = 0.02 / math.sqrt(2 * self.config.n_layers)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        for layer in self.layers:
            nn.init.normal_(layer.attention.wo.weight, mean=0.0, std=std_proj)
            nn.init.normal_(layer.feed_forward.w2.weight, mean=0.0, std=std_proj)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        b, s = idx.size()
        h = self.tok_embeddings(idx)
        t = torch.arange(s, device=idx.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.float())  # (s, rope/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (s, rope)
        cos = emb.cos().to(h.dtype)
        sin = emb.sin().to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)


def lm_inputs(config: MLAConfig, batch: int, seq: int, device, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (tokens, targets); the first 5 targets of row 0 ignored (-100), so data-parallel ranks count
    different numbers of tokens (as tests/conftest.py's build does for the decoder presets)."""
    idx = torch.randint(0, config.vocab_size, (batch, seq), device=device, generator=generator)
    targets = torch.randint(0, config.vocab_size, (batch, seq), device=device, generator=generator)
    if device.type != "meta":
        targets[0, :5] = -100
    return idx, targets


def _mla(name: str, **fields) -> Preset:
    return Preset(name, "mla", MLAConfig(**fields), model_class=MLATransformer, inputs=lm_inputs)


PRESETS = [
    _mla("mla-tiny", vocab_size=256, dim=64, n_layers=2, n_heads=8, q_lora_rank=32, kv_lora_rank=16,
         qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, ffn_hidden=128, max_seq_len=128),
    # DeepSeek-V3's attention on a dense FFN: "DeepSeek-V3 Technical Report" (arXiv:2412.19437) §4.2 and the
    # Hugging Face config of deepseek-ai/DeepSeek-V3 (hidden_size 7168, 61 layers, 128 heads, q_lora_rank 1536,
    # kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, intermediate_size 18432 of
    # the first_k_dense_replace=3 dense layers, vocab 129280, rms_norm_eps 1e-6, rope_theta 10000). NOT the
    # published model: every layer's FFN is that dense SwiGLU (no MoE, no multi-token prediction), ~37.4B
    # parameters; max_seq_len is the 4K pre-training context (the 128K extension uses YaRN, not done here).
    _mla("deepseek-v3-mla-dense", vocab_size=129280, dim=7168, n_layers=61, n_heads=128, q_lora_rank=1536,
         kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, ffn_hidden=18432,
         max_seq_len=4096),
    # DeepSeek-V2-Lite's attention on a dense FFN: "DeepSeek-V2" (arXiv:2405.04434) Appendix B and the Hugging
    # Face config of deepseek-ai/DeepSeek-V2-Lite (hidden_size 2048, 27 layers, 16 heads, q_lora_rank null:
    # queries not compressed, kv_lora_rank 512, nope 128, rope 64, v 128, intermediate_size 10944 of its one
    # dense layer, vocab 102400, rms_norm_eps 1e-6, rope_theta 10000). NOT the published model: dense FFN in
    # every layer (no MoE), ~2.6B parameters.
    _mla("deepseek-v2-lite-dense", vocab_size=102400, dim=2048, n_layers=27, n_heads=16, q_lora_rank=None,
         kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, ffn_hidden=10944,
         max_seq_len=4096),
]
