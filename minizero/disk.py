"""ZeRO-Infinity's disk tier: each rank's optimizer state (fp32 masters, Adam's moments) lives in a file.

    python -m minizero.run --stage 3 --world-size 2 --dtype bf16 --offload disk --offload-path /tmp
    engine = minizero.wrap(model, 3, factory, dtype="bf16", offload="disk", offload_path="/tmp")
    python -m minizero.scale --infinity          # a 1.5B-parameter GPT on this 24 GB machine (lab/infinity.py)

DeepSpeed's `offload_optimizer: {"device": "nvme", "nvme_path": DIR}` (ZeRO-Infinity, Rajbhandari et
al. 2021). Of the paper's 2 + 2 + K bytes per parameter, memory keeps the 2 + 2 that compute needs (the
bf16 parameter and gradient shards, 4Ψ/N a rank at stage 3) and the KΨ/N of optimizer state (K = 12 for
mixed-precision Adam: fp32 master 4, two moments 4 + 4; fp32 training has no separate master, K = 8) go
to a file of this rank. It is what `step()` alone reads, and it reads it once a step, in order:

    read piece i+1  ──────────────┐           one I/O thread, first in first out: a piece is read
    step piece i on the host  ◄───┘           before its step and written after it, while the host
    write piece i-1  ─────────────            steps the piece between them

A *piece* is a run of the optimizer's cache-sized views ([Note: cache-sized views], optim.py) of one
bucket, about PIECE_NUMEL elements: its record in the file is [master | state 1 | state 2 ...], each
piece_numel fp32 values. So memory holds three pieces' records (3 × 12 · PIECE_NUMEL bytes for Adam,
~150 MB, DeepSpeed's pipeline_read / pipeline_write buffers) whatever the model's size, and a stage-1
bucket of the whole model is as fine as stage 3's units. The gradient of a piece is upcast to fp32 into
the optimizer's hands just before its step (no fp32 gradient partition is kept, unlike offload.py).

Bitwise what the in-memory optimizer computes: the same views, stepped by the same optimizer with the
same gradients, only not all in one optimizer.step() (a view without a gradient is not stepped; every
torch optimizer steps each parameter on its own values). Between steps the state's tensors are
*placeholders*: stride-0 views of one element, with the right shapes and no memory.

The file is scratch: opened with O_TMPFILE, it never has a name, so the kernel frees it when the
process ends, however it ends (also a rank killed mid-step): nothing to clean up, no stray files. It is
allocated in full when the engine is built (a full folder fails there, in one line), and read and
written with O_DIRECT where the file system has it (ext4, xfs; not tmpfs): the page cache would
otherwise keep a second copy of the state in memory and the bandwidth measured would be memory's.
Checkpoints are unchanged: saving reads the state into memory (state_dict, master_values), loading
holds it in memory until the next step writes it out (_spill).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from minizero.optim import OptimizerFactory, ShardOptimizer, _per_element

PIECE_NUMEL = 1 << 22        # elements per piece of the pipeline: 16 MiB of each fp32 field
ALIGN = 4096                 # O_DIRECT: buffer addresses, file offsets and lengths in whole blocks
IO_CHUNK = 64 << 20          # bytes per read/write call (Linux moves at most ~2 GiB per call)
_NOTHING = torch.zeros(1)    # what every placeholder is a view of


def check_folder(path) -> None:
    """Raise ValueError (one line) unless `path` is an existing folder this process can write in: wrap and
    the CLI call it before anything is built or started."""
    if path is None:
        raise ValueError("offload='disk' needs offload_path, the folder for the optimizer state's files")
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
    """nbytes of uint8 starting on an ALIGN boundary (O_DIRECT reads and writes into it)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip: skip + nbytes]


def per_element_state(optimizer_factory: OptimizerFactory) -> list[str]:
    """The names of the state the optimizer keeps one value of per element (AdamW: exp_avg, exp_avg_sq;
    SGD with momentum: momentum_buffer), found by stepping a throwaway copy on two elements."""
    probe = nn.Parameter(torch.zeros(2))
    probe.grad = torch.ones(2)
    optimizer = optimizer_factory([probe])
    optimizer.step()
    names = [name for name, value in optimizer.state[probe].items() if _per_element(value, probe)]
    odd = [name for name in names if optimizer.state[probe][name].dtype != torch.float32]
    if odd:
        raise ValueError(f"offload='disk' keeps fp32 optimizer state; this optimizer's {', '.join(odd)} "
                         f"is {optimizer.state[probe][odd[0]].dtype}")
    return names


