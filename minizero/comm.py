"""The communication layer: the only module in minizero that calls torch.distributed collectives.

Run its tests:      python -m pytest tests/test_comm.py
See it explained:   notebooks/00_communication.ipynb

Every stage talks to the other ranks through the functions below (all_reduce, reduce_scatter,
all_gather, broadcast, all_to_all, and the teaching-only ring_all_reduce). Each takes an optional
`group`: a subset of the ranks (see `Group`) for the designs beyond the paper that shard within a
node and replicate across nodes. Keeping them in one place buys two things:

1. A byte tally. Each call adds to a per-rank counter the bytes that a bandwidth-optimal
   *ring* sends per rank for it. With N ranks and a tensor of S bytes (always the *full* size,
   before sharding):

       all-reduce                 2(N-1)/N * S     (= a reduce-scatter followed by an all-gather)
       reduce-scatter, all-gather  (N-1)/N * S
       broadcast                   (N-1)/N * S     (pipelined ring broadcast)

   That is the unit the ZeRO paper uses when it says DDP and stages 1-2 move 2Ψ per step and stage 3
   moves 3Ψ (section 7): its Ψ counts the (N-1)/N factor as ~1. The tally does not time anything; it
   is what the algorithm must move, independent of what the backend really does underneath.

2. One switch between gloo (CPU processes on a laptop) and NCCL (one process per GPU), and the place
   that knows their costs: on gloo, reduce-scatter and all-gather run in another way that is faster
   there ([Note: collectives on gloo] below).

3. A place to model the network (minizero/beyond/network.py; off by default). The tally also splits
its
   bytes by where the ring runs: "intra_node" (the group lies inside one node of ranks_per_node()
   consecutive ranks) or "inter_node" (it spans nodes). With `set_network(...)` or MINIZERO_NETWORK,
   each collective is also booked on this rank's link and completes no earlier than a ring on that
   network would.

How a process group gets here: `minizero.launch` calls `init(rank, world_size, ...)` in each child;
under `torchrun`, `init()` reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the environment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from collections import Counter

import torch
import torch.distributed as dist

from minizero import events
from minizero.flat import partition
from minizero.beyond.network import Link, Network, network_from_env, parse_network, sleep_until

# Collectives wait this long for a missing peer before raising. A dead peer is normally noticed much
# sooner by the launcher (it kills the survivors); this bound covers torchrun and anything the
# launcher cannot see.
DEFAULT_TIMEOUT_S = float(os.environ.get("MINIZERO_TIMEOUT_S", "120"))

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}


# --------------------------------------------------------------------------------------------------
# Process group
# --------------------------------------------------------------------------------------------------

def init(rank: int | None = None, world_size: int | None = None, *, backend: str | None = None,
         store: dist.Store | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the process group. Without arguments, read torchrun's environment variables."""
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    ranks = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    if backend == "nccl" and ranks > 1 and not hasattr(dist, "all_gather_single"):
        # NCCL's all_gather / reduce_scatter below call torch 2.13's *_single collectives; one
        # rank calls none (an older torch trains at N = 1 on a GPU)
        raise RuntimeError(f"minizero needs torch >= 2.13 for NCCL with {ranks} ranks "
                           f"(dist.all_gather_single); this is torch {torch.__version__}")
    if backend == "nccl":
        # One process per GPU: LOCAL_RANK under torchrun, the global rank under minizero.launch.
        local_rank = int(os.environ.get("LOCAL_RANK", rank if rank is not None else 0))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank is None:  # torchrun (or any launcher that sets the env:// variables)
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, store=store, timeout=timeout
        )
    reset_tally()
    if _network is None:
        set_network(network_from_env())                      # MINIZERO_NETWORK, if set


def destroy(wait_for_peers: bool = False) -> None:
    """Leave the process group. wait_for_peers: first a barrier, so no rank closes its connections
    while another is still finishing a collective with it (gloo can abort the slower process at exit
    otherwise). Only on success: after a failure the peers may never arrive."""
    global _agreement_group
    if dist.is_initialized():
        if wait_for_peers:
            barrier()
        dist.destroy_process_group()
    _agreement_group = None


def is_initialized() -> bool:
    return dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def backend() -> str:
    return dist.get_backend() if dist.is_initialized() else "gloo"


