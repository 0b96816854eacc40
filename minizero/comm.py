"""The communication layer: every collective of minizero passes through here.

    python -m pytest tests/test_comm.py          # notebooks/00_communication.ipynb explains it

Every stage talks to the other ranks through four collectives (all_reduce, reduce_scatter,
all_gather, broadcast), each of which passes through `issue`. One place buys three things:
1. A byte tally: each call adds the bytes a bandwidth-optimal *ring* sends per rank for it, with N
   ranks and a tensor of S bytes (its full size): 2(N-1)/N * S for an all-reduce (a reduce-scatter
   then an all-gather), (N-1)/N * S for the others. The paper's unit when it says DDP and stages
   1-2 move 2Ψ per step and stage 3 3Ψ (section 7): a model of what the algorithm must move.
2. One event per collective (events.py): what it is for (`tag`), its size, when it is done.
3. One switch between gloo (CPU processes) and NCCL (a GPU per process) ([Note: collectives on
   gloo]). `minizero.launch` calls `init(rank, world_size)` in each process; under torchrun,
   `init()` reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the environment.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections import Counter

import torch
import torch.distributed as dist

from minizero import events
from minizero.flat import partition

# Collectives wait this long for a missing peer before raising (the launcher notices sooner).
DEFAULT_TIMEOUT_S = float(os.environ.get("MINIZERO_TIMEOUT_S", "120"))

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}

# --- the process group ----------------------------------------------------------------------------
def init(rank: int | None = None, world_size: int | None = None, *, backend: str | None = None,
         store: dist.Store | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the process group. Without arguments, read torchrun's environment variables."""
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    ranks = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    if backend == "nccl" and ranks > 1 and not hasattr(dist, "all_gather_single"):
        raise RuntimeError(f"minizero needs torch >= 2.13 for NCCL with {ranks} ranks "
                           f"(dist.all_gather_single); this is torch {torch.__version__}")
    if backend == "nccl":          # one GPU per process: LOCAL_RANK under torchrun, else the rank
        local_rank = int(os.environ.get("LOCAL_RANK", rank if rank is not None else 0))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank is None:                                   # torchrun (env:// variables)
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world_size, store=store,
                                timeout=timeout)
    reset_tally()


def destroy(wait_for_peers: bool = False) -> None:
    """Leave the process group (wait_for_peers: a barrier first, so no rank closes a connection
    another still uses)."""
    if dist.is_initialized():
        if wait_for_peers:
            barrier()
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def backend() -> str:
    return dist.get_backend() if dist.is_initialized() else "gloo"


def device() -> torch.device:                          # its GPU under NCCL, the CPU under gloo
    nccl = backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


# --- the collectives: each returns a handle (call .wait()) with async_op=True, else None. With one
# rank they are a copy or nothing, so every stage also runs in one process. `tag` says what the
# collective is for ("unit 3 (blocks.2)", "bucket 0"): the event stream carries it.
def all_reduce(tensor: torch.Tensor, op: str = "avg", async_op: bool = False,
               group: Group | None = None, tag: str = ""):
    """In place: every rank ends with op(tensor over ranks). DDP's gradient averaging."""
    return issue("all_reduce", tensor, group, tag, async_op,
                 lambda: dist.all_reduce(tensor, op=_OPS[op], async_op=True, group=_pg(group)))


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str = "avg",
                   async_op: bool = False, group: Group | None = None, tag: str = ""):
    """input [N * n] on every rank -> output [n] on rank r = op over ranks of input[r*n:(r+1)*n].
    `output` may be rank r's slice of `input` (in place: stage 1's). The rest of `input` is
    workspace: undefined after."""
    assert input.numel() == output.numel() * group_size(group), "reduce_scatter: input: N x output"

    def run():
        if _on_gloo():                                    # [Note: collectives on gloo]
            mine = partition(input.view(-1), group_rank(group), group_size(group))       # [n]
            copy_out = _copy_into(output, mine) if output.data_ptr() != mine.data_ptr() else None
            return Joined([dist.all_reduce(input, op=_OPS[op], async_op=True, group=_pg(group))],
                          copy_out)
        return dist.reduce_scatter_single(output, input, op=_OPS[op], async_op=True,
                                          group=_pg(group))
    return issue("reduce_scatter", input, group, tag, async_op, run, _copy_into(output, input))


def all_gather(output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
               group: Group | None = None, tag: str = ""):
    """input [n] from every rank -> output [N * n] on every rank, rank r's at output[r*n:(r+1)*n].
    `input` may be this rank's slice of `output` (in place): how ZeRO rebuilds full parameters."""
    n = group_size(group)
    assert output.numel() == input.numel() * n, "all_gather: output is N x input"

    def run():
        if _on_gloo():                                    # [Note: collectives on gloo]
            pieces = [partition(output.view(-1), i, n) for i in range(n)]          # N x [n]
            _copy_into(pieces[group_rank(group)], input.view(-1))()
            ranks = range(n) if group is None else group.ranks
            return Joined([dist.broadcast(piece, src=src, async_op=True, group=_pg(group))
                           for piece, src in zip(pieces, ranks) if input.numel()])
        return dist.all_gather_single(output, input, async_op=True, group=_pg(group))
    return issue("all_gather", output, group, tag, async_op, run, _copy_into(output, input))


