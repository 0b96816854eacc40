"""Exercise 7: ZeRO stage 3, the four hooks: gather before forward, free after, gather before
backward, reduce-scatter and free after backward.

    Grade it:    pytest exercises -k ex07            (or: python -m minizero.grade -k ex07)
    Notebook:    notebooks/04_zero3.ipynb
    Compare:     minizero/zero3.py (Unit: gather, free, pre_forward, post_forward, pre_backward,
                 post_backward)

Stage 3 (P_os+g+p) partitions the parameters too: (2 + 2 + K)Ψ/N bytes per rank, plus the few
*units* (here: each transformer block, and the rest of the model as one more unit) that are
materialized at any moment. A unit's parameters live in one flat buffer `unit.full` [Ψ_u padded];
while it is materialized the model's parameters are views into it (minizero points them there after
your pre_ hooks, and at NaN placeholders after your post_ hooks: [Note: absent parameters] in
minizero/absent.py). Between uses its storage is released (0 bytes, shape kept), and all that
persists is this rank's partition `unit.shard` [Ψ_u / N], which the optimizer updates in place.

minizero calls your four hooks for every unit (they replace the lifecycle methods of zero3.Unit),
with the unit itself, which has:
    unit.name                    e.g. "blocks.0" ("<root>" is the model minus its blocks)
    unit.full                    the unit's flat parameter buffer; freed: its
                                 full.untyped_storage().nbytes() == 0
    unit.shard                   this rank's partition of it, [full.numel() / N]
    unit.reduce_scatter_grads()  what you wrote in exercise 6 (minizero's version), for this unit:
                                 stage its gradients, free p.grad, start the averaging
                                 reduce-scatter into the gradient shard; returns the async handle
                                 (None inside no_sync(), where gradients only accumulate)

Write the hooks:
  pre_forward(unit, following)   the unit is about to run: materialize its full parameters from
                                 the N shards; then *prefetch* `following`, the unit forward runs
                                 next (None for the last one, and on the first step, while the
                                 order is unknown)
  post_forward(unit)             it has run: release its full parameters
  pre_backward(unit, following)  its backward is about to run and needs the parameters again:
                                 materialize them, then prefetch `following` (next in backward's
                                 order)
  post_backward(unit)            its gradients are complete: reduce-scatter them, release the
                                 parameters, and return the handle reduce_scatter_grads() gave you

Materializing means: give `unit.full` its storage back, then all-gather every rank's shard into it.
Write it in place (the model's parameters are views of unit.full, and autograd saved some of them
for backward): never replace unit.full with a new tensor. Releasing means resizing its storage to 0
bytes.

Prefetching means *starting* that all-gather for `following` (async_op=True) and not waiting: the
network fetches the next unit while this one computes. The unit's own pre_forward then only waits
for the handle. So you need to remember each started handle until its unit's turn (a dict keyed by
unit: the unit objects are minizero's, don't store things on them). Without prefetch every unit's
forward starts by waiting for a whole all-gather: stage 3's communication would add to its compute
instead of hiding behind it.

What the grader checks: after each hook, that the unit is materialized (pre_*) or released (post_*);
from the second step on, that every unit but the first one in each direction was already prefetched
when its hook began; that your hooks gather and free by themselves (unit.gather() and unit.free()
are minizero's own answer: calling them fails); and three ranks training a small GPT for 3 SGD steps
with minizero's stage 3 driven by your hooks end where one process training on the whole batch ends.

Hints:
  * t.untyped_storage().resize_(nbytes) re-allocates (or, with 0, frees) a tensor's memory in place.
    A tensor of t.numel() elements needs t.numel() * t.element_size() bytes.
  * comm.all_gather(output, input, async_op=True): rank r's input lands at output[r*n:(r+1)*n],
    n = input.numel(); it returns a handle whose .wait() returns when the data is there.
  * Two small helpers, start_gather(unit) (allocate, start the all-gather, remember the handle;
    nothing if it is on its way already) and free(unit), make the four hooks one to three lines
    each.
"""

from minizero import comm  # noqa: F401  (your answer will need it)


def pre_forward(unit, following) -> None:
    raise NotImplementedError("ex07: write pre_forward")


def post_forward(unit) -> None:
    raise NotImplementedError("ex07: write post_forward")


def pre_backward(unit, following) -> None:
    raise NotImplementedError("ex07: write pre_backward")


def post_backward(unit):
    raise NotImplementedError("ex07: write post_backward")
