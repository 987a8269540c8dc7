"""RETRO-style retrieval-enhanced decoder (plain, single device).

Borgeaud et al. 2022, "Improving language models by retrieving from trillions of tokens" (arXiv:2112.04426),
§2. A Llama-style decoder (models/llama.py: pre-norm RMSNorm, RoPE, GQA self-attention, SwiGLU) in which
the layers ``retro_layers`` add a chunked cross-attention (CCA) between the self-attention and the MLP,
each a pre-norm residual: the paper's RETRO block ATTN -> CCA -> FFW.

Inputs: ``tokens`` [batch, seq], ``neighbours`` [batch, seq / chunk_size, n_neighbours, neighbour_len] (the
token ids retrieved for each chunk of ``chunk_size`` tokens: in the paper each neighbour is the retrieved
chunk and its continuation, r = 2m tokens), ``targets`` [batch, seq].

* Encoder: each neighbour is encoded on its own by a small bidirectional transformer (own embedding and
  width ``enc_dim``, non-causal attention, RoPE, SwiGLU), once, shared by every CCA layer. The paper's
  encoder also cross-attends to the decoder's activations of the chunk it was retrieved for; that
  conditioning is omitted here.
* CCA (§2.4, eq. 3 and Fig. 2): chunk u's neighbours were retrieved with chunk u itself as the query, so
  only tokens after chunk u may see them. As in the paper the activations are shifted by m - 1: the last
  token of chunk u and the first m - 1 tokens of chunk u + 1 attend to the neighbours of chunk u. The
  first m - 1 tokens of the sequence attend to nothing (their CCA output is 0), and the neighbours of the
  last chunk are seen by its last token only (the shifted window is zero-padded past the sequence).
  Each query attends to the n_neighbours x neighbour_len encoded tokens of its window (no mask, no
  positional encoding: the paper's relative positions in CCA are not modelled). Queries are projected
  from the decoder width, keys and values from the encoder width.

Megatron's minimum per layer under tp without sequence parallelism (forward all-reduces): a decoder
self-attention + MLP layer 2, a RETRO layer 3 (+1: the CCA's output projection), an encoder layer 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .llama import Attention, LlamaConfig, RMSNorm, TransformerBlock, apply_rotary, rope_inv_freq
from .presets import Preset

__all__ = ["RetroConfig", "Retro", "ChunkedCrossAttention", "PRESETS"]


@dataclass(kw_only=True)
class RetroConfig(LlamaConfig):
    """A Llama config for the decoder plus the retrieval fields."""

    chunk_size: int = 64  # m
    n_neighbours: int = 2  # k
    neighbour_len: int = 128  # r: a retrieved chunk and its continuation
    retro_start: int = 5  # the first layer (0-based) with CCA
    retro_every: int = 3  # then every retro_every-th layer
    enc_dim: int = 896
    enc_layers: int = 2
    enc_heads: int = 16
    enc_ffn_hidden: int = 3584

    @property
    def seq_multiple(self) -> int:
        """Sequences come in whole chunks (what ``mcompile plan`` captures at)."""
        return self.chunk_size

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk_size < 1 or self.n_neighbours < 1 or self.neighbour_len < 1 or self.retro_every < 1:
            raise ValueError("chunk_size, n_neighbours, neighbour_len and retro_every must be >= 1")
        if not 0 <= self.retro_start < self.n_layers:
            raise ValueError(f"retro_start={self.retro_start} must be a layer index in [0, {self.n_layers})")
        if self.max_seq_len % self.chunk_size:
            raise ValueError(f"max_seq_len={self.max_seq_len} must be a multiple of chunk_size={self.chunk_size}")
        self.encoder_config()  # validates the encoder's width and heads

    @property
    def retro_layers(self) -> list[int]:
        return list(range(self.retro_start, self.n_layers, self.retro_every))

    def encoder_config(self) -> LlamaConfig:
        return LlamaConfig(vocab_size=self.vocab_size, dim=self.enc_dim, n_layers=self.enc_layers,
                           n_heads=self.enc_heads, n_kv_heads=self.enc_heads, ffn_hidden=self.enc_ffn_hidden,
                           norm_eps=self.norm_eps, rope_theta=self.rope_theta, max_seq_len=self.neighbour_len)


class EncoderAttention(Attention):
    """Llama's attention without the causal mask: a neighbour is read both ways."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.size()
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)  # (b, nh, s, hd)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        return self.wo(y.transpose(1, 2).contiguous().view(b, s, self.n_heads * self.head_dim))


