"""Serving many requests on one pool: sessions admitted by planned peak, closed (every page back at once), and
reclaimed deterministically.
"""
