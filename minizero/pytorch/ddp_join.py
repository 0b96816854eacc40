"""Uneven inputs for minizero.DistributedDataParallel: torch's Join, as torch's DDP takes part.

    with model.join():                          # rank r may have more batches than rank 0
        for x, y in my_batches:
            loss_fn(model(x), y).backward(); optimizer.step()
    with Join([model, zero_optimizer]): ...     # with minizero.ZeroRedundancyOptimizer too

torch's Join (torch/distributed/algorithms/join.py) runs the protocol: each forward tells it "this
rank has data" (Join.notify_join_context, an all-reduce of ones); a rank whose loop has ended
answers that all-reduce with zeros, and while the answer is not zero it runs every joinable's
main_hook once, which must issue the collectives one training iteration of the others issues, in
the same order. When every rank has joined, post_hook(is_last_joiner) runs on all. Join's own
all-reduces are torch's, on join_process_group; the rest here go through minizero.comm with the
tags and sizes the training ranks use, so beyond/desync.py's fingerprints match.

One iteration of a rank with data, under Join (DistributedDataParallel.forward and backward):
  1. the buffers, if forward_sync_buffers: from the highest rank still training (a joined rank's
     are stale), agreed on in one all-reduce (torch's _find_common_rank);
  2. the vote: an all-reduce of [will backward, will all-reduce] (torch's
     _check_global_requires_backward_grad_sync; the first entry is minizero's, below);
  3. in backward, one all-reduce per bucket in bucket order, then the used-parameters agreement if
     find_unused_parameters (or static_graph's first backward), then the event "backward done".
A joined rank contributes zeros to each. divide_by_initial_world_size=True averages over the group
(the joined ranks' zeros included: every sample weighs the same); False sums and divides by the
number of ranks that voted to all-reduce (the vote's answer). post_hook: every rank takes the
parameters (and synced buffers) of the highest rank among the last to join.

[Note: the desync watch under Join] beyond/desync.py agrees on the fingerprints before each
blocking collective and, with check_every=1, at each "backward done". The shadow issues the same
collectives, blocking or not as the training ranks do (their vote is waited for at once, so both
sides wait the same way: a round trip per forward under Join that torch's DDP does not wait for,
and the count divide_by_initial_world_size=False needs), and emits "backward done" when the vote
says a backward follows: so the watch checks uneven inputs too (tests/test_pytorch_ddp.py's N = 2
launch, check_every=1), provided each forward with gradients enabled is followed by one backward
(torch's Join needs that as well: the shadow cannot know a forward's backward was skipped). A
forward under torch.no_grad() votes [0, 0] and is shadowed by nothing but the buffers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from minizero import comm, events


def vote(ddp, backward: bool, sync: bool) -> tuple[int, int]:
    """Step 2 above on every rank: how many ranks will backward, how many will all-reduce."""
    counts = torch.tensor([int(backward), int(sync)], dtype=torch.int32, device=ddp.device)
    comm.all_reduce(counts, op="sum", async_op=True, group=ddp.group, tag="join: vote").wait()
    return int(counts[0]), int(counts[1])


def common_rank(ddp, candidate: bool) -> int:
    """The highest global rank among the candidates (torch's _find_common_rank)."""
    rank = torch.tensor([comm.rank() if candidate else -1], dtype=torch.int64, device=ddp.device)
    comm.all_reduce(rank, op="max", group=ddp.group, tag="join: common rank")
    return int(rank)


def reduce_over_training(ddp, bucket, training: int):
    """divide_by_initial_world_size=False: the bucket's sum over the ranks, divided by the number
    of ranks still training, on arrival (the handle the reducer waits for)."""
    if not ddp.sync:
        return None
    grads = ddp.grads.bucket(bucket)
    ddp.layout.reclaim_grads(bucket, grads)                 # after a zero_grad(): flat.py
    handle = comm.all_reduce(grads, op="sum", async_op=True, group=ddp.group,
                             tag=f"bucket {bucket.index}")
    return _DividedOnArrival(handle, grads, training)


class _DividedOnArrival:
    def __init__(self, handle, grads: torch.Tensor, by: int):
        self.handle, self.grads, self.by = handle, grads, by

    def wait(self) -> None:
        self.handle.wait()
        self.grads.div_(self.by)


def process_group(ddp):
    """What Join compares across its joinables (ZeroRedundancyOptimizer's answer, the same way)."""
    return dist.group.WORLD if ddp.group is None else ddp.group.process_group


class ShadowIteration(JoinHook):
    """DistributedDataParallel's join hook: a joined rank's part of the others' iterations."""

    def __init__(self, ddp, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        if ddp.require_forward_param_sync and ddp.forward_sync_buffers:
            ddp._sync_buffers(common_rank(ddp, False))                              # 1
        backward, sync = vote(ddp, False, False)                                    # 2
        ddp.require_forward_param_sync = sync > 0          # as the training ranks' forward sets it
        if sync:                                                                    # 3
            op = "avg" if ddp._divide_by_initial_world_size else "sum"
            handles = [comm.all_reduce(torch.zeros_like(ddp.grads.bucket(b)), op=op,
                                       async_op=True, group=ddp.group, tag=f"bucket {b.index}")
                       for b in ddp.layout.buckets]
            for handle in handles:
                handle.wait()
            if (ddp.find_unused_parameters or ddp.static_graph) and ddp._learned is None:
                # torch's joined rank sends its last answer again (its used map, all-reduced in
                # place): what some rank used in the last iteration of all is still "used", and
                # gets a zero gradient where a rank still training does not use it
                used = (torch.zeros(len(ddp.trainable), dtype=torch.int32, device=ddp.device)
                        if ddp._used_anywhere is None else ddp._used_anywhere.clone())
                comm.all_reduce(used, op="max", async_op=True, group=ddp.group,
                                tag="used parameters").wait()
        if backward:
            events.emit("backward done", engine=ddp)      # the watch's check: [Note] above

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        ddp._sync_final_model(common_rank(ddp, is_last_joiner))
