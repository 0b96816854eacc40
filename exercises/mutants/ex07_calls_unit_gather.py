"""Mutant: lets minizero's unit gather and free itself (unit.gather(), unit.free()): its answer, not
yours."""

from solutions.ex07_zero3_hooks import post_backward, post_forward, pre_backward  # noqa: F401


def pre_forward(unit, following):
    unit.gather()
    if following is not None:
        following.gather(async_op=True)
