"""Exercise 2: DDP's gradient buckets and the hook that averages them.

    Grade it:    pytest exercises -k ex02            (or: python -m minizero.grade -k ex02)
    Notebook:    notebooks/01_ddp.ipynb
    Compare:     minizero/ddp.py, minizero/flat.py (split_into_buckets), minizero/reducer.py

Data parallelism: every rank holds the whole model, computes gradients on its own B/N rows, and the
ranks average their gradients, which gives exactly the gradient of the global batch (the mean of N
equal-sized means is the global mean). Then every rank takes the same optimizer step and the
replicas stay equal.

Averaging parameter by parameter would mean hundreds of tiny messages, each paying the network's
latency; one message after backward would leave the network idle while backward runs. DDP does
neither: it groups gradients into *buckets* of about `bucket_bytes`, in the order backward produces
them, and all-reduces each bucket asynchronously as soon as all its gradients exist, overlapping
communication with the rest of backward. minizero's DDP lays each bucket's gradients end to end in
one flat buffer (every p.grad is a view into it) and calls a hook with that buffer when the bucket
is complete.

Write:
  1. split_into_buckets(params, bucket_bytes): cut `params` (already in backward order) into buckets
     of consecutive parameters. Add parameters to the current bucket until it holds *at least*
     bucket_bytes (count p.numel() * p.element_size(): parameters may be fp32 or bf16), then start a
     new one; what is left at the end is the last bucket. Same rule as PyTorch DDP's bucket_cap_mb.
  2. all_reduce_bucket(grads): the hook. `grads` is a bucket's flat gradient buffer on this rank;
     start making it the *average* over ranks, in place, and return the asynchronous handle
     (minizero's reducer calls .wait() on it before the optimizer step). Start it now, from inside
     backward, and do not wait for it: that is the overlap of communication with the rest of
     backward.

What the grader checks: your buckets for several parameter lists and sizes; that your hook returns a
handle and has issued its all-reduce when it returns (comm.tally() counts the bytes); and two ranks
training a small GPT for 3 SGD steps with DDP, your hook averaging every bucket, ending where one
process training on the whole batch ends (SGD, because Adam would not notice gradients N times too
large).

Hints:
  * comm.all_reduce(tensor, op=..., async_op=True) returns a handle; look at its `op` choices.
  * If a backend could only sum, you would divide by comm.world_size() first (PyTorch DDP does
    that).
"""

import torch
from torch import nn

from minizero import comm  # noqa: F401  (your answer will need it)


def split_into_buckets(params: list[nn.Parameter], bucket_bytes: float) -> list[list[nn.Parameter]]:
    """Consecutive parameters; close a bucket as soon as it holds at least `bucket_bytes`."""
    raise NotImplementedError("ex02: write split_into_buckets")


def all_reduce_bucket(grads: torch.Tensor):
    """Start averaging the flat gradient buffer `grads` over ranks in place; return the async
    handle."""
    raise NotImplementedError("ex02: write all_reduce_bucket")
