"""Serving many requests on one pool: sessions admitted by planned peak, closed (every page back at once), and
reclaimed deterministically; with a host tier, idle sessions parked in host memory and brought back at their next call.
"""
