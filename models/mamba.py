"""Mamba-2 in a hybrid stack (plain, single device): Mamba-2 blocks, self-attention and MLP layers.

Mamba-2 block (Dao & Gu 2024, arXiv:2405.21060, §7 "the Mamba-2 architecture"; mamba_ssm's ``Mamba2``,
Megatron Core's ``MambaMixer``): from the block input u (b, l, dim)

    z, x, B, C, dt = in_proj(u)                       d_inner = expand * dim = heads * head_dim
    x, B, C        = SiLU(causal depthwise conv1d(x, B, C))   (kernel 4, over positions, per channel)
    dt             = softplus(dt + dt_bias),  A = -exp(A_log)
    y              = SSD scan(x, dt, A, B, C, D)     (mcompile::ssd_scan, kernels/ssd_scan.py)
    y              = RMSNorm_per_group(y * SiLU(z)) * w   (gated RMSNorm, norm after the gate, one norm
                                                           per group of d_inner / groups channels)
    out            = out_proj(y)

``in_proj`` is written as five ``nn.Linear`` (``in_proj_z``, ``in_proj_x``, ``in_proj_B``, ``in_proj_C``,
``in_proj_dt``) and the conv as three depthwise ``nn.Conv1d`` (``conv_x``, ``conv_B``, ``conv_C``): the
same function as mamba_ssm's one fused in_proj (its weight is these five stacked by rows) and one
conv1d over the concatenated x, B, C channels (a depthwise conv is per channel). With the fused form
(``fused_in_proj=True``) the projection's output is split at unequal sizes, which a column split of
the fused weight does not follow (Megatron reorders the fused weight per rank for that); the default
form leaves each piece its own column-parallel weight.

Hybrid stack (Waleffe et al. 2024, "An Empirical Study of Mamba-based Language Models",
arXiv:2406.07887; Megatron's ``hybrid_override_pattern``): one character per layer, ``M`` a Mamba-2
block, ``*`` self-attention (Llama's GQA attention, models/llama.py, with RoPE), ``-`` an MLP
(up, squared ReLU, down); every layer pre-norm (RMSNorm) with a residual. Embedding, final RMSNorm,
LM head, cross-entropy.

Plain PyTorch: no parallelism; the scan is the one op taken from mcompile (a custom op, so that
torch.export captures it whole).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from mcompile.kernels.ssd_scan import ssd_scan

from .llama import Attention, LlamaConfig, RMSNorm, rope_inv_freq

__all__ = ["MambaHybridConfig", "MambaHybrid", "Mamba2Mixer", "PRESETS"]


@dataclass
class MambaHybridConfig:
    vocab_size: int
    dim: int
    pattern: str  # one char a layer: "M" Mamba-2, "*" attention, "-" MLP
    n_heads: int  # attention
    n_kv_heads: int
    ffn_hidden: int
    ssm_heads: int
    ssm_head_dim: int  # p
    ssm_state: int  # n
    ssm_groups: int  # groups of B and C (heads // groups heads share one)
    conv_kernel: int = 4
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    fused_in_proj: bool = False

    def __post_init__(self) -> None:
        if set(self.pattern) - set("M*-"):
            raise ValueError(f"pattern {self.pattern!r}: characters must be M (Mamba-2), * (attention) or - (MLP)")
        if self.ssm_heads % self.ssm_groups:
            raise ValueError(f"ssm_groups ({self.ssm_groups}) must divide ssm_heads ({self.ssm_heads})")
        if "*" in self.pattern:
            LlamaConfig(self.vocab_size, self.dim, 1, self.n_heads, self.n_kv_heads, self.ffn_hidden)  # checks

    @property
    def n_layers(self) -> int:
        return len(self.pattern)

    @property
    def d_inner(self) -> int:
        return self.ssm_heads * self.ssm_head_dim

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def attention_config(self) -> LlamaConfig:
        return LlamaConfig(vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                           n_kv_heads=self.n_kv_heads, ffn_hidden=self.ffn_hidden, norm_eps=self.norm_eps,
                           rope_theta=self.rope_theta, max_seq_len=self.max_seq_len)


def _causal_conv(conv: nn.Conv1d, t: torch.Tensor) -> torch.Tensor:
    """(b, l, ch) -> (b, l, ch): depthwise conv over positions, left-padded (output t sees inputs <= t)."""
    return conv(t.transpose(1, 2))[..., : t.shape[1]].transpose(1, 2)


class Mamba2Mixer(nn.Module):
    def __init__(self, config: MambaHybridConfig) -> None:
        super().__init__()
        c = config
        self.heads, self.head_dim, self.state, self.groups = c.ssm_heads, c.ssm_head_dim, c.ssm_state, c.ssm_groups
        self.eps = c.norm_eps
        d_inner, d_bc = c.d_inner, c.ssm_groups * c.ssm_state
        self.sizes = (d_inner, d_inner, d_bc, d_bc, c.ssm_heads)  # z, x, B, C, dt
        conv = lambda ch: nn.Conv1d(ch, ch, c.conv_kernel, groups=ch, padding=c.conv_kernel - 1)  # noqa: E731
        if c.fused_in_proj:
            self.in_proj = nn.Linear(c.dim, sum(self.sizes), bias=False)
            self.conv1d = conv(d_inner + 2 * d_bc)
        else:
            self.in_proj_z = nn.Linear(c.dim, d_inner, bias=False)
            self.in_proj_x = nn.Linear(c.dim, d_inner, bias=False)
            self.in_proj_B = nn.Linear(c.dim, d_bc, bias=False)
            self.in_proj_C = nn.Linear(c.dim, d_bc, bias=False)
            self.in_proj_dt = nn.Linear(c.dim, c.ssm_heads, bias=False)
            self.conv_x, self.conv_B, self.conv_C = conv(d_inner), conv(d_bc), conv(d_bc)
        self.dt_bias = nn.Parameter(torch.empty(c.ssm_heads))
        self.A_log = nn.Parameter(torch.empty(c.ssm_heads))
        self.D = nn.Parameter(torch.empty(c.ssm_heads))
        self.norm_weight = nn.Parameter(torch.empty(d_inner))
        self.out_proj = nn.Linear(d_inner, c.dim, bias=False)
        self.reset_ssm_parameters()

    @torch.no_grad()
    def reset_ssm_parameters(self) -> None:
        """mamba_ssm's Mamba2 init: A in U(1, 16), dt in logU(1e-3, 1e-1) through softplus's inverse, D = 1."""
        if self.A_log.is_meta:
            return
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        dt = torch.exp(torch.rand_like(self.dt_bias) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.D.fill_(1.0)
        self.norm_weight.fill_(1.0)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        b, s, _ = u.shape
        if hasattr(self, "in_proj"):
            z, xbc, dt = self.in_proj(u).split([self.sizes[0], sum(self.sizes[1:4]), self.sizes[4]], dim=-1)
            x, B, C = F.silu(_causal_conv(self.conv1d, xbc)).split(list(self.sizes[1:4]), dim=-1)
        else:
            z, dt = self.in_proj_z(u), self.in_proj_dt(u)
            x = F.silu(_causal_conv(self.conv_x, self.in_proj_x(u)))
            B = F.silu(_causal_conv(self.conv_B, self.in_proj_B(u)))
            C = F.silu(_causal_conv(self.conv_C, self.in_proj_C(u)))
        dt = F.softplus(dt + self.dt_bias)
        A = -torch.exp(self.A_log)
        y = ssd_scan(x.reshape(b, s, self.heads, self.head_dim), dt, A,
                     B.reshape(b, s, self.groups, self.state), C.reshape(b, s, self.groups, self.state), self.D)
        # gated RMSNorm, the norm after the gate, one norm a group (mamba_ssm RMSNormGated, group_size
        # d_inner / groups, norm_before_gate=False)
        y = y.reshape(b, s, self.heads * self.head_dim) * F.silu(z)
        yg = y.float().reshape(b, s, self.groups, -1)
        yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + self.eps)
        y = yg.reshape(b, s, self.heads * self.head_dim).to(u.dtype) * self.norm_weight
        return self.out_proj(y)


class MLP(nn.Module):
    """up, squared ReLU, down (the hybrid's MLP layers: 4 x dim, not gated)."""

    def __init__(self, config: MambaHybridConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.down = nn.Linear(config.ffn_hidden, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)).square())


