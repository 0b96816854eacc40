"""Mutant: borrows minizero's padding arithmetic instead of writing it."""

import minizero.flat
from solutions.ex04_zero1_partition import all_gather_params, partition  # noqa: F401


def padded_numel(numel, world_size):
    return minizero.flat.padded_size(numel, world_size)
