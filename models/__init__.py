"""Plain single-device reference models (GPT-2/3, Llama-3) and named presets.

Nothing here knows about parallelism; mcompile captures these with torch.export and
parallelizes the captured graph.
"""

from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig
from .presets import PRESETS, Preset, get_preset, list_presets

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "PRESETS", "Preset", "get_preset", "list_presets"]
