"""Developer tools that are not the library (compile reports and the like); nothing in `pagedqvg` imports them.
"""
