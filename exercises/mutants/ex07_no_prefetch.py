"""Mutant: gathers each unit when its turn comes and never prefetches the next: correct, but every
unit's compute waits for a whole all-gather."""

from solutions.ex07_zero3_hooks import free, gather, post_backward  # noqa: F401


def pre_forward(unit, following):
    gather(unit)


def post_forward(unit):
    free(unit)


def pre_backward(unit, following):
    gather(unit)
