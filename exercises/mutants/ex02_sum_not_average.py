"""Mutant: sums each bucket over ranks instead of averaging it, so SGD steps N times too far."""

from minizero import comm
from solutions.ex02_ddp_bucket import split_into_buckets  # noqa: F401  (the correct half)


def all_reduce_bucket(grads):
    return comm.all_reduce(grads, op="sum", async_op=True)
