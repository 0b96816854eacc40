"""Mutant: K is the optimizer's own state only, forgetting the fp32 master copy a bf16 (or
offloaded) run keeps: Adam's K = 8 instead of the paper's 12."""

from solutions.ex12_predict_and_plan import ELEMENT, STATE, bytes_per_step, plan  # noqa: F401


def model_states(num_params, world_size, stage, *, dtype, optimizer, offload):
    psi, n = float(num_params), world_size
    params = ELEMENT[dtype] * psi / (n if stage >= 3 else 1)
    grads = ELEMENT[dtype] * psi / (n if stage >= 2 else 1)
    states = STATE[optimizer] * psi / (n if stage >= 1 else 1)
    if offload:
        return {"params": params, "grads": grads, "optimizer": 0.0,
                "offloaded": states + 4 * psi / (n if stage >= 1 else 1)}
    return {"params": params, "grads": grads, "optimizer": states, "offloaded": 0.0}
