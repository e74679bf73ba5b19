"""Page writes: K/V rows scattered into pool pages (and slot fills), each torch reference beside its Triton kernel.
"""
