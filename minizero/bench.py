"""`python -m minizero.bench`: minizero against PyTorch's own implementation of every stage (the command is minizero/lab/bench.py)."""

import sys

from minizero.lab.bench import main

if __name__ == "__main__":
    sys.exit(main())