class HybridLayer(nn.Module):
    """x + mixer(RMSNorm(x)), the mixer a Mamba-2 block, an attention or an MLP."""

    def __init__(self, kind: str, config: MambaHybridConfig) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(config.dim, config.norm_eps)
        if kind == "M":
            self.mixer = Mamba2Mixer(config)
        elif kind == "*":
            self.mixer = Attention(config.attention_config())
        else:
            self.mixer = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + (self.mixer(h, cos, sin) if self.kind == "*" else self.mixer(h))


class MambaHybrid(nn.Module):
    def __init__(self, config: MambaHybridConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList([HybridLayer(k, config) for k in config.pattern])
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config.head_dim, config.rope_theta), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Linears and embeddings N(0, 0.02), every residual output projection N(0, 0.02 / sqrt(2 n_layers));
        the SSM parameters as mamba_ssm initialises them; convs keep PyTorch's default."""
        if self.output.weight.is_meta:
            return
        std_proj = 0.02 / math.sqrt(2 * self.config.n_layers)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        for layer in self.layers:
            m = layer.mixer
            out = m.out_proj if isinstance(m, Mamba2Mixer) else m.wo if isinstance(m, Attention) else m.down
            nn.init.normal_(out.weight, mean=0.0, std=std_proj)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        b, s = idx.size()
        h = self.tok_embeddings(idx)
        t = torch.arange(s, device=idx.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)


