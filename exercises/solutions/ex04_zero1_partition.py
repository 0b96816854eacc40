"""Exercise 4, answer: stage 1's padding and partitions (minizero/flat.py, padded_size and
FlatLayout.my_partition) and its all-gather after the step (minizero/zero1.py)."""

from minizero import comm


def padded_numel(numel, world_size):
    return -(-numel // world_size) * world_size                # ceil(Ψ / N) · N


def partition(numel, world_size, rank):
    size = padded_numel(numel, world_size) // world_size       # one partition: Ψ_padded / N
    return rank * size, (rank + 1) * size


def all_gather_params(flat):
    start, end = partition(flat.numel(), comm.world_size(), comm.rank())
    # in place: my partition is the input
    comm.all_gather(flat, flat[start:end])
