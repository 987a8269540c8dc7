"""Tensor parallelism's passes: attention heads (heads), collective matmul (collective_matmul).

Layers (tests/test_layers.py): heads with sharding and lowering; collective_matmul with the other passes.
This __init__ imports nothing.
"""