class EncoderBlock(TransformerBlock):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.attention = EncoderAttention(config)


class ChunkedCrossAttention(nn.Module):
    def __init__(self, config: RetroConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.chunk_size = config.chunk_size
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.enc_dim, config.dim, bias=False)
        self.wv = nn.Linear(config.enc_dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, enc: torch.Tensor) -> torch.Tensor:
        """x: (b, s, dim) decoder activations; enc: (b, l, k * r, enc_dim), the encoded neighbours of each of
        the l = s / m chunks."""
        b, s, d = x.size()
        m, n_chunks, kr = self.chunk_size, enc.size(1), enc.size(2)
        # shift by m - 1: window u holds positions u*m + m - 1 .. u*m + 2m - 2 (zero-padded past the end)
        shifted = F.pad(x[:, m - 1:], (0, 0, 0, m - 1))  # (b, s, d)
        q = self.wq(shifted).view(b * n_chunks, m, self.n_heads, self.head_dim).transpose(1, 2)  # (b*l, nh, m, hd)
        k = self.wk(enc).view(b * n_chunks, kr, self.n_heads, self.head_dim).transpose(1, 2)  # (b*l, nh, k*r, hd)
        v = self.wv(enc).view(b * n_chunks, kr, self.n_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v)  # (b*l, nh, m, hd)
        y = self.wo(y.transpose(1, 2).contiguous().view(b, s, d))
        # shift back: position p gets window position p - (m - 1); the first m - 1 tokens get 0
        return F.pad(y[:, : s - (m - 1)], (0, 0, m - 1, 0))


class RetroBlock(TransformerBlock):
    """ATTN -> CCA -> FFW, each a pre-norm residual."""

    def __init__(self, config: RetroConfig) -> None:
        super().__init__(config)
        self.cca_norm = RMSNorm(config.dim, config.norm_eps)
        self.cca = ChunkedCrossAttention(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, enc: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        x = x + self.cca(self.cca_norm(x), enc)
        x = x + self.feed_forward(self.ffn_norm(x))
        return x


def _rope_tables(inv_freq: torch.Tensor, s: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(s, device=inv_freq.device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)  # (s, head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Retro(nn.Module):
    def __init__(self, config: RetroConfig) -> None:
        super().__init__()
        self.config = config
        enc_cfg = config.encoder_config()
        self.enc_embeddings = nn.Embedding(config.vocab_size, config.enc_dim)
        self.encoder = nn.ModuleList([EncoderBlock(enc_cfg) for _ in range(config.enc_layers)])
        self.enc_norm = RMSNorm(config.enc_dim, config.norm_eps)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        retro = set(config.retro_layers)
        self.layers = nn.ModuleList([RetroBlock(config) if i in retro else TransformerBlock(config)
                                     for i in range(config.n_layers)])
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config.head_dim, config.rope_theta), persistent=False)
        self.register_buffer("enc_inv_freq", rope_inv_freq(enc_cfg.head_dim, config.rope_theta), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """(Re)compute the RoPE buffers in place, e.g. after ``to_empty()`` from meta."""
        cfg = self.config
        self.inv_freq.copy_(rope_inv_freq(cfg.head_dim, cfg.rope_theta, device=self.inv_freq.device))
        self.enc_inv_freq.copy_(rope_inv_freq(cfg.enc_dim // cfg.enc_heads, cfg.rope_theta,
                                              device=self.enc_inv_freq.device))

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, 0.02); residual output projections scaled by 1/sqrt(2 * layers) (as models/llama.py)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        for blocks, n in ((self.layers, self.config.n_layers), (self.encoder, self.config.enc_layers)):
            std = 0.02 / math.sqrt(2 * n)
            for block in blocks:
                for proj in (block.attention.wo, block.feed_forward.w2, getattr(block, "cca", None)):
                    if proj is not None:
                        nn.init.normal_(getattr(proj, "wo", proj).weight, mean=0.0, std=std)

    def encode(self, neighbours: torch.Tensor) -> torch.Tensor:
        """neighbours: (b, l, k, r) token ids -> (b, l, k * r, enc_dim), each neighbour encoded on its own."""
        b, n_chunks, k, r = neighbours.size()
        e = self.enc_embeddings(neighbours.reshape(b * n_chunks * k, r))  # (b*l*k, r, enc_dim)
        cos, sin = _rope_tables(self.enc_inv_freq, r, e.dtype)
        for block in self.encoder:
            e = block(e, cos, sin)
        return self.enc_norm(e).reshape(b, n_chunks, k * r, -1)

    def forward(self, idx: torch.Tensor, neighbours: torch.Tensor, targets: torch.Tensor | None = None):
        b, s = idx.size()
        cfg = self.config
        want = (b, s // cfg.chunk_size, cfg.n_neighbours, cfg.neighbour_len)
        bad_targets = targets is not None and targets.shape != idx.shape
        if s % cfg.chunk_size or tuple(neighbours.shape) != want or bad_targets:
            raise ValueError(f"tokens {list(idx.shape)} need a length that is a multiple of chunk_size="
                             f"{cfg.chunk_size}, neighbours of shape {list(want)} and targets of the tokens' shape; "
                             f"got neighbours {list(neighbours.shape)}, targets "
                             f"{None if targets is None else list(targets.shape)}")
        enc = self.encode(neighbours)
        h = self.tok_embeddings(idx)
        cos, sin = _rope_tables(self.inv_freq, s, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, enc) if isinstance(layer, RetroBlock) else layer(h, cos, sin)
        logits = self.output(self.norm(h))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)