def device() -> torch.device:
    """Where this rank computes: its GPU under NCCL, the CPU under gloo."""
    if backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


# --------------------------------------------------------------------------------------------------
# Groups: collectives over a subset of the ranks
# --------------------------------------------------------------------------------------------------

class Group:
    """A subset of the ranks that run collectives among themselves: `ranks` (global ranks, in ring
    order), this rank's `index` in it (-1 when not a member) and the backend's process group.

    The paper's ZeRO shards over all N ranks (group=None everywhere). Hierarchical designs
    (HSDP / MiCS, ZeRO++'s hpZ) shard within a group of S ranks and replicate across the N/S groups:
    two kinds of group.
    """

    def __init__(self, ranks: list[int], process_group=None):
        self.ranks = tuple(ranks)
        self.index = self.ranks.index(rank()) if rank() in self.ranks else -1
        # dist.new_group is collective: every rank must create every group, in the same order
        # (not for a process group the user made already: group_of)
        if process_group is None and world_size() > 1:
            process_group = dist.new_group(list(ranks))
        self.process_group = process_group

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"Group{list(self.ranks)}"


def group_of(process_group) -> Group | None:
    """A process group as PyTorch's front ends take it (minizero/pytorch/): None or the world
    (dist.group.WORLD) as None; a torch ProcessGroup (dist.new_group) or a 1-D DeviceMesh as a
    Group around it, which makes no new one (only its members need to be here)."""
    if process_group is None or isinstance(process_group, Group):
        return process_group
    if hasattr(process_group, "get_group"):             # a DeviceMesh (2-D: raises, naming it)
        process_group = process_group.get_group()
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a ProcessGroup, got {type(process_group)}")
    ranks = dist.get_process_group_ranks(process_group)
    return None if ranks == list(range(world_size())) else Group(ranks, process_group)


def mesh(shard_size: int) -> tuple[Group, Group]:
    """Cut the N ranks into a 2-D mesh of N/S rows of S = shard_size consecutive ranks.

    Returns this rank's (shard group: its row, replicate group: its column). With ranks_per_node = S
    a row is one node, so the shard group's collectives stay inside the node. Every rank creates
    every group (dist.new_group is collective), then keeps the two it belongs to.
    """
    n = world_size()
    row = row_group(shard_size)
    columns = [Group(column_of(index, shard_size, n)) for index in range(shard_size)]
    return row, columns[rank() % shard_size]


def row_group(size: int) -> Group:
    """This rank's row of `size` consecutive ranks, alone (hpZ's node group needs no columns). Every
    rank creates every row (dist.new_group is collective), then keeps its own."""
    n = world_size()
    if size < 1 or n % size:
        raise ValueError(f"a shard group of {size} ranks does not divide the world size {n}")
    rows = [Group(row_of(start, size)) for start in range(0, n, size)]
    return rows[rank() // size]


def row_of(r: int, size: int) -> list[int]:
    """Rank r's row of the mesh: the `size` consecutive ranks it shards with (its node
    when size = R)."""
    start = r // size * size
    return list(range(start, start + size))


def column_of(r: int, size: int, n: int) -> list[int]:
    """Rank r's column of the mesh: one rank of each row, the ranks that hold the same partition."""
    return list(range(r % size, n, size))


def group_size(group: Group | None) -> int:
    return world_size() if group is None else group.size


def group_rank(group: Group | None) -> int:
    """This rank's position in `group` (its rank when group is None): which shard it owns."""
    return rank() if group is None else group.index


def _pg(group: Group | None):
    return None if group is None else group.process_group


# --------------------------------------------------------------------------------------------------
# Byte tally (per rank, per kind of collective, and intra- / inter-node) and the network model
# --------------------------------------------------------------------------------------------------

_tally: Counter = Counter()
_span: Counter = Counter()       # the same bytes, by where their ring runs: intra_node / inter_node
_network: Network | None = None  # set_network, or MINIZERO_NETWORK at init; None: off
link = Link()                    # this rank's link under the model
_seq = 0                         # collectives this rank has issued (the same count on every rank)


def reset_tally() -> None:
    _tally.clear()
    _span.clear()


def tally() -> dict[str, float]:
    """Bytes this rank has sent since the last reset, by kind, plus their 'total', split into
    'intra_node' and 'inter_node' (intra + inter = total)."""
    out = dict(_tally)
    out["total"] = sum(_tally.values())
    out["intra_node"], out["inter_node"] = _span["intra_node"], _span["inter_node"]
    return out


def ring_bytes(kind: str, full_bytes: int, n: int) -> float:
    """Bytes one rank sends in a bandwidth-optimal ring for a collective over a tensor
    of `full_bytes`."""
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_gather": (n - 1) / n, "broadcast": (n - 1) / n, "all_to_all": (n - 1) / n}[kind]
    return factor * full_bytes


def set_network(model: Network | str | None) -> None:
    """Model the network from now on: a Network, a spec ("1gbps,10us,ranks_per_node=2":
    beyond/network.py)
    or None (off). Set in the parent, minizero.launch hands it to the ranks it starts."""
    global _network
    _network = parse_network(model) if isinstance(model, str) else model
    link.free_at = 0.0


def network() -> Network | None:
    return _network


def ranks_per_node() -> int:
    """Ranks per node: the network model's; without one, torchrun's LOCAL_WORLD_SIZE, else every
    rank (minizero.launch runs them all on one machine)."""
    if _network is not None:
        return _network.ranks_per_node
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))


