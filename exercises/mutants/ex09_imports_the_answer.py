"""Mutant: calls minizero's optimizer step instead of writing the host step."""

from minizero.optim import ShardOptimizer


def offload_step(opt, grad_parts):
    ShardOptimizer.step(opt, grad_parts)
