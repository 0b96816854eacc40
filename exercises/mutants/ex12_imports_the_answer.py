"""Mutant: borrows minizero's formulas instead of writing them."""

from minizero import memory
from solutions.ex12_predict_and_plan import ELEMENT, STATE, bytes_per_step, plan  # noqa: F401


def model_states(num_params, world_size, stage, *, dtype, optimizer, offload):
    k = memory.optimizer_k(STATE[optimizer], dtype, offload)
    return memory.estimate_breakdown(num_params, world_size, stage, param_bytes=ELEMENT[dtype],
                                     grad_bytes=ELEMENT[dtype], k=k, offload=offload)
