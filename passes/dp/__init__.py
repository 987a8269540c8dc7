"""Data parallelism: FSDP / ZeRO-3 (fsdp) and gradient communication overlap (overlap).

Layer (tests/test_layers.py): the other passes. This __init__ imports nothing.
"""
