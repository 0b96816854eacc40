"""Every command of minizero, listed and dispatched from one place:
`python -m minizero <command> ...`.

    python -m minizero                         # the list
    python -m minizero run --stage 2 --world-size 4
    python -m minizero bench --sizes 1M,8M

Each command's front end is minizero/cli/<command>.py; `python -m minizero.<command>` runs the same
one (run, bench, memory, scale, consolidate, grade).
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "run": "train the small GPT with a ZeRO stage; memory and traffic next to the paper's formulas",
    "bench": "minizero against PyTorch's DDP / ZeroRedundancyOptimizer / FSDP2 and DeepSpeed",
    "memory": "the paper's per-rank bytes for any model size, stage and world size",
    "scale": (
        "the largest model (or micro-batch) each stage trains within a memory budget, measured"
    ),
    "consolidate": "a sharded checkpoint -> one plain fp32 state_dict",
    "grade": "score the exercises",
    "collectives": "gloo's collectives against what minizero.comm runs instead, timed",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, COMMANDS))
        print(
            "usage: python -m minizero <command> [options] "
            "  (python -m minizero <command> --help)\n"
        )
        print("\n".join(f"  {name:<{width}}  {what}" for name, what in COMMANDS.items()))
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(
            "python -m minizero: error: unknown command "
            f"{argv[0]!r} (one of {', '.join(COMMANDS)})",
            file=sys.stderr,
        )
        return 2
    sys.argv[0] = f"python -m minizero {argv[0]}"
    return importlib.import_module(f"minizero.cli.{argv[0]}").main(argv[1:])