def retro_inputs(config: RetroConfig, batch: int, seq: int, device, generator) -> tuple[torch.Tensor, ...]:
    """Random (tokens, neighbours, targets); seq must be a multiple of chunk_size. The first 5 targets of row 0
    are ignored (-100), so data-parallel ranks count different numbers of tokens."""
    if seq % config.chunk_size:
        raise ValueError(f"seq={seq} must be a multiple of chunk_size={config.chunk_size}")
    n_chunks = seq // config.chunk_size

    def ids(*shape):
        return torch.randint(0, config.vocab_size, shape, device=device, generator=generator)

    idx, targets = ids(batch, seq), ids(batch, seq)
    neighbours = ids(batch, n_chunks, config.n_neighbours, config.neighbour_len)
    if device.type != "meta":
        targets[0, :5] = -100
    return idx, neighbours, targets


def _retro(name: str, **fields) -> Preset:
    return Preset(name, "retro", RetroConfig(**fields), model_class=Retro, inputs=retro_inputs)


PRESETS = [
    # 2 decoder layers, the second a RETRO layer; chunks of 4 (4 chunks at seq 16), 2 neighbours of 8 tokens
    _retro("retro-tiny", vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=128,
           max_seq_len=128, rope_theta=10000.0, chunk_size=4, n_neighbours=2, neighbour_len=8, retro_start=1,
           retro_every=3, enc_dim=32, enc_layers=2, enc_heads=4, enc_ffn_hidden=64),
    # RETRO 7.5B: Borgeaud et al. 2022 (arXiv:2112.04426) Table 2 (d_model 4096, d_ffw 16384, 32 heads of 128,
    # 32 layers), §2 and Appendix (SentencePiece vocabulary of 128,000 tokens, 2048-token context, chunks of
    # m = 64, k = 2 neighbours of r = 128 tokens, a 2-layer encoder of width 896 with 16 heads, RETRO layers
    # from layer 6 every 3rd: 6, 9, ..., 30 counted from 1). Not the paper's model: a SwiGLU FFW of hidden
    # d_ffw, RoPE instead of relative position encodings, the encoder not conditioned on the decoder.
    _retro("retro-7.5b", vocab_size=128000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden=16384,
           max_seq_len=2048, rope_theta=10000.0, chunk_size=64, n_neighbours=2, neighbour_len=128, retro_start=5,
           retro_every=3, enc_dim=896, enc_layers=2, enc_heads=16, enc_ffn_hidden=3584),
]
