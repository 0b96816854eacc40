"""Exercise 12, answer: the paper's model-state counts and ring bytes (minizero/memory/__init__.py,
estimate_breakdown, optimizer_k, step_collectives, comm_volume), and a planner on top of them."""

from minizero.memory import activation_bytes

ELEMENT = {"fp32": 4, "bf16": 2}                 # bytes of a parameter and of a gradient
# the optimizer's own state: Adam's two fp32 moments
STATE = {"adam": 8, "sgd": 0}
OPTIONS = (
    [(stage, False, False) for stage in range(4)]
    + [(stage, False, True) for stage in range(4)]
    + [(3, True, True)]
)                          # (stage, offload, checkpointing), cheapest first


def model_states(num_params, world_size, stage, *, dtype, optimizer, offload):
    psi, n, e = float(num_params), world_size, ELEMENT[dtype]
    k = STATE[optimizer] + (4 if dtype != "fp32" or offload else 0)    # + the fp32 master copy
    params = e * psi / (n if stage >= 3 else 1)                         # P_p from stage 3
    grads = e * psi / (n if stage >= 2 else 1)                          # P_g from stage 2
    states = k * psi / (n if stage >= 1 else 1)                         # P_os from stage 1
    if offload:                        # the states and a fp32 gradient partition move to the host
        return {"params": params, "grads": grads, "optimizer": 0.0,
                "offloaded": states + 4 * psi / (n if stage >= 1 else 1)}
    return {"params": params, "grads": grads, "optimizer": states, "offloaded": 0.0}


def bytes_per_step(num_params, world_size, stage, *, dtype):
    # one reduce-scatter or all-gather
    ring = (world_size - 1) / world_size * ELEMENT[dtype] * num_params
    # DDP's all-reduce is both; stage 3 gathers twice
    return 3 * ring if stage == 3 else 2 * ring


def plan(num_params, shape, world_size, budget, rows, *, dtype, optimizer):
    for stage, offload, checkpointing in OPTIONS:
        states = model_states(
            num_params, world_size, stage, dtype=dtype, optimizer=optimizer, offload=offload
        )
        device = states["params"] + states["grads"] + states["optimizer"]
        fits = [
            b
            for b in range(1, rows + 1)
            if device
            + activation_bytes(
                shape["layers"],
                shape["hidden"],
                shape["heads"],
                shape["seq"],
                b,
                bytes_per_elem=ELEMENT[dtype],
                mlp_ratio=shape["mlp_ratio"],
                checkpointing=checkpointing,
            )
            <= budget
        ]
        if fits:
            return {
                "stage": stage,
                "offload": offload,
                "checkpointing": checkpointing,
                "micro_batch": max(fits),
            }
    return None
