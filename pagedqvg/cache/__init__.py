"""The per-layer paged causal KV cache: the dense cache's contract (docs/SEMANTICS.md) over the store, with its
sequencing core, argument checks, pack policy and packing under pool pressure.
"""
