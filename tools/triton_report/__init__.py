"""Ahead-of-time Triton compile reports: specialization keys, PTX for a CUDA target, and registers / spills /
shared memory of every kernel at the presets' shapes, without a GPU.
"""
