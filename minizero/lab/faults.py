"""Failures on purpose: for the tests that check that a failing rank never hangs the others.

    cfg = TrainConfig(..., fault=Fault(rank=1, step=2, mode="kill"))     # from Python
    MINIZERO_FAIL_RANK=1 MINIZERO_FAIL_STEP=1 python -m minizero.run ...  # from outside (the CLI)

Rank `rank` fails when step `step`'s first forward starts: it raises ("raise") or dies without a
word ("kill": SIGKILL to itself, as the kernel's OOM killer would). The fault is a forward pre-hook
on the model, armed once after the engine is built, so the training loop knows nothing about it.
"kill-in-save" (rank 0) dies instead inside the save made after `step` steps, every shard written
and the manifest not yet: the worst moment for a checkpoint. It listens for the "checkpoint commit"
event (events.py), so the implementation knows nothing about it either.

Two faults take a rank out of step with the others instead (minizero/beyond/desync.py names them),
the way a user's model does by accident: in step `step`, "skip-block" runs the model without block
`block` (a forward that took another path: at stage 3 that unit is never gathered),
"extra-micro-batch" runs one more forward and backward after the step's first forward.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, replace

import torch

from minizero import comm, events


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int = 0
    mode: str = "raise"     # "raise", "kill", "kill-in-save", "skip-block", "extra-micro-batch"
    block: int = 2          # skip-block: which of model.blocks

    @classmethod
    def from_env(cls) -> Fault | None:
        env = os.environ
        if "MINIZERO_FAIL_RANK" not in env:
            return None
        return cls(int(env["MINIZERO_FAIL_RANK"]), int(env.get("MINIZERO_FAIL_STEP", "0")),
                   env.get("MINIZERO_FAIL_MODE", "raise"),
                   int(env.get("MINIZERO_FAIL_BLOCK", "2")))

    def arm(self, engine) -> None:
        """Make this rank fail at the first forward of step `self.step` (engine.step_count counts
        steps)."""
        if comm.rank() != self.rank:
            return
        if self.mode == "kill-in-save":
            def die_before_commit(name, fields):
                if name == "checkpoint commit" and engine.step_count == self.step:
                    os.kill(os.getpid(), signal.SIGKILL)      # the shards are on disk, uncommitted
            events.subscribe(die_before_commit)
            return
        if self.mode == "skip-block":
            self._skip_block(engine)
            return
        if self.mode == "extra-micro-batch":
            self._extra_micro_batch(engine)
            return

        def fail(module, args):
            if engine.step_count != self.step:
                return
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")

        engine.module.register_forward_pre_hook(fail)

    def _skip_block(self, engine) -> None:
        """In step `step`, the model's forward runs with block `block` replaced by a
        pass-through."""
        blocks = engine.module.blocks
        original = blocks[self.block]

        def skip(module, args):
            if engine.step_count == self.step:
                blocks[self.block] = torch.nn.Identity()

        def restore(module, args, output):
            blocks[self.block] = original

        engine.module.register_forward_pre_hook(skip)
        engine.module.register_forward_hook(restore)

    def _extra_micro_batch(self, engine) -> None:
        """After step `step`'s first forward, one more forward and backward on the same input."""
        ran = []

        def again(module, args, output):
            if engine.step_count == self.step and not ran:
                ran.append(True)                # before the forward below, which comes here too
                engine.backward(engine(*args).float().mean())

        engine.module.register_forward_hook(again)


def train_another_model_on(rank: int, cfg):
    """Worker: train `cfg`, except that rank `rank` builds its model n_head embedding columns wider
    (a config that differs on one machine): minizero.beyond.desync names it before the first
    collective."""
    from minizero.lab.train import train_worker  # here: train imports this module
    if comm.rank() == rank:
        width = cfg.model_config().n_embd + cfg.model_config().n_head
        cfg = replace(cfg, model_overrides={**cfg.model_overrides, "n_embd": width})
    return train_worker(cfg)


def never_issue_on(rank: int, seconds: float) -> None:
    """Worker: every rank but `rank` all-reduces; `rank` is busy for `seconds` outside minizero.comm
    (a collective behind an `if rank == ...`)."""
    if comm.rank() == rank:
        time.sleep(seconds)
    else:
        comm.all_reduce(torch.ones(3), tag="the loss")
