"""Mutant: forgets that backward needs the parameters again: no gather before a unit's backward."""

from solutions.ex07_zero3_hooks import post_backward, post_forward, pre_forward  # noqa: F401


def pre_backward(unit, following):
    pass
