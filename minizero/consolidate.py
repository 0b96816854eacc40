"""`python -m minizero.consolidate`: turn a sharded checkpoint into one plain fp32 state_dict (the
command is minizero/cli/consolidate.py)."""

import sys

from minizero.cli.consolidate import main

if __name__ == "__main__":
    sys.exit(main())
