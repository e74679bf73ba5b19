"""The `pagedqvg` command: `pagedqvg plan` (what fits a budget) and `pagedqvg simulate` (run the real pool and
prove the plan).
"""

from pagedqvg.cli.app import main

__all__ = ["main"]
