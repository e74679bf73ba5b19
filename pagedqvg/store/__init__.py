"""Where one layer's rows live in pool pages and every move of them: segments, dense rows (PageIO), packed PRQ
segments (PackedStore) and the stores of each tier format. Knows pages and kernels, not the dense-cache contract.
"""