def spans_nodes(group: Group | None) -> bool:
    """Does the group's ring cross a node boundary?"""
    return ranks_span_nodes(range(world_size()) if group is None else group.ranks, ranks_per_node())


def ranks_span_nodes(ranks, per_node: int) -> bool:
    """Whether these ranks sit on more than one node (ranks r and s share a node iff
    r // R == s // R). The one rule for the tally's split and for memory.comm_volume_by_node."""
    return len({r // per_node for r in ranks}) > 1


def _book(tally_kind: str, kind: str, sent: float, n: int, group: Group | None):
    """Add `sent` bytes to the tally; with a network model, book the ring of `kind` on this rank's
    link. Returns (start, end) of the modelled transfer (time.perf_counter seconds), or None without
    a model."""
    _tally[tally_kind] += sent
    inter = spans_nodes(group)
    _span["inter_node" if inter else "intra_node"] += sent
    if _network is None or n == 1:
        return None
    seconds = _network.time(kind, sent, n, inter)
    end = link.book(seconds)
    return end - seconds, end


# --------------------------------------------------------------------------------------------------
# Collectives. Each returns an async handle (call .wait()) when async_op=True, else None.
# With one rank they are no-ops (or a copy), so every stage also runs single-process.
# `tag` says what a collective is for ("unit 3 (blocks.3)", "bucket 0"): the event stream carries
# it.
# --------------------------------------------------------------------------------------------------

class Joined:
    """One handle for several collectives in flight: wait() waits for each, then runs `finish` once
    (what is left to do locally when they are done: a copy out, a dequantization). `keep`: tensors
    the collectives read, held until they are done."""

    def __init__(self, handles: list, finish=None, keep=None):
        self.handles, self.finish, self.keep = handles, finish, keep

    def wait(self) -> bool:
        for handle in self.handles:
            handle.wait()
        if self.finish is not None:
            self.finish()
            self.finish = None                                    # wait() twice finishes once
        self.keep = None
        return True


class _Issued:
    """A collective's handle: wait() waits for the backend, then (with a network model) until the
    modelled ring has delivered it, then says so on the event stream, once."""

    def __init__(self, handle, seq: int, kind: str, tag: str, modeled):
        self.handle, self.seq, self.kind, self.tag, self.modeled = handle, seq, kind, tag, modeled
        self.done = False

    def wait(self) -> bool:
        if not self.done:
            if self.handle is not None:
                self.handle.wait()
            if self.modeled is not None:
                sleep_until(self.modeled[1])
            self.done = True
            events.emit("collective done", seq=self.seq, kind=self.kind, tag=self.tag)
        return True


_blocking = False          # synchronous(): every collective completes before it returns


@contextlib.contextmanager
def synchronous():
    """Inside the block every collective completes before the call returns, async_op or not
    (its handle is already done). For debugging and for stepping through a step phase by
    phase (lab/stepthrough.py): NCCL_BLOCKING_WAIT's idea. Values are the same; only the
    overlap is gone."""
    global _blocking
    previous, _blocking = _blocking, True
    try:
        yield
    finally:
        _blocking = previous


def _issue(kind: str, full: torch.Tensor, group: Group | None, tag: str, async_op: bool, run,
           local=None, sent: float | None = None):
    """Every collective passes here: tally the ring bytes of `kind` over `full` (its whole size),
    book it on the modelled network, tell the event stream, then run it (`run()`: the backend's
    async handle; with one rank `local()`, if anything, instead)."""
    global _seq
    n = group_size(group)
    if sent is None:
        sent = ring_bytes(kind, full.numel() * full.element_size(), n)
    modeled = _book(kind, kind, sent, n, group)
    _seq += 1
    events.emit("collective", kind=kind, tag=tag, group=group, numel=full.numel(), dtype=full.dtype,
                blocking=not async_op or _blocking,
                sent=sent, tensor=full, seq=_seq, modeled=modeled)
    if n == 1:
        if local is not None:
            local()
        handle = None
    else:
        handle = run()
    issued = _Issued(handle, _seq, kind, tag, modeled)
    if not async_op or _blocking:
        issued.wait()
    return issued if async_op else None


# [Note: collectives on gloo] The ring formulas above are what a bandwidth-optimal implementation
# sends, and NCCL's collectives are such rings. gloo's are not equally good: on the machine this
# project is developed on, gloo's reduce-scatter, half an all-reduce on paper, takes longer than its
# whole all-reduce, and its all-gather longer than broadcasting each rank's piece
# (docs/performance.md has the table and the command that measures it: python -m minizero.bench
# --collectives). So on gloo minizero runs reduce_scatter as an all-reduce of the input followed by
# a copy of this rank's part, and all_gather as one broadcast per rank: more bytes move, less time
# passes. The tally still books the collective the algorithm asks for, with its ring bytes: the
# papers' cost, and what NCCL sends. The price for callers: reduce_scatter's input is workspace, its
# contents afterwards undefined on every backend (every stage's input is a buffer it is done with).
# `backend_collectives()` turns this off.
_gloo_workarounds = True


@contextlib.contextmanager
def backend_collectives():
    """Inside the block reduce_scatter and all_gather run the backend's own collectives on gloo too
    ([Note: collectives on gloo]); the bench's --collectives times both ways."""
    global _gloo_workarounds
    previous, _gloo_workarounds = _gloo_workarounds, False
    try:
        yield
    finally:
        _gloo_workarounds = previous


def _on_gloo() -> bool:
    return _gloo_workarounds and backend() == "gloo"


def _copy_into(output: torch.Tensor, input: torch.Tensor):
    """One rank's collective: the output is the input (unless it already is)."""
    def local():
        if output.data_ptr() != input.data_ptr():
            output.copy_(input.view_as(output))
    return local


def all_reduce(
    tensor: torch.Tensor,
    op: str = "avg",
    async_op: bool = False,
    group: Group | None = None,
    tag: str = "",
):
    """In place: every rank ends with op(tensor over ranks). DDP's gradient averaging."""
    return _issue("all_reduce", tensor, group, tag, async_op,
                  lambda: dist.all_reduce(tensor, op=_OPS[op], async_op=True, group=_pg(group)))


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op: str = "avg",
    async_op: bool = False,
    group: Group | None = None,
    tag: str = "",
):
    """input [N * n] on every rank -> output [n] on rank r = op over ranks of input[r*n:(r+1)*n].

    `output` may be rank r's slice of `input` itself (in place): stage 1 uses that to average its
    own partition of the gradient without a second buffer. The rest of `input` is workspace:
    undefined after.
    """
    assert input.numel() == output.numel() * group_size(group), (
        "reduce_scatter: input must be N x output"
    )

    def run():
        if _on_gloo():                                    # [Note: collectives on gloo]
            mine = partition(input.view(-1), group_rank(group), group_size(group))       # [n]
            copy_out = _copy_into(output, mine) if output.data_ptr() != mine.data_ptr() else None
            return Joined(
                [dist.all_reduce(input, op=_OPS[op], async_op=True, group=_pg(group))], copy_out
            )
        return dist.reduce_scatter_single(
            output, input, op=_OPS[op], async_op=True, group=_pg(group)
        )
    return _issue("reduce_scatter", input, group, tag, async_op, run, _copy_into(output, input))


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    async_op: bool = False,
    group: Group | None = None,
    tag: str = "",
):
    """input [n] from every rank -> output [N * n] on every rank, rank r's input at
    output[r*n:(r+1)*n].

    `input` may be this rank's slice of `output` (in place), which is how ZeRO rebuilds
    full parameters.
    """
    n = group_size(group)
    assert output.numel() == input.numel() * n, "all_gather: output must be N x input"

    def run():
        if _on_gloo():                                    # [Note: collectives on gloo]
            pieces = [partition(output.view(-1), i, n) for i in range(n)]          # N x [n]
            _copy_into(pieces[group_rank(group)], input.view(-1))()
            ranks = range(n) if group is None else group.ranks
            return Joined([dist.broadcast(piece, src=src, async_op=True, group=_pg(group))
                           for piece, src in zip(pieces, ranks) if input.numel()])
        return dist.all_gather_single(output, input, async_op=True, group=_pg(group))
    return _issue("all_gather", output, group, tag, async_op, run, _copy_into(output, input))


