"""Exercise 5: gradient clipping when every rank holds only its partition of the gradients.

    Grade it:    pytest exercises -k ex05            (or: python -m minizero.grade -k ex05)
    Notebook:    notebooks/02_zero1.ipynb
    Compare:     minizero/engine.py (Engine._clip), torch.nn.utils.clip_grad_norm_

Clipping by the global norm rescales all gradients by min(1, max_norm / (‖g‖ + 1e-6)), where ‖g‖ is
the 2-norm of the *whole* gradient: every element of every parameter. From ZeRO's stage 1 on, after
the reduce-scatter each rank holds only its partition of the averaged gradient [Ψ/N]. Clipping each
partition by its own norm (a classic mistake) gives each rank a different scale: the ranks'
parameters are then no longer those of one model trained with clipping, and they drift apart in ways
no test of a single rank sees. The global norm needs one number from each rank: ‖g‖² is the sum over
ranks of the sums of squares of their partitions. One all-reduce of one element, 4 bytes, instead of
the gradients.

Write clip_grad_norm_(grads, max_norm): `grads` is this rank's list of gradient partitions (one
tensor per bucket, as ZeRO-1 and ZeRO-2 hold them, padding zeros included: they add nothing to the
norm). Scale them all in place by min(1, max_norm / (‖g‖ + 1e-6)) and return ‖g‖ as a float, the
same on every rank: exactly what torch.nn.utils.clip_grad_norm_ would do to the whole, unpartitioned
gradient.

What the grader checks: three ranks hold uneven partitions of two gradients of known norm; after
your clip_grad_norm_ each rank's partitions must equal its slice of torch's clipped gradient, and
the norm each rank returns the global one, both when clipping applies and when the norm is below
max_norm; and each rank may send at most a few bytes (one number: comm.tally), not the gradients
themselves.

Hints:
  * Sum the squares in fp32 (g.float().pow(2).sum()) into one 0-dimensional tensor, then
    comm.all_reduce(that, op="sum"); its square root is ‖g‖ on every rank.
  * (max_norm / (norm + 1e-6)).clamp(max=1.0) is the scale; g.mul_(scale) scales in place.
"""

from minizero import comm  # noqa: F401  (your answer will need it)


def clip_grad_norm_(grads: list, max_norm: float) -> float:
    """Clip this rank's gradient partitions by the global norm over all ranks' partitions; return
    it."""
    raise NotImplementedError("ex05: write clip_grad_norm_")