def _inputs(config: MambaHybridConfig, batch: int, seq: int, device, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (tokens, targets); the first row's first 3 targets ignored (-100), so dp ranks count different
    numbers of tokens."""
    idx = torch.randint(0, config.vocab_size, (batch, seq), device=device, generator=generator)
    targets = torch.randint(0, config.vocab_size, (batch, seq), device=device, generator=generator)
    if device.type != "meta":
        targets[0, : min(3, seq)] = -100
    return idx, targets


def _preset(name: str, config: MambaHybridConfig):
    from mcompile.models.presets import Preset

    return Preset(name, "mamba", config, model_class=MambaHybrid, inputs=_inputs)


PRESETS = [
    # tests: Mamba-2, attention, Mamba-2, MLP; 8 SSM heads of 8 (d_inner 64 = dim), state 16, 2 groups
    _preset("mamba2-hybrid-tiny", MambaHybridConfig(
        vocab_size=256, dim=64, pattern="M*M-", n_heads=8, n_kv_heads=4, ffn_hidden=256, ssm_heads=8,
        ssm_head_dim=8, ssm_state=16, ssm_groups=2, max_seq_len=64)),
    # Waleffe et al. 2024 (arXiv:2406.07887), the 8B Mamba-2-Hybrid: 56 layers, 24 Mamba-2, 4
    # self-attention, 28 MLP, hidden 4096, attention 32 heads in 8 GQA groups, MLP 16384 (4 x), sequence 4096.
    # The pattern and sizes: NeMo's NVIDIAMambaHybridConfig8B (hybrid_override_pattern, mamba_num_groups=8,
    # ffn_hidden_size=16384, num_query_groups=8) and the released nvidia/mamba2-hybrid-8b-3t-4k. Mamba-2
    # layers at Megatron's defaults: expand 2 (d_inner 8192), head dim 64 (128 heads), state 128, conv 4.
    # Vocabulary 256000 (the paper's 256K SentencePiece vocabulary; recalled, not re-read here). Deviations,
    # neither changing a weight shape: attention applies RoPE (the paper's hybrid uses no position embedding),
    # and the MLP activation (squared ReLU here) was not checked against the released config.
    _preset("mamba2-hybrid-8b", MambaHybridConfig(
        vocab_size=256000, dim=4096, pattern="M-M-M--M-M*-M-M-M-M--M*-M-M-M-M-M*--M-M-M-M-M*-M--M-M-M-",
        n_heads=32, n_kv_heads=8, ffn_hidden=16384, ssm_heads=128, ssm_head_dim=64, ssm_state=128,
        ssm_groups=8, max_seq_len=4096)),
]
