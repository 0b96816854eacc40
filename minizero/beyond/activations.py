"""ZeRO-R's activations: the bytes saved for backward, measured, and activation
checkpointing (P_a+cpu).

    python -m minizero.run --stage 3 --world-size 2 --activation-checkpointing [cpu]
    engine = minizero.wrap(model, 2, optimizer, activation_checkpointing=True)   # or "cpu"
    engine.memory()["activations"]       # peak bytes saved for backward during the last step

Activations are what a forward keeps for its backward: a Linear keeps its input, a softmax its
output. For a transformer they grow with sequence s and micro-batch b, not with Ψ
(memory.activation_bytes has the per-layer formula), and for long sequences they outgrow the model
states ZeRO-DP shards.

Measured (`SavedTensorMeter`): autograd's saved-tensor hooks see every tensor a forward saves, and
the packed object autograd holds is released when backward has used it. Each storage is counted once
(q, k, v can be views of one buffer), and parameters are left out: memory() counts them already. The
peak is the most bytes alive at once during a step, forward and backward (recomputes included).

Checkpointed (`checkpoint`): each unit (a transformer's blocks, units.default_units) runs its
forward without saving anything but its inputs; backward runs that forward again, then its backward.
Kept: s·b·h per layer instead of the layer's ~16·s·b·h + a·s²·b, for one more forward per step
(~33 % more compute, the paper's figure). mode "cpu" keeps those inputs in host memory until
backward: the paper's P_a+cpu. The paper's P_a itself (partitioned activations) splits the
checkpoints that model parallelism *replicates* across its ranks; in pure data parallelism every
rank's activations are its own, for its own rows, and there is no replica to partition. With tensor
parallelism (beyond/tensor_parallel.py) there is: the M ranks of a group hold the same block inputs,
and mode "partitioned" keeps each rank's 1/M of them and all-gathers them before the recompute (P_a;
"partitioned+cpu" keeps that 1/M on the host: P_a+cpu).

Why not torch.utils.checkpoint: its non-reentrant recompute keeps the recomputed tensors through
saved- tensor hooks of its own, which a measurement cannot see. `_Checkpoint` is the reentrant
design in a few lines: an autograd Function saving only the inputs, whose backward recomputes under
the meter and runs backward through the recomputed graph. At stage 3 the recompute runs after the
unit's pre-backward hook gathered it, and calls the unit's forward, not its hooks: the unit is
gathered and freed once per backward, as without checkpointing ([Note: recompute] in units.py covers
units inside a checkpoint).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from minizero import comm
from minizero.flat import padded_size, partition

MODES = (False, True, "cpu")       # wrap(activation_checkpointing=...) checks these
# The paper's P_a: the checkpoints partitioned over a tensor-parallel group (its ranks hold the same
# block inputs); "+cpu" also keeps each rank's part on the host. checkpoint(..., group=) only.
PARTITIONED = ("partitioned", "partitioned+cpu")


class _Saved:
    """What autograd holds for one saved tensor while the meter records: the tensor, and a release
    of its bytes when autograd drops it (its backward ran, or the graph was freed)."""
    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: SavedTensorMeter, key: int | None):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        if self.key is not None:
            self.meter._release(self.key)


class SavedTensorMeter:
    """Bytes of the tensors saved for backward, alive now and at most during the current (or
    last) step."""

    def __init__(self, param_tensors: Callable[[], list[torch.Tensor]]):
        self.param_tensors = param_tensors          # what holds the parameters: not activations
        self.peak = 0
        self.alive = 0                                  # bytes saved for backward now
        self._storages: dict[int, list[int]] = {}   # storage -> [saved tensors using it, its bytes]
        self._excluded: set[int] = set()
        self._new_step = True

    def new_step(self) -> None:
        """The next forward starts a step: its peak is counted afresh (engine.step calls this)."""
        self._new_step = True

    @contextlib.contextmanager
    def recording(self):
        """Count what is saved for backward inside this block (the engine's forward,
        a recompute)."""
        if self._new_step:
            self.peak, self._new_step = self.alive, False
        # A storage is identified by its StorageImpl (_cdata), which stage 3's resize_ keeps: a
        # unit's full buffer stays recognisable while it is freed and gathered again.
        self._excluded = {t.untyped_storage()._cdata for t in self.param_tensors()}
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def _pack(self, t: torch.Tensor) -> _Saved:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._excluded:                    # a parameter or a view of one: counted already
            return _Saved(t, self, None)
        entry = self._storages.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:                         # each storage once, however many tensors share it
            self.alive += entry[1]
            self.peak = max(self.peak, self.alive)
        entry[0] += 1
        return _Saved(t, self, key)

    def _release(self, key: int) -> None:
        entry = self._storages[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.alive -= entry[1]
            del self._storages[key]


def _unpack(saved: _Saved) -> torch.Tensor:
    return saved.tensor


# --- activation checkpointing ---------------------------------------------------------------------
class _Checkpoint(torch.autograd.Function):
    """forward(run, meter, group, dummy, *inputs): run(*inputs) saving nothing but the inputs
    (with a tensor-parallel `group`, P_a: this rank's 1/M of each); backward gathers them again,
    recomputes under the meter and backpropagates through the recomputed graph. `dummy` requires
    grad, so that the output does even when no input does (parameters inside still need
    gradients)."""

    @staticmethod
    def forward(ctx, run, meter, group, dummy, *inputs):
        ctx.run, ctx.meter, ctx.group = run, meter, group
        ctx.rng = _rng_state(inputs)                 # dropout in the recompute draws the same masks
        ctx.tensor_inputs = [torch.is_tensor(x) for x in inputs]
        ctx.grad_inputs = [torch.is_tensor(x) and x.requires_grad for x in inputs]
        ctx.others = [None if torch.is_tensor(x) else x for x in inputs]          # None, flags, ...
        ctx.shapes = [x.shape for x in inputs if torch.is_tensor(x)]
        kept = [x if group is None else _my_part(x, group) for x in inputs if torch.is_tensor(x)]
        ctx.save_for_backward(*kept)                 # packed once forward returns
        with torch.no_grad():
            return run(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        tensors = iter(ctx.saved_tensors if ctx.group is None else
                       [_whole(part, shape, ctx.group)
                        for part, shape in zip(ctx.saved_tensors, ctx.shapes)])
        inputs = [next(tensors).detach().requires_grad_(g) if is_tensor else other
                  for is_tensor, other, g in zip(ctx.tensor_inputs, ctx.others, ctx.grad_inputs)]
        with torch.random.fork_rng(devices=ctx.rng[1]), torch.enable_grad(), ctx.meter.recording():
            _set_rng_state(ctx.rng)
            outputs = ctx.run(*inputs)              # <- the recompute: one more forward of the unit
        outputs = (outputs,) if torch.is_tensor(outputs) else outputs
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None,) * 4 + tuple(x.grad if torch.is_tensor(x) else None for x in inputs)


def _my_part(x: torch.Tensor, group) -> torch.Tensor:
    """P_a's line: of a checkpoint every rank of the group holds alike, keep 1/M (flat, padded)."""
    flat = x.detach().reshape(-1)
    padding = padded_size(flat.numel(), group.size) - flat.numel()
    padded = torch.nn.functional.pad(flat, (0, padding))
    return partition(padded, group.index, group.size).clone()                       # [numel/M]


def _whole(part: torch.Tensor, shape: torch.Size, group) -> torch.Tensor:
    """The checkpoint again, all-gathered from the M parts, before the recompute needs it."""
    full = part.new_empty(part.numel() * group.size)                           # [numel padded]
    comm.all_gather(full, part, group=group, tag="partitioned checkpoint")
    return full[:shape.numel()].view(shape)


def checkpoint(units: list[nn.Module], mode: bool | str, meter: SavedTensorMeter,
               group=None) -> None:
    """Make each unit's forward a checkpoint (mode True), its inputs kept on the host ("cpu"), or
    partitioned over the tensor-parallel `group` whose ranks hold the same inputs (PARTITIONED:
    P_a, and P_a+cpu). Units inside another unit are left alone: the outer recompute runs them
    anyway. Keyword arguments reach the forward but get no gradient (a mask, a flag); tensors that
    need one are passed positionally."""
    if (mode in PARTITIONED) != (group is not None and group.size > 1):
        raise ValueError(f"activation_checkpointing={mode!r}: P_a partitions the checkpoints that "
                         "the ranks of a tensor-parallel group replicate, so 'partitioned' needs "
                         "such a group (M > 1), and only it does")
    inside = {id(m) for u in units for m in u.modules() if m is not u}
    for unit in units:
        if id(unit) not in inside:
            unit.forward = partial(_checkpointed, unit.forward, meter, mode in ("cpu",
                                   "partitioned+cpu"), group if mode in PARTITIONED else None)


def _checkpointed(forward, meter, host, group, *inputs, **kwargs):
    if not torch.is_grad_enabled():                     # nothing would be saved: plain forward
        return forward(*inputs, **kwargs)
    dummy = torch.empty(0, requires_grad=True)
    with _to_host() if host else contextlib.nullcontext():     # P_a+cpu: the checkpoint on the host
        return _Checkpoint.apply(partial(forward, **kwargs), meter, group, dummy, *inputs)


@contextlib.contextmanager
def _to_host():
    """Saved tensors go to host memory when saved and come back to their device when backward needs
    them; an explicit copy even when the device is the CPU, so the measured device bytes drop as on
    a GPU."""
    pin = torch.cuda.is_available()
    pack = lambda t: (
        t.device,
        t.to("cpu", copy=True).pin_memory() if pin else t.to("cpu", copy=True),
    )  # noqa: E731
    unpack = lambda saved: saved[1].to(saved[0], copy=True, non_blocking=True)  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _rng_state(inputs) -> tuple:
    cuda = [x.device for x in inputs if torch.is_tensor(x) and x.device.type == "cuda"][:1]
    return torch.get_rng_state(), cuda, [torch.cuda.get_rng_state(d) for d in cuda]


def _set_rng_state(state: tuple) -> None:
    cpu, devices, cuda = state
    torch.set_rng_state(cpu)
    for d, s in zip(devices, cuda):
        torch.cuda.set_rng_state(s, d)
