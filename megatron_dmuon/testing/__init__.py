"""Test infrastructure: run real megatron-core on CPU/gloo.

Nothing here is imported by the GPU training path. `cpu_shim` maps the CUDA calls megatron-core
hard-codes onto the CPU so that its real DDP, buffers and DistributedOptimizer run under gloo.
"""
