"""The intermediate representation every layer and the runtime share: the configuration, the device mesh,
placements and the plan, node meta keys, the collective ops, and what reads them alone (FLOPs, memory,
buckets, the moe_ffn op, dropout masks, the timeline, host reads, compatibility patches).

Layer: IR, the lowest. It may import only itself, mcompile.kernels and mcompile.models (tests/test_layers.py).
"""