def broadcast(tensor: torch.Tensor, src: int = 0, async_op: bool = False,
              group: Group | None = None, tag: str = ""):
    """In place: every rank ends with rank `src`'s tensor (a global rank). Starts replicas equal."""
    return issue("broadcast", tensor, group, tag, async_op,
                 lambda: dist.broadcast(tensor, src=src, async_op=True, group=_pg(group)))


class Group:
    """Ranks that run collectives among themselves (`ranks`, this rank's `index` among them, -1 if
    not one): every collective's `group=`. None, everywhere in the paper's ZeRO, is all N ranks."""

    def __init__(self, ranks: list[int]):
        self.ranks, self.size = tuple(ranks), len(ranks)
        self.index = self.ranks.index(rank()) if rank() in self.ranks else -1
        # collective: every rank creates every group, in the same order
        self.process_group = dist.new_group(list(ranks)) if world_size() > 1 else None



def group_size(group: Group | None) -> int:
    return world_size() if group is None else group.size


def group_rank(group: Group | None) -> int:            # which partition of the group's it owns
    return rank() if group is None else group.index


# --- the byte tally -------------------------------------------------------------------------------
_tally: Counter = Counter()         # bytes by kind of collective
_by_ranks: Counter = Counter()      # the same bytes by the ranks the ring ran over (None: all)
_seq = 0                            # collectives this rank has issued (the same on every rank)


def reset_tally() -> None:
    _tally.clear()
    _by_ranks.clear()


def tally() -> dict[str, float]:           # bytes sent since the reset (ring model), by kind, total
    return {**_tally, "total": sum(_tally.values())}


def tally_by_ranks() -> dict[tuple[int, ...] | None, float]:     # by the ranks of each ring
    return dict(_by_ranks)


def ring_bytes(kind: str, full_bytes: int, n: int) -> float:    # what one rank sends in a ring
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_gather": (n - 1) / n, "broadcast": (n - 1) / n, "all_to_all": (n - 1) / n}[kind]
    return factor * full_bytes


# --- issuing a collective: tally, event, run, handle ----------------------------------------------
class Joined:
    """One handle for several in flight: wait() waits for each, then runs `finish` once."""

    def __init__(self, handles: list, finish=None):
        self.handles, self.finish = handles, finish

    def wait(self) -> bool:
        for handle in self.handles:
            handle.wait()
        if self.finish is not None:
            self.finish()
            self.finish = None                                    # wait() twice finishes once
        return True


_blocking = False          # synchronous(): every collective completes before it returns


@contextlib.contextmanager
def synchronous():
    """Inside the block every collective completes before it returns, async_op or not: for
    debugging and the step-through (lab/stepthrough.py)."""
    global _blocking
    previous, _blocking = _blocking, True
    try:
        yield
    finally:
        _blocking = previous


def issue(kind: str, full: torch.Tensor, group: Group | None, tag: str, async_op: bool, run,
          local=None, sent: float | None = None):
    """Every collective passes here (beyond/'s too): tally the ring bytes of `kind` over `full`,
    tell the event stream, run it (`run()`: the backend's handle; one rank: `local()`, if any)."""
    global _seq
    n = group_size(group)
    if sent is None:
        sent = ring_bytes(kind, full.numel() * full.element_size(), n)
    _tally[kind] += sent
    _by_ranks[None if group is None else group.ranks] += sent
    _seq += 1
    events.emit("collective", kind=kind, tag=tag, group=group, numel=full.numel(), dtype=full.dtype,
                blocking=not async_op or _blocking, sent=sent, tensor=full, seq=_seq)
    handle = run() if n > 1 else None
    if n == 1 and local is not None:
        local()                                        # one rank: a copy (or nothing at all)
    seq = _seq              # its handle's wait() waits for it, then says so on the event stream
    issued = Joined([] if handle is None else [handle],
                    lambda: events.emit("collective done", seq=seq, kind=kind, tag=tag))
    if not async_op or _blocking:
        issued.wait()
    return issued if async_op else None


# [Note: collectives on gloo] NCCL's collectives are bandwidth-optimal rings; gloo's are not: here,
# its reduce-scatter (half an all-reduce on paper) takes longer than its all-reduce, its all-gather
# longer than N broadcasts (docs/performance.md: python -m minizero.bench --collectives). So on gloo
# reduce_scatter runs as an all-reduce plus a copy of this rank's part, all_gather as N broadcasts:
# more bytes move, less time passes; the tally books what the algorithm asks for. The price:
# reduce_scatter's input is workspace on every backend. `backend_collectives()` turns this off.
_gloo_workarounds = True


@contextlib.contextmanager
def backend_collectives():                     # inside the block: gloo's own collectives too
    global _gloo_workarounds
    previous, _gloo_workarounds = _gloo_workarounds, False
    try:
        yield
    finally:
        _gloo_workarounds = previous


def _on_gloo() -> bool:
    return _gloo_workarounds and backend() == "gloo"


def _pg(group: Group | None):
    return None if group is None else group.process_group


def _copy_into(output: torch.Tensor, input: torch.Tensor):       # one rank's collective
    def local():
        if output.data_ptr() != input.data_ptr():
            output.copy_(input.view_as(output))
    return local


def all_gather_object(obj) -> list:          # every rank's obj, by rank (not tallied: reports)
    out = [obj] * world_size()
    if world_size() > 1:
        dist.all_gather_object(out, obj)
    return out
