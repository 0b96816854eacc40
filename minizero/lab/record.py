"""A recording of the event stream (minizero/events.py), for tests, notebooks and experiments.

    from minizero.lab.record import recorded
    with recorded("collective") as log:            # [(time.perf_counter(), name, fields), ...]
        engine.backward(loss)
"""

from __future__ import annotations

import contextlib
import time

import torch

from minizero.events import subscribed


@contextlib.contextmanager
def recorded(*names: str):
    """A list of (time.perf_counter(), name, fields) for the events named (all when none) inside the
    block; no tensors (a record must not keep alive a buffer the engine freed)."""
    log: list[tuple[float, str, dict]] = []

    def keep(name: str, fields: dict) -> None:
        if not names or name in names:
            log.append((time.perf_counter(), name,
                        {k: v for k, v in fields.items() if not torch.is_tensor(v)}))
    with subscribed(keep):
        yield log
