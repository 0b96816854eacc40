"""Mutant: plans with the model states alone: the activations of the micro-batch do not fit."""

from solutions.ex12_predict_and_plan import OPTIONS, bytes_per_step, model_states  # noqa: F401


def plan(num_params, shape, world_size, budget, rows, *, dtype, optimizer):
    for stage, offload, checkpointing in OPTIONS:
        states = model_states(
            num_params, world_size, stage, dtype=dtype, optimizer=optimizer, offload=offload
        )
        if states["params"] + states["grads"] + states["optimizer"] <= budget:
            return {
                "stage": stage,
                "offload": offload,
                "checkpointing": checkpointing,
                "micro_batch": rows,
            }
    return None
