"""Exercise 17: per-parameter sharding, FSDP2's way: a parameter's dim-0 shard with its padding,
the all-gather that rebuilds it, and its gradient's reduce-scatter.

    Grade it:    pytest exercises -k ex17            (or: python -m minizero.grade -k ex17)
    Notebook:    notebooks/12_two_layouts.ipynb
    Compare:     minizero/pytorch/fsdp_param.py (padded_rows, shard_rows, ShardedParam:
                 copy_shard_into, copy_grad_into, add_grad), minizero/pytorch/fsdp_unit.py
                 (Unit: gather, _copy_out) and minizero/pytorch/fsdp_reduce.py (Reduction)
                 (minizero goes one step further: a unit's parameters share one all-gather and
                 one reduce-scatter, each shard copied into its column of one buffer)

Stage 3 keeps 1/N of every parameter on each rank. The flat layout (exercises 4 and 8) lays a
unit's parameters end to end and cuts the line anywhere. PyTorch's FSDP2 cuts each parameter on
its own, along its first dimension: a parameter of d0 rows is cut into N shards of

    chunk = ceil(d0 / N) rows;  rank r keeps rows r*chunk ... r*chunk + chunk - 1

and where N does not divide d0 the rows past d0 are zeros (the padding), so that every rank holds
the same count: an all-gather needs it. A weight of shape [5, 4] at N = 3 (one column of the
picture per row):

    rows of the parameter   | 0  1 | 2  3 | 4  - |     chunk = 2; "-" a row of zeros
    shards                  |  r0  |  r1  |  r2  |     rank 2 holds row 4 and one padding row

and a parameter of one row at N = 3 leaves ranks 1 and 2 with padding only. Write:

  1. shard(param, rank, world_size): this rank's padded shard, [chunk, *rest], a new tensor
     (param is [d0, *rest]; rest may be empty: a bias).
  2. all_gather_param(shard, shape): every rank calls it with its own padded shard; return the
     whole parameter of `shape` ([d0, *rest]) on every rank: one all-gather of the N shards, in
     rank order, then the padding rows dropped.
  3. reduce_scatter_grad(grad): every rank calls it with the whole gradient its own rows of the
     batch gave ([d0, *rest]); return this rank's rows of the gradient *averaged* over the ranks,
     padded like its shard: [chunk, *rest], zeros in the padding rows. Pad the gradient to
     N*chunk rows and reduce-scatter it, one collective.

With these three a rank trains: gather each parameter whole for the forward and backward, reduce
each gradient to its rows, step its shard. What stays between steps is 1/N of everything, up to
the padding.

What the grader checks: (1) your shard for many shapes and every rank at N = 1 to 4 (in this
process), against FSDP2's rule; (2) on three ranks, a small model whose dims 0 are 5, 7 and 1:
your all-gather rebuilds each parameter from FSDP2's shards on every rank, sending one
all-gather's bytes; (3) your reduce-scatter gives each rank its rows of the whole batch's gradient
(the average of the ranks' own), sending one reduce-scatter's bytes; (4) three SGD steps with your
three functions end on every rank where one process training on the whole batch ends.

Hints:
  * ceil(a / b) for integers is -(-a // b); torch.zeros((chunk, *param.shape[1:])) and a slice
    assignment build the shard.
  * comm.all_gather(out [N * n], mine [n]) puts rank r's n elements at out[r * n:(r + 1) * n]:
    flatten the shard (n = chunk * row elements), and the result viewed as [N * chunk, *rest]
    holds the rows in order.
  * comm.reduce_scatter(out [n], full [N * n], op="avg") gives rank r the average of
    full[r * n:(r + 1) * n] over the ranks: rank r's rows, when full is the padded gradient
    flattened.
"""

import torch

from minizero import comm  # noqa: F401  (your answer will need it)


def shard(param: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """param [d0, *rest] -> rank's padded shard [ceil(d0 / world_size), *rest]."""
    raise NotImplementedError("ex17: write shard")


def all_gather_param(shard: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Every rank's padded shard [chunk, *rest] -> the whole parameter [d0, *rest] = shape."""
    raise NotImplementedError("ex17: write all_gather_param")


def reduce_scatter_grad(grad: torch.Tensor) -> torch.Tensor:
    """This rank's whole gradient [d0, *rest] -> its rows of the average over ranks, padded:
    [chunk, *rest]."""
    raise NotImplementedError("ex17: write reduce_scatter_grad")
