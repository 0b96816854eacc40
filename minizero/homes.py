"""Where P_os lives: the one interface of every optimizer home, as the engine, checkpoints and the
memory meter use it.

    python -m pytest tests/test_architecture.py -k home

The paper's homes are optim.ShardOptimizer (the device) and offload.HostShardOptimizer (host
memory): they step. What wrap's engines need around that (checkpoints, engine.gathered(),
full_state_dict) is BucketState below: DeviceHome and HostHome are the homes they build, and
beyond/disk.py's DiskShardOptimizer (a file) is one too; fairscale's FlatParameters hand the
partitions to the user's optimizer. A home is what stages.Stage.optimizer or the engine's home=
builds: (parts, optimizer factory, grouping, placement) -> a SteppedHome.
tests/test_architecture.py checks that each has every method below, with these arguments.
"""

from __future__ import annotations

from typing import Protocol

import torch

from minizero.offload import HostShardOptimizer
from minizero.optim import ShardOptimizer


class OptimizerHome(Protocol):
    """What every home has."""
    param_parts: list[torch.Tensor]    # what it updates: views into the model's parameter storage

    def reload(self) -> None: ...      # the parameters were written from outside: masters follow
    def master_values(self) -> list[torch.Tensor]: ...   # fp32 values, one per part
    def device_tensors(self) -> list[torch.Tensor]: ...  # what it holds on the device (memory)
    def host_tensors(self) -> list[torch.Tensor]: ...    # ... in host memory
    def disk_bytes(self) -> int: ...                     # ... in a file


class SteppedHome(OptimizerHome, Protocol):
    """An OptimizerHome the engine steps with the averaged gradients (all but FSDP's, whose user
    steps); checkpoints save and load its state; `optimizer` is torch's."""
    optimizer: torch.optim.Optimizer

    def step(self, grad_parts: list[torch.Tensor]) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state_dict: dict) -> None: ...


class BucketState:
    """A ShardOptimizer mixin: its state in buckets (what checkpoints save and load, whatever the
    cache-sized views: [Note: cache-sized views] in optim.py), writes from outside, master values.
    """

    def reload(self) -> None:
        """The parameters were written from outside (engine.gathered(modifier_rank=...)): the
        masters take their values."""
        with torch.no_grad():
            for master, part in zip(self.masters, self.param_parts):
                if master.data_ptr() != part.data_ptr():
                    master.copy_(part.reshape(-1))

    def state_dict(self) -> dict:
        """torch's state_dict with one entry per bucket (what a checkpoint saves): a state with one
        value per element concatenated over a master's views (zeros where a view has none:
        padding, parameters in no group, views another kind of group steps), any other (Adam's
        step) the first view's with it; "params" of a group: its buckets."""
        saved, state = self.optimizer.state_dict(), {}
        for b, views in enumerate(self.views):
            parts = [saved["state"].get(self._index.get(id(v)), {}) for v in views]
            first = {}                                 # each state's name -> the first view with it
            for j, view_state in enumerate(parts):
                for name in view_state:
                    first.setdefault(name, j)
            if first:
                state[b] = {
                    name: torch.cat([s[name] if name in s else
                                     torch.zeros(v.shape, dtype=parts[j][name].dtype)
                                     for s, v in zip(parts, views)])
                    if _per_element(parts[j][name], views[j])
                    else parts[j][name]
                    for name, j in first.items()
                }
        bucket_of = {self._index[id(v)]: b for b, views in enumerate(self.views)
                     for v in views if id(v) in self._index}
        groups = [{**g, "params": sorted({bucket_of[i] for i in g["params"]})}
                  for g in saved["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """The inverse of state_dict(): each bucket's per-element state cut into its views; the
        groups' settings are the saved ones (which views each steps is this optimizer's own)."""
        current = self.optimizer.state_dict()["param_groups"]
        if len(state_dict["param_groups"]) != len(current):
            raise ValueError(f"the optimizer state has {len(state_dict['param_groups'])} "
                             f"parameter groups, this optimizer {len(current)}")
        state = {}
        for b, bucket_state in state_dict["state"].items():
            b = int(b)
            for j, view in enumerate(self.views[b]):
                if id(view) not in self._index:
                    continue                                   # not stepped: no state
                state[self._index[id(view)]] = {
                    name: value.split(self._sizes[b])[j].clone()
                    if _per_element(value, self.masters[b])
                    else (value.clone() if torch.is_tensor(value) else value)   # each view: a step
                    for name, value in bucket_state.items()
                }
        groups = [{**saved, "params": now["params"]}
                  for saved, now in zip(state_dict["param_groups"], current)]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})

    def master_values(self) -> list[torch.Tensor]:
        """The fp32 values of the owned parameters, one per part (for full_state_dict)."""
        return [m.detach() for m in self.masters]

    def disk_bytes(self) -> int:
        return 0                      # in memory (beyond/disk.py's home keeps it in a file)


class DeviceHome(BucketState, ShardOptimizer):
    """optim.ShardOptimizer, checkpointable: P_os on the device."""


class HostHome(BucketState, HostShardOptimizer):
    """offload.HostShardOptimizer, checkpointable: P_os in host memory."""


def _per_element(value, like: torch.Tensor) -> bool:
    """A state with one value per element of `like` (Adam's moments, SGD's momentum)."""
    return torch.is_tensor(value) and value.shape == like.shape
