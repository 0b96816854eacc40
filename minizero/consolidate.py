"""Turn a sharded checkpoint into one plain fp32 state_dict, as DeepSpeed's zero_to_fp32.py does.

    python -m minizero.consolidate ckpt model.pt
    model.load_state_dict(torch.load("model.pt"), strict=True)      # no process group, no minizero

Run its tests:  python -m pytest tests/test_checkpoint.py

The checkpoint (format: minizero/checkpoint.py) holds each bucket's fp32 master weights as N partitions,
one per rank file. Concatenating the partitions rebuilds the padded bucket [N·Ψ_b/N]; the manifest's
offsets and shapes cut it back into parameters, exactly like flat.Bucket.views. Frozen parameters and
buffers come from replicated.pt. The result has the keys of model.state_dict(), in order, including
buffers and both names of the tied embedding/head weight, floating point tensors in fp32.

This is also the way to continue at another world size: load the state into a fresh model and wrap it
at the new N (`TrainConfig(init_state="model.pt", start_step=k)` does that). The optimizer state does
not come along (as with zero_to_fp32): Adam's moments restart from zero.

Bad input (no checkpoint, a missing, truncated or damaged file): one line on stderr, exit code 2, and
OUT is left as it was (it is written atomically, and only once the checkpoint has been read).
"""

from __future__ import annotations

import io
import sys

import torch

from minizero.checkpoint import CheckpointError, read_file, read_manifest, write_atomic
from minizero.cli import OneLineParser, UsageError, fail

PROG = "python -m minizero.consolidate"


def consolidate(directory: str) -> dict[str, torch.Tensor]:
    """The whole model's fp32 state_dict from a sharded checkpoint. Raises CheckpointError."""
    manifest = read_manifest(directory)
    shards: dict[int, dict] = {}

    def shard(r: int) -> dict:
        if r not in shards:
            shards[r] = read_file(directory, manifest, f"rank{r}.pt")
        return shards[r]

    values: dict[str, torch.Tensor] = {}
    for i, b in enumerate(manifest["buckets"]):
        parts = b["padded_numel"] // b["shard_numel"]        # N for stages 1-3; 1 for DDP (replicated)
        full = torch.cat([shard(r)["masters"][i] for r in range(parts)])       # [padded_numel] fp32
        for p in b["params"]:
            numel = torch.Size(p["shape"]).numel()
            values[p["name"]] = full[p["offset"]: p["offset"] + numel].view(p["shape"]).clone()
    for name, t in read_file(directory, manifest, "replicated.pt").items():
        values[name] = t.float() if t.is_floating_point() else t
    return {e["key"]: values[e["source"]] for e in manifest["state_dict"]}


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a directory written by engine.save()")
    parser.add_argument("out", help="where to write the state_dict (torch.save)")
    try:
        args = parser.parse_args(argv)
        state = consolidate(args.checkpoint)
        step = read_manifest(args.checkpoint)["step"]
        buf = io.BytesIO()
        torch.save(state, buf)
        write_atomic(args.out, buf.getvalue())
    except (UsageError, CheckpointError) as e:
        return fail(PROG, str(e))
    except OSError as e:                                     # OUT not writable: a directory, no parent...
        return fail(PROG, f"cannot write {args.out}: {e.strerror}")
    print(f"wrote {args.out}: {len(state)} tensors, step {step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
