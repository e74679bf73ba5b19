"""Memory planning and proof: exact page accounting (`pagedqvg plan`), model presets, staggered sessions, the
simulator that runs the real pool against the plan (`pagedqvg simulate`), and synthetic video-like K/V.
"""
