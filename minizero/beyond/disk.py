"""ZeRO-Infinity's disk tier: each rank's optimizer state (fp32 masters, Adam's moments) in a file.

    python -m minizero.run --stage 3 --dtype bf16 --offload disk --offload-path /tmp
    engine = minizero.wrap(model, 3, factory, dtype="bf16", offload="disk", offload_path="/tmp")
    python -m minizero.scale --infinity     # a 1.5B-parameter GPT in 24 GB (lab/infinity.py)

DeepSpeed's `offload_optimizer: {"device": "nvme", "nvme_path": DIR}` (ZeRO-Infinity, Rajbhandari
et al. 2021). Of the paper's 2 + 2 + K bytes per parameter, memory keeps the 2 + 2 that compute
needs (the bf16 parameter and gradient shards: 4Ψ/N a rank at stage 3), and the KΨ/N of optimizer
state (K = 12 for mixed-precision Adam: fp32 master 4, two moments 4 + 4; fp32 training has no
separate master, K = 8) live in a file of this rank. Only `step()` uses them, once a step, in order:

    read piece i+1   ─────┐       one I/O thread, first in first out: each piece is read before
    step piece i  ◄───────┘       its step and written after it, while the host steps the piece
    write piece i-1               between the two

A *piece* is a run of the optimizer's cache-sized views ([Note: cache-sized views], optim.py) of
one bucket, about PIECE_NUMEL elements. Its record in the file is [master | state 1 | state 2 ...],
each piece_numel fp32 values. Memory holds three records (3 × 12 · PIECE_NUMEL bytes for Adam,
~150 MB: DeepSpeed's pipeline_read / pipeline_write buffers) whatever the model's size, so stage
1's single bucket is cut as finely as stage 3's units. A piece's gradient is upcast to fp32 just
before its step: no fp32 gradient partition is kept (offload.py keeps one).

Bitwise what the in-memory optimizer computes: the same views, stepped by the same optimizer with
the same gradients, only not all in one optimizer.step(): a view without a gradient is skipped,
and torch's optimizers step each parameter on its own values. Between steps the views (when they
are the masters) and their per-element state are *placeholders*: stride-0 views of one element,
of the right shapes, holding no memory; a step points them at a record's values (_attach).

The file is scratch, opened with O_TMPFILE: it never has a name, so the kernel frees it when the
process ends, however it ends (a rank killed mid-step too): no stray files, nothing to clean up on
the next run. It is allocated in full when the engine is built (a full disk fails there, in one
line), and moved with O_DIRECT where the file system has it (ext4, xfs; not tmpfs): the page cache
would otherwise hold a second copy of the state in memory, and the bandwidth measured would be
memory's. Checkpoints are unchanged: saving reads the state into memory (state_dict,
master_values); loading keeps it there (`resident`) until the next step writes it out.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from minizero.homes import BucketState, _per_element
from minizero.optim import OptimizerFactory, Placement, ShardOptimizer
from minizero.param_groups import Grouping

PIECE_NUMEL = 1 << 22       # elements a piece of the pipeline: 16 MiB of each fp32 field
ALIGN = 4096                # O_DIRECT: buffer addresses, file offsets and lengths in whole blocks
IO_CHUNK = 64 << 20         # bytes a read/write call (Linux moves at most ~2 GiB in one)
_NOTHING = torch.zeros(1)   # what every placeholder is a view of


def check_folder(path) -> None:
    """Raise ValueError (one line) unless `path` is an existing folder this process can write in:
    the engine checks it before anything is built, the CLI before any process starts."""
    if path is None:
        raise ValueError("offload='disk' needs offload_path, the folder of the optimizer state")
    if not os.path.isdir(path):
        raise ValueError(f"offload_path {str(path)!r} is not an existing folder")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"offload_path {str(path)!r} is not writable")


def placeholder(shape) -> torch.Tensor:
    """A tensor of `shape` that holds no memory (stride 0); writing into it raises."""
    return _NOTHING.expand(shape)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """nbytes of uint8 starting on an ALIGN boundary (what O_DIRECT reads into and writes from)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip: skip + nbytes]


