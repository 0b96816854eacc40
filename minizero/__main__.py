"""`python -m minizero <command> ...`: every command, listed and dispatched
(minizero/cli/commands.py)."""

import sys

from minizero.cli.commands import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
