"""Mutant: averages each bucket with a blocking all-reduce and returns None: correct numbers, but
backward waits for every bucket to cross the network (no overlap)."""

from minizero import comm
from solutions.ex02_ddp_bucket import split_into_buckets  # noqa: F401  (the correct half)


def all_reduce_bucket(grads):
    comm.all_reduce(grads, op="avg")
