"""Sharding: the placement rules of every op (rules/), propagation, the planner, its quality checks, block
repetition, mixer hints, op arguments, and a compiled capture (planned and lowered).

Layer: sharding and lowering. It may import the IR, kernels, models, runtime and capture, and the
lowering passes of that layer (tests/test_layers.py).
"""
