"""Named model presets: tiny test models and the published GPT-2/GPT-3/Llama-3/Mixtral/DeepSeek-V3 shapes."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig
from .moe_lm import DeepSeekV3, DeepSeekV3Config, Mixtral, MixtralConfig

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


Family = str  # "gpt", "llama", "mixtral", "deepseek", or a family module's own (FAMILY_MODULES below)

# a family's model class and the config class it takes
_FAMILIES: dict[str, tuple[type[nn.Module], type]] = {
    "gpt": (GPT, GPTConfig),
    "llama": (Llama, LlamaConfig),
    "mixtral": (Mixtral, MixtralConfig),
    "deepseek": (DeepSeekV3, DeepSeekV3Config),
}


@dataclass(frozen=True)
class Preset:
    """A named model: ``model_class(config)`` builds it. ``model_class`` defaults to the family's class
    (``GPT``, ``Llama``, ``Mixtral``, ``DeepSeekV3``); pass another ``nn.Module`` class taking the config
    to name a variant of a family."""

    name: str
    family: Family
    config: object  # the family's config dataclass (GPTConfig, LlamaConfig, ...)
    model_class: type[nn.Module] | None = None
    # a family whose model is not called as model(tokens, targets) (an encoder-decoder, images and text):
    # inputs(config, batch, seq, device, generator) -> the example inputs' tuple, random and valid
    inputs: Callable | None = None

    def __post_init__(self) -> None:
        if self.family not in _FAMILIES and self.model_class is not None:
            return  # a family module's model (FAMILY_MODULES): its own class and config
        if self.family not in _FAMILIES:
            raise ValueError(f"preset {self.name!r}: unknown family {self.family!r}; families: {', '.join(_FAMILIES)}")
        cls, config_cls = _FAMILIES[self.family]
        if self.model_class is None:
            if not isinstance(self.config, config_cls):
                raise TypeError(f"preset {self.name!r}: family {self.family!r} ({cls.__name__}) needs a "
                                f"{config_cls.__name__}, got a {type(self.config).__name__}: fix the family or pass "
                                "model_class")
            object.__setattr__(self, "model_class", cls)  # frozen: resolved once, here

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
        config = dataclasses.replace(self.config)  # the model gets its own copy
        dev_ctx = torch.device(device) if device is not None else contextlib.nullcontext()
        with dev_ctx, _default_dtype(dtype):
            return self.model_class(config)

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
        if self.inputs is not None:
            return tuple(self.inputs(self.config, batch, seq, device, gen))
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


def _mixtral(name: str, **fields) -> Preset:
    return Preset(name, "mixtral", MixtralConfig(**fields))


def _deepseek(name: str, **fields) -> Preset:
    return Preset(name, "deepseek", DeepSeekV3Config(**fields))


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
    _mixtral("mixtral-tiny", vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=128,
             max_seq_len=128, rope_theta=1e6, n_experts=4, top_k=2),
    # Mixtral 8x7B: Jiang et al. 2024, "Mixtral of Experts" (arXiv:2401.04088) Table 1, and the
    # Hugging Face config of mistralai/Mixtral-8x7B-v0.1 (hidden_size 4096, intermediate_size 14336 per
    # expert, 32 layers, 32 heads, 8 kv heads, vocab 32000, 8 local experts, 2 per token, rope_theta 1e6,
    # max_position_embeddings 32768, rms_norm_eps 1e-5, untied embeddings): 46.7B parameters.
    _mixtral("mixtral-8x7b", vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
             norm_eps=1e-5, rope_theta=1e6, max_seq_len=32768, n_experts=8, top_k=2),
    _deepseek("deepseek-tiny", vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=8, ffn_hidden=128,
              max_seq_len=128, norm_eps=1e-6, rope_theta=10000.0, moe_ffn_hidden=32, n_routed_experts=8,
              n_shared_experts=1, top_k=2, n_groups=4, topk_groups=2, first_dense_layers=1),
    # DeepSeek-V3's shape: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (arXiv:2412.19437) §4.2, and
    # the Hugging Face config of deepseek-ai/DeepSeek-V3 (hidden_size 7168, 61 layers, 128 heads,
    # intermediate_size 18432 for the first_k_dense_replace=3 dense layers, moe_intermediate_size 2048,
    # 256 routed + 1 shared experts, 8 per token, n_group 8, topk_group 4, routed_scaling_factor 2.5,
    # vocab 129280, rms_norm_eps 1e-6, rope_theta 10000). NOT the published model: attention here is
    # standard multi-head attention (head_dim 7168/128 = 56), not MLA, and there is no multi-token-
    # prediction module, so it has ~672B parameters, not 671B. max_seq_len is the 4K pre-training
    # context: the 128K extension uses YaRN, which models/llama.py's RoPE does not do.
    _deepseek("deepseek-v3", vocab_size=129280, dim=7168, n_layers=61, n_heads=128, n_kv_heads=128,
              ffn_hidden=18432, norm_eps=1e-6, rope_theta=10000.0, max_seq_len=4096, moe_ffn_hidden=2048,
              n_routed_experts=256, n_shared_experts=1, top_k=8, n_groups=8, topk_groups=4,
              routed_scaling_factor=2.5, first_dense_layers=3),
]

# families defined in a module of their own (models/<name>.py), each with a list PRESETS of Preset
FAMILY_MODULES = ("bert", "t5", "mla", "mamba", "llava", "retro")
for _mod in FAMILY_MODULES:
    if importlib.util.find_spec(f"{__package__}.{_mod}") is not None:
        _ALL += importlib.import_module(f"{__package__}.{_mod}").PRESETS

PRESETS: dict[str, Preset] = {p.name: p for p in _ALL}
if len(PRESETS) != len(_ALL):
    raise AssertionError("two presets share a name")


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