def broadcast(
    tensor: torch.Tensor,
    src: int = 0,
    async_op: bool = False,
    group: Group | None = None,
    tag: str = "",
):
    """In place: every rank ends with rank `src`'s tensor (src: a global rank). Starts all
    replicas equal."""
    return _issue("broadcast", tensor, group, tag, async_op,
                  lambda: dist.broadcast(tensor, src=src, async_op=True, group=_pg(group)))


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    async_op: bool = False,
    group: Group | None = None,
    tag: str = "",
):
    """input [N * n] -> output [N * n]: chunk j of rank r's input lands as chunk r of rank
    j's output.

    A transpose of who-holds-what. Each rank keeps one chunk and sends N-1: (N-1)/N of the
    input. ZeRO++'s quantized gradient reduce-scatter (qgZ) uses it to send int8 chunks, summed
    by the receiver.
    """
    assert output.numel() == input.numel() and input.numel() % group_size(group) == 0, \
        "all_to_all: input and output must be the same N x n"
    return _issue("all_to_all", input, group, tag, async_op,
                  lambda: dist.all_to_all_single(output, input, async_op=True, group=_pg(group)),
                  _copy_into(output, input))


# --------------------------------------------------------------------------------------------------
# Routes: how one partition travels (ZeRO's variants as data, not as branches in the stages)
# --------------------------------------------------------------------------------------------------

