"""Bytes this rank really put on the wire, by collective: measured, next to comm's tally (modelled).

    python -m pytest tests/test_wire.py
    from minizero.memory import wire
    with wire.WireMeter() as meter:    # this rank, in the block (wire.unavailable(): why not)
        engine.backward(loss)
        engine.step()
        meter.bytes()  # {"reduce_scatter": ..., "all_gather": ..., "overlapped": 0, "total": ...}

comm.tally() is a model: the bytes a bandwidth-optimal ring sends for each collective the algorithm
asks for (the papers' unit, and what NCCL sends). What gloo really sends differs ([Note:
collectives on gloo] in comm.py: a reduce-scatter runs as an all-reduce, 2x the ring's bytes; an
all-gather as N broadcasts), and every message carries a header. This meter counts what was sent.

What it reads: Linux counts, per thread, the bytes each one hands to write(), writev() and send()
(`wchar` in /proc/self/task/<tid>/io). gloo's TCP transport writes from its own threads
("gloo_tcp_loop", "pt_gloo_runloop"), which do nothing else, so their counters are this rank's
bytes on the wire, payload and headers. Another thread's writes (a print, a file, the desync
watchdog's store updates) are not counted; point-to-point sends are written from the calling
thread (WireMeter(calling_thread=True)). Measured on 2 gloo ranks: an all-reduce of S = 4 MB
wrote 2(N-1)/N·S + 576 B on each rank (docs/performance.md has the table and its command).

How the bytes become a collective's: the meter reads those counters at each "collective" (issued)
and "collective done" (waited) event (events.py). What was written between two readings went out
while the collectives then in flight were running:
  * all of one kind: that kind's. A collective run alone (every one inside comm.synchronous())
    is measured exactly, headers included;
  * several kinds at once (stage 3's prefetched all-gather while a reduce-scatter is in flight):
    "overlapped". Which of them sent those bytes cannot be told from a counter; the total is
    still exact;
  * none: "outside", left out of the total (the backend's traffic that is no collective of
    minizero's: desync's agreement, a barrier, all_gather_object).
NCCL moves bytes by DMA over NVLink or InfiniBand, not through a thread's write calls: there, and
without /proc (not Linux), `unavailable()` says why and a report shows "n/a".
"""

from __future__ import annotations

import os
import threading
from collections import Counter

from minizero import comm, events

TASKS = "/proc/self/task"                      # one folder per thread of this process
GLOO_THREADS = ("gloo", "pt_gloo")             # the name prefixes of gloo's own threads


def unavailable() -> str | None:
    """Why this rank cannot measure its bytes on the wire; None when it can (gloo on Linux)."""
    if not os.path.isdir(TASKS):
        return "no /proc/self/task/<tid>/io on this system (Linux only)"
    if comm.backend() != "gloo":
        return f"{comm.backend()} sends by DMA, not through this process's write calls"
    return None


class WireMeter:
    """This rank's bytes on the wire by collective kind, since the last reset()."""

    def __init__(self, calling_thread: bool = False):
        """calling_thread: also count this thread's writes. gloo sends a point-to-point message
        (send, recv, batch_isend_irecv: ring.ring_all_reduce) from the thread that calls it; a
        print or a file written meanwhile would then count too."""
        self.calling_thread = threading.get_native_id() if calling_thread else None
        self.counts: Counter = Counter()    # kind (or "overlapped", "outside") -> bytes
        self.in_flight: dict[int, str] = {}  # seq -> kind, from "collective" to "collective done"
        self._files: dict[int, int] = {}     # gloo thread id -> its open io file
        self._last: dict[int, int] = {}      # gloo thread id -> its wchar at the last reading
        self._threads = -1                   # threads when last scanned (a new group adds some)
        self._stop = lambda: None            # unsubscribes, once started

    # --- the counters -----------------------------------------------------------------------------
    def _scan(self) -> None:
        """Open the io file of every gloo thread not yet known (a new process group starts
        some): st_nlink of /proc/self/task is the number of threads + 2."""
        threads = os.stat(TASKS).st_nlink
        if threads == self._threads:
            return
        self._threads = threads
        for tid in map(int, os.listdir(TASKS)):
            if tid in self._files:
                continue
            try:
                with open(f"{TASKS}/{tid}/comm") as f:
                    name = f.read().strip()
                if name.startswith(GLOO_THREADS) or tid == self.calling_thread:
                    self._files[tid] = os.open(f"{TASKS}/{tid}/io", os.O_RDONLY)
                    self._last[tid] = _wchar(self._files[tid])
            except OSError:                       # the thread ended meanwhile
                self._forget(tid)

    def _forget(self, tid: int) -> None:
        if tid in self._files:
            os.close(self._files.pop(tid))
        self._last.pop(tid, None)

    def _written(self) -> int:
        """Bytes gloo's threads have written since the last call."""
        self._scan()
        written = 0
        for tid, fd in list(self._files.items()):
            try:
                now = _wchar(fd)
            except OSError:                       # the thread ended (its group was destroyed)
                self._forget(tid)
                continue
            written += now - self._last[tid]
            self._last[tid] = now
        return written

    def _book(self) -> None:
        """What was written since the last reading, to the collectives in flight all that time."""
        written = self._written()
        kinds = set(self.in_flight.values())
        key = "outside" if not kinds else kinds.pop() if len(kinds) == 1 else "overlapped"
        self.counts[key] += written

    # --- the events -------------------------------------------------------------------------------
    def on_event(self, name: str, fields: dict) -> None:
        if name == "collective":
            self._book()
            self.in_flight[fields["seq"]] = fields["kind"]
        elif name == "collective done":
            self._book()
            self.in_flight.pop(fields["seq"], None)

    def start(self) -> WireMeter:
        """Count from now on: subscribe to the event stream."""
        self._stop = events.subscribe(self.on_event)
        self.reset()
        return self

    def __enter__(self) -> WireMeter:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def reset(self) -> None:
        """Start counting from now (collectives in flight stay in flight)."""
        self._written()
        self.counts.clear()

    def bytes(self) -> dict[str, int]:
        """Bytes on the wire by kind since the last reset, with "overlapped", "outside" and
        "total" (every kind and "overlapped"; "outside" is not in it)."""
        self._book()
        out = {kind: n for kind, n in self.counts.items() if kind != "outside"}
        out["total"] = sum(out.values())
        out.setdefault("overlapped", 0)
        out["outside"] = self.counts["outside"]
        return out

    def close(self) -> None:
        """Stop counting: unsubscribe, close the counters' files."""
        self._stop()
        for tid in list(self._files):
            self._forget(tid)


def _wchar(fd: int) -> int:
    """The wchar line of an open /proc/.../io file, read again from its start."""
    for line in os.pread(fd, 512, 0).splitlines():
        if line.startswith(b"wchar:"):
            return int(line.split()[1])
    raise OSError("no wchar line")
