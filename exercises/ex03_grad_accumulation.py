"""Exercise 3: gradient accumulation in data parallelism: communicate once per step, not per
micro-batch.

    Grade it:    pytest exercises -k ex03            (or: python -m minizero.grade -k ex03)
    Notebook:    notebooks/01_ddp.ipynb
    Compare:     minizero/engine.py (Engine.no_sync, Engine.backward), minizero/lab/train.py
                 (forward_backward: all micro-batches but the last inside engine.no_sync())

A step's global batch may not fit in memory at once: each rank then runs K micro-batches, one after
the other, and the gradients of all K *accumulate* in p.grad (backward adds into it) before one
optimizer step. In data parallelism the expensive part is the all-reduce of Ψ gradients (2(N-1)/N ·
4Ψ bytes per rank in fp32). Done after every micro-batch it would cost K times that for nothing:
averaging is linear, so the average of the sums is the sum of the averages. PyTorch's DDP and
minizero's engines therefore offer `no_sync()`: backward inside it only accumulates locally, and the
first backward outside it reduces what was accumulated. The scale has to be right exactly once: with
each micro-batch's loss divided by K and the ranks' sums averaged over N, the step's gradient is
that of the global batch.

Write train_step(model, optimizer, micro_batches, loss_fn) for one rank: `model` is this rank's
replica (all ranks start equal), `micro_batches` a list of K (inputs, targets) pairs of this rank's
rows, loss_fn(model(inputs), targets) the mean loss of a micro-batch. Run forward and backward on
each micro-batch with the loss divided by K, communicating nothing; then make every parameter's
.grad the average over ranks (comm.all_reduce), take one optimizer step and zero the gradients.
Return the step's loss on this rank: the sum over micro-batches of the loss divided by K (a float).

What the grader checks: two ranks, K = 2 micro-batches, 3 SGD steps of a small MLP; every rank must
end where one process training on the whole global batch ends, and the bytes each rank sends per
step (comm.tally) must be those of one all-reduce of all the gradients, not K of them.

Hints:
  * loss.backward() adds into p.grad: doing nothing between micro-batches *is* the accumulation.
  * comm.all_reduce(p.grad, op="avg") averages in place; every rank must issue the same collectives
    in the same order (model.parameters() is the same list everywhere).
  * optimizer.zero_grad() after the step, so the next step does not accumulate into this one.
"""

from minizero import comm  # noqa: F401  (your answer will need it)


def train_step(model, optimizer, micro_batches: list, loss_fn) -> float:
    """K micro-batches accumulated locally, one averaging of the gradients, one optimizer step."""
    raise NotImplementedError("ex03: write train_step")
