"""`python -m pagedqvg.cli`: the `pagedqvg` command."""

import sys

from pagedqvg.cli.app import main

if __name__ == "__main__":
    sys.exit(main())
