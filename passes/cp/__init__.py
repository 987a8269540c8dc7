"""Context parallelism: its ops and attention (ops) and its planning (plan).

Layers (tests/test_layers.py): ops with sharding and lowering; plan with the other passes.
This __init__ imports nothing.
"""
