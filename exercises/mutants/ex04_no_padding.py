"""Mutant: forgets the padding: partitions of numel // N elements, the last numel % N never
owned."""

from solutions.ex04_zero1_partition import all_gather_params  # noqa: F401


def padded_numel(numel, world_size):
    return numel


def partition(numel, world_size, rank):
    size = numel // world_size
    return rank * size, (rank + 1) * size
