"""`python -m minizero.consolidate ckpt model.pt`: a sharded checkpoint as one plain
fp32 state_dict (saved on a 2-D mesh: the tensor-parallel parts merged, the unsplit model's keys).

    python -m minizero.consolidate ckpt model.pt
    model.load_state_dict(torch.load("model.pt"), strict=True)      # no process group, no minizero

    python -m minizero.consolidate ckpt full.pt --optimizer-state   # + the whole optimizer state
    engine.load("full.pt")                                           # any stage, N, dtype, offload

How: minizero.checkpoint.consolidate (a plain state_dict: continue with
`TrainConfig(init_state="model.pt",
start_step=k)`, Adam's moments restart from zero, as with zero_to_fp32) and, with --optimizer-state,
minizero.checkpoint.universal (the parameters and every optimizer state tensor whole, plus the step:
what engine.load reshards from; DeepSpeed's ds_to_universal).
Bad input (no checkpoint, a missing, truncated or damaged file): one line on stderr, exit code 2,
and OUT is left as it was (it is written atomically, and only once the checkpoint has been read).
"""

from __future__ import annotations

import io
import sys

import torch

from minizero.checkpoint import (
    CheckpointError, consolidate, find, read_manifest, universal, write_atomic,
)
from minizero.cli import OneLineParser, UsageError, fail

PROG = "python -m minizero.consolidate"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a directory written by engine.save(), or a run "
                                           "directory (--save-every): its newest step-NNNNNN")
    parser.add_argument("out", help="where to write the state_dict (torch.save)")
    parser.add_argument(
        "--optimizer-state",
        action="store_true",
        help="also the whole optimizer state: a file engine.load() accepts at any stage and N",
    )
    try:
        args = parser.parse_args(argv)
        source = find(args.checkpoint)
        if source != args.checkpoint:
            print(f"{PROG}: reading {source}, the newest complete checkpoint of {args.checkpoint}",
                  file=sys.stderr)
        args.checkpoint = source
        state = universal(args.checkpoint) if args.optimizer_state else consolidate(args.checkpoint)
        step = read_manifest(args.checkpoint)["step"]
        buf = io.BytesIO()
        torch.save(state, buf)
        write_atomic(args.out, buf.getvalue())
    except (UsageError, CheckpointError) as e:
        return fail(PROG, str(e))
    except OSError as e:                               # OUT not writable: a directory, no parent...
        return fail(PROG, f"cannot write {args.out}: {e.strerror}")
    what = "parameters and optimizer state" if args.optimizer_state else f"{len(state)} tensors"
    print(f"wrote {args.out}: {what}, step {step}")
    return 0