class ScratchFile:
    """One rank's file of `nbytes` in `folder`, nameless (O_TMPFILE), allocated in full now; read and
    written at offsets, in IO_CHUNK calls that release the GIL (the pipeline's thread runs beside
    the step). Counts the bytes it moves and the seconds its calls take."""

    def __init__(self, folder, nbytes: int):
        check_folder(folder)
        flags = os.O_TMPFILE | os.O_RDWR
        try:
            self.fd, self.direct = os.open(folder, flags | os.O_DIRECT, 0o600), True
        except OSError as e:                            # tmpfs and a few others have no O_DIRECT
            if e.errno != errno.EINVAL:
                raise ValueError(f"offload_path {str(folder)!r}: cannot create a file ({e.strerror})") from None
            self.fd, self.direct = os.open(folder, flags, 0o600), False
        try:
            os.posix_fallocate(self.fd, 0, max(nbytes, 1))
        except OSError as e:
            os.close(self.fd)
            free = shutil.disk_usage(folder).free
            raise ValueError(f"offload_path {str(folder)!r}: no room for this rank's optimizer state "
                             f"({nbytes / 1e9:.2f} GB needed, {free / 1e9:.2f} GB free: {e.strerror})") from None
        self.nbytes = nbytes
        self.read_bytes = self.written_bytes = 0
        self.read_seconds = self.write_seconds = 0.0

    def read(self, buffer: torch.Tensor, offset: int) -> torch.Tensor:
        """Fill `buffer` (uint8, aligned) from the file at `offset`; returns it."""
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
                raise OSError(errno.EIO, f"the optimizer state's file moved {moved} bytes at {offset + done}")
            done += moved

    def allocated(self) -> int:
        """Bytes the file takes on disk."""
        return os.fstat(self.fd).st_blocks * 512

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)                          # nameless: the kernel frees its blocks now
            self.fd = -1


