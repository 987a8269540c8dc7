"""Applications on the compiler's API: the mcompile command (cli), the demo, reports, generation,
evaluation, Hugging Face import/export (hf_io), training (train/) and data preprocessing (data/).

Layer: applications, the highest. It may import every layer (tests/test_layers.py).
"""
