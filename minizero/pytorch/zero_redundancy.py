"""torch.distributed.optim.ZeroRedundancyOptimizer as PyTorch users write it: the optimizer states
partitioned (ZeRO's P_os), whole parameters per rank.

    model = minizero.DistributedDataParallel(model)   # or torch's DDP, or gradients you averaged
    optimizer = minizero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()

Run its tests:  python -m pytest tests/test_zero_redundancy.py

Two ways to give each of the N ranks 1/N of the optimizer states. zero1.py cuts the flat buffer of
all parameters into N equal partitions at any element (DeepSpeed, the paper): balanced to one
element, a parameter may straddle two ranks, and the gradients are reduce-scattered. This file
gives each rank *whole* parameters (torch's way; Megatron's layer-wise optimizer and the matrix
optimizers such as Muon need it): greedily by size, largest first, each to the rank holding the
fewest elements so far. Gradients arrive averaged everywhere (an all-reduce, DDP's), each rank
steps its own parameters with your optimizer class, then each rank broadcasts the parameters it
owns. The cost of whole parameters: the ranks hold unequal shares (a large embedding alone can
outweigh the rest), and an all-reduce plus broadcasts moves 3(N-1)/N Ψ where reduce-scatter plus
all-gather moves 2(N-1)/N Ψ. docs/pytorch.md measures both on the default GPT.

Torch's interface, its state_dict format (so a state saved by torch's ZeroRedundancyOptimizer loads
here and back), consolidate_state_dict, add_param_group, step(closure), zero_grad,
parameters_as_bucket_view and torch's Join (uneven inputs); overlap_with_ddp is refused in one line.
Every collective is comm.py's (but Join's own all-reduces, which are torch's).
"""

from __future__ import annotations

import copy
import io
import itertools

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.utils._pytree import tree_map

from minizero import comm, owners
from minizero.pytorch.process_groups import group_of

# It steps beside a DDP, and beside another ZeroRedundancyOptimizer: an optimizer built again over
# the same parameters to load a checkpoint into (torch's test_state_dict) is how users resume.
OWNER = owners.Owner("minizero.ZeroRedundancyOptimizer",
                     ("minizero.DistributedDataParallel", "minizero.ZeroRedundancyOptimizer"))


