"""Named model presets: tiny test models and the published GPT-2/GPT-3/Llama-3 shapes."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn

from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig

__all__ = ["Preset", "PRESETS", "did_you_mean", "get_preset", "list_presets"]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@dataclass(frozen=True)
class Preset:
    name: str
    family: Literal["gpt", "llama"]
    config: GPTConfig | LlamaConfig

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        cfg = self.config
        return cfg.block_size if isinstance(cfg, GPTConfig) else cfg.max_seq_len

    def build(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> nn.Module:
        """Construct the model. ``device="meta"`` allocates no parameter memory.

        The module is constructed directly on ``device`` (under a ``torch.device`` context) and
        with ``dtype`` as the default floating dtype, so no full-size float32 copy is ever made.
        Llama's RoPE ``inv_freq`` buffer is always float32.
        """
        cls = GPT if self.family == "gpt" else Llama
        config = dataclasses.replace(self.config)  # the model gets its own copy
        dev_ctx = torch.device(device) if device is not None else contextlib.nullcontext()
        with dev_ctx, _default_dtype(dtype):
            return cls(config)

    def example_inputs(
        self, batch: int = 2, seq: int = 16, device: torch.device | str | None = None, seed: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random ``(idx, targets)`` token tensors of shape (batch, seq), dtype long, in [0, vocab)."""
        if seq > self.max_seq_len:
            raise ValueError(f"seq={seq} exceeds the max sequence length {self.max_seq_len} of {self.name}")
        device = torch.device(device) if device is not None else torch.device("cpu")
        gen = None
        if seed is not None and device.type != "meta":
            gen = torch.Generator(device=device).manual_seed(seed)
        idx = torch.randint(0, self.vocab_size, (batch, seq), device=device, dtype=torch.long, generator=gen)
        targets = torch.randint(
            0, self.vocab_size, (batch, seq), device=device, dtype=torch.long, generator=gen
        )
        return idx, targets


def _gpt(name: str, n_layer: int, n_head: int, n_embd: int, vocab: int = 50257, block: int = 1024) -> Preset:
    return Preset(
        name,
        "gpt",
        GPTConfig(vocab_size=vocab, block_size=block, n_layer=n_layer, n_head=n_head, n_embd=n_embd),
    )


def _llama(
    name: str,
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    ffn_hidden: int,
    vocab: int = 128256,
    max_seq_len: int = 8192,
) -> Preset:
    cfg = LlamaConfig(
        vocab_size=vocab,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_hidden=ffn_hidden,
        norm_eps=1e-5,
        rope_theta=500000.0,
        max_seq_len=max_seq_len,
    )
    return Preset(name, "llama", cfg)


_ALL = [
    # vocab 257 is deliberately odd so that tensor-parallel vocab padding gets exercised
    _gpt("gpt2-tiny", n_layer=2, n_head=4, n_embd=64, vocab=257, block=128),
    _gpt("gpt2-small", n_layer=12, n_head=12, n_embd=768),  # 124M
    _gpt("gpt2-medium", n_layer=24, n_head=16, n_embd=1024),  # 350M
    _gpt("gpt2-large", n_layer=36, n_head=20, n_embd=1280),  # 774M
    _gpt("gpt2-xl", n_layer=48, n_head=25, n_embd=1600),  # 1.5B
    _gpt("gpt3-175b", n_layer=96, n_head=96, n_embd=12288, vocab=50257, block=2048),
    _llama(
        "llama3-tiny", dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=128, vocab=256, max_seq_len=128
    ),
    _llama("llama3-8b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336),
    _llama("llama3-70b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672),
    _llama("llama3-405b", dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden=53248),
]

PRESETS: dict[str, Preset] = {p.name: p for p in _ALL}


def list_presets() -> list[str]:
    """Names of all presets, sorted."""
    return sorted(PRESETS)


def did_you_mean(name: str, known) -> str:
    """``" (did you mean 'llama3-8b'?)"`` for a near miss of one of ``known`` (difflib, ignoring case),
    else ``""``: a suffix for an error message."""
    import difflib

    by_folded = {k.lower(): k for k in known}
    close = difflib.get_close_matches(name.lower(), list(by_folded), n=1, cutoff=0.6)
    return f" (did you mean {by_folded[close[0]]!r}?)" if close else ""


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}{did_you_mean(name, PRESETS)}; known presets: {', '.join(list_presets())}"
        ) from None