def per_element_state(optimizer_factory: OptimizerFactory,
                      grouping: Grouping | None = None) -> list[str]:
    """The names of the state the optimizer keeps one value of per element (AdamW: exp_avg and
    exp_avg_sq; SGD with momentum: momentum_buffer), found by stepping a throwaway copy of it on
    two elements (with each parameter group's settings: amsgrad in one adds a state)."""
    probe = nn.Parameter(torch.zeros(2))
    probe.grad = torch.ones(2)
    names, state = [], {}
    for settings in [None] if grouping is None else grouping.settings:
        optimizer = optimizer_factory([probe] if settings is None
                                      else [{**settings, "params": [probe]}])
        optimizer.step()
        state.update(optimizer.state[probe])
        names += [name for name, value in optimizer.state[probe].items()
                  if _per_element(value, probe) and name not in names]
    odd = [name for name in names if state[name].dtype != torch.float32]
    if odd:
        raise ValueError(f"offload='disk' keeps fp32 optimizer state; this optimizer's {odd[0]} "
                         f"is {state[odd[0]].dtype}")
    return names


class ScratchFile:
    """One rank's file of `nbytes` in `folder`: nameless (O_TMPFILE), allocated in full now, read
    and written at offsets in IO_CHUNK calls that release the GIL (so the pipeline's thread moves
    data while the step computes). Counts the bytes it moves and the seconds its calls take."""

    def __init__(self, folder, nbytes: int):
        check_folder(folder)
        flags = os.O_TMPFILE | os.O_RDWR
        try:
            self.fd, self.direct = os.open(folder, flags | os.O_DIRECT, 0o600), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise ValueError(f"offload_path {str(folder)!r}: cannot create a file "
                                 f"({e.strerror})") from None
            self.fd, self.direct = os.open(folder, flags, 0o600), False   # tmpfs: no O_DIRECT
        self.close = weakref.finalize(self, os.close, self.fd)   # closed: the blocks are freed
        try:
            os.posix_fallocate(self.fd, 0, max(nbytes, 1))
        except OSError as e:
            self.close()
            free = shutil.disk_usage(folder).free
            raise ValueError(f"offload_path {str(folder)!r}: no room for this rank's optimizer "
                             f"state ({nbytes / 1e9:.2f} GB needed, {free / 1e9:.2f} GB free: "
                             f"{e.strerror})") from None
        self.nbytes = nbytes
        self.read_bytes = self.written_bytes = 0
        self.read_seconds = self.write_seconds = 0.0

    def read(self, buffer: torch.Tensor, offset: int) -> torch.Tensor:
        """Fill `buffer` (uint8, ALIGN-ed) from the file at `offset`; returns it."""
        start = time.perf_counter()
        self._each_chunk(buffer, offset, os.preadv)
        self.read_seconds += time.perf_counter() - start
        self.read_bytes += buffer.numel()
        return buffer

    def write(self, buffer: torch.Tensor, offset: int) -> None:
        start = time.perf_counter()
        self._each_chunk(buffer, offset, os.pwritev)
        self.write_seconds += time.perf_counter() - start
        self.written_bytes += buffer.numel()

    def _each_chunk(self, buffer: torch.Tensor, offset: int, call) -> None:
        view = memoryview(buffer.numpy())
        done = 0
        while done < len(view):
            moved = call(self.fd, [view[done: done + IO_CHUNK]], offset + done)
            if moved <= 0:
                raise OSError(errno.EIO, f"the optimizer state's file: {moved} bytes moved at "
                                         f"{offset + done}")
            done += moved

    def allocated(self) -> int:
        """Bytes the file takes on disk."""
        return os.fstat(self.fd).st_blocks * 512


