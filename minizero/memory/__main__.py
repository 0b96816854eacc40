"""`python -m minizero.memory --params 7.5e9 --world-size 64`: the paper's per-rank table for
any model.

The formulas are minizero/memory/__init__.py; the command's arguments and table are
minizero/cli/memory.py. (memory is a package only so that this command can exist without running the
formulas' module a second time as __main__: the engines import it with the package, and runpy warns
about re-running such a module.)
"""

import sys

from minizero.cli.memory import main

sys.exit(main())
