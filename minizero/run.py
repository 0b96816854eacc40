"""`python -m minizero.run`: train a model with a ZeRO stage and print what it measured (the command
is minizero/cli/run.py)."""

import sys

from minizero.cli.run import main

if __name__ == "__main__":
    sys.exit(main())
