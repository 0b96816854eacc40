"""Mutant: steps its partition but never all-gathers: every rank's other partitions go stale."""

from solutions.ex04_zero1_partition import padded_numel, partition  # noqa: F401


def all_gather_params(flat):
    pass
