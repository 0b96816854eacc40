"""Mutant: an off-by-one, ceil(Ψ/N) written as Ψ // N + 1 (one element too many when N divides
Ψ)."""

from solutions.ex04_zero1_partition import all_gather_params  # noqa: F401


def padded_numel(numel, world_size):
    return (numel // world_size + 1) * world_size


def partition(numel, world_size, rank):
    size = numel // world_size + 1
    return rank * size, (rank + 1) * size
