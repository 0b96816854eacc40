"""A `fully_shard` unit's gradients on their way to its shards: reduce-scatter, HSDP's all-reduce,
then each parameter's rows into its shard's .grad.

    python -m pytest tests/test_fully_shard.py tests/test_fully_shard_scenarios.py

When: PostBackward, an autograd node on a unit's inputs ([Note: post-backward]), calls
Unit.post_backward (fsdp_unit.py), which starts a Reduction when the unit's backward is done; its
Root finishes it when the next one starts or backward ends (one in flight, as FSDP2's default).
The layout is the all-gather's mirror ([Note: dim-0 shards] in fsdp_param.py): each whole gradient,
padded to N·chunk rows, laid out by rank into `staging` [N, Σ chunk·row], so that rank r's part of
the reduce-scatter is its rows of every gradient, side by side: `output` [Σ chunk·row]. On a 2-D
mesh (HSDP) that part is then all-reduced across the replicas. The average is the collective's
("avg") or a sum divided before and after (`divisors`); the result is cast to the parameters' own
dtype, moved where the shards live (CPUOffloadPolicy: the host), and each parameter's rows are
added to its shard's gradient (which zero_grad(set_to_none=False) left in place): "bucket arrived"
on the event stream, as reducer.py's.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from minizero import comm, events


class Reduction:
    """One unit's gradients from this backward: started at construction, ended by finish()."""

    def __init__(self, unit, grads: list):
        """grads: [(ShardedParam, its whole gradient)] of the parameters that got one."""
        self.unit, self.params = unit, [sp for sp, _ in grads]
        groups = unit.groups
        sizes = [sp.chunk * sp.row for sp in self.params]
        self.staging = torch.empty(groups.shard_size, sum(sizes), dtype=unit.dtypes[1],
                                   device=unit.device)                 # [N, Σ chunk·row]
        for (sp, grad), columns in zip(grads, self.staging.split(sizes, dim=1)):
            sp.copy_grad_into(columns, grad)                           # copy-in, by rank
        events.emit("bucket ready", engine=unit.owner, bucket=unit, unit=unit)
        events.emit("staging", engine=unit.owner, bucket=unit, nbytes=self.staging.nbytes)
        pre, self.post, self.op = divisors(groups.data_parallel_size, self.staging.dtype,
                                           unit.divide_factor)
        if pre != 1:
            self.staging.div_(pre)
        self.output = self.staging.new_empty(self.staging.shape[1])    # [Σ chunk·row]
        # <- the essential line of the backward: each rank's rows of every gradient, averaged
        with comm.backend_collectives():           # [Note: the collectives users count]
            self.handle = comm.reduce_scatter(self.output, self.staging.view(-1), op=self.op,
                                              async_op=True, group=groups.shard, tag=unit.tag)

    def finish(self) -> None:
        """Wait for the reduce-scatter; all-reduce across replicas (HSDP); add each parameter's
        rows to its shard's .grad, in the parameter's dtype, where the shard lives."""
        unit, output = self.unit, self.output
        self.handle.wait()
        events.emit("staging", engine=unit.owner, bucket=unit, nbytes=-self.staging.nbytes)
        self.staging = None
        if unit.groups.replicate is not None:
            output = unit.across_replicas(output, self.op)
            if output is None:                        # set_requires_all_reduce(False): kept
                return
        if self.post != 1:
            output.div_(self.post)
        output = output.to(unit.home, unit.params[0].dtype)
        offset = 0
        for sp in self.params:
            sp.add_grad(output[offset:offset + sp.rows * sp.row].view(sp.rows, *sp.shape[1:]))
            offset += sp.chunk * sp.row
        events.emit("bucket arrived", engine=unit.owner, bucket=unit)


# [Note: the collectives users count] On gloo, minizero.comm runs a reduce-scatter as an all-reduce
# and an all-gather as N broadcasts ([Note: collectives on gloo] in comm.py). fully_shard does not:
# its users count its collectives by kind, as PyTorch's own FSDP2 tests do with CommDebugMode (one
# all-gather and one reduce-scatter per unit, no all-reduce on a 1-D mesh), and torch's fully_shard
# calls the backend's all_gather_into_tensor and reduce_scatter_tensor on every backend. So its
# collectives are the backend's own, as comm.backend_collectives() gives them.


class PostBackward(torch.autograd.Function):
    """[Note: post-backward] An identity on a unit's inputs. Its backward runs when the gradients
    of the inputs are complete, which is after every parameter of the unit got its gradient:
    the unit's last backward operation is what computes the inputs' gradient, and autograd
    accumulates a parameter's gradient (AccumulateGrad) as soon as it is computed, before the
    node waiting for the inputs' gradient runs. A unit whose inputs need no gradient (the root,
    fed token ids) is reduced at the end of backward instead (Root.finish_backward)."""

    @staticmethod
    def forward(ctx, unit, *inputs):
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.post_backward()
        return (None, *grads)

    @staticmethod
    def around(unit, args, kwargs):
        """(args, kwargs) with the tensors that need a gradient passed through the identity."""
        flat, spec = tree_flatten((args, kwargs))
        where = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
        if not where:
            return args, kwargs
        outputs = PostBackward.apply(unit, *(flat[i] for i in where))
        for i, t in zip(where, outputs):
            flat[i] = t
        return tree_unflatten(flat, spec)


def divisors(n: int, dtype: torch.dtype, factor: float | None) -> tuple[float, float, str]:
    """(pre, post, op) for averaging over n ranks, or dividing by `factor` instead of n. fp32 and
    bf16 average in the collective (op "avg"). fp16's range is narrow: a sum over many ranks may
    overflow, and dividing each gradient by n first may underflow; so it divides by a power of
    two p near √n before the sum and by n / p after it (PyTorch's FSDP2 does the same)."""
    if dtype != torch.float16:
        return (1, 1, "avg") if factor is None else (1, factor, "sum")
    total, pre = factor or n, 1
    while total % pre == 0 and total / pre > pre:
        pre *= 2
    return pre, total / pre, "sum"
