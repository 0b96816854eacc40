"""One event stream: the few moments of a training step that matter, for whoever wants to watch.

    from minizero import events
    with events.subscribed(lambda name, fields: print(name, fields.get("tag", ""))):
        engine.backward(loss)
        engine.step()

minizero's code never looks at who is watching. At each transition that a learner, a plot or a test
may want to see, it calls `emit(name, **fields)`; every subscriber is called with (name, fields), in
this process (one rank). What is emitted, and by whom:

    collective        comm.py, as a collective is issued: kind, tag (what it is for: "unit 3
                      (blocks.3)", "bucket 0"), group, numel, dtype, sent (ring bytes this rank
                      sends), tensor (the full buffer), seq (this rank's count of collectives),
                      blocking (the caller waits for it at once: not async_op),
                      modeled ((start, end) on the network model's link, or None). Emitted
                      before the collective runs: beyond/desync.py's watch agrees with the other
                      ranks here and raises DesyncError instead of letting a mismatched one run
    collective done   comm.py, when that collective has completed (its handle waited): seq,
                      kind, tag
    ring exchange     comm.py's ring_all_reduce, before each exchange: buffer (the padded
                      tensor), send (the index of the chunk this rank sends)
    unit gather       zero3.py, a unit's all-gather issued (prefetch: True when nobody waits for
                      it yet); `nbytes` its full parameters take
    unit gathered     zero3.py, its full parameters are there
    unit freed        zero3.py, its full parameters released; `nbytes` they gave back (negative)
    secondary         zero3.py, hpZ's node-local copy kept (+nbytes) or dropped (-nbytes)
    bucket ready      zero2.py, every gradient of a bucket is in its staging buffer
    bucket launched   reducer.py, a gradient bucket's collective issued (`in_backward`:
                      during backward)
    bucket arrived    reducer.py, its reduced gradients are in place
    staging           zero2.py, a bucket's staging buffer allocated (+nbytes) or released (-nbytes)
    checkpoint commit checkpoint.py, every rank's shard of a checkpoint is on disk and the
                      manifest not yet written: `directory`
    unit forward      engine.py, a unit's forward has ended (index)
    unit backward     engine.py, a unit's backward starts (index)
    backward done     engine.py, the end of engine.backward()
    optimizer step    engine.py, the optimizer has stepped what this rank owns (before
                      parameters move)
    step              engine.py, the end of engine.step()

Engine events carry `engine`; unit events `unit`; bucket events `bucket` (a flat.Bucket).
Subscribers must not change what they are shown: the stream is for observing. The engine's own
counted memory peaks (engine.py) subscribe like any other watcher; so do `engine.memory_timeline()`,
the step-through (lab/stepthrough.py), the network timelines, the graders and the bench.

With a torch.profiler running, each event is also a `minizero/<name>` label in the trace.
"""

from __future__ import annotations

import contextlib
import time
import weakref
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


@contextlib.contextmanager
def recorded(*names: str):
    """A list of (time.perf_counter(), name, fields) for the events named (all when none), emitted
    inside the block. Tensors in the fields are left out: a record must not keep alive a buffer that
    the engine has freed."""
    log: list[tuple[float, str, dict]] = []

    def keep(name: str, fields: dict) -> None:
        if not names or name in names:
            log.append((time.perf_counter(), name,
                        {k: v for k, v in fields.items() if not torch.is_tensor(v)}))
    with subscribed(keep):
        yield log


def subscribe_weakly(method) -> None:
    """Subscribe a bound method without keeping its object alive (an engine watching its own
    events): once the object is garbage, the subscription removes itself."""
    ref = weakref.WeakMethod(method)

    def call(name: str, fields: dict) -> None:
        live = ref()
        if live is None:
            _subscribers.remove(call)
        else:
            live(name, fields)
    _subscribers.append(call)
