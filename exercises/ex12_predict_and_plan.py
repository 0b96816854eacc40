"""Exercise 12: predict memory and communication before running, then plan a run under a budget.

    Grade it:    pytest exercises -k ex12            (or: python -m minizero.grade -k ex12)
    Notebook:    notebooks/06_compare.ipynb, then 07_activations.ipynb (activations per row)
    Compare:     minizero/memory/__init__.py (estimate_breakdown, optimizer_k, step_collectives,
                 comm_volume), python -m minizero.memory

The ZeRO paper's whole argument is arithmetic done before anything runs: per rank, Ψ parameters
trained with mixed-precision Adam hold 2Ψ + 2Ψ + KΨ bytes of model states, and each stage divides
one more term by N. Write that arithmetic yourself, then use it to choose how to train.

  1. model_states(num_params, world_size, stage, *, dtype, optimizer, offload) -> dict of bytes per
     rank, {"params", "grads", "optimizer", "offloaded"} (floats):
       * a parameter and a gradient take 4 bytes in "fp32", 2 in "bf16";
       * K, the optimizer's bytes per parameter: its own state ("adam": two fp32 moments, 8; "sgd":
         0) plus a fp32 master copy, 4, when the model computes in bf16 or the optimizer is
         offloaded (in pure fp32 the parameters are the master);
       * stage 1 divides the optimizer term by N, stage 2 the gradients too, stage 3 the parameters
         too (stage 0 is DDP: nothing divided);
       * offload=True moves the optimizer term to the host: "optimizer" is then 0 and "offloaded"
         holds that term plus the fp32 gradient partition the host steps on, 4Ψ (divided by N from
         stage 1).
  2. bytes_per_step(num_params, world_size, stage, *, dtype) -> bytes one rank sends per step as a
     ring counts them (the paper's section 7): a reduce-scatter or an all-gather of Ψ elements sends
     (N-1)/N of them, an all-reduce twice that. Stage 0 all-reduces the gradients; stages 1 and 2
     reduce-scatter the gradients and all-gather the updated parameters; stage 3 reduce-scatters the
     gradients and all-gathers the parameters twice (forward and backward).
  3. plan(num_params, shape, world_size, budget, rows, *, dtype, optimizer) -> the run to launch, or
     None if nothing fits. `shape` is {"layers", "hidden", "heads", "seq", "mlp_ratio"} of
     minizero's GPT, `budget` the bytes one rank may hold, `rows` its rows per step. The device
     holds the model states ("params" + "grads" + "optimizer") plus the activations of one
     micro-batch of b rows, minizero.memory.activation_bytes(layers, hidden, heads, seq, b,
     bytes_per_elem=..., mlp_ratio=..., checkpointing=...) (given: ZeRO-R's counting, exercise 11).
     Try, in this order, each option costing more than the one before (communication, then
     recompute, then host traffic): stages 0, 1, 2, 3 without checkpointing; stages 0, 1, 2, 3 with
     it; stage 3 with both checkpointing and offload; and return, for the first one that fits with
     at least one row, {"stage", "offload" (bool), "checkpointing" (bool), "micro_batch": the
     largest b <= rows that fits}. (The rest of the rows become accumulated micro-batches, exercise
     3: they cost no communication.)

What the grader checks: model_states and bytes_per_step against minizero.memory on 300 random
configurations (Ψ up to 3·10^10, N up to 1024), within floating-point rounding; plan against the
same rule on minizero.memory's formulas on 300 more; and for real: two ranks train a 7 M parameter
GPT with the stage and micro-batch you plan for a budget that only ZeRO makes room for, each rank's
memory capped by the kernel at the budget plus what it holds whatever the model
(minizero.launch(memory_cap=...)): the planned run must train, one row more must run out of memory.
Of minizero you may use minizero.comm and minizero.memory.activation_bytes (the rest of
minizero.memory is the answer).

Hints:
  * Ψ/N with N = world_size; keep the arithmetic in floats (psi = float(num_params)).
  * DeepSpeed's docs and the paper's figure 1 are the same table: stage 2 is 2Ψ + (2 + K)Ψ/N.
"""

from minizero.memory import activation_bytes  # noqa: F401  (plan will need it)


def model_states(num_params: int, world_size: int, stage: int, *, dtype: str, optimizer: str,
                 offload: bool) -> dict[str, float]:
    """Bytes per rank of the model states by category: params, grads, optimizer, offloaded."""
    raise NotImplementedError("ex12: write model_states")


def bytes_per_step(num_params: int, world_size: int, stage: int, *, dtype: str) -> float:
    """Bytes one rank sends per step in a ring."""
    raise NotImplementedError("ex12: write bytes_per_step")


def plan(num_params: int, shape: dict, world_size: int, budget: float, rows: int, *, dtype: str,
         optimizer: str) -> dict | None:
    """The first option that fits the budget, with its largest micro-batch; None if none does."""
    raise NotImplementedError("ex12: write plan")
