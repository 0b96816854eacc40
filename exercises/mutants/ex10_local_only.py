"""Mutant: checks only this rank's own partitions (no collective): the rank holding the inf skips
the step, the others take it, and their parameters part ways."""

import torch


def found_overflow(grads):
    return any(not torch.isfinite(g).all() for g in grads)