class ZeroRedundancyOptimizer(torch.optim.Optimizer, Joinable):
    """torch 2.13's ZeroRedundancyOptimizer(params, optimizer_class, process_group=None,
    parameters_as_bucket_view=False, overlap_with_ddp=False, **defaults). `optim` is this rank's
    optimizer_class over its parameters; `param_groups` every rank's, as torch shows them.
    Collective: every rank of the group builds it, steps it and adds the same parameter groups
    (under torch's Join, uneven inputs: a rank out of data steps with the gradients it has)."""

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer], process_group=None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 **defaults):
        if overlap_with_ddp:
            raise ValueError("ZeroRedundancyOptimizer: overlap_with_ddp=True (the step inside "
                             "DDP's communication hook) is not supported by minizero")
        params = _checked(params)
        self.initialized = False                   # add_param_group, called by torch's __init__
        super().__init__(params, defaults)
        Joinable.__init__(self)
        self._all_params = [p for group in self.param_groups for p in group["params"]]
        kinds = {(p.dtype, p.device.type, p.layout) for p in self._all_params}
        if len(kinds) > 1 or self._all_params[0].is_sparse:
            raise ValueError("ZeroRedundancyOptimizer: every parameter must be dense and of one "
                             f"dtype and device type, got {sorted(map(str, kinds))}")
        self.process_group = process_group
        self.group = group_of(process_group)                     # None: every rank
        self.world_size, self.rank = comm.group_size(self.group), comm.group_rank(self.group)
        owners.claim(self._all_params, OWNER)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self.partition = self._partition()        # [rank][group] -> its whole parameters
        self.optim = optimizer_class(self._local_groups(), **defaults)
        _copy_settings(self.optim.param_groups, self.param_groups)   # its defaults, shown here
        self._trainable = [p.requires_grad for p in self._all_params]
        self._buckets: list[torch.Tensor] = []
        self._build_buckets()
        self._all_state_dicts: list[dict] = []       # consolidate_state_dict's, on its target
        self.initialized = True

    def _partition(self) -> list[list[list[torch.Tensor]]]:
        return whole_parameters([g["params"] for g in self.param_groups], self.world_size)

    def rank_of(self, p: torch.Tensor) -> int:
        """The rank (in the process group) that steps p and broadcasts it."""
        return next(r for r, groups in enumerate(self.partition) for g in groups
                    if any(q is p for q in g))

    def _local_groups(self) -> list[dict]:
        """This rank's share of every group (possibly no parameters), with the group's settings."""
        return [dict(group, params=mine)
                for group, mine in zip(self.param_groups, self.partition[self.rank])]

    def _src(self, rank: int) -> int:
        return rank if self.group is None else self.group.ranks[rank]        # a global rank

    # --- step -----------------------------------------------------------------------------------
    def step(self, closure=None, **kwargs):
        """This rank's optimizer steps its parameters (the settings you changed in param_groups,
        an LR scheduler's, go to it first), then every parameter is broadcast from its owner."""
        Join.notify_join_context(self)   # under Join, if it is the first joinable: "I have data"
        return self._step(closure, **kwargs)

    def _step(self, closure=None, **kwargs):
        trainable = [p.requires_grad for p in self._all_params]
        if trainable != self._trainable:               # a frozen parameter thawed, or the reverse
            self._trainable = trainable
            self._build_buckets()
        _copy_settings(self.param_groups, self.optim.param_groups)
        loss = (self.optim.step(**kwargs) if closure is None
                else self.optim.step(closure=closure, **kwargs))
        _copy_settings(self.optim.param_groups, self.param_groups)
        self._broadcast_from_owners()
        return loss

    # --- uneven inputs: torch's Join(joinables) ---------------------------------------------------
    def join_hook(self, **kwargs) -> JoinHook:
        """A rank whose data ran out steps (with the gradients its earlier hooks set, or its
        last ones) for as long as another rank steps: its parameters' broadcasts must still go.
        Join's own all-reduce stands for step's notice there (torch's hook sends the notice too:
        first in Join, torch's optimizer desynchronizes the ranks; this one does not)."""
        return _StepWhileOthersStep(self)

    @property
    def join_device(self) -> torch.device:
        return self._all_params[0].device

    @property
    def join_process_group(self):
        return dist.group.WORLD if self.group is None else self.group.process_group

    def _broadcast_from_owners(self) -> None:
        """Every rank needs every updated parameter: each owner broadcasts its own, one broadcast
        per rank, all in flight at once.

        [Note: one broadcast per rank] torch broadcasts parameter by parameter unless
        parameters_as_bucket_view; on gloo each broadcast costs a round trip: the 1M GPT's 52
        parameters took 17-19 ms that way against 3-4 ms in one broadcast per rank (8M: 34 against
        24-27 ms; 2 ranks, a loaded machine). So without bucket views each rank's parameters
        travel through a staging buffer (copied in and out: p.data stays as it is, as torch
        promises; Ψ of them at once, while they travel); with bucket views they are the bucket."""
        handles, staged = [], []
        for rank in range(self.world_size):
            if self.parameters_as_bucket_view:
                bucket = self._buckets[rank]
            else:
                params = list(itertools.chain.from_iterable(self.partition[rank]))
                if not params:
                    continue                                        # a rank that owns nothing
                bucket = (torch.cat([p.detach().reshape(-1) for p in params])
                          if rank == self.rank else torch.empty(
                              sum(p.numel() for p in params), dtype=params[0].dtype,
                              device=params[0].device))                              # [Ψ_rank]
                staged.append((rank, bucket, params))
            handles.append(comm.broadcast(bucket, src=self._src(rank), async_op=True,
                                          group=self.group, tag=f"parameters of rank {rank}"))
        for handle in handles:
            handle.wait()
        with torch.no_grad():
            for rank, bucket, params in staged:
                if rank != self.rank:
                    offset = 0
                    for p in params:
                        p.copy_(bucket[offset: offset + p.numel()].view_as(p))
                        offset += p.numel()

    def _build_buckets(self) -> None:
        """parameters_as_bucket_view: each rank's trainable parameters become views of one flat
        bucket per rank, so that one broadcast sends them (torch's rule; a frozen parameter gets
        storage of its own again and is not sent)."""
        if not self.parameters_as_bucket_view:
            return
        self._buckets = []
        with torch.no_grad():
            for groups in self.partition:
                params = list(itertools.chain.from_iterable(groups))
                for p in params:
                    if not p.requires_grad:
                        p.data = p.data.detach().clone()
                train = [p for p in params if p.requires_grad]
                first = self._all_params[0]
                bucket = torch.zeros(max(1, sum(p.numel() for p in train)), dtype=first.dtype,
                                     device=first.device)                       # [Ψ_r], Ψ_r >= 1
                offset = 0
                for p in train:
                    view = bucket[offset: offset + p.numel()].view_as(p)
                    view.copy_(p.data)
                    p.data = view
                    offset += p.numel()
                self._buckets.append(bucket)

    # --- parameter groups -------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """torch.optim's add_param_group, on every rank: the new group is partitioned by the same
        rule (the earlier groups keep their owners), this rank's part joins its optimizer."""
        super().add_param_group(param_group)
        if not self.initialized:                   # torch.optim.Optimizer.__init__ adding groups
            return
        added = self.param_groups[-1]
        owners.claim(added["params"], OWNER)
        self._all_params += added["params"]
        self._trainable = [p.requires_grad for p in self._all_params]
        self.partition = self._partition()
        self.optim.add_param_group(dict(added, params=self.partition[self.rank][-1]))
        _copy_settings(self.optim.param_groups, self.param_groups)
        self._build_buckets()

    # --- state dicts, torch's format: {"state": {index: ...}, "param_groups": [...]} --------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collect every rank's optimizer state on rank `to` of the group (collective: every rank
        calls it). Then state_dict() there is the whole optimizer's, in torch's format."""
        _copy_settings(self.param_groups, self.optim.param_groups)
        on_cpu = tree_map(lambda t: t.cpu() if torch.is_tensor(t) else t, self.optim.state_dict())
        states = _all_gather_objects(on_cpu, self.group)            # (a GPU's tensors: on the CPU)
        self._all_state_dicts = states if self.rank == to else []

    def state_dict(self) -> dict:
        """The consolidated state, indexed as torch's optimizers index it: by position over all
        groups' parameters, as you passed them."""
        if not self._all_state_dicts:
            raise RuntimeError(f"ZeroRedundancyOptimizer.state_dict(): no consolidated state on "
                               f"rank {self.rank}: call consolidate_state_dict(to={self.rank}) on "
                               "every rank first")
        index = {p: i for i, p in enumerate(self._all_params)}
        state = {}
        for local, groups in zip(self._all_state_dicts, self.partition):
            for local_group, params in zip(local["param_groups"], groups):
                for local_index, p in zip(local_group["params"], params):
                    if local_index in local["state"]:
                        state[index[p]] = local["state"][local_index]
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [index[p] for p in g["params"]]} for g in self.param_groups]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """A state in torch's format (this optimizer's, torch's ZeroRedundancyOptimizer's or a
        plain optimizer's over the same parameter groups): each rank keeps its parameters' state,
        every rank the groups' settings."""
        saved_groups = state_dict["param_groups"]
        if [len(s["params"]) for s in saved_groups] != [len(g["params"])
                                                         for g in self.param_groups]:
            raise ValueError(f"ZeroRedundancyOptimizer.load_state_dict: the state's parameter "
                             f"groups hold {[len(s['params']) for s in saved_groups]} parameters, "
                             f"this optimizer's {[len(g['params']) for g in self.param_groups]}")
        position = {p: i for i, p in enumerate(itertools.chain.from_iterable(
            local["params"] for local in self._local_groups()))}
        local_state = {}
        for saved, group in zip(saved_groups, self.param_groups):
            for saved_index, p in zip(saved["params"], group["params"]):
                if p in position and saved_index in state_dict["state"]:
                    local_state[position[p]] = copy.deepcopy(state_dict["state"][saved_index])
        _copy_settings(saved_groups, self.param_groups)
        local_groups, start = [], 0
        for saved, mine in zip(saved_groups, self.partition[self.rank]):
            local_groups.append({**saved, "params": list(range(start, start + len(mine)))})
            start += len(mine)
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})


