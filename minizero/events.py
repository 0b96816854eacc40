"""One event stream: the few moments of a training step that matter, for whoever wants to watch.

    from minizero import events
    with events.subscribed(lambda name, fields: print(name, fields.get("tag", ""))):
        engine.backward(loss)
        engine.step()

At each moment a learner, a plot or a test may want to see, minizero calls `emit(name, **fields)`
and every subscriber of this process (one rank) gets (name, fields), to observe, never to change
what it is shown. What is emitted:

    collective         comm.py, as one is issued: kind, tag ("unit 3 (blocks.2)", "bucket 0"),
                       group, numel, dtype, sent (ring bytes), tensor, seq (this rank's count),
                       blocking (the caller waits for it at once)
    collective done    comm.py, when its handle was waited: seq, kind, tag
    unit gather        zero3.py, a unit's all-gather issued (prefetch: nobody waits for it yet),
                       nbytes its full parameters take
    unit gathered      zero3.py, its full parameters are there
    unit freed         zero3.py, its full parameters released (nbytes: negative)
    bucket ready       zero2.py, every gradient of a bucket is in its staging buffer
    staging            zero2.py, a staging buffer allocated (+nbytes) or released (-nbytes)
    bucket launched    reducer.py, a gradient bucket's collective issued (in_backward)
    bucket arrived     reducer.py, its reduced gradients are in place
    backward done      engine.py, the end of backward
    optimizer step     engine.py, the optimizer stepped what this rank owns
    step               engine.py, the end of engine.step()

Engine events carry `engine`, unit events `unit`, bucket events `bucket` (a flat.Bucket); the
pieces around the paper emit a few more (assembled.py lists them). Under torch.profiler, each
event is also a `minizero/<name>` label in the trace.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

Subscriber = Callable[[str, dict], None]

_subscribers: list[Subscriber] = []


def emit(name: str, **fields) -> None:
    """Tell every subscriber that `name` happened. Costs one call per subscriber (none: nothing)."""
    for subscriber in tuple(_subscribers):
        subscriber(name, fields)
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function(f"minizero/{name}"):
            pass


def subscribe(subscriber: Subscriber) -> Callable[[], None]:
    """Call `subscriber(name, fields)` for every event from now on; returns the function that
    stops it."""
    _subscribers.append(subscriber)
    return lambda: _subscribers.remove(subscriber) if subscriber in _subscribers else None


@contextlib.contextmanager
def subscribed(subscriber: Subscriber):
    """`subscriber` sees the events emitted inside the block."""
    stop = subscribe(subscriber)
    try:
        yield subscriber
    finally:
        stop()
