"""Exercise 8, answer: ZeRO stage 3 from torch and minizero.comm alone. minizero's own version
spreads the same steps over flat.py (the layout), zero3.py (Unit: gather, free, the four hooks;
ShardedUnits.following: the prefetch), zero2.py (the reduce-scatter), reducer.py (when a bucket
is ready) and engine.py (clipping, the step)."""

import torch
from torch import nn

from minizero import comm


class Unit:
    """One unit's flat buffer [Ψ_u padded] (its parameters are views of it, 0 bytes while freed),
    this rank's persistent shard of it and of its gradient [Ψ_u / N], and the state of one
    backward."""

    def __init__(self, params: list[nn.Parameter]):
        n, r = comm.world_size(), comm.rank()
        self.params = params
        numel = sum(p.numel() for p in params)
        self.size = -(-numel // n)                                  # Ψ_u / N, padding included
        # on the collectives' device (NCCL: this rank's GPU), in the parameters' dtype
        self.like = {"dtype": params[0].dtype, "device": comm.device()}
        self.full = torch.zeros(self.size * n, **self.like)         # [Ψ_u padded]
        offset = 0
        # lay out, then point p into the buffer
        for p in params:
            self.full[offset: offset + p.numel()] = p.detach().reshape(-1)
            p.data = self.full[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
        self.shard = self.full[r * self.size: (r + 1) * self.size].clone()    # mine, kept
        self.grad_shard = torch.zeros(self.size, **self.like)
        # the all-gather in flight, if any
        self.handle = None
        # params whose gradient is complete
        self.ready: set[int] = set()
        # freed: the shard is all that stays
        self.full.untyped_storage().resize_(0)

    def start_gather(self) -> None:
        """Allocate and start the all-gather (a prefetch when nobody waits for it yet)."""
        if self.handle is None and not self.full.untyped_storage().nbytes():
            self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
            self.handle = comm.all_gather(self.full, self.shard, async_op=True)

    def gather(self) -> None:
        self.start_gather()
        if self.handle is not None:
            self.handle.wait()
            self.handle = None

    def free(self) -> None:
        if self.handle is not None:          # never free a buffer an all-gather is still writing
            self.handle.wait()
            self.handle = None
        self.full.untyped_storage().resize_(0)

    def reduce_scatter(self) -> tuple:
        """Stage the gradients end to end, free them, start averaging partition r onto rank r."""
        staging = torch.zeros(self.full.numel(), **self.like)
        offset = 0
        for p in self.params:
            if p.grad is not None:                                  # None: unused this step, zeros
                staging[offset: offset + p.numel()] = p.grad.reshape(-1)
            offset += p.numel()
            p.grad = None
        mine = staging[comm.rank() * self.size: (comm.rank() + 1) * self.size]
        return mine, comm.reduce_scatter(mine, staging, op="avg", async_op=True)


class Zero3:
    def __init__(self, model: nn.Module, units: list[nn.Module], lr: float, max_norm: float):
        self.model, self.lr, self.max_norm = model, lr, max_norm
        taken: set[int] = set()
        groups = []
        # the blocks, then the root's rest
        for module in units[1:] + units[:1]:
            params = [p for p in module.parameters() if id(p) not in taken]    # a tied weight once
            taken |= {id(p) for p in params}
            groups.append(params)
        self.units = [Unit(params) for params in groups[-1:] + groups[:-1]]    # in forward order
        self.pending: list[tuple] = []                              # (unit, my partition, handle)
        for i, module in enumerate(units):
            module.register_forward_pre_hook(lambda m, args, i=i: self.pre_forward(i))
            module.register_forward_hook(lambda m, args, out, i=i: self.post_forward(i, out))
            for p in self.units[i].params:
                p.register_post_accumulate_grad_hook(lambda p, i=i: self.grad_ready(i, p))

    def __call__(self, *inputs):
        return self.model(*inputs)

    # forward: gather, prefetch the next; free after
    def pre_forward(self, i: int) -> None:
        self.units[i].gather()
        if i + 1 < len(self.units):
            self.units[i + 1].start_gather()                        # while unit i computes

    def post_forward(self, i: int, output: torch.Tensor) -> None:
        self.units[i].free()
        if output.requires_grad:                                    # backward will need it again
            output.register_hook(lambda grad: self.pre_backward(i))

    # backward runs the units in reverse: the root (its output's gradient comes first), then the
    # last block
    def backward_order(self) -> list[int]:
        return [0] + list(range(len(self.units) - 1, 0, -1))

    def pre_backward(self, i: int) -> None:
        self.units[i].gather()
        order = self.backward_order()
        following = order.index(i) + 1
        if following < len(order):
            self.units[order[following]].start_gather()

    def grad_ready(self, i: int, p: nn.Parameter) -> None:
        unit = self.units[i]
        unit.ready.add(id(p))
        if len(unit.ready) == len(unit.params):                     # the unit's backward is done
            self.finish(unit)

    def finish(self, unit: Unit) -> None:
        self.pending.append((unit, *unit.reduce_scatter()))
        unit.ready.clear()
        unit.free()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        # units with a parameter never used
        for unit in self.units:
            if unit.ready or unit.full.untyped_storage().nbytes():
                self.finish(unit)
        for unit, mine, handle in self.pending:
            handle.wait()
            unit.grad_shard += mine                                 # accumulates over micro-batches
        self.pending.clear()

    # step: clip by the global norm over every rank's shards, SGD on my shards
    def global_norm(self) -> torch.Tensor:
        squares = sum(unit.grad_shard.pow(2).sum() for unit in self.units)
        comm.all_reduce(squares, op="sum")
        return squares.sqrt()

    def step(self) -> float:
        norm = self.global_norm()
        scale = (self.max_norm / (norm + 1e-6)).clamp(max=1.0)
        for unit in self.units:
            unit.shard -= self.lr * scale * unit.grad_shard
            unit.grad_shard.zero_()
        return norm.item()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        for unit in self.units:
            unit.gather()
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        for unit in self.units:
            unit.free()
        return state
