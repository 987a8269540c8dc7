"""Context parallelism: its ops and attention (ops), its planning (plan), what a rank reads of its inputs (reads).

Layers (tests/test_layers.py): ops with sharding and lowering; plan and reads (what a cp rank reads of its inputs)
with the other passes.
This __init__ imports nothing.
"""