class Exact:
    """The paper's codec: the values travel as they are stored."""

    def all_gather(self, output, input, group, tag):
        return all_gather(output, input, async_op=True, group=group, tag=tag)

    def reduce_scatter(self, output, input, group, tag):
        return reduce_scatter(output, input, op="avg", async_op=True, group=group, tag=tag)


EXACT = Exact()


@dataclasses.dataclass(frozen=True)
class Route:
    """Which ranks a partition's collective runs over (`group`, None: all N), in what codec (EXACT,
    or quantize.Int8Blocks: ZeRO++), and where its source lives (`home`: "device", or "host" with
    offload="params", ZeRO-Infinity: copied to the compute device first). Route() is the paper's
    ZeRO; HSDP, hpZ, parameter offload, qwZ and qgZ are other routes (zero2.py, zero3.py build
    them). Both methods start the collective and return its async handle."""
    group: Group | None = None
    codec: Exact = EXACT
    home: str = "device"

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: str = ""):
        if self.home == "host":                       # host -> device, explicit (also on a CPU run)
            input = input.to(device(), copy=True, non_blocking=True)
            return Joined([self.codec.all_gather(output, input, self.group, tag)], keep=input)
        return self.codec.all_gather(output, input, self.group, tag)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, tag: str = ""):
        return self.codec.reduce_scatter(output, input, self.group, tag)


# --------------------------------------------------------------------------------------------------
# Agreement: do all ranks hold the same number? (minizero/beyond/desync.py's check, before a
# collective)
# --------------------------------------------------------------------------------------------------

_agreement_group = None     # every rank, on gloo (CPU) whatever the backend; made by open_agreement


def open_agreement() -> None:
    """Make the process group that `agree` runs on. Collective (dist.new_group): every rank calls it
    at the same point, once (later calls do nothing)."""
    global _agreement_group
    if _agreement_group is None and world_size() > 1:
        _agreement_group = dist.new_group(backend="gloo",
                                          timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))