class _StepWhileOthersStep(JoinHook):
    def __init__(self, optimizer: ZeroRedundancyOptimizer):
        self.optimizer = optimizer

    def main_hook(self) -> None:                  # once per step of the ranks that have data
        self.optimizer._step()


def whole_parameters(groups: list[list[torch.Tensor]], n: int) -> list[list[list[torch.Tensor]]]:
    """torch's partition ([rank][group] -> parameters): each group's parameters, largest first (a
    stable sort: ties keep their order), each to the rank with the fewest elements so far (the
    first such rank), counting over all groups. Deterministic, so every rank computes the same, and
    a group added later leaves the earlier groups' owners where they were."""
    held = [0] * n
    out = [[] for _ in range(n)]
    for params in groups:
        mine = [[] for _ in range(n)]
        for p in sorted(params, key=torch.Tensor.numel, reverse=True):
            rank = held.index(min(held))
            mine[rank].append(p)
            held[rank] += p.numel()
        for rank in range(n):
            out[rank].append(mine[rank])
    return out


def _checked(params) -> list:
    """params as a list of tensors or of groups, or torch's TypeError / ValueError."""
    wrong = TypeError(f"ZeroRedundancyOptimizer: params must be an iterable of tensors or of "
                      f"parameter groups (dicts), got {torch.typename(params)}")
    if isinstance(params, torch.Tensor):
        raise wrong
    try:
        params = list(params)
    except TypeError:
        raise wrong from None
    if not params:
        raise ValueError("ZeroRedundancyOptimizer: params is empty")
    if not (all(isinstance(p, torch.Tensor) for p in params)
            or all(isinstance(p, dict) for p in params)):
        raise TypeError("ZeroRedundancyOptimizer: params must be all tensors or all parameter "
                        "groups (dicts)")
    if any(isinstance(g, dict) and "params" not in g for g in params):
        raise ValueError("ZeroRedundancyOptimizer: a parameter group without 'params'")
    return params


def _copy_settings(source: list[dict], target: list[dict]) -> None:
    """Every setting but the parameters, group by group (an LR scheduler writes the global groups;
    an optimizer may add keys of its own to its groups)."""
    for src, dst in zip(source, target):
        dst.update((k, v) for k, v in src.items() if k != "params")


def _all_gather_objects(obj, group) -> list:
    """Every rank's `obj` (tensors and plain values), by rank: serialized, one all-reduce of the
    sizes and one all-gather of the bytes, both comm's (tallied)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    mine = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    n, device = comm.group_size(group), comm.device()
    sizes = torch.zeros(n, dtype=torch.int64, device=device)
    sizes[comm.group_rank(group)] = mine.numel()
    comm.all_reduce(sizes, op="sum", group=group, tag="optimizer state sizes")
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine.to(device)
    everyone = torch.empty(n * longest, dtype=torch.uint8, device=device)         # [N x longest]
    comm.all_gather(everyone, padded, group=group, tag="optimizer states")
    rows = everyone.view(n, longest).cpu()
    return [torch.load(io.BytesIO(rows[r, : int(sizes[r])].numpy().tobytes()), weights_only=False)
            for r in range(n)]
