"""DeepSpeed's save_checkpoint / load_checkpoint over minizero's checkpoints: tags, `latest`,
client_state, and what the DeepSpeed-style engine counts beside the ZeRO state.

    engine, *_ = minizero.initialize(model=model, config=config)
    engine.save_checkpoint("save", client_state={"epoch": 3})   # save/global_step{N}/, save/latest
    path, client_state = engine.load_checkpoint("save")         # the tag `latest` names
    python -m minizero.consolidate save model.pt                # zero_to_fp32: follows `latest`

Run its tests:  python -m pytest tests/test_checkpoint.py tests/test_deepspeed_scenarios.py

Each tag is one checkpoint directory of checkpoint.py: every rank writes its shard (the K·Ψ/N it
owns), rank 0 commits a manifest atomically, and load reshards to any stage, N, dtype and offload.
What DeepSpeed's engine keeps beyond the ZeRO state goes into the same commit (checkpoint.save's
`extra`): global_steps and micro_steps, the schedule's state_dict() and the script's client_state.
Everything else a resumed run needs is the engine's own and engine.load restores it: the masters,
the optimizer's state, the step count, the RNG and fp16's loss scaler (S, its counters, the skipped
steps). So a resumed run goes on bit-identically on the same N (WarmupLR where it stopped, not
from its first step), and to rounding on another N (another order of the gradient sums).

As DeepSpeed 0.19.8: the default tag is global_step{global_steps}; `latest` (a file holding the
tag) is written after the tag's commit unless save_latest=False; load_checkpoint without a tag
reads `latest`, and without that file warns once and returns (None, None), loading nothing.
load_optimizer_states=False or load_module_only=True load the weights only (the optimizer state
stays the engine's; its masters follow the weights, DeepSpeed's _restore_from_bit16_weights; with
load_module_strict=False a partial state_dict); load_module_only also leaves the counters and the
schedule alone. A full resume needs the model it was saved from (CheckpointError otherwise).

Unlike DeepSpeed: the path returned is the tag's folder (DeepSpeed's: a file in it); the
client_state returned is exactly the dict the script saved (DeepSpeed's also holds its own
bookkeeping: ds_config, param_shapes...); a tag that is not there is a CheckpointError (one line)
instead of an assertion; after load_optimizer_states=False the first step runs at the restored
schedule's lr (DeepSpeed's WarmupLR leaves the optimizer's lr as built until its next step).
"""

from __future__ import annotations

import os
import warnings

from minizero import checkpoint, comm
from minizero.checkpoint import CheckpointError


def save_checkpoint(front, save_dir, tag=None, client_state=None, save_latest: bool = True
                    ) -> bool:
    """front.save_checkpoint (front: initialize's DeepSpeedStyleEngine). Collective."""
    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty path, got {save_dir!r}")
    tag = f"global_step{front.global_steps}" if tag is None else str(tag)
    tags = sorted(set(comm.all_gather_object(tag)))
    if len(tags) > 1:           # each rank's shard would go to another directory: no commit
        raise ValueError(f"save_checkpoint: the ranks passed different tags {tags}; the tag must "
                         "be the same on every rank")
    schedule = front.lr_scheduler
    extra = {"global_steps": front.global_steps, "micro_steps": front.micro_steps,
             "lr_scheduler": None if schedule is None else schedule.state_dict(),
             "client_state": dict(client_state or {})}
    checkpoint.save(front.engine, os.path.join(os.fspath(save_dir), tag), extra)
    if save_latest and comm.rank() == 0:          # after the commit: `latest` never names a half
        checkpoint.write_atomic(os.path.join(os.fspath(save_dir), checkpoint.LATEST),
                                tag.encode())
    comm.barrier()
    return True


def load_checkpoint(front, load_dir, tag=None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, custom_load_fn=None):
    """front.load_checkpoint: (the tag's path, the client_state saved with it), or (None, None)
    when no tag is given and load_dir has no `latest`. Collective, between steps."""
    if custom_load_fn is not None:
        raise TypeError("load_checkpoint: custom_load_fn is not supported (minizero's checkpoint "
                        "is its own sharded format; load the weights yourself after it)")
    if tag is None:
        tag = checkpoint.read_latest(load_dir)
        if tag is None:
            if comm.rank() == 0:
                warnings.warn(f"load_checkpoint: {load_dir} has no '{checkpoint.LATEST}' file, so "
                              "nothing was loaded; pass tag= to load a given one", stacklevel=3)
            return None, None
    path = os.path.join(os.fspath(load_dir), str(tag))
    extra = checkpoint.read_extra(path) or {}      # first: a damaged one stops before any change
    engine = front.engine
    if load_module_only or not load_optimizer_states:
        _load_weights(engine, path, load_module_strict)
    else:
        engine.load(path)
    if not load_module_only:
        if load_lr_scheduler_states and front.lr_scheduler is not None \
                and extra.get("lr_scheduler") is not None:
            front.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        # a checkpoint of engine.save has no extra: its step count is every optimizer step
        front.global_steps = extra.get("global_steps", engine.step_count)
        front.micro_steps = extra.get("micro_steps",
                                      front.global_steps * front.gradient_accumulation_steps())
    return path, extra.get("client_state", {})


def _load_weights(engine, path: str, strict: bool) -> None:
    """The checkpoint's whole fp32 weights into the model, as a write inside gathered() (every
    stage; the masters follow); the optimizer's state is left as it is."""
    if engine.mid_step:
        raise CheckpointError("load_checkpoint() between backward() and step(): the gradients "
                              "since the last step would step the loaded weights; call it between "
                              "steps")
    state = checkpoint.consolidate(path)
    with engine.gathered(modifier_rank=0):        # every rank read the same file: rank 0's values
        engine.module.load_state_dict(state, strict=strict)