def agree(value: int) -> bool:
    """Whether every rank called agree() with the same `value` (an integer, |value| < 2**62).

    [Note: agreement] One all-reduce with MAX over [value, -value] (int64): every rank gets the
    largest value and minus the smallest, and all are equal exactly when largest == smallest.
    Integers, so nothing rounds; MAX, so every rank gets the same answer at the same call. It runs
    on a group of its own, on the CPU with gloo whatever the backend: on the training group it
    would queue behind every collective still in flight (and wait for them), and on NCCL reading
    its answer would wait for the GPU. Not tallied, not an event: it is not part of ZeRO's
    algorithm, and it is not a collective of the stream it checks. Blocks until every rank calls
    it (open_agreement first)."""
    return agree_later(value).wait()


class Agreement:
    """agree_later's answer, once every rank has given its value: wait() -> whether all agree."""

    def __init__(self, value: int, pair: torch.Tensor | None = None, work=None):
        self.value, self.pair, self.work = value, pair, work

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        return self.pair is None or int(self.pair[0]) == self.value == -int(self.pair[1])


def agree_later(value: int) -> Agreement:
    """agree() without waiting: the answer is read later, when every rank has long given its value
    (desync.py agrees so at the end of a backward, where waiting would cost a round trip a step)."""
    if world_size() == 1:
        return Agreement(value)
    pair = torch.tensor([value, -value], dtype=torch.int64)
    return Agreement(value, pair, dist.all_reduce(pair, op=dist.ReduceOp.MAX, async_op=True,
                                                  group=_agreement_group))


def all_gather_object(obj) -> list:
    """Every rank's `obj`, by rank. For reporting results under torchrun, not for training:
    not tallied."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


# --------------------------------------------------------------------------------------------------
# Teaching: a ring all-reduce built from point-to-point sends, equal to all_reduce(op="sum").
# --------------------------------------------------------------------------------------------------

def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over ranks in place with the ring algorithm, using only send/recv.

    The tensor is cut into N chunks. Ranks sit on a ring; each talks only to its two neighbours.

      Phase 1, reduce-scatter (N-1 steps): at step s, rank r sends chunk (r - s) to rank r+1 and
        adds the chunk (r - s - 1) it receives from rank r-1 into its own copy. After N-1 steps
        rank r holds the complete sum of chunk (r + 1).
      Phase 2, all-gather (N-1 steps): the same rotation, but the received chunk *replaces* the
        local one, so the finished sums travel once around the ring.

    Each rank sends 2(N-1) chunks of S/N bytes: 2(N-1)/N * S, independent of N for large N. That is
    why the ring is bandwidth-optimal and why the tally above uses it as the unit.
    """
    n, r = world_size(), rank()
    if n == 1:
        return tensor
    flat = tensor.reshape(-1)                                   # a view when contiguous
    chunk = -(-flat.numel() // n)                               # ceil(S / N)
    padded = torch.zeros(chunk * n, dtype=flat.dtype, device=flat.device)  # [N * chunk]
    padded[: flat.numel()].copy_(flat)
    chunks = padded.view(n, chunk)                              # chunks[i]: [chunk]
    incoming = torch.empty(chunk, dtype=flat.dtype, device=flat.device)
    right, left = (r + 1) % n, (r - 1) % n
    # tallied (and, with a network model, timed) as the 2(N-1) hops of chunk bytes it sends
    modeled = _book(
        "ring_all_reduce", "all_reduce", 2 * (n - 1) * chunk * flat.element_size(), n, None
    )

    def exchange(send_idx: int) -> None:
        # [N * chunk], before the exchange
        events.emit("ring exchange", buffer=padded, send=send_idx)
        # Post the send and the receive together so neither neighbour waits on the other
        # (no deadlock).
        ops = [
            dist.P2POp(dist.isend, chunks[send_idx], right),
            dist.P2POp(dist.irecv, incoming, left),
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    for s in range(n - 1):                                      # phase 1: reduce-scatter
        exchange((r - s) % n)
        chunks[(r - s - 1) % n] += incoming
    for s in range(n - 1):                                      # phase 2: all-gather
        exchange((r + 1 - s) % n)
        chunks[(r - s) % n].copy_(incoming)

    flat.copy_(padded[: flat.numel()])
    if flat.data_ptr() != tensor.data_ptr():                    # non-contiguous input: write back
        tensor.copy_(flat.view_as(tensor))
    if modeled is not None:
        sleep_until(modeled[1])
    return tensor
