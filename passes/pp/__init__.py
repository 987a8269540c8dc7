"""Pipeline parallelism: stage partitioning (stages) and the pipeline split pass (pipeline_split).

Layers (tests/test_layers.py): stages with sharding and lowering; pipeline_split with the other passes.
This __init__ imports nothing.
"""
