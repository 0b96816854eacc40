"""Run a function on N processes of one machine, each a rank of one process group:
`minizero.launch`.

    import minizero
    from minizero.lab.train import TrainConfig, train_worker
    # list of 4 per-rank return values
    results = minizero.launch(train_worker, 4, TrainConfig(stage=2))

This is for one machine (a laptop's CPU cores, or the GPUs of one box). Across machines use
torchrun, which sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; `minizero.comm.init()`
reads those.

How the processes start, and why not plain `fork`:
  `fork` is the fastest start (~0.2 s for 4 ranks) but unsafe once the parent has run torch ops on
  several threads: the child inherits a copy of the OpenMP thread pool's state without its threads
  and can hang in its first parallel op. A notebook that computes a reference and then forks workers
  hits exactly that. `spawn` is safe but every child imports torch again (~5 s for 4 ranks).
  We use `forkserver` with torch preloaded: the first launch starts one clean server process that
  imports torch once and never runs an op; every worker is forked from *it*, so starts are fork-fast
  after the first and never inherit a used thread pool. CUDA is safe for the same reason (the server
  never touches the GPU). `fn` must be importable, as with spawn: defined in a module or in the
  script being run (the server imports the main script as `__mp_main__`, so keep its top level
  behind `if __name__ == "__main__"`), not in a notebook cell or a REPL.

Failure handling: if any rank raises or dies, `launch` kills the others at once (they may be blocked
in a collective waiting for the dead one) and raises RuntimeError naming the rank and its exception,
followed by every rank's last collectives (the flight recorder of minizero/beyond/desync.py).
Ranks out of step: each rank's collectives are fingerprinted and compared
(minizero/beyond/desync.py). When the ranks issue different collectives, or none finishes for
`stall_timeout` seconds while a rank waits, the run stops in seconds with one line naming the rank
that diverged and what each issued, instead of hanging until the backend's collective timeout
(comm.DEFAULT_TIMEOUT_S). A rank that runs out of memory says so in that one line ("rank 2 failed:
out of memory (...)"), one killed by a signal names the signal (SIGKILL is also what the kernel's
OOM killer sends).

Memory cap (`memory_cap=` bytes per rank): each child sets its RLIMIT_DATA before running fn, so an
allocation past the cap fails in that rank (torch: RuntimeError "can't allocate memory") instead of
taking the machine's memory from everyone: how to show "this does not fit" without filling the
machine (python -m minizero.scale --rss). RLIMIT_DATA counts a process's private writable memory,
torch's own included (0.3 GB of an idle rank here): what allocations take. Not RLIMIT_AS: it counts
every mapping (0.8 GB of an idle rank here, mostly torch's shared libraries; a CUDA process reserves
far more address space than it uses). Not RLIMIT_RSS: Linux ignores it. Only the soft limit is set,
so a failing rank can lift it to report.
Results come back as `torch.save` bytes through a pipe, not as shared-memory tensors, so a worker
may exit before the parent reads them.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import resource
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from minizero import comm
from minizero.beyond import desync
from minizero.options import check_positive_int
from minizero.beyond.network import network_from_env, set_network
from minizero.beyond.network import network as modelled_network

_GRACE_S = 5.0    # after a failure, how long survivors get between SIGTERM and SIGKILL
_SETTLE_S = 1.0   # after a first failure, how long to collect other reports before naming the cause
_EXITED_S = 2.0   # a rank gone without a message or an EOF on its pipe after this long: died


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _context(start_method: str | None, fn: Callable) -> mp.context.BaseContext:
    method = start_method or (
        "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    )
    ctx = mp.get_context(method)
    if method == "forkserver":
        # Imported once in the server instead of once per rank: torch; torch._dynamo, which
        # torch.optim's first Optimizer() imports (~1.7 s of CPU per rank); and the module of the
        # first launched function when it is minizero's. (The server starts on the first launch;
        # later launches reuse it, so later modules load per rank.) Not a module of the user's: a
        # notebook's worker file (notebooks/ranks.py) is edited between launches, and a copy
        # preloaded in the server would hide every edit from later ranks.
        module = getattr(fn, "__module__", None) or ""
        mine = [module] if module.split(".")[0] == "minizero" else []
        ctx.set_forkserver_preload(["__main__", "torch", "torch._dynamo"] + mine)
    return ctx


def _out_of_memory(exc: BaseException) -> bool:
    """Whether exc is an allocation that failed: Python's MemoryError, torch's CUDA
    OutOfMemoryError, or torch's CPU allocator refused by the OS ("can't allocate memory",
    errno 12)."""
    return isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(
        exc
    )


def _worker(rank: int, world_size: int, port: int, backend: str | None, payload: bytes, conn,
            memory_cap: int | None = None, network=None, stall_timeout: float | None = None,
            check_every: int = 0) -> None:
    """Body of each child process: join the group, run fn, send back ("ok", result) or
    ("error", ...)."""
    # Ranks share the machine's cores; more threads than cores per rank only adds contention.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    watch = None
    try:
        if memory_cap is not None:
            resource.setrlimit(resource.RLIMIT_DATA, (memory_cap, hard))
        fn, args = _loads(payload)
        store = dist.TCPStore(
            "127.0.0.1",
            port,
            world_size + 1,
            is_master=False,
            timeout=datetime.timedelta(seconds=60),
        )
        comm.init(rank, world_size, backend=backend, store=store)
        set_network(network)    # the parent's, not the environment the forkserver started with
        if stall_timeout is not None or check_every:
            # a verdict is the parent's to report: it reads it from the store and stops every rank
            watch = desync.watch(store, stall_timeout, check_every, on_verdict=lambda line: None)
        result = fn(*args)
        if watch is not None:
            watch.settle()              # the last backward's agreement, before the group closes
        comm.destroy(wait_for_peers=True)
        conn.send(("ok", _dumps(result)))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent, even SystemExit
        hint = ""
        if isinstance(exc, AttributeError) and "Can't get attribute" in str(exc):
            hint = (
                " (the worker function must be importable: "
                "define it in a module, not a notebook cell)"
            )
        # The rank is finished: lift its cap, so that reporting cannot fail for the memory it
        # was denied.
        resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))
        message = f"{type(exc).__name__}: {exc}{hint}"
        if _out_of_memory(exc):
            cap = f" under its cap of {memory_cap / 1e6:.0f} MB" if memory_cap is not None else ""
            message = f"out of memory{cap} ({' '.join(message.split())})"
        conn.send(("error", message, traceback.format_exc()))
    finally:
        if watch is not None:
            watch.stop()
        comm.destroy()
        conn.close()


def _stop(procs: list) -> None:
    """Terminate, then kill, every process still alive; reap all of them."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def launch(fn: Callable, world_size: int, *args: Any, backend: str | None = None,
           start_method: str | None = None, timeout: float | None = None,
           memory_cap: int | None = None,
           stall_timeout: float | None = desync.DEFAULT_STALL_TIMEOUT_S,
           check_every: int = desync.DEFAULT_CHECK_EVERY) -> list:
    """Run fn(*args) on `world_size` ranks; return the list of their return values, by rank.

    backend: "gloo" (CPU) or "nccl" (one GPU per rank); default NCCL when there is a GPU per rank,
      else gloo (NCCL refuses two ranks on one GPU).
    timeout: seconds for the whole run (None: no limit); past it every rank is killed.
    memory_cap: bytes of private memory each rank may hold, torch's own included (RLIMIT_DATA; None:
    no cap). stall_timeout: seconds in which no rank issues or finishes a collective while one
    waits, before
      the run is stopped naming who never issued it (default 20, $MINIZERO_STALL_TIMEOUT_S; None:
      never). check_every: compare the ranks' collective fingerprints before the first and every
      k-th collective (0: only when the run stalls). Both: minizero/beyond/desync.py.
    Raises RuntimeError("rank R failed: ...") if any rank raises or dies; no child outlives the
    call. The ranks model the network this process has (beyond/network.py's set_network, else
    MINIZERO_NETWORK).
    """
    check_positive_int("world_size", world_size)
    if backend is None:
        backend = "nccl" if 0 < world_size <= torch.cuda.device_count() else "gloo"
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ValueError(f"nccl needs one GPU per rank: world_size={world_size}, "
                         f"GPUs={torch.cuda.device_count()}")
    if stall_timeout is not None and (isinstance(stall_timeout, bool) or not (
            isinstance(stall_timeout, (int, float)) and stall_timeout > 0)):
        raise ValueError("stall_timeout must be a positive number of seconds or None, "
                         f"got {stall_timeout!r}")
    if not (isinstance(check_every, int) and check_every >= 0) or isinstance(check_every, bool):
        raise ValueError(f"check_every must be a number of collectives >= 0, got {check_every!r}")
    if memory_cap is not None:
        check_positive_int("memory_cap", memory_cap, "number of bytes")
    try:
        payload = _dumps((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(f"launch sends the worker and its arguments to every rank by pickle, which "
                        f"failed: {' '.join(str(e).split())} (the worker must be importable: "
                        "defined at the top of a module, not a lambda, a nested function or a "
                        "notebook cell)") from None
    ctx = _context(start_method, fn)
    # The parent hosts the rendezvous store on a port the OS picks, so there is no race for a
    # free port.
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    network = modelled_network() or network_from_env()
    procs, conns = [], []
    try:
        for rank in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker,
                args=(
                    rank, world_size, store.port, backend, payload, send_end, memory_cap, network,
                    stall_timeout, check_every,
                ),
                name=f"minizero-rank{rank}",
                daemon=True,
            )
            p.start()
            send_end.close()            # the child holds the only writer now: EOF means it died
            procs.append(p)
            conns.append(recv_end)
        return _collect(procs, conns, timeout, store)
    finally:
        _stop(procs)
        for c in conns:
            c.close()
        del store


def _died(exitcode: int | None) -> str:
    """Why a rank that sent nothing is gone, in words: a negative exit code is the signal that
    killed it."""
    text = f"process died (exit code {exitcode}) before returning a result"
    if exitcode is not None and exitcode < 0:
        name = (
            signal.Signals(-exitcode).name
            if -exitcode in signal.valid_signals()
            else f"signal {-exitcode}"
        )
        text += f": killed by {name}"
        if -exitcode == signal.SIGKILL:
            text += " (also what the kernel's OOM killer sends when the machine runs out of memory)"
    return text


def _collect(procs: list, conns: list, timeout: float | None, store: dist.Store) -> list:
    """Wait for every rank's message. On a failure, listen a moment longer before naming the
    culprit: when a rank dies, its peers soon fail too ("connection reset by peer" in a
    collective), and their reports can arrive before the dead rank's closed pipe. A rank that died
    without a word is the cause; otherwise the first rank that raised. Ranks out of step are named
    by desync's verdict instead, which may come while every rank still waits. The caller then kills
    whoever is left."""
    deadline = None if timeout is None else time.monotonic() + timeout
    results: list = [None] * len(procs)
    pending = set(range(len(procs)))
    # rank -> (order: died first, then by time; message)
    failures: dict[int, tuple[float, str]] = {}
    exited: dict[int, float] = {}           # rank -> when it was first seen gone without a word
    settle_until = None
    while pending and (settle_until is None or time.monotonic() < settle_until):
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(
                f"minizero.launch: timed out after {timeout} s; ranks {sorted(pending)} "
                f"had not finished{desync.report(store, len(procs))}"
            )
        verdict = desync.verdict(store)
        if verdict is not None:
            raise RuntimeError(f"ranks out of step: {verdict}{desync.report(store, len(procs))}")
        multiprocessing.connection.wait([conns[r] for r in pending],
                                        timeout=0.1 if failures else 0.5)
        for r in sorted(pending):
            if not conns[r].poll():
                if procs[r].is_alive():
                    continue
                # Exited, and its pipe neither holds a message nor closed: another process still
                # holds the pipe's writing end (a process the rank started outlives it), so no EOF
                # will come. Waiting for one hung a notebook with no rank left; it died.
                exited.setdefault(r, time.monotonic())
                if time.monotonic() - exited[r] < _EXITED_S:
                    continue
                pending.discard(r)
                failures[r] = (float("-inf"), _died(procs[r].exitcode) + " (its result pipe "
                               "stayed open: a process it started still holds it)")
                continue
            pending.discard(r)
            try:
                msg = conns[r].recv()
            except EOFError:             # the pipe closed without a message: the process died
                procs[r].join(1.0)
                failures[r] = (float("-inf"), _died(procs[r].exitcode))
                continue
            if msg[0] == "error":
                failures[r] = (
                    time.monotonic(),
                    f"{msg[1]}\n--- traceback of rank {r} ---\n{msg[2]}",
                )
            else:
                results[r] = _loads(msg[1])
        if failures and settle_until is None:
            settle_until = time.monotonic() + _SETTLE_S
    if failures:
        r = min(failures, key=lambda rank: failures[rank][0])
        verdict = desync.verdict(store)
        first = (f"ranks out of step: {verdict}" if verdict is not None else
                 f"rank {r} failed: {failures[r][1]}")
        raise RuntimeError(first + desync.report(store, len(procs)))
    return results
