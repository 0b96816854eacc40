"""Exercise 2, answer: minizero's bucketing (flat.py) and the one line of its DDP hook (ddp.py)."""

from minizero import comm
from minizero.flat import split_into_buckets

__all__ = ["split_into_buckets", "all_reduce_bucket"]


def all_reduce_bucket(grads):
    return comm.all_reduce(grads, op="avg", async_op=True)
