"""What the fully_shard tests share: the two implementations side by side (minizero's and PyTorch's,
driven by the same code on the same data), the models, a user's training loop, and whole-parameter
results. Importable by the launched ranks (pytest puts tests/ on sys.path)."""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import minizero.pytorch as mz_fsdp
from minizero import comm, events
from minizero.lab.data import global_batch, local_batch
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.train import loss_fn

# The two implementations, each with its own policy classes: a scenario is written once.
IMPLEMENTATIONS = {"minizero": mz_fsdp, "torch": torch_fsdp}
BATCH = 24                # rows of the global batch: 1-4 ranks x 1-2 micro-batches

# The awkward GPT: the head tied to the embedding, two frozen parameters (one a whole embedding,
# one inside a block), a parameter forward never uses, dims 0 of 17 and 14 (uneven at N = 2, 3, 4).
AWKWARD = dict(frozen=("pos_emb.weight", "blocks.0.ln1.weight"), unused_param=True)


def gpt(awkward: bool = False, seed: int = 0, **overrides) -> nn.Module:
    return make_model(GPTConfig.named("tiny", **(AWKWARD if awkward else {}), **overrides),
                      seed=seed)


class Wide(nn.Module):
    """A model with a parameter of one row (rank 1 of 2 holds none of it), a frozen Linear between
    trainable ones, and a bias-free Linear whose 5 rows split 3 + 2 (N = 2), 2 + 2 + 1 (N = 3)."""

    def __init__(self, dim: int = 6):
        super().__init__()
        self.width = dim
        self.first = nn.Linear(dim, 5, bias=False)
        self.frozen = nn.Linear(5, 5).requires_grad_(False)
        self.last = nn.Linear(5, dim)
        self.gain = nn.Parameter(torch.ones(1, dim))                  # one row

    def forward(self, x):
        return self.last(torch.relu(self.frozen(self.first(x)))) * self.gain


def wide(seed: int = 0) -> Wide:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Wide()


def shard(impl: str, model: nn.Module, units=None, **kwargs) -> nn.Module:
    """fully_shard as torchtitan applies it: each unit (default: the GPT's blocks), then root."""
    fully_shard = IMPLEMENTATIONS[impl].fully_shard
    for unit in (model.blocks if units is None else units):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def policy(impl: str, name: str, **fields):
    """MixedPrecisionPolicy / CPUOffloadPolicy of that implementation."""
    return getattr(IMPLEMENTATIONS[impl], name)(**fields)


def batch(step: int, micro: int = 0, accumulate: int = 1, n: int | None = None,
          rank: int | None = None, width: int | None = None):
    """This rank's rows of step `step`'s global batch (micro-batch `micro` of `accumulate`): the
    GPT's sorting task, or (width) random inputs and targets for Wide."""
    if width is None:
        x, y = global_batch(step, BATCH, GPTConfig.named("tiny").block_size)
    else:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, width, generator=gen), torch.randn(BATCH, width, generator=gen)
    n = comm.world_size() if n is None else n
    rank = comm.rank() if rank is None else rank
    return local_batch(x, y, rank, n, micro, accumulate)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The GPT's cross-entropy, or Wide's mean squared error."""
    if isinstance(model, Wide):
        return (model(x).float() - y).pow(2).mean()
    return loss_fn(model(x), y)


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer whole (DTensors' full_tensor(); a collective)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def train(model: nn.Module, steps: int = 3, lr: float = 1e-2, zero_grad=lambda model, opt:
          opt.zero_grad(), clip: float | None = None, accumulate: int = 1,
          before_micro=None, optimizer=torch.optim.AdamW, one_process: bool = False,
          keep=False) -> dict:
    """A user's loop: loss.backward(), clip_grad_norm_, step, zero_grad. accumulate micro-batches
    per step; before_micro(model, micro, last) runs before each (gradient-sync switches). Returns
    the losses, the clip norms and the whole parameters after."""
    opt = optimizer(model.parameters(), lr=lr)
    losses, norms = [], []
    for step in range(steps):
        zero_grad(model, opt)
        for micro in range(accumulate):
            if before_micro is not None:
                before_micro(model, micro, micro == accumulate - 1)
            width = model.width if isinstance(model, Wide) else None
            x, y = batch(step, micro, accumulate, *((1, 0) if one_process else ()), width=width)
            loss = loss_of(model, x, y) / accumulate
            loss.backward()
            losses.append(loss.item())
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
    out = {"losses": losses, "norms": norms, "params": whole(model)}
    if keep:                                       # the model and optimizer, for more checks
        out["model"], out["optimizer"] = model, opt
    return out


def reference(model: nn.Module, **kwargs) -> dict:
    """The same loop in one process on the global batch."""
    return train(model, one_process=True, **kwargs)


def seeded(build, seed: int = 0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


class TorchCollectives(TorchDispatchMode):
    """Counts the c10d collectives PyTorch's side issues (CommDebugMode's count, without its
    module tracker, which trips over these models' hooks here)."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func.__name__
            self.counts["all_gather" if "allgather" in name else "reduce_scatter"
                        if "reduce_scatter" in name else "all_reduce"
                        if "allreduce" in name else name] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting(impl: str):
    """Counts `impl`'s collectives by kind as a user counting them sees them (CommDebugMode, the
    profiler): the c10d operations dispatched, minizero's and torch's alike. (minizero's event
    stream books the collective the algorithm asks for; on gloo, comm.py may run another.)"""
    with TorchCollectives() as mode:
        yield mode


@contextlib.contextmanager
def recorded(*names: str):
    """[(name, fields)] of the events named (all when none) emitted inside the block."""
    log: list = []
    with events.subscribed(lambda name, f: log.append((name, f))
                           if not names or name in names else None):
        yield log
