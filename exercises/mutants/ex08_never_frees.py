"""Mutant: a unit is never freed once gathered (free() does nothing): the numbers are right, every
unit stays materialized, and a unit still materialized is not all-gathered again."""

from solutions.ex08_zero3_from_scratch import Zero3 as Right


class Zero3(Right):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for unit in self.units:
            unit.free = lambda: None
