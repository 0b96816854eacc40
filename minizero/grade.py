"""`python -m minizero.grade`: score the exercises (the command is minizero/lab/grade.py)."""

import sys

from minizero.lab.grade import main

if __name__ == "__main__":
    sys.exit(main())
