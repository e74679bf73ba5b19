"""Attention over a view plan straight from pages: the single launch and the split-KV launch, each torch
reference beside its Triton kernel.
"""
