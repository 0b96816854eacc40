"""Mutant: never frees a unit after its forward: correct numbers, and every unit materialized at
once."""

from solutions.ex08_zero3_from_scratch import Zero3 as Right


class Zero3(Right):
    def post_forward(self, i, output):
        if output.requires_grad:
            output.register_hook(lambda grad: self.pre_backward(i))
