"""T5 encoder-decoder transformer (plain, single device).

Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer"
(JMLR 21, arXiv:1910.10683), and its v1.1 revision (google-research/text-to-text-transfer-transformer,
released_checkpoints.md): RMSNorm without bias or mean subtraction before each sub-layer (pre-norm), a
learned, bucketed relative position bias (one [num_buckets, heads] table per stack, shared by the
stack's layers; bidirectional in the encoder, causal in the decoder; none in cross-attention), no
1/sqrt(d_kv) scaling of the scores (folded into the initialisation), an encoder padding mask, the decoder
fed the labels shifted right behind a start token, a ReLU FFN (original) or gated-GELU FFN (v1.1), and
an LM head tied to the shared embedding with the decoder output scaled by d_model**-0.5 (original) or
untied (v1.1). Loss: cross-entropy over the labels, -100 ignored.

Plain PyTorch only: no parallelism, nothing imported from mcompile's compiler. The forward has no Python
control flow on tensor values, so that ``torch.export`` captures it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .presets import Preset

__all__ = ["T5Config", "T5", "T5RMSNorm", "relative_position_bucket", "PRESETS"]


@dataclass
class T5Config:
    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_heads: int
    num_layers: int  # encoder layers
    num_decoder_layers: int
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    feed_forward: str = "gated-gelu"  # "relu" (T5, Raffel et al. 2020) or "gated-gelu" (T5 v1.1)
    tie_word_embeddings: bool = False  # True: original T5 (head = shared embedding, input scaled by d_model**-0.5)
    layer_norm_eps: float = 1e-6
    dropout: float = 0.0
    max_seq_len: int = 512
    decoder_start_token_id: int = 0  # T5 starts the decoder with the pad token
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if self.feed_forward not in ("relu", "gated-gelu"):
            raise ValueError(f"feed_forward must be 'relu' or 'gated-gelu', got {self.feed_forward!r}")
        if self.relative_attention_num_buckets < 4 or self.relative_attention_num_buckets % 2:
            raise ValueError("relative_attention_num_buckets must be an even number >= 4, got "
                             f"{self.relative_attention_num_buckets}")

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.d_kv


class T5RMSNorm(nn.Module):
    """T5's layer norm: scale only, no bias, no mean subtraction, variance in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """Bucket of each ``key - query`` offset (Raffel et al. 2020 §2.1; mesh-tensorflow's
    ``_relative_position_bucket``): exact buckets for small offsets, logarithmic ones up to
    ``max_distance``, the last bucket beyond. Bidirectional: half the buckets for positive offsets."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:  # causal: only keys at or before the query, distance = query - key >= 0
        distance = -torch.clamp(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # log-spaced buckets for distances in [max_exact, max_distance); clamp(min=1) keeps log finite where unused
    large = max_exact + (
        torch.log(distance.clamp(min=1).float() / max_exact) / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class RelativePositionBias(nn.Module):
    """A learned scalar per (bucket, head), added to the attention scores: (1, heads, q, k)."""

    def __init__(self, config: T5Config, bidirectional: bool) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance
        self.relative_attention_bias = nn.Embedding(self.num_buckets, config.num_heads)

    def forward(self, q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
        context = torch.arange(q_len, dtype=torch.long, device=device)[:, None]
        memory = torch.arange(k_len, dtype=torch.long, device=device)[None, :]
        buckets = relative_position_bucket(memory - context, self.bidirectional, self.num_buckets,
                                           self.max_distance)  # (q, k)
        values = self.relative_attention_bias(buckets)  # (q, k, heads)
        return values.permute(2, 0, 1).unsqueeze(0)  # (1, heads, q, k)


class T5Attention(nn.Module):
    """Multi-head attention without score scaling; ``bias`` (broadcast to (b, heads, q, k)) carries the
    relative positions and the masks."""

    def __init__(self, config: T5Config) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.d_kv = config.d_kv
        self.dropout = config.dropout
        self.q = nn.Linear(config.d_model, config.inner_dim, bias=False)
        self.k = nn.Linear(config.d_model, config.inner_dim, bias=False)
        self.v = nn.Linear(config.d_model, config.inner_dim, bias=False)
        self.o = nn.Linear(config.inner_dim, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.size()
        t = kv.size(1)
        q = self.q(x).view(b, s, self.num_heads, self.d_kv).transpose(1, 2)  # (b, nh, s, d_kv)
        k = self.k(kv).view(b, t, self.num_heads, self.d_kv).transpose(1, 2)  # (b, nh, t, d_kv)
        v = self.v(kv).view(b, t, self.num_heads, self.d_kv).transpose(1, 2)
        # T5 does not divide the scores by sqrt(d_kv): the query projection's init absorbs it
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(b, s, self.num_heads * self.d_kv)
        return self.o(y)


class T5FeedForward(nn.Module):
    """ReLU FFN (T5) or gated-GELU (T5 v1.1: gelu(wi_0 x) * wi_1 x, tanh-approximate GELU)."""

    def __init__(self, config: T5Config) -> None:
        super().__init__()
        self.gated = config.feed_forward == "gated-gelu"
        if self.gated:
            self.wi_0 = nn.Linear(config.d_model, config.d_ff, bias=False)
            self.wi_1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        else:
            self.wi = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            h = F.gelu(self.wi_0(x), approximate="tanh") * self.wi_1(x)
        else:
            h = F.relu(self.wi(x))
        return self.wo(self.dropout(h))


class T5EncoderLayer(nn.Module):
    def __init__(self, config: T5Config) -> None:
        super().__init__()
        self.attention_norm = T5RMSNorm(config.d_model, config.layer_norm_eps)
        self.attention = T5Attention(config)
        self.ffn_norm = T5RMSNorm(config.d_model, config.layer_norm_eps)
        self.feed_forward = T5FeedForward(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(x)
        x = x + self.dropout(self.attention(h, h, bias))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class T5DecoderLayer(nn.Module):
    def __init__(self, config: T5Config) -> None:
        super().__init__()
        self.self_attention_norm = T5RMSNorm(config.d_model, config.layer_norm_eps)
        self.self_attention = T5Attention(config)
        self.cross_attention_norm = T5RMSNorm(config.d_model, config.layer_norm_eps)
        self.cross_attention = T5Attention(config)
        self.ffn_norm = T5RMSNorm(config.d_model, config.layer_norm_eps)
        self.feed_forward = T5FeedForward(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, self_bias: torch.Tensor,
                cross_bias: torch.Tensor) -> torch.Tensor:
        h = self.self_attention_norm(x)
        x = x + self.dropout(self.self_attention(h, h, self_bias))
        x = x + self.dropout(self.cross_attention(self.cross_attention_norm(x), memory, cross_bias))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class T5Stack(nn.Module):
    """The encoder or the decoder: its relative position table, its layers, a final norm."""

    def __init__(self, config: T5Config, decoder: bool) -> None:
        super().__init__()
        self.decoder = decoder
        self.relative_position = RelativePositionBias(config, bidirectional=not decoder)
        n = config.num_decoder_layers if decoder else config.num_layers
        layer = T5DecoderLayer if decoder else T5EncoderLayer
        self.layers = nn.ModuleList([layer(config) for _ in range(n)])
        self.final_norm = T5RMSNorm(config.d_model, config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)


class T5(nn.Module):
    """``T5(config)(input_ids, attention_mask, labels) -> loss``: ``input_ids`` (b, s) and its 0/1
    ``attention_mask`` (0 = encoder padding) for the encoder; ``labels`` (b, t), -100 where ignored, both
    the decoder's targets and (shifted right) its inputs."""

    def __init__(self, config: T5Config) -> None:
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = T5Stack(config, decoder=False)
        self.decoder = T5Stack(config, decoder=True)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.tie_weights()
        self.init_weights()

    def tie_weights(self) -> None:
        """Tie ``lm_head.weight`` to ``shared.weight`` if ``config.tie_word_embeddings`` (call again after
        ``to_empty()`` from meta)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.shared.weight

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Mesh-tensorflow's T5 init (as Hugging Face's ``T5PreTrainedModel._init_weights``), one module's
        own tensors: embedding N(0, 1); q N(0, (d_model d_kv)^-1/2), k and v N(0, d_model^-1/2), o
        N(0, (heads d_kv)^-1/2); FFN inputs N(0, d_model^-1/2), output N(0, d_ff^-1/2); position table
        N(0, d_model^-1/2); an untied head N(0, d_model^-1/2); norms 1."""
        c = self.config
        if isinstance(module, T5RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, T5Attention):
            nn.init.normal_(module.q.weight, std=(c.d_model * c.d_kv) ** -0.5)
            nn.init.normal_(module.k.weight, std=c.d_model ** -0.5)
            nn.init.normal_(module.v.weight, std=c.d_model ** -0.5)
            nn.init.normal_(module.o.weight, std=c.inner_dim ** -0.5)
        elif isinstance(module, T5FeedForward):
            for lin in ([module.wi_0, module.wi_1] if module.gated else [module.wi]):
                nn.init.normal_(lin.weight, std=c.d_model ** -0.5)
            nn.init.normal_(module.wo.weight, std=c.d_ff ** -0.5)
        elif isinstance(module, RelativePositionBias):
            nn.init.normal_(module.relative_attention_bias.weight, std=c.d_model ** -0.5)
        elif module is self:
            if not c.tie_word_embeddings:
                nn.init.normal_(self.lm_head.weight, std=c.d_model ** -0.5)
            nn.init.normal_(self.shared.weight, std=1.0)  # after the head: tied, the embedding's init wins

    @torch.no_grad()
    def init_weights(self) -> None:
        for module in self.modules():
            self._init_weights(module)

    def num_params(self) -> int:
        """Parameter count, tied weights counted once."""
        return sum(p.numel() for p in self.parameters())

    def shift_right(self, labels: torch.Tensor) -> torch.Tensor:
        """The decoder's inputs: the start token, then the labels but the last; -100 becomes padding."""
        shifted = labels.roll(1, dims=1)  # position 0 (the last label, wrapped around) is overwritten
        first = torch.arange(labels.size(1), device=labels.device) == 0
        shifted = torch.where(first, self.config.decoder_start_token_id, shifted)
        return shifted.masked_fill(shifted == -100, self.config.pad_token_id)

    def encode(self, input_ids: torch.Tensor, pad_bias: torch.Tensor) -> torch.Tensor:
        enc = self.encoder
        s = input_ids.size(1)
        x = enc.dropout(self.shared(input_ids))
        bias = enc.relative_position(s, s, input_ids.device) + pad_bias  # (b, heads, s, s)
        for layer in enc.layers:
            x = layer(x, bias)
        return enc.dropout(enc.final_norm(x))

    def decode(self, decoder_ids: torch.Tensor, memory: torch.Tensor, pad_bias: torch.Tensor) -> torch.Tensor:
        dec = self.decoder
        t = decoder_ids.size(1)
        x = dec.dropout(self.shared(decoder_ids))
        pos = torch.arange(t, device=decoder_ids.device)
        future = pos[None, :] > pos[:, None]  # (t, t): key after query
        causal = torch.zeros(t, t, dtype=x.dtype, device=x.device).masked_fill(future, torch.finfo(x.dtype).min)
        self_bias = dec.relative_position(t, t, decoder_ids.device) + causal  # (1, heads, t, t)
        for layer in dec.layers:
            x = layer(x, memory, self_bias, pad_bias)
        return dec.dropout(dec.final_norm(x))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        dtype = self.shared.weight.dtype
        # (b, 1, 1, s): 0 where a key is a real token, the most negative float where it is padding
        pad_bias = (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
        memory = self.encode(input_ids, pad_bias)
        h = self.decode(self.shift_right(labels), memory, pad_bias)
        if self.config.tie_word_embeddings:  # Mesh TensorFlow's tied head: rescale before the embedding matmul
            h = h * self.config.d_model ** -0.5
        logits = self.lm_head(h)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)


def t5_inputs(config: T5Config, batch: int, seq: int, device: torch.device,
              generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels), all (batch, seq): the first row's last 3 encoder positions are
    padding (mask 0, token pad_token_id), the first row's first 5 labels are -100 (ignored)."""
    input_ids = torch.randint(1, config.vocab_size, (batch, seq), device=device, generator=generator)
    labels = torch.randint(1, config.vocab_size, (batch, seq), device=device, generator=generator)
    attention_mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    attention_mask[0, -3:] = 0
    input_ids[0, -3:] = config.pad_token_id
    labels[0, :5] = -100
    return input_ids, attention_mask, labels


def _t5(name: str, **fields) -> Preset:
    return Preset(name, "t5", T5Config(**fields), model_class=T5, inputs=t5_inputs)


PRESETS = [
    # tiny, for tests: the original T5's choices (ReLU FFN, tied head), an odd vocabulary (padded under tp)
    _t5("t5-tiny", vocab_size=257, d_model=64, d_kv=8, d_ff=128, num_heads=8, num_layers=2, num_decoder_layers=2,
        feed_forward="relu", tie_word_embeddings=True, max_seq_len=64),
    # the same with T5 v1.1's choices: gated-GELU FFN, untied head
    _t5("t5-tiny-untied", vocab_size=128, d_model=64, d_kv=8, d_ff=128, num_heads=8, num_layers=2,
        num_decoder_layers=2, feed_forward="gated-gelu", tie_word_embeddings=False, max_seq_len=64),
    # T5-11B: Raffel et al. 2020 §3.7 / Table 14 (d_model 1024, d_ff 65536, 128 heads of d_kv 128, 24 + 24
    # layers) and the Hugging Face config of google-t5/t5-11b (vocab 32128, 32 buckets, max distance 128,
    # ReLU FFN, tied head); 512-token inputs in pre-training
    _t5("t5-11b", vocab_size=32128, d_model=1024, d_kv=128, d_ff=65536, num_heads=128, num_layers=24,
        num_decoder_layers=24, feed_forward="relu", tie_word_embeddings=True, max_seq_len=512),
    # T5 v1.1 XL (3B): google-research/text-to-text-transfer-transformer released_checkpoints.md and the
    # Hugging Face config of google/t5-v1_1-xl (d_model 2048, d_ff 5120, 32 heads of d_kv 64, 24 + 24
    # layers, vocab 32128, gated-GELU, untied head)
    _t5("t5-v1_1-xl", vocab_size=32128, d_model=2048, d_kv=64, d_ff=5120, num_heads=32, num_layers=24,
        num_decoder_layers=24, feed_forward="gated-gelu", tie_word_embeddings=False, max_seq_len=512),
    # T5 v1.1 XXL (11B): google/t5-v1_1-xxl (d_model 4096, d_ff 10240, 64 heads of d_kv 64, 24 + 24 layers)
    _t5("t5-v1_1-xxl", vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_heads=64, num_layers=24,
        num_decoder_layers=24, feed_forward="gated-gelu", tie_word_embeddings=False, max_seq_len=512),
]
