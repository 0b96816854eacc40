"""One parameter under `minizero.fully_shard`: its dim-0 shard as the module's own parameter (a
DTensor), and the whole parameter it is rebuilt into while its unit is gathered (FSDP2's FSDPParam).

    python -m pytest tests/test_fully_shard.py

[Note: dim-0 shards] The second layout, beside flat.py's. The flat layout lays every parameter of a
bucket end to end and cuts the line into N equal pieces at any element: a piece may start in the
middle of one matrix and end in another. Here each parameter is cut on its own, along its first
dimension, into N pieces of `chunk` = ceil(d0 / N) rows (torch.chunk's rule, which DTensor's
Shard(0) uses too):

    pos_emb [17, 14] at N = 2:  rank 0 rows 0-8 (9)   rank 1 rows 9-16 (8) + 1 padding row
                     at N = 3:  rank 0 rows 0-5 (6)   rank 1 rows 6-11 (6)  rank 2 rows 12-16 + 1
                     at N = 4:  5 rows each, rank 3 holds 2 rows + 3 padding rows

Every rank stores `padded` [chunk, *rest], its rows and then zeros: the all-gather needs the same
count from every rank, and N·chunk rows come back, of which the first d0 are the parameter. So a
rank holds chunk·row elements of every parameter (row: the elements of one row, d0 of them make the
parameter): Σ ceil(d0/N)·row in all, at most N - 1 rows per parameter more than Ψ/N (flat.py pads
a whole bucket once, at most N - 1 elements). What the module registers between steps is
`sharded`, a DTensor (placements Shard(0), or (Replicate(), Shard(0)) on HSDP's 2-D mesh) whose
local tensor is the unpadded rows, a view into `padded`: what the optimizer steps, what
clip_grad_norm_, state_dict() and torch.distributed.checkpoint read, and what .full_tensor() turns
into the whole parameter. So the optimizer's state is unpadded (rank 3 above keeps 2 rows of Adam
moments, rank 0 five) while parameters and gradients are padded.

While its unit is gathered, the module registers `unsharded` instead: a plain Parameter viewing
`full` [N·chunk·row], which the unit fills from every rank's `padded` (fsdp_unit.py). Autograd saves
it for backward, so it is made once and only its storage comes and goes (resize to 0 bytes and
back), and it is written through `.data`, which leaves autograd's version counter alone: the same
object holds the parameter again when backward needs it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def padded_rows(d0: int, n: int) -> int:
    """chunk: the rows of every rank's padded shard of a parameter with d0 rows, over n ranks."""
    return -(-d0 // n)


def shard_rows(d0: int, n: int, rank: int) -> int:
    """The rows of the parameter that rank `rank` of n holds (without padding)."""
    chunk = padded_rows(d0, n)
    return max(0, min(chunk, d0 - rank * chunk))


class ShardedParam:
    """One parameter's shard (`padded`, `sharded`), its gathered whole (`full`, `unsharded`) and
    its gradient on the way to the shard. places: every (module, name) it is registered under (a
    tied weight: several), all switched together."""

    def __init__(self, param: nn.Parameter, places: list[tuple[nn.Module, str]], mesh, placements,
                 rank: int, size: int, home: torch.device, pin: bool):
        self.places, self.mesh, self.placements = places, mesh, tuple(placements)
        self.shape = param.shape
        self.row = param[0].numel()                              # elements in one row of dim 0
        self.chunk = padded_rows(self.shape[0], size)            # rows of every rank's shard
        self.rows = shard_rows(self.shape[0], size, rank)        # of them, the parameter's
        start = rank * self.chunk
        meta = param.is_meta                  # built on the meta device: materialized later
        self.padded = torch.zeros((self.chunk, *self.shape[1:]), dtype=param.dtype,
                                  device="meta" if meta else home,
                                  pin_memory=pin and not meta)   # [chunk, *rest]
        with torch.no_grad():
            self.padded[:self.rows].copy_(param[start:start + self.rows])
        local = self.padded[:self.rows]                          # [rows, *rest], what trains
        self.sharded = nn.Parameter(self._dtensor(local), requires_grad=param.requires_grad)
        self.full: torch.Tensor | None = None          # [N·chunk·row] while gathered, else 0 bytes
        self.unsharded: nn.Parameter | None = None     # [d0, *rest], a view of full
        self.accumulated: torch.Tensor | None = None   # its gradient summed in reduce_dtype while
        # gradient sync is off (set_requires_gradient_sync(False)) and reduce_dtype is wider
        self.sharded._minizero_shard = self              # fully_shard() skips what a unit holds

    def _dtensor(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                  shape=self.shape, stride=_contiguous_strides(self.shape))

    @property
    def dtype(self) -> torch.dtype:
        return self.sharded.dtype

    @property
    def requires_grad(self) -> bool:
        """As the module's parameter says now (the shard, or the whole one while gathered)."""
        return self.places[0][0]._parameters[self.places[0][1]].requires_grad

    def local(self) -> torch.Tensor:
        """The rows the optimizer steps: the registered DTensor's local tensor (a view of it)."""
        with torch.no_grad():
            return self.sharded.to_local()

    def sync_registered(self) -> None:
        """Adopt a DTensor the user registered in its place (load_state_dict(assign=True))."""
        current = self.places[0][0]._parameters[self.places[0][1]]
        if current is not self.sharded and current is not self.unsharded \
                and isinstance(current, DTensor):
            self.sharded = current
            current._minizero_shard = self

    def copy_shard_into(self, row: torch.Tensor) -> None:
        """Write this rank's padded shard into `row` [chunk·row] of the all-gather's buffer: the
        copy-in, casting to its dtype and moving to its device (CPUOffloadPolicy's host-to-device
        copy). From `padded` while the local tensor is its view (the optimizer steps it in place);
        from whatever replaced it otherwise (model.to_empty(), load_state_dict(assign=True)),
        padded with zeros here."""
        self.sync_registered()
        local = self.local()
        if local.is_meta:
            raise RuntimeError(f"fully_shard: a parameter of shape {tuple(self.shape)} is still "
                               "on the meta device: materialize it first (model.to_empty(device="
                               "...) and initialise it, or load_state_dict(..., assign=True))")
        if self.padded is not None and \
                local.untyped_storage().data_ptr() != self.padded.untyped_storage().data_ptr():
            self.padded = None                 # replaced: its storage is the user's now
        with torch.no_grad():
            if self.padded is not None:
                row.copy_(self.padded.view(-1), non_blocking=True)
            else:
                row[:local.numel()].copy_(local.reshape(-1), non_blocking=True)
                row[local.numel():].zero_()

    # --- the gathered whole: allocated while the unit is gathered, 0 bytes otherwise -------------
    def allocate(self, dtype: torch.dtype, device: torch.device, size: int) -> None:
        """Give `full` its storage ([N·chunk·row] of dtype) and make `unsharded` (once)."""
        numel = size * self.chunk * self.row
        if self.full is None or self.full.dtype != dtype or self.full.device != device:
            self.full = torch.empty(numel, dtype=dtype, device=device)
            view = self.full[:self.shape.numel()].view(self.shape)
            self.unsharded = nn.Parameter(view, requires_grad=self.requires_grad)
            self.unsharded._minizero_shard = self
        _resize(self.full, numel * self.full.element_size())

    def release(self) -> None:
        """Free `full` (0 bytes; `unsharded` keeps its shape, and autograd its saved references)."""
        if self.full is not None:
            _resize(self.full, 0)

    def full_bytes(self) -> int:
        """What `full` takes while allocated (it is allocated whole or not at all)."""
        return 0 if self.full is None else self.full.numel() * self.full.element_size()

    def register(self, gathered: bool) -> None:
        """The module's parameter: `unsharded` while gathered, `sharded` otherwise. It takes the
        requires_grad of the one it replaces: the user sets it on whichever the module holds."""
        param = self.unsharded if gathered else self.sharded
        current = self.places[0][0]._parameters[self.places[0][1]]
        if param.requires_grad != current.requires_grad:
            param.requires_grad_(current.requires_grad)
        for module, name in self.places:
            module._parameters[name] = param

    # --- its gradient: the whole one autograd made, then this rank's rows of the average --------
    def take_grad(self) -> torch.Tensor | None:
        """The whole gradient of this backward (plus what accumulated without sync) [d0, *rest];
        None if it got none. Leaves `unsharded` without one."""
        grad = self.unsharded.grad if self.unsharded is not None else None
        if self.accumulated is not None:
            grad = self.accumulated if grad is None else self.accumulated.add_(grad)
            self.accumulated = None
        if grad is not None:
            self.unsharded.grad = None
        return grad

    def copy_grad_into(self, columns: torch.Tensor, grad: torch.Tensor) -> None:
        """Lay the whole gradient out by rank into the reduce-scatter's buffer: `columns` [N,
        chunk·row] is this parameter's part of it, rank r's row its rows r·chunk.. (zeros past
        d0: the padding); casting to the reduce dtype."""
        flat, width = grad.reshape(-1), columns.shape[1]
        full_rows = flat.numel() // width                      # ranks whose rows are all real
        columns[:full_rows].copy_(flat[:full_rows * width].view(full_rows, width))
        if full_rows < columns.shape[0]:
            rest = flat.numel() - full_rows * width
            columns[full_rows, :rest].copy_(flat[full_rows * width:])
            columns[full_rows, rest:].zero_()
            columns[full_rows + 1:].zero_()

    def accumulate(self, dtype: torch.dtype) -> None:
        """set_requires_gradient_sync(False): keep this backward's gradient for the next one, in
        `dtype` when that is wider than autograd's (bf16 compute, fp32 reduce_dtype)."""
        grad = self.unsharded.grad if self.unsharded is not None else None
        if grad is None or (grad.dtype == dtype and self.accumulated is None):
            return                                 # autograd adds the next one into .grad itself
        self.accumulated = grad.to(dtype) if self.accumulated is None \
            else self.accumulated.add_(grad)
        self.unsharded.grad = None

    def add_grad(self, rows: torch.Tensor) -> None:
        """This rank's rows of the averaged gradient [rows, *rest] -> the shard's .grad (a DTensor
        like the parameter), added to what is there (no zero_grad() between backwards)."""
        if self.sharded.grad is None:
            self.sharded.grad = self._dtensor(rows)
        else:
            with torch.no_grad():
                self.sharded.grad.to_local().add_(rows)


def _resize(t: torch.Tensor, nbytes: int) -> None:
    if t.untyped_storage().nbytes() != nbytes:
        t.untyped_storage().resize_(nbytes)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))
