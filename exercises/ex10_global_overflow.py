"""Exercise 10: fp16 loss scaling, the global overflow check.

    Grade it:    pytest exercises -k ex10            (or: python -m minizero.grade -k ex10)
    Notebook:    notebooks/05_offload.ipynb (its last section: the loss scale of an fp16 run)
    Compare:     minizero/loss_scale.py (found_overflow, LossScaler.update) and its
                 [Note: global overflow]

fp16 training multiplies the loss by a scale S so that small gradients do not underflow; a step
whose gradients hold an inf or a nan (S was too large) is skipped and S is halved. With ZeRO the
gradients are partitioned: after the reduce-scatter each rank holds only its own partition, so an
inf in the gradient lands on ONE rank. If each rank decided from its own partition, that rank would
skip the step while the others take it: their parameters (and their scales) part ways for good.

Write found_overflow(grads): `grads` is this rank's list of gradient partitions (one tensor per
bucket, fp16). Return True on EVERY rank if ANY rank's partitions hold an inf or a nan, False on
every rank otherwise: the same answer everywhere. minizero's loss scaler calls it once per step
(unscale), then skips the step on True and backs off the scale (with hysteresis), exactly as
DeepSpeed does.

What the grader checks: two ranks train a small GPT in fp16 with minizero's stage 3 for 4 steps,
your found_overflow as the scaler's check. The grader puts an inf into rank 1's partition at step 1
and a nan into rank 0's at step 2. Every rank must report an overflow at steps 1 and 2 (and only
where minizero's own check does), and the run, loss scales included, must end bit-identical to
minizero's.

Hints:
  * torch.isfinite(t).all() is False if t holds an inf, a -inf or a nan.
  * minizero.comm.all_reduce(tensor, op=...) combines one tensor over the ranks in place (op "sum",
    "avg" or "max"). One small tensor, one collective per step: every rank must call it, overflow or
    not.
"""


def found_overflow(grads: list) -> bool:
    """Whether any rank's gradient partitions hold an inf or a nan; the same answer on every
    rank."""
    raise NotImplementedError("ex10: write found_overflow")
