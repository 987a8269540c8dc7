"""BERT: a post-LN Transformer encoder with a masked-LM head (plain, single device).

Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers for Language
Understanding" (arXiv:1810.04805). Token + learned position + token-type embeddings summed and
normalised; each layer is self-attention over the unpadded keys (an ``attention_mask`` of 1 for a
token, 0 for padding) then a GELU MLP, each followed by residual add and LayerNorm (post-LN); the
masked-LM head is dense + GELU + LayerNorm, then a decoder tied to the word embeddings with a bias of
its own. The loss is the cross-entropy over the masked positions (labels -100 elsewhere). The
next-sentence-prediction head is left out (RoBERTa showed it is not needed; it is no parallelism
case of its own). Plain PyTorch only: no parallelism, nothing imported from mcompile, no Python
control flow on tensor sizes or values, so ``torch.export`` captures it with dynamic batch and
sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["BertConfig", "Bert", "PRESETS"]


@dataclass
class BertConfig:
    vocab_size: int = 30522
    hidden: int = 768
    n_layers: int = 12
    n_heads: int = 12
    ffn_hidden: int = 3072
    max_seq_len: int = 512  # learned positions
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.hidden % self.n_heads != 0:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by n_heads ({self.n_heads})")


class Embeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.hidden)
        self.position = nn.Embedding(config.max_seq_len, config.hidden)
        self.token_type = nn.Embedding(config.type_vocab_size, config.hidden)
        self.ln = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.word(input_ids) + self.position(pos) + self.token_type(token_type_ids)
        return self.drop(self.ln(x))


class SelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.hidden = config.hidden
        self.head_dim = config.hidden // config.n_heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)  # one fused projection, as Megatron's BERT
        self.out = nn.Linear(config.hidden, config.hidden)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``keep``: (b, 1, 1, s) bool, True where the key is a token (not padding)."""
        b, s, _ = x.size()
        q, k, v = self.qkv(x).split(self.hidden, dim=2)
        q = q.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)  # (b, nh, s, hd)
        k = k.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(b, s, self.hidden)
        return self.resid_dropout(self.out(y))


class MLP(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.hidden, config.ffn_hidden)
        self.gelu = nn.GELU()  # BERT's exact (erf) GELU
        self.proj = nn.Linear(config.ffn_hidden, config.hidden)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))


class Layer(nn.Module):
    """Post-LN: LayerNorm after each residual add (the original Transformer's and BERT's order)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attn = SelfAttention(config)
        self.ln_1 = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.mlp = MLP(config)
        self.ln_2 = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = self.ln_1(x + self.attn(x, keep))
        return self.ln_2(x + self.mlp(x))


class MLMHead(nn.Module):
    """dense + GELU + LayerNorm, then the decoder: the word embeddings (tied) and a bias of its own."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden, config.hidden)
        self.gelu = nn.GELU()
        self.ln = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden, config.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.ln(self.gelu(self.dense(x))))


class Bert(nn.Module):
    """``model(input_ids, attention_mask, token_type_ids, labels)`` -> the masked-LM loss (a scalar)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList([Layer(config) for _ in range(config.n_layers)])
        self.mlm = MLMHead(config)
        self.tie_weights()
        self.init_weights()

    def tie_weights(self) -> None:
        """The MLM decoder's weight IS the word embedding (one Parameter); call again after ``to_empty()``."""
        self.mlm.decoder.weight = self.embeddings.word.weight

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
        keep = attention_mask.bool()[:, None, None, :]  # (b, 1, 1, s): every query sees the unpadded keys
        x = self.embeddings(input_ids, token_type_ids)
        for layer in self.layers:
            x = layer(x, keep)
        logits = self.mlm(x)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    @torch.no_grad()
    def init_weights(self) -> None:
        """BERT's init (truncated normal in the reference code; normal here): std 0.02, zero biases."""
        self.apply(self._init_weights)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """One module's own tensors (Hugging Face's convention, used for a model built on meta)."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """Parameter count, the tied decoder weight counted once (``parameters()`` de-duplicates)."""
        return sum(p.numel() for p in self.parameters())


def example_inputs(config: BertConfig, batch: int, seq: int, device, generator) -> tuple[torch.Tensor, ...]:
    """Random valid inputs: (input_ids, attention_mask, token_type_ids, labels). The first row's last 3
    positions are padding (when seq > 3); 15% of the unpadded positions are masked-LM targets, at least
    one per row (labels -100 elsewhere); token types 0 then 1 from a random split point per row."""
    kw = dict(device=device, generator=generator)
    ids = torch.randint(0, config.vocab_size, (batch, seq), dtype=torch.long, **kw)
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    if seq > 3:
        mask[0, -3:] = 0
    split = torch.randint(1, seq + 1, (batch, 1), **kw)
    token_type = (torch.arange(seq, device=device)[None, :] >= split).long() % config.type_vocab_size
    target = (torch.rand(batch, seq, **kw) < 0.15) & mask.bool()
    target[:, 0] = True  # at least one target per row (position 0 is never padding)
    labels = torch.where(target, ids, torch.full_like(ids, -100))
    return ids, mask, token_type, labels


def _presets() -> list:
    from .presets import Preset  # the registry imports this module: import its Preset lazily

    def bert(name: str, **fields) -> Preset:
        return Preset(name, "bert", BertConfig(**fields), model_class=Bert, inputs=example_inputs)

    return [
        # tiny, for tests: vocabulary 257 (odd) so that the vocab-parallel padding is exercised
        bert("bert-tiny", vocab_size=257, hidden=64, n_layers=2, n_heads=8, ffn_hidden=128, max_seq_len=64),
        # BERT-Base and BERT-Large: Devlin et al. 2019 (arXiv:1810.04805) §3 (L=12, H=768, A=12 / L=24,
        # H=1024, A=16; feed-forward 4H), and google-research/bert's bert_config.json of the uncased
        # models (vocab_size 30522, max_position_embeddings 512, type_vocab_size 2, layer_norm 1e-12)
        bert("bert-base", vocab_size=30522, hidden=768, n_layers=12, n_heads=12, ffn_hidden=3072, max_seq_len=512),
        bert("bert-large", vocab_size=30522, hidden=1024, n_layers=24, n_heads=16, ffn_hidden=4096, max_seq_len=512),
    ]


PRESETS = _presets()
