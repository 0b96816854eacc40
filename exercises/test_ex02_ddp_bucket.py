"""Grader for exercise 2 (DDP buckets and the averaging hook):  pytest exercises -k ex02

Your buckets are compared with minizero's on a few parameter lists; your hook then replaces the
all-reduce of minizero's DDP (a thin subclass) while two ranks train, and the result is compared
with one process training on the whole batch. Each bucket's all-reduce must be issued from inside
backward, asynchronously: the hook returns a handle, and its bytes were sent (comm.tally) while the
hook ran.
"""

from dataclasses import replace

import pytest
import torch
from torch import nn

import _grading as g
from minizero import comm
from minizero.ddp import AllReducedGradients
from minizero.assembled import DDP
from minizero.flat import split_into_buckets

CFG = g.config(stage=0, world_size=2)             # bucket_size 3000 bytes: several buckets

# (parameter sizes in elements, dtype, bucket_bytes): where ">= bucket_bytes" and "> bucket_bytes"
# differ, bf16 (2 bytes an element), a cap larger than everything, a cap smaller than any parameter.
BUCKET_CASES = [([5, 3, 8, 1, 7], torch.float32, 32), ([2, 2, 2], torch.float32, 16),
                ([5, 3, 8, 1, 7], torch.bfloat16, 32), ([5, 3, 8, 1, 7], torch.float32, 1e9),
                ([4, 9, 2], torch.float32, 1)]


class LearnerGradients(AllReducedGradients):
    """minizero's DDP gradients with the learner's hook in place of their all-reduce of a finished
    bucket."""
    answer = None                                   # the learner's module, set by the worker

    def reduce(self, b, tag=None):
        if not self.engine.sync:
            return None                             # inside no_sync(): gradients only accumulate
        before = comm.tally()["total"]
        handle = self.answer.all_reduce_bucket(self.bucket(b))
        where = f"rank {comm.rank()}, bucket {b.index}: all_reduce_bucket"
        if handle is None:
            raise AssertionError(f"{where} returned None: a blocking all-reduce holds backward up "
                                 "until the bucket has crossed the network; start it "
                                 "(async_op=True) and return the handle, so the next buckets' "
                                 "gradients are computed meanwhile")
        if comm.tally()["total"] == before:
            raise AssertionError(f"{where} sent nothing while it ran: issue the all-reduce now, "
                                 "from inside backward, not later in the handle's wait()")
        return handle


class LearnerDDP(DDP):
    row = replace(DDP.row, gradients=LearnerGradients)   # DDP's row of the table, the learner's P_g


def worker(module_name: str) -> dict:
    LearnerGradients.answer = g.learner(module_name)
    return g.train_with(LearnerDDP, CFG)


def check_buckets(impl: str) -> None:
    g.guard(impl)
    answer = g.learner(impl)
    for sizes, dtype, cap in BUCKET_CASES:
        params = [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]
        index = {id(p): i for i, p in enumerate(params)}
        expected = [[index[id(p)] for p in bucket] for bucket in split_into_buckets(params, cap)]
        buckets = g.call(answer.split_into_buckets, params, cap)
        got = [[index.get(id(p), "?") for p in bucket] for bucket in buckets]
        if got != expected:
            raise AssertionError(
                f"split_into_buckets(parameters of {sizes} elements in {dtype}, bucket_bytes="
                f"{cap:g}): expected buckets {expected}, got {got} (parameter indices; '?' is not "
                "one of the parameters given). A bucket closes as soon as it holds at least "
                "bucket_bytes.")


def check_training(impl: str) -> None:
    g.guard(impl)
    g.assert_matches_reference(CFG, g.launch(worker, CFG.world_size, impl),
                               hint="Is every bucket averaged over the ranks, not summed?")


@pytest.mark.points(1)
def test_buckets_follow_the_size_rule(impl):
    check_buckets(impl)


@pytest.mark.points(2)
def test_ddp_with_your_hook_trains_like_one_process(impl):
    check_training(impl)
