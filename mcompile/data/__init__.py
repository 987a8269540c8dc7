"""Data: tokenizers, the indexed token dataset, blends and deterministic sampling (`mcompile preprocess`)."""
