"""Exercise 17, answer: FSDP2's dim-0 shard of one parameter, its all-gather and its gradient's
reduce-scatter, as minizero/pytorch/fsdp_param.py (padded_rows, ShardedParam: copy_shard_into,
copy_grad_into, add_grad) and fsdp_unit.py (Unit: gather, _copy_out) do them for a whole unit at
once."""

import torch

from minizero import comm


def shard(param, rank, world_size):
    chunk = -(-param.shape[0] // world_size)              # rows of every rank's shard
    start = rank * chunk
    rows = max(0, min(chunk, param.shape[0] - start))     # of them, the parameter's
    out = torch.zeros((chunk, *param.shape[1:]), dtype=param.dtype, device=param.device)
    out[:rows] = param[start:start + rows]                # [chunk, *rest], zeros past d0
    return out


def all_gather_param(shard, shape):
    n = comm.world_size()
    full = torch.empty(n * shard.numel(), dtype=shard.dtype, device=shard.device)
    comm.all_gather(full, shard.reshape(-1))              # rank r's rows at r * chunk
    return full.view(n * shard.shape[0], *shard.shape[1:])[:shape[0]].clone()


def reduce_scatter_grad(grad):
    n = comm.world_size()
    chunk = -(-grad.shape[0] // n)
    padded = torch.zeros((n * chunk, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
    padded[:grad.shape[0]] = grad                         # [N·chunk, *rest], zeros past d0
    rows = torch.empty((chunk, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
    comm.reduce_scatter(rows.view(-1), padded.view(-1), op="avg")
    return rows
