"""Exercise 15: tensor parallelism, Megatron's column- and row-parallel linear layers.

    Grade it:    pytest exercises -k ex15            (or: python -m minizero.grade -k ex15)
    Read first:  minizero/beyond/tensor_parallel.py's docstring (f and g; no notebook yet)
    Compare:     minizero/beyond/tensor_parallel.py (ColumnParallelLinear, RowParallelLinear,
                 copy_to_group, reduce_from_group)

ZeRO shards what data parallelism replicates, but every rank still computes the whole model.
Tensor parallelism (Megatron-LM, Shoeybi et al., 2019) splits each layer's matmul over M ranks. An
MLP is two linear layers, and Megatron splits them so that one all-reduce forward and one backward
is all the pair needs:
  * the first, column-parallel: its weight [out, in] is split along out (its rows). Each rank gets
    the whole input x and computes its out/M outputs; the activation (GELU) is elementwise, so each
    rank applies it to its own slice with nothing from the others.
  * the second, row-parallel: its weight is split along in (its columns). Each rank multiplies its
    slice of the hidden activations by its columns and gets a *partial sum* of the whole output;
    the sum over ranks is the output. The bias is added once, after the sum.
The two collectives, f and g in the Megatron paper, are each other's mirror:
  f (before the column-parallel layer): forward the identity; backward an all-reduce (sum) of the
    input's gradient, because each rank's gradient of x flowed back through its outputs only.
  g (after the row-parallel layer): forward an all-reduce (sum) of the partial outputs; backward the
    identity, because the output's gradient is already whole on every rank.

Write (this rank is comm.rank() of M = comm.world_size() ranks; all of them are one group):
  * shard_columns(linear) -> (weight [out/M, in], bias [out/M]): this rank's rows, in rank order.
  * shard_rows(linear) -> weight [out, in/M]: this rank's columns, in rank order.
  * column_parallel(x, weight, bias) -> [..., out/M]: f, then x W_i^T + b_i.
  * row_parallel(x_i, weight, bias) -> [..., out]: x_i W_i^T, then g, then + bias.
f and g are torch.autograd.Functions you write: a forward and a backward each.

What the grader checks: three ranks split a 2-layer MLP (6 -> 12 -> 6, GELU) with your functions
and run it on the same batch as the whole MLP on one process: your shards' shapes and values, the
output of every rank, and after backward the gradients of the input and of every shard. Each
collective is counted: one all-reduce forward, one backward, of the output's size.

Hints:
  * weight.chunk(M, dim=0)[rank] and .chunk(M, dim=1)[rank]; .clone() them (a shard is a
    parameter of its own, not a view of the whole).
  * forward of f: return x.view_as(x) (an identity autograd can attach a backward to).
  * comm.all_reduce(t, op="sum") works in place: all-reduce a .clone() of the partial output, and a
    .contiguous() gradient. backward returns one gradient per input of forward.
"""

import torch  # noqa: F401  (your answer will need it)

from minizero import comm  # noqa: F401  (your answer will need it)


def shard_columns(linear):
    """This rank's rows of a column-parallel layer: (weight [out/M, in], bias [out/M])."""
    raise NotImplementedError("ex15: write shard_columns")


def shard_rows(linear):
    """This rank's columns of a row-parallel layer: weight [out, in/M]."""
    raise NotImplementedError("ex15: write shard_rows")


def column_parallel(x, weight, bias):
    """f(x) W_i^T + b_i: this rank's out/M outputs."""
    raise NotImplementedError("ex15: write column_parallel")


def row_parallel(x_shard, weight, bias):
    """g(x_i W_i^T) + b: the whole output on every rank."""
    raise NotImplementedError("ex15: write row_parallel")