class DiskShardOptimizer(ShardOptimizer):
    """A ShardOptimizer whose master weights (when separate from the parameters) and per-element state
    live in a ScratchFile of `folder`, stepped piece by piece through a read/step/write pipeline."""
    piece_numel = PIECE_NUMEL

    def __init__(self, param_parts: list[torch.Tensor], optimizer_factory: OptimizerFactory, folder):
        self.names = per_element_state(optimizer_factory)
        # fp32 parameters are their own master (optim.py): only the state goes to disk then
        self.own_master = param_parts[0].dtype != torch.float32
        self.resident = False            # the state is in memory (after load_state_dict) until _spill
        super().__init__(param_parts, optimizer_factory)
        self.pieces = self._cut_pieces()
        self.file = ScratchFile(folder, sum(p["bytes"] for p in self.pieces))
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minizero-disk")
        for piece, slot in self._each_piece(read=False):     # the masters start as the parameters
            slot.zero_()
            if self.own_master:
                self._field(piece, slot, 0).copy_(self._part(piece))

    def _make_master(self, part: torch.Tensor) -> nn.Parameter:
        if not self.own_master:
            return super()._make_master(part)
        return nn.Parameter(placeholder(part.numel()))  # its values are written to disk by __init__

    @property
    def fields(self) -> int:
        """fp32 values per element in the file: the master (if separate) and each per-element state."""
        return int(self.own_master) + len(self.names)

    def _cut_pieces(self) -> list[dict]:
        """Runs of whole views of one bucket, ~piece_numel elements each, and their records' offsets."""
        pieces, offset = [], 0
        for b, views in enumerate(self.views):
            start, first = 0, 0
            for j, view in enumerate(views):
                end = start + view.numel() if j == first else end + view.numel()
                if end - start >= self.piece_numel or j == len(views) - 1:
                    numel = end - start
                    nbytes = aligned(self.fields * numel * 4)
                    pieces.append({"bucket": b, "views": range(first, j + 1), "start": start,
                                   "numel": numel, "offset": offset, "bytes": nbytes})
                    offset += nbytes
                    start, first = end, j + 1
        return pieces

    # --- one piece's record, in a slot of memory ---------------------------------------------------
    @staticmethod
    def _field(piece: dict, slot: torch.Tensor, f: int) -> torch.Tensor:
        """The slot's fp32 values of field f (0: the master, if separate) for the piece: [numel]."""
        n = piece["numel"]
        return slot.view(torch.float32)[f * n: (f + 1) * n]

    def _fields_of(self, piece: dict, slot: torch.Tensor) -> list[list[torch.Tensor]]:
        """[field][view]: _field cut into the piece's views."""
        sizes = [self.views[piece["bucket"]][j].numel() for j in piece["views"]]
        return [list(self._field(piece, slot, f).split(sizes)) for f in range(self.fields)]

    def _part(self, piece: dict) -> torch.Tensor:
        """The model's parameters the piece holds the master of: [numel], compute dtype."""
        return self.param_parts[piece["bucket"]][piece["start"]:][: piece["numel"]]

    def _attach(self, piece: dict, slot: torch.Tensor) -> None:
        """Point the piece's views (masters) and their state at the slot's values."""
        fields = self._fields_of(piece, slot)
        for i, j in enumerate(piece["views"]):
            view = self.views[piece["bucket"]][j]
            if self.own_master:
                view.data = fields[0][i]
            state = self.optimizer.state[view]
            for name, values in zip(self.names, fields[self.own_master:]):
                if name in state:                       # absent until the view's first step
                    state[name] = values[i]

    def _detach(self, piece: dict, slot: torch.Tensor) -> None:
        """The inverse of _attach: what the optimizer holds goes into the slot (its first step created
        new tensors), and the views and their state become placeholders again."""
        fields = self._fields_of(piece, slot)
        for i, j in enumerate(piece["views"]):
            view = self.views[piece["bucket"]][j]
            if self.own_master:
                if view.data_ptr() != fields[0][i].data_ptr():
                    fields[0][i].copy_(view.detach())
                view.data = placeholder(view.shape)
            state = self.optimizer.state[view]
            for name, values in zip(self.names, fields[self.own_master:]):
                if name in state:
                    if state[name].data_ptr() != values[i].data_ptr():
                        values[i].copy_(state[name])
                    state[name] = placeholder(view.shape)

    def _each_piece(self, read: bool = True, write: bool = True):
        """Yield (piece, slot) for every piece in file order, the slot holding its record (read=True); what
        the caller leaves in the slot is written back (write=True). One I/O thread reads a piece ahead and
        writes behind, into three slots in turn: piece i+1 goes into the slot of piece i-2, once that
        piece's write is done, while piece i is stepped in its own slot and piece i-1 is written."""
        if not self.pieces:
            return
        slots = [aligned_buffer(max(p["bytes"] for p in self.pieces)) for _ in range(min(3, len(self.pieces)))]
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

    # --- the step ----------------------------------------------------------------------------------
    def step(self, grad_parts: list[torch.Tensor]) -> None:
        self._spill()                                 # a checkpoint just loaded: to the file first
        for piece, slot in self._each_piece():
            self._attach(piece, slot)
            views = [self.views[piece["bucket"]][j] for j in piece["views"]]
            grad = grad_parts[piece["bucket"]][piece["start"]:][: piece["numel"]].float()   # this piece only
            for view, g in zip(views, grad.split([v.numel() for v in views])):
                view.grad = g
            self.optimizer.step()                     # only views with a gradient (this piece's) move
            for view in views:
                view.grad = None
            if self.own_master:                       # fp32 master -> the parameters (bf16: rounds)
                self._part(piece).copy_(self._field(piece, slot, 0))
            self._detach(piece, slot)

    def _grads_to_views(self) -> None:
        pass                 # step() hands each piece's views their gradients itself

    # --- the whole state in memory: checkpoints, reload --------------------------------------------
    def _load(self) -> None:
        """Read the whole state into memory (the masters and every view's state as ordinary tensors)."""
        if self.resident:
            return
        for b, master in enumerate(self.masters):
            if self.own_master:
                master.data = torch.empty(master.numel())
                for view, values in zip(self.views[b], master.data.tensor_split(len(self.views[b]))):
                    view.data = values
        for piece, slot in self._each_piece(write=False):
            fields = self._fields_of(piece, slot)
            for i, j in enumerate(piece["views"]):
                view = self.views[piece["bucket"]][j]
                if self.own_master:
                    view.data.copy_(fields[0][i])
                state = self.optimizer.state[view]
                for name, values in zip(self.names, fields[self.own_master:]):
                    if name in state:
                        state[name] = values[i].clone()
        self.resident = True

    def _spill(self) -> None:
        """Write what is in memory (after _load or load_state_dict) to the file and drop it."""
        if not self.resident:
            return
        for piece, slot in self._each_piece(read=False):
            slot.zero_()                              # state a view has not created yet reads as zeros
            self._detach(piece, slot)
        for master in self.masters:
            if self.own_master:
                master.data = placeholder(master.numel())
        self.resident = False

    @contextlib.contextmanager
    def _in_memory(self, changes: bool):
        """The whole state as ordinary tensors inside the block; written back after it if `changes`."""
        was = self.resident
        self._load()
        try:
            yield
        finally:
            if changes:
                self._spill()
            elif not was:
                self._drop()

    def _drop(self) -> None:
        """Back to placeholders without writing (what is in memory equals the file)."""
        for b, master in enumerate(self.masters):
            for view in self.views[b]:
                if self.own_master:
                    view.data = placeholder(view.shape)
                state = self.optimizer.state[view]
                for name in self.names:
                    if name in state:
                        state[name] = placeholder(view.shape)
            if self.own_master:
                master.data = placeholder(master.numel())
        self.resident = False

    def state_dict(self) -> dict:
        with self._in_memory(changes=False):
            return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Into memory (checkpoint.py then writes the masters into self.masters); the next step writes
        it to the file."""
        self._load()
        super().load_state_dict(state_dict)

    def master_values(self) -> list[torch.Tensor]:
        with self._in_memory(changes=False):
            return super().master_values()       # detached: they keep the memory once placeholders return

    def reload(self) -> None:
        with self._in_memory(changes=True):
            super().reload()

    # --- accounting --------------------------------------------------------------------------------
    def device_tensors(self) -> list[torch.Tensor]:
        return []

    def host_tensors(self) -> list[torch.Tensor]:
        return self.state_tensors()               # between steps: Adam's step counters, placeholders

    def disk_bytes(self) -> int:
        return self.file.allocated()

    def close(self) -> None:
        self.io.shutdown()
        self.file.close()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()
