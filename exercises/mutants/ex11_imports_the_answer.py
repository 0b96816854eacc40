"""Mutant: PyTorch's activation checkpointing instead of the learner's own autograd.Function."""

import torch.utils.checkpoint


def checkpoint(run, *inputs):
    return torch.utils.checkpoint.checkpoint(run, *inputs, use_reentrant=False)
