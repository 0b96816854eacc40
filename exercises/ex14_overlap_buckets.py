"""Exercise 14: overlap communication with backward: launch buckets in order, at most k in flight.

    Grade it:    pytest exercises -k ex14            (or: python -m minizero.grade -k ex14)
    Notebook:    notebooks/08_beyond.ipynb (the network model: overlap and prefetch)
    Compare:     minizero/reducer.py (GradBuckets: _on_grad_ready, _launch_ready, _wait_oldest,
                 finish), minizero/network.py (the model that times each collective)

A data-parallel backward produces its gradients bucket by bucket. Each bucket's collective can start
as soon as its gradients exist, so the network works while autograd computes the next buckets: a
step then takes about max(compute, communication) instead of their sum. Two rules bind the schedule:

  * buckets are launched strictly in bucket order, 0, 1, 2, ...: every rank must issue the same
    collectives in the same order, and gradients may become ready out of order (a bucket ready
    early waits until every bucket before it has been launched);
  * at most k buckets are in flight: launching one more first waits for the oldest. Each bucket in
    flight holds a buffer, so k bounds the memory (what keeps ZeRO-2's gradients near Ψ/N).

Write the class BucketLauncher(num_buckets, launch, max_in_flight):
  ready(i)   bucket i's gradients are complete (called from backward, in any order). Launch every
             bucket that can go now, in order: launch(j) starts bucket j's collective and returns
             its async handle; before a launch that would make more than max_in_flight in flight,
             wait for the oldest handle.
  finish()   backward is over: launch what is left, in order, then wait for every handle. Afterwards
             the launcher is ready for the next step (all buckets again).

What the grader checks: two ranks run a simulated backward of 8 buckets whose gradients become ready
out of order, with k = 2, under minizero's network model (minizero/network.py: each collective takes
a modelled time, deterministic): the buckets are launched in order, never more than k in flight, all
waited for by finish(); and, with communication the larger part, your step takes at most 1.15 x
max(compute, communication), while the same step launching everything after backward takes their
sum.

Hints:
  * Keep the index of the next bucket to launch, which buckets are ready, and a deque of
    (bucket, handle) in flight; collections.deque.popleft() gives the oldest.
  * Never wait for a handle you just started: that is a blocking collective, no overlap.
"""


class BucketLauncher:
    def __init__(self, num_buckets: int, launch, max_in_flight: int):
        raise NotImplementedError("ex14: write BucketLauncher")

    def ready(self, i: int) -> None:
        raise NotImplementedError("ex14: write BucketLauncher.ready")

    def finish(self) -> None:
        raise NotImplementedError("ex14: write BucketLauncher.finish")
