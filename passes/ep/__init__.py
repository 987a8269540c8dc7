"""Expert parallelism: finding the mixture-of-experts blocks (find_moe).

Layer (tests/test_layers.py): sharding and lowering. This __init__ imports nothing.
"""
