"""`python -m minizero.bench`: minizero against PyTorch's own implementation of every stage (the
command is minizero/cli/bench.py)."""

import sys

from minizero.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
