"""The byte layout of everything pagedqvg allocates: segment rows in pages, the page-size choice, the attention
scratch. Pure arithmetic (no tensor moves); read by the allocator, the kernels, the cache and the planner.
"""
