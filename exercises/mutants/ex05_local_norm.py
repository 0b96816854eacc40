"""Mutant: clips each rank's partitions by their own norm: a different scale on every rank."""

import torch


def clip_grad_norm_(grads, max_norm):
    norm = torch.sqrt(sum(g.float().pow(2).sum() for g in grads))
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale)
    return norm.item()
