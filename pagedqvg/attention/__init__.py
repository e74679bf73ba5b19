"""Attention straight from pages (`update_and_attend`): softmax(q·kᵀ)·v over a view plan's rows, tile by tile,
without building the view.
"""
