"""Mutant: borrows minizero's global overflow check."""

from minizero import loss_scale


def found_overflow(grads):
    return loss_scale.found_overflow(grads)
