"""Exercise 8, the capstone: ZeRO stage 3 from plain PyTorch, a wrapper and its sharded optimizer.

    Grade it:    pytest exercises -k ex08 -s         (-s: your peak and bytes next to minizero's)
    Notebook:    notebooks/04_zero3.ipynb
    Compare:     minizero/zero3.py (Unit, ShardedUnits), minizero/flat.py,
                 minizero/zero2.py (GradientShard.reduce), minizero/reducer.py,
                 minizero/engine.py (step, _clip)

Exercises 4 to 7 each wrote one piece inside minizero's engines. Here you write the whole of stage 3
(P_os+g+p) yourself, from torch and minizero.comm's collectives only, as Stanford CS336's second
assignment has its students write an FSDP wrapper. Per rank it keeps (2 + 2 + K)Ψ/N bytes of model
states, plus the few units materialized at any moment, and sends 3Ψ(N-1)/N elements per micro-batch:
an all-gather of the parameters for forward, another for backward, a reduce-scatter of the
gradients.

Write the class Zero3(model, units, lr, max_norm):
  * units[0] is the model itself, units[1:] its transformer blocks, in the order forward runs them.
    A block's unit holds that block's parameters; the root unit holds every parameter of the model
    that no block holds (embeddings, final LayerNorm, the head, whose weight is *tied* to the token
    embedding: one Parameter, to count and shard once, and a parameter that forward never uses).
  * __init__: for each unit, lay its parameters end to end in one flat buffer padded to a multiple
    of N and make each parameter a view of it (p.data = view); keep this rank's partition [Ψ_u / N]
    (a clone) and a zero gradient shard of the same size; free the buffer (its storage to 0 bytes).
    Hook the modules (register_forward_pre_hook, register_forward_hook) and the parameters
    (register_post_accumulate_grad_hook) to drive what follows.
  * forward (engine(inputs) calls model(inputs)): before a unit runs, materialize it (all-gather the
    N partitions into its buffer) and *prefetch* the next unit (start its all-gather,
    async_op=True); after it ran, free it. On the unit's output, register a tensor hook: its
    backward starts there.
  * backward(loss): loss.backward(), during which, unit by unit in the reverse of the order their
    forwards *ended* (the root first: its forward ends last, and the head's gradient comes first),
    materialize the unit again before its backward (and prefetch the next one), and, once its
    gradients are complete (every parameter of the unit got one), reduce-scatter them (op "avg",
    async) and free the unit and its full gradients. Units left unfinished when loss.backward()
    returns (a parameter never used) are finished then. Wait for every reduce-scatter and add your
    partition into the gradient shard: backward is called once per micro-batch, and the gradient
    shards accumulate until the step.
  * step() -> float: clip by the *global* norm (exercise 5: the norm over every rank's gradient
    shards, scale min(1, max_norm / (norm + 1e-6))), then SGD on your partitions, shard -= lr *
    grad_shard, and zero the gradient shards. Return the norm.
  * full_state_dict() -> dict: every unit materialized, {name: tensor.clone()} of
    model.state_dict(), then freed again.

What the grader checks (two ranks, a 4-block GPT, 3 SGD steps of two micro-batches, max_norm below
the gradients' norm so clipping acts): every rank ends where one process training on the whole batch
ends (torch's SGD and clip_grad_norm_), on two ranks and on four; at most the root and two blocks
are materialized at once (the one computing and the one prefetched: measured on the parameters'
storages); each micro-batch sends 3Ψ(N-1)/N fp32 elements, within the padding (comm.tally: use
minizero.comm's collectives); and when a block's forward ends, the next block's all-gather has been
issued already. minizero's engines, flat layout, reducer, units and optimizer are refused in your
file (and PyTorch's FSDP).

Hints:
  * Exercise 7's start_gather / gather / free and exercise 6's staging buffer are most of it: one
    small class per unit (buffer, shard, gradient shard, the all-gather in flight) keeps the wrapper
    short.
  * A unit's parameters are views of its buffer: while it is freed they have their shapes and 0
    bytes of storage; resizing the storage back makes the same views valid again. Never free a
    buffer whose all-gather is still in flight (a prefetch nobody waited for): wait its handle
    first, or the collective writes into released memory.
  * Allocate every buffer where the collectives run: device=comm.device() (a GPU under NCCL, the
    CPU under gloo) and the parameters' dtype.
  * register_post_accumulate_grad_hook(fn) calls fn(p) once p.grad holds this backward's complete
    gradient (a tied weight's two uses summed already).
  * comm.reduce_scatter(mine, staging, op="avg", async_op=True), where `mine` is your slice of
    staging, works in place; keep (unit, mine, handle) until backward ends.
"""

import torch
from torch import nn

from minizero import comm  # noqa: F401  (your answer will need it)


class Zero3:
    def __init__(self, model: nn.Module, units: list[nn.Module], lr: float, max_norm: float):
        raise NotImplementedError("ex08: write Zero3")

    def __call__(self, *inputs):
        return self.model(*inputs)

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError("ex08: write Zero3.backward")

    def step(self) -> float:
        raise NotImplementedError("ex08: write Zero3.step")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError("ex08: write Zero3.full_state_dict")