class DiskShardOptimizer(BucketState, ShardOptimizer):
    """A ShardOptimizer whose masters (when separate from the parameters) and per-element state live
    in a ScratchFile of `folder`, stepped piece by piece through a read / step / write pipeline."""
    piece_numel = PIECE_NUMEL

    def __init__(self, param_parts: list[torch.Tensor], optimizer_factory: OptimizerFactory,
                 grouping: Grouping | None = None, placement: Placement | None = None, *,
                 folder):
        self.names = per_element_state(optimizer_factory, grouping)
        # fp32 parameters in host memory are their own master (optim.py): then only the state goes
        # to disk. A GPU's are not: the host steps a master of its own (test_cuda's disk runs)
        part = param_parts[0]
        self.own_master = part.dtype != torch.float32 or part.device.type != "cpu"
        self.resident = False           # the whole state is in memory (a checkpoint loaded)
        masters = ([nn.Parameter(placeholder(p.numel())) for p in param_parts]  # values: below
                   if self.own_master else None)
        super().__init__(param_parts, optimizer_factory, grouping, placement, masters=masters)
        self.pieces = self._cut_pieces()
        self.file = ScratchFile(folder, sum(p["bytes"] for p in self.pieces))
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minizero-disk")
        weakref.finalize(self, self.io.shutdown, wait=False)
        for piece, slot in self._each_piece(read=False):    # the masters start as the parameters
            slot.zero_()
            if self.own_master:
                self._field(piece, slot, 0).copy_(self._part(piece))

    @property
    def fields(self) -> int:
        """fp32 values per element in the file: the master (if separate), each per-element state."""
        return int(self.own_master) + len(self.names)

    def _cut_pieces(self) -> list[dict]:
        """Runs of whole views of one bucket, ~piece_numel elements each, and their records."""
        pieces, offset = [], 0
        for b, views in enumerate(self.views):
            first, start, numel = 0, 0, 0
            for j, view in enumerate(views):
                numel += view.numel()
                if numel >= self.piece_numel or j == len(views) - 1:
                    nbytes = aligned(self.fields * numel * 4)
                    pieces.append({"bucket": b, "views": range(first, j + 1), "start": start,
                                   "numel": numel, "offset": offset, "bytes": nbytes})
                    offset += nbytes
                    first, start, numel = j + 1, start + numel, 0
        return pieces

    # --- a piece's record, in a slot of memory -----------------------------------------------
    @staticmethod
    def _field(piece: dict, slot: torch.Tensor, f: int) -> torch.Tensor:
        """The slot's fp32 values of field f (0: the master, if separate) for the piece: [numel]."""
        n = piece["numel"]
        return slot.view(torch.float32)[f * n: (f + 1) * n]

    def _by_view(self, piece: dict, slot: torch.Tensor):
        """(view, its state, [its values in each field]) for each view of the piece."""
        views = [self.views[piece["bucket"]][j] for j in piece["views"]]
        sizes = [v.numel() for v in views]
        fields = [self._field(piece, slot, f).split(sizes) for f in range(self.fields)]
        for i, view in enumerate(views):
            yield view, self._state(view), [values[i] for values in fields]

    def _part(self, piece: dict) -> torch.Tensor:
        """The model's parameters whose master the piece holds: [numel], in the compute dtype."""
        return self.param_parts[piece["bucket"]][piece["start"]:][: piece["numel"]]

    def _attach(self, piece: dict, slot: torch.Tensor) -> None:
        """Point the piece's views (when they are the masters) and their state at the slot."""
        for view, state, values in self._by_view(piece, slot):
            if self.own_master:
                view.data = values[0]
            for name, value in zip(self.names, values[self.own_master:]):
                if name in state:                       # absent until the view's first step
                    state[name] = value

    def _detach(self, piece: dict, slot: torch.Tensor | None) -> None:
        """The inverse of _attach: what the optimizer holds goes into the slot (a first step made
        new tensors; slot None: nothing is kept); then the views and state are placeholders."""
        if slot is not None:
            for view, state, values in self._by_view(piece, slot):
                held = [view.detach()] if self.own_master else []
                for value, now in zip(values, held + [state.get(name) for name in self.names]):
                    if now is not None and now.data_ptr() != value.data_ptr():
                        value.copy_(now)
        for j in piece["views"]:
            view = self.views[piece["bucket"]][j]
            if self.own_master:
                view.data = placeholder(view.shape)
            state = self._state(view)
            for name in self.names:
                if name in state:
                    state[name] = placeholder(view.shape)

    def _each_piece(self, read: bool = True, write: bool = True):
        """Yield (piece, slot) for every piece in file order, the slot holding its record
        (read=True); what the caller leaves in the slot is written back (write=True). One I/O
        thread reads a piece ahead and writes behind, into three slots in turn: piece i+1 lands in
        the slot of piece i-2 once that one is written, while piece i is stepped in its own slot
        and piece i-1 is written from its."""
        if not self.pieces:
            return
        size = max(p["bytes"] for p in self.pieces)
        slots = [aligned_buffer(size) for _ in range(min(3, len(self.pieces)))]
        writes = []

        def fetch(i):
            if write and i >= len(slots):
                writes[i - len(slots)].result()         # the slot's last record is on disk
            slot = slots[i % len(slots)][: self.pieces[i]["bytes"]]
            return self.io.submit(self.file.read, slot, self.pieces[i]["offset"]) if read else slot
        pending = fetch(0)
        for i, piece in enumerate(self.pieces):
            slot = pending.result() if read else pending
            if i + 1 < len(self.pieces):
                pending = fetch(i + 1)
            yield piece, slot
            if write:
                writes.append(self.io.submit(self.file.write, slot, piece["offset"]))
        for w in writes:
            w.result()

    # --- the step ------------------------------------------------------------------------------
    def step(self, grad_parts: list[torch.Tensor]) -> None:
        self._release(write=True)                     # a checkpoint was loaded: to the file first
        for piece, slot in self._each_piece():
            self._attach(piece, slot)
            views = [self.views[piece["bucket"]][j] for j in piece["views"]]
            grad = grad_parts[piece["bucket"]][piece["start"]:][: piece["numel"]]
            grad = grad.to("cpu", torch.float32)     # a GPU's gradients: to the host, as offload.py
            for view, g in zip(views, grad.split([v.numel() for v in views])):
                view.grad = g
            self.optimizer.step()                 # only views with a gradient (this piece's) move
            for view in views:
                view.grad = None
            if self.own_master:                       # fp32 master -> the parameters (bf16: rounds)
                self._part(piece).copy_(self._field(piece, slot, 0))
            self._detach(piece, slot)

    def _grads_to_views(self) -> None:
        pass                                          # step() hands each piece's views their grads

    # --- the whole state in memory: checkpoints, reload ----------------------------------------
    def _load(self) -> None:
        """Read the whole state into memory: masters and each view's state as ordinary tensors."""
        if self.resident:
            return
        for master, views, sizes in zip(self.masters, self.views, self._sizes):
            if self.own_master:
                master.data = torch.empty(master.numel())
                for view, values in zip(views, master.data.split(sizes)):
                    view.data = values
        for piece, slot in self._each_piece(write=False):
            for view, state, values in self._by_view(piece, slot):
                if self.own_master:
                    view.data.copy_(values[0])
                for name, value in zip(self.names, values[self.own_master:]):
                    if name in state:
                        state[name] = value.clone()
        self.resident = True

    def _release(self, write: bool) -> None:
        """Back from _load (or load_state_dict): write the state to the file first if `write`, then
        the placeholders again."""
        if not self.resident:
            return
        pieces = self._each_piece(read=False) if write else ((p, None) for p in self.pieces)
        for piece, slot in pieces:
            if slot is not None:
                slot.zero_()                          # state a view has not created yet: zeros
            self._detach(piece, slot)
        if self.own_master:
            for master in self.masters:
                master.data = placeholder(master.numel())
        self.resident = False

    @contextlib.contextmanager
    def _in_memory(self, write: bool):
        """The whole state as ordinary tensors inside the block; written back after it if `write`,
        else dropped (unless it was in memory before)."""
        was = self.resident
        self._load()
        try:
            yield
        finally:
            if write or not was:
                self._release(write)

    def state_dict(self) -> dict:
        with self._in_memory(write=False):
            return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Into memory (checkpoint.py then copies the masters into self.masters); the next step
        writes it all to the file."""
        self._load()
        super().load_state_dict(state_dict)

    def master_values(self) -> list[torch.Tensor]:
        with self._in_memory(write=False):
            return super().master_values()     # detached: they keep their memory after the block

    def reload(self) -> None:
        with self._in_memory(write=True):
            super().reload()

    # --- accounting ----------------------------------------------------------------------------
    def device_tensors(self) -> list[torch.Tensor]:
        return []

    def host_tensors(self) -> list[torch.Tensor]:
        return self.state_tensors()       # between steps: Adam's step counters and placeholders

    def disk_bytes(self) -> int:
        return self.file.allocated()
