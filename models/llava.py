"""LLaVA-style vision-language model (plain, single device).

Liu et al. 2023, "Visual Instruction Tuning" (LLaVA) and "Improved Baselines with Visual Instruction
Tuning" (LLaVA-1.5, arXiv:2310.03744): a CLIP ViT encodes the image into patch features, a projector
(LLaVA-1.5: two linears with a GELU between them) maps them to the language model's width, and a
Llama-style decoder reads them as the first positions of one sequence, followed by the text
embeddings. The causal LM loss is taken over the text targets only: the image positions' targets
are -100.

- Vision tower (CLIP ViT, Radford et al. 2021): patch embedding as a linear over unfolded patches
  (CLIP's Conv2d with stride = patch and no bias, written as the same matmul), a learned class token
  and learned position embeddings, a LayerNorm before the layers (CLIP's ``pre_layrnorm``), pre-LN
  layers of bidirectional attention and a quick-GELU MLP. LLaVA-1.5 takes the penultimate layer's
  hidden states without the class token (``mm_vision_select_layer=-2``, ``mm_vision_select_feature=
  "patch"``): the tower here ends at the layer whose output is used, with no final norm.
- Language model: models/llama.py's blocks (RMSNorm, RoPE, grouped-query attention, SwiGLU), RoPE
  positions counted over image and text together.

Plain PyTorch only: nothing imported from mcompile beyond the sibling model module. The forward pass
has no Python control flow on tensor sizes or values, so ``torch.export`` captures it with dynamic
batch and text length (the image size is fixed by the config).

Inputs: ``pixel_values`` [b, 3, H, W] float, ``input_ids`` [b, s] int64, ``labels`` [b, s] int64 where
``labels[:, t]`` is the target of text position t (already shifted, as models/llama.py's targets;
-100 = ignored, e.g. the instruction of a conversation turn). The sequence the LM reads has
``n_patches + s`` positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .llama import LlamaConfig, RMSNorm, TransformerBlock, init_block_module, rope_inv_freq

__all__ = ["LlavaConfig", "Llava", "VisionTower", "Projector", "PRESETS"]


@dataclass
class LlavaConfig:
    # language model (Llama-style decoder)
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    # vision tower (CLIP ViT)
    image_size: int
    patch_size: int
    vision_dim: int
    vision_layers: int
    vision_heads: int
    vision_ffn_hidden: int
    in_channels: int = 3
    class_token: bool = True
    norm_eps: float = 1e-5
    vision_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 4096  # positions of the LM: image patches + text
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size != 0:
            raise ValueError(f"image_size ({self.image_size}) must be a multiple of patch_size ({self.patch_size})")
        if self.vision_dim % self.vision_heads != 0:
            raise ValueError(f"vision_dim ({self.vision_dim}) must be divisible by vision_heads ({self.vision_heads})")
        if self.n_patches >= self.max_seq_len:
            raise ValueError(f"the {self.n_patches} image patches leave no room for text in max_seq_len "
                             f"({self.max_seq_len})")
        self.lm_config()  # the decoder's own checks (heads, kv heads, even head_dim)

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def lm_config(self) -> LlamaConfig:
        return LlamaConfig(vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                           n_kv_heads=self.n_kv_heads, ffn_hidden=self.ffn_hidden, norm_eps=self.norm_eps,
                           rope_theta=self.rope_theta, max_seq_len=self.max_seq_len,
                           tie_embeddings=self.tie_embeddings)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's activation (``hidden_act="quick_gelu"``): x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


class VisionAttention(nn.Module):
    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        self.n_heads = config.vision_heads
        self.head_dim = config.vision_dim // config.vision_heads
        d = config.vision_dim
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.size()
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)  # (b, nh, s, hd)
        k = self.k_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        y = y.transpose(1, 2).contiguous().view(b, s, d)
        return self.out_proj(y)


class VisionMLP(nn.Module):
    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.vision_dim, config.vision_ffn_hidden)
        self.fc2 = nn.Linear(config.vision_ffn_hidden, config.vision_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(quick_gelu(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.vision_dim, eps=config.vision_norm_eps)
        self.attn = VisionAttention(config)
        self.ln_2 = nn.LayerNorm(config.vision_dim, eps=config.vision_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class VisionTower(nn.Module):
    """CLIP ViT up to the layer LLaVA reads: [b, 3, H, W] -> patch features [b, n_patches, vision_dim]."""

    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        self.config = config
        p, c, d = config.patch_size, config.in_channels, config.vision_dim
        self.patch_embed = nn.Linear(c * p * p, d, bias=False)  # = Conv2d(c, d, p, stride=p, bias=False)
        n_pos = config.n_patches + (1 if config.class_token else 0)
        self.class_embedding = nn.Parameter(torch.zeros(d)) if config.class_token else None
        self.pos_embedding = nn.Parameter(torch.zeros(n_pos, d))
        self.ln_pre = nn.LayerNorm(d, eps=config.vision_norm_eps)
        self.layers = nn.ModuleList([VisionBlock(config) for _ in range(config.vision_layers)])

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        b = pixel_values.size(0)
        p, g = cfg.patch_size, cfg.image_size // cfg.patch_size
        # unfold into patches, each flattened (channel, row, col) as Conv2d's weight is: (b, g*g, c*p*p)
        x = pixel_values.view(b, cfg.in_channels, g, p, g, p).permute(0, 2, 4, 1, 3, 5)
        x = self.patch_embed(x.reshape(b, g * g, cfg.in_channels * p * p))  # (b, n_patches, d)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(b, 1, -1), x], dim=1)
        x = self.ln_pre(x + self.pos_embedding)
        for layer in self.layers:
            x = layer(x)
        return x[:, 1:] if self.class_embedding is not None else x  # LLaVA: the patches, not the class token


class Projector(nn.Module):
    """LLaVA-1.5's ``mlp2x_gelu``: Linear(vision_dim, dim), GELU, Linear(dim, dim)."""

    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.vision_dim, config.dim)
        self.fc2 = nn.Linear(config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Llava(nn.Module):
    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        self.config = config
        lm = config.lm_config()
        self.vision = VisionTower(config)
        self.projector = Projector(config)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList([TransformerBlock(lm) for _ in range(config.n_layers)])
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("inv_freq", rope_inv_freq(lm.head_dim, config.rope_theta), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Linears, embeddings, the class token and positions N(0, 0.02), biases 0, norms 1; the residual
        output projections of both stacks N(0, 0.02 / sqrt(2 n_layers)) of their own stack."""
        for module in self.modules():
            self._init_weights(module)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """One module's own tensors (Hugging Face's convention, e.g. after building on meta); the model
        itself also recomputes its RoPE buffer."""
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, VisionTower):
            nn.init.normal_(module.pos_embedding, mean=0.0, std=0.02)
            if module.class_embedding is not None:
                nn.init.normal_(module.class_embedding, mean=0.0, std=0.02)
        elif isinstance(module, (VisionAttention, VisionMLP)):
            std = 0.02 / math.sqrt(2 * self.config.vision_layers)
            nn.init.normal_(module.out_proj.weight if isinstance(module, VisionAttention) else module.fc2.weight,
                            mean=0.0, std=std)
        elif module is self:
            lm = self.config.lm_config()
            self.inv_freq.copy_(rope_inv_freq(lm.head_dim, lm.rope_theta, device=self.inv_freq.device))
        else:
            init_block_module(module, self.config.n_layers)
        if isinstance(module, (VisionAttention, VisionMLP)):
            for lin in module.children():  # their linears were drawn above (children first): keep out_proj/fc2
                if lin is not getattr(module, "out_proj", None) and lin is not getattr(module, "fc2", None):
                    nn.init.normal_(lin.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s = input_ids.size()
        n = self.config.n_patches
        img = self.projector(self.vision(pixel_values))  # (b, n, dim)
        h = torch.cat([img, self.tok_embeddings(input_ids)], dim=1)  # image first, then text: (b, n + s, dim)
        t = torch.arange(n + s, device=input_ids.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.float())  # (n + s, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(h.dtype)
        sin = emb.sin().to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        targets = torch.cat([labels.new_full((b, n), -100), labels], dim=1)  # no loss at the image positions
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)


def example_inputs(config: LlavaConfig, batch: int, seq: int, device, generator) -> tuple:
    """(pixel_values [b, 3, H, W], input_ids [b, seq], labels [b, seq]): random, with the first five text
    targets of the first sample ignored (an instruction), so data-parallel ranks count different numbers
    of tokens."""
    if config.n_patches + seq > config.max_seq_len:
        raise ValueError(f"{config.n_patches} image patches + seq={seq} text tokens exceed max_seq_len "
                         f"{config.max_seq_len}: use seq <= {config.max_seq_len - config.n_patches}")
    hw = config.image_size
    pixels = torch.randn(batch, config.in_channels, hw, hw, device=device, generator=generator)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device, generator=generator)
    labels = torch.randint(0, config.vocab_size, (batch, seq), device=device, generator=generator)
    labels[0, : min(5, seq - 1)] = -100
    return pixels, ids, labels


def _presets() -> list:
    from .presets import Preset  # presets imports this module while it builds its list

    def preset(name: str, **fields) -> Preset:
        return Preset(name, "llava", LlavaConfig(**fields), model_class=Llava, inputs=example_inputs)

    return [
        preset("llava-tiny", vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=128,
               image_size=32, patch_size=8, vision_dim=64, vision_layers=2, vision_heads=4, vision_ffn_hidden=128,
               max_seq_len=64),
        # LLaVA-1.5-13B (Liu et al. 2023, arXiv:2310.03744; HF liuhaotian/llava-v1.5-13b config.json):
        # - vision: CLIP ViT-L/14 at 336 px (HF openai/clip-vit-large-patch14-336: hidden 1024, 16 heads,
        #   intermediate 4096, 24 layers, patch 14 -> 24 x 24 = 576 patches + a class token, quick_gelu,
        #   layer_norm_eps 1e-5). LLaVA-1.5 reads layer 23's output (mm_vision_select_layer=-2): the 24th
        #   layer never reaches the loss, so the tower is built with the 23 layers that do.
        # - projector: mm_projector_type "mlp2x_gelu", 1024 -> 5120 -> 5120.
        # - LM: Vicuna-13B v1.5 (HF lmsys/vicuna-13b-v1.5, a Llama-2-13B: hidden 5120, 40 layers, 40 heads,
        #   40 kv heads, intermediate 13824, vocab 32000, rms_norm_eps 1e-5, rope_theta 10000,
        #   max_position_embeddings 4096, untied embeddings). LLaVA-1.5 trains at model_max_length 2048.
        preset("llava-1.5-13b", vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40,
               ffn_hidden=13824, image_size=336, patch_size=14, vision_dim=1024, vision_layers=23,
               vision_heads=16, vision_ffn_hidden=4096, norm_eps=1e-5, vision_norm_eps=1e-5, rope_theta=10000.0,
               max_seq_len=4096),
    ]


PRESETS = _presets()
