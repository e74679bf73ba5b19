"""PRQ packing kernels: k-means assignment/update and the residual pack, each torch reference beside its
Triton kernel.
"""
