"""Mutant: right values, but keeps the full gradients (p.grad) alive: no memory saved over stage
1."""

import solutions.ex06_zero2_reduce_scatter as answer


def reduce_scatter_bucket(params, padded_numel):
    grads = [p.grad for p in params]
    staging, handle = answer.reduce_scatter_bucket(params, padded_numel)
    for p, grad in zip(params, grads):
        p.grad = grad
    return staging, handle
