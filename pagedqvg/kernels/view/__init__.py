"""View builds: dense, packed (PRQ dequant) and mixed run-table views straight from pages, each torch reference
beside its Triton kernel, plus the allocation-free decode plan of repeated views.
"""
