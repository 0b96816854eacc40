"""`python -m minizero.scale`: the largest model each stage can train within a memory budget (the
command is minizero/cli/scale.py)."""

import sys

from minizero.cli.scale import main

if __name__ == "__main__":
    sys.exit(main())
