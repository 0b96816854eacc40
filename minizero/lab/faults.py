"""Failures on purpose: for the tests that check that a failing rank never hangs the others.

    cfg = TrainConfig(..., fault=Fault(rank=1, step=2, mode="kill"))     # from Python
    MINIZERO_FAIL_RANK=1 MINIZERO_FAIL_STEP=1 python -m minizero.run ...  # from outside (the CLI)

Rank `rank` fails when step `step`'s first forward starts: it raises ("raise") or dies without a word
("kill": SIGKILL to itself, as the kernel's OOM killer would). The fault is a forward pre-hook on the
model, armed once after the engine is built, so the training loop knows nothing about it.
"kill-in-save" (rank 0) dies instead inside the save made after `step` steps, every shard written and
the manifest not yet: the worst moment for a checkpoint. It listens for the "checkpoint commit" event
(events.py), so the implementation knows nothing about it either.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from minizero import comm, events


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int = 0
    mode: str = "raise"                       # "raise", "kill" or "kill-in-save"

    @classmethod
    def from_env(cls) -> Fault | None:
        env = os.environ
        if "MINIZERO_FAIL_RANK" not in env:
            return None
        return cls(int(env["MINIZERO_FAIL_RANK"]), int(env.get("MINIZERO_FAIL_STEP", "0")),
                   env.get("MINIZERO_FAIL_MODE", "raise"))

    def arm(self, engine) -> None:
        """Make this rank fail at the first forward of step `self.step` (engine.step_count counts steps)."""
        if comm.rank() != self.rank:
            return
        if self.mode == "kill-in-save":
            def die_before_commit(name, fields):
                if name == "checkpoint commit" and engine.step_count == self.step:
                    os.kill(os.getpid(), signal.SIGKILL)          # the shards are on disk, uncommitted
            events.subscribe(die_before_commit)
            return

        def fail(module, args):
            if engine.step_count != self.step:
                return
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")

        engine.module.register_forward_pre_hook(fail)
