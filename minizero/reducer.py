"""Gradient buckets that start communicating while backward is still running.

Used by DDP (each bucket is all-reduced) and by stages 2 and 3 (each bucket is reduce-scattered; at
stage 3 a bucket is a unit). The mechanism of PyTorch DDP's Reducer:
  * an autograd hook on every parameter fires once its gradient for this backward is complete (a
    tied weight used twice fires once, after both uses);
  * a bucket whose parameters have all fired is *ready*; ready buckets are launched strictly in
    bucket order, because every rank must issue the same collectives in the same order (else a
    rank's bucket 2 meets another's bucket 1: wrong sums or a hang);
  * the collectives are asynchronous: bucket i travels while autograd computes bucket i+1's;
  * at most `max_in_flight` buckets are in flight (launching one more waits for the oldest), which
    bounds the memory of buffers in flight (what keeps stage 2's gradient memory at ~Ψ/N);
  * `finish()` at the end of backward launches what never became ready (parameters without a
    gradient: reduced as zeros on every rank, as in DeepSpeed) and waits for everything.
`overlap=False` (stage 0) launches every bucket after backward, to measure what overlap hides.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Callable

from minizero import events
from minizero.flat import Bucket


class GradBuckets:
    """launch(bucket) -> async handle or None; done(bucket) runs after its handle; on_grad(param,
    bucket), if given, as each gradient is complete (stage 2 stages it at once)."""

    def __init__(self, buckets: list[Bucket], launch: Callable, done: Callable | None = None,
                 on_grad: Callable | None = None, max_in_flight: int = 2, overlap: bool = True,
                 owner=None):
        self.buckets, self.overlap, self.owner = buckets, overlap, owner
        self.launch, self.done, self.on_grad = launch, done, on_grad
        self.max_in_flight = max_in_flight
        self._bucket_of = {p: i for i, b in enumerate(buckets) for p in b.params}
        self._in_flight: deque = deque()
        self._in_backward = True
        self._reset()
        # The hook holds the reducer weakly: a parameter keeps its hooks where Python's cycle
        # collector cannot see them, so parameter -> hook -> reducer -> engine -> model ->
        # parameter would never be freed (the bench's ranks grew until the OOM killer came).
        hook = _weakly(self._on_grad_ready)
        self.hooks = [p.register_post_accumulate_grad_hook(hook)      # handles: removable
                      for b in buckets for p in b.params]

    def _reset(self) -> None:
        # gradients not yet produced, per bucket
        self._missing = [len(b.params) for b in self.buckets]
        self._next = 0                                            # next bucket to launch, in order

    def _on_grad_ready(self, p) -> None:
        if self.on_grad is not None:
            self.on_grad(p, self.buckets[self._bucket_of[p]])
        self.mark_ready(p)

    def mark_ready(self, p) -> None:        # also for one that gets no gradient (pytorch/ddp.py)
        i = self._bucket_of[p]
        self._missing[i] -= 1
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            if len(self._in_flight) >= self.max_in_flight:
                self._wait_oldest()
            b = self.buckets[self._next]
            self._in_flight.append((b, self.launch(b)))
            events.emit(
                "bucket launched", engine=self.owner, bucket=b, in_backward=self._in_backward
            )
            self._next += 1

    def _wait_oldest(self) -> None:
        b, handle = self._in_flight.popleft()
        if handle is not None:
            handle.wait()
            if self.done is not None:
                self.done(b)
            events.emit("bucket arrived", engine=self.owner, bucket=b)

    def finish(self) -> None:
        """After loss.backward(): launch the rest in order, wait for all, get ready for the next."""
        self._missing = [0] * len(self.buckets)
        self._in_backward = False
        self._launch_ready()
        while self._in_flight:
            self._wait_oldest()
        self._in_backward = True
        self._reset()


def _weakly(method: Callable) -> Callable:
    """`method` through a weak reference to its object: does nothing once the object is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        live = ref()
        if live is not None:
            live(*args)
    return call
