"""Mutant: all-gathers every rank's gradients to compute the norm: right answer, Ψ elements on the
wire where one number would do."""

import torch

from minizero import comm


def clip_grad_norm_(grads, max_norm):
    mine = torch.cat([g.reshape(-1).float() for g in grads])
    everything = torch.zeros(mine.numel() * comm.world_size())
    comm.all_gather(everything, mine)
    norm = everything.norm()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale)
    return norm.item()
