"""One rank's model-state bytes as a step runs: engine.memory()'s peaks and memory_timeline().

    python -m pytest tests/test_engine.py -k memory_timeline

The engine only emits events (events.py); this meter subscribes to them. It measures every storage
(memory.measure) at the end of each backward and step, and counts on from there in between
([Note: counted peaks]).
"""

from __future__ import annotations

import contextlib
import time
import weakref

from minizero import events
from minizero.memory import measure

# What memory_timeline() calls each event of the stream.
_LABELS = {
    "unit forward": "forward {index}",
    "unit backward": "backward {index}",
    "bucket launched": "bucket {index} launched",
    "bucket arrived": "bucket {index} arrived",
    "backward done": "end of backward",
    "step": "step",
}


class ModelStateMeter:
    """engine.memory()'s figures: bytes by category now and the peaks seen so far."""

    # [Note: counted peaks] Stage 3 wants the peak where it happens, at each unit gathered and each
    # gradient bucket in flight: several times a step. Re-measuring every storage there would cost
    # a noticeable part of a step (docs/performance.md). Between two measurements, the only model
    # states that come and go in a step are the buffers the stages allocate and free themselves (a
    # unit's full parameters and hpZ's secondaries, a bucket's staging buffer): their events carry
    # the bytes in and out (_COUNTED), and the moments of _PEAKS compare the running count with
    # the peak. Autograd's p.grad needs no count: stages 2-3 free each one the moment it is
    # complete, before any such moment. Except inside no_sync(), where gradients accumulate in
    # p.grad until the step: then every moment measures again.
    _COUNTED = {"unit gather": "params", "unit freed": "params", "secondary": "params",
                "staging": "grads"}
    _PEAKS = ("unit gathered", "bucket ready")
    _MEASURED = ("backward done", "step")

    def __init__(self, engine, by_category):
        """by_category(): {category: the tensors holding it} (assembled.py's)."""
        self.engine, self.by_category = engine, by_category
        self.peaks = {"peak": 0, "peak_params": 0}
        self._now: dict[str, int] | None = None            # bytes by category, counted on
        _subscribe_weakly(self._on_event)

    def now(self) -> dict[str, int]:
        return measure(self.by_category())

    def measure(self) -> dict[str, int]:
        """Measure every storage and count on from there; the bytes now."""
        self._now = self.now()
        self._update(self._now)
        return self._now

    def _on_event(self, name: str, fields: dict) -> None:
        if fields.get("engine") is not self.engine:
            return
        if name in self._COUNTED and self._now is not None:
            self._now[self._COUNTED[name]] += fields["nbytes"]
        elif name in self._PEAKS:
            if self._now is None or self.engine.accumulating:
                self.measure()
            else:
                self._update(self._now)
        elif name in self._MEASURED:
            self.measure()

    def _update(self, now: dict[str, int]) -> None:
        total = now["params"] + now["grads"] + now["optimizer"]
        self.peaks["peak"] = max(self.peaks["peak"], total)
        self.peaks["peak_params"] = max(self.peaks["peak_params"], now["params"])

    @contextlib.contextmanager
    def timeline(self, activations):
        """engine.memory_timeline(): (time, event, bytes by category now) at each event of the
        engine's, labelled as in _LABELS; the categories as memory() counts them, plus the
        activations alive."""
        timeline: list[tuple[float, str, dict[str, int]]] = []

        def record(name: str, fields: dict) -> None:
            if fields.get("engine") is self.engine and name in _LABELS:
                index = fields["bucket"].index if "bucket" in fields else fields.get("index")
                timeline.append((time.perf_counter(), _LABELS[name].format(index=index),
                                 {**self.now(), "activations": activations.alive}))
        with events.subscribed(record):
            yield timeline


def _subscribe_weakly(method) -> None:
    """Subscribe a bound method without keeping its object alive (an engine's meter): once the
    object is garbage, the subscription removes itself."""
    ref = weakref.WeakMethod(method)

    def call(name: str, fields: dict) -> None:
        live = ref()
        if live is None:
            stop()
        else:
            live(name, fields)
    stop = events.subscribe(call)
