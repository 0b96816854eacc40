"""Mutant: gathers each unit when its turn comes, never the next one ahead: each unit's compute
waits for a whole all-gather."""

from solutions.ex08_zero3_from_scratch import Zero3 as Right


class Zero3(Right):
    def pre_forward(self, i):
        self.units[i].gather()

    def pre_backward(self, i):
        self.units[i].gather()
