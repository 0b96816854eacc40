"""Mutant: right sums, wrong algorithm: passes the whole tensor around the ring N-1 times, sending
(N-1) * S elements per rank instead of the ring's 2(N-1)/N * S."""

import torch

from minizero import comm
from ex01_ring_allreduce import exchange


def ring_all_reduce(tensor):
    travelling, incoming = tensor.clone().view(-1), torch.empty(tensor.numel())
    for _ in range(comm.world_size() - 1):
        exchange(travelling, incoming)
        travelling.copy_(incoming)
        tensor.view(-1).add_(incoming)
    return tensor
