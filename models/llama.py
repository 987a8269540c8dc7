"""Llama-3 style decoder-only transformer (plain, single device).

RMSNorm, rotary position embeddings (rotate-half form), grouped-query attention and a SwiGLU
MLP. Plain PyTorch only: no parallelism, nothing imported from mcompile. The forward pass has
no Python control flow on tensor sizes or values so that it can be captured by
``torch.export.export(..., strict=False)`` with dynamic batch and sequence dimensions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["LlamaConfig", "Llama", "RMSNorm"]


@dataclass
class LlamaConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if (self.dim // self.n_heads) % 2 != 0:
            raise ValueError("head_dim must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (b, n_heads, s, head_dim); cos/sin: (s, head_dim)."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.size()
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)  # (b, nh, s, hd)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (b, nkv, s, hd)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        # grouped-query attention: SDPA broadcasts each kv head over its group of query heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y = y.transpose(1, 2).contiguous().view(b, s, self.n_heads * self.head_dim)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)  # gate
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)  # down
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        x = x + self.feed_forward(self.ffn_norm(x))
        return x


@torch.no_grad()
def init_block_module(module: nn.Module, n_layers: int) -> bool:
    """GPT-2-style init of one module's own tensors: linears and embeddings N(0, 0.02), norms 1, and an
    attention / feed-forward block's output projection N(0, 0.02 / sqrt(2 n_layers)) (shared by the MoE models,
    models/moe_lm.py). False when the module has none of these."""
    std_proj = 0.02 / math.sqrt(2 * n_layers)
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    elif isinstance(module, RMSNorm):
        nn.init.ones_(module.weight)
    elif isinstance(module, Attention):
        nn.init.normal_(module.wo.weight, mean=0.0, std=std_proj)
    elif isinstance(module, FeedForward):
        nn.init.normal_(module.w2.weight, mean=0.0, std=std_proj)
    else:
        return False
    return True


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList([TransformerBlock(config) for _ in range(config.n_layers)])
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("inv_freq", rope_inv_freq(config.head_dim, config.rope_theta), persistent=False)
        self.init_weights()

    def tie_weights(self) -> None:
        """Tie ``output.weight`` to ``tok_embeddings.weight`` if ``config.tie_embeddings``.

        Call again after ``to_empty()`` from meta: without
        ``torch.__future__.set_swap_module_params_on_conversion(True)`` it unties them.
        """
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_buffers(self) -> None:
        """(Re)compute the RoPE ``inv_freq`` buffer in place, e.g. after ``to_empty()`` from meta."""
        self.inv_freq.copy_(
            rope_inv_freq(self.config.head_dim, self.config.rope_theta, device=self.inv_freq.device)
        )

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, 0.02) init; residual output projections scaled by 1/sqrt(2*n_layers)."""
        std_proj = 0.02 / math.sqrt(2 * self.config.n_layers)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        for layer in self.layers:
            nn.init.normal_(layer.attention.wo.weight, mean=0.0, std=std_proj)
            nn.init.normal_(layer.feed_forward.w2.weight, mean=0.0, std=std_proj)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """The same init, one module at a time (Hugging Face's convention), e.g. for a model built on
        the meta device: called for every module after its children, it sets the module's own
        tensors; an attention / feed-forward block re-draws its output projection with the scaled
        std, and the model itself recomputes its RoPE buffer."""
        if not init_block_module(module, self.config.n_layers) and module is self:
            self.init_buffers()

    def num_params(self) -> int:
        """Parameter count, tied weights counted once (``parameters()`` de-duplicates)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        b, s = idx.size()
        h = self.tok_embeddings(idx)
        # rotary tables for positions 0..s-1, computed in float32 then cast to the activation dtype
        t = torch.arange(s, device=idx.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.float())  # (s, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (s, hd)
        cos = emb.cos().to(h.dtype)
        sin = emb.sin().to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        h = self.norm(h)
        logits = self.output(h)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)
