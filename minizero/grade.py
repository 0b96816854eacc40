"""`python -m minizero.grade`: score the exercises (the command is minizero/cli/grade.py)."""

import sys

from minizero.cli.grade import main

if __name__ == "__main__":
    sys.exit(main())
