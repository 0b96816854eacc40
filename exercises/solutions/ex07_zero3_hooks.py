"""Exercise 7, answer: what minizero's stage 3 does in Unit.gather / Unit.free (zero3.py), without its
prefetching and bookkeeping, and where it does it (Unit.pre_forward ... Unit.post_backward)."""

from minizero import comm


def gather(unit) -> None:
    full = unit.full
    full.untyped_storage().resize_(full.numel() * full.element_size())   # allocate [Ψ_u padded]
    comm.all_gather(full, unit.shard)                                    # N partitions -> full unit


def free(unit) -> None:
    unit.full.untyped_storage().resize_(0)          # shape kept, parameters stay views, 0 bytes held


def pre_forward(unit):
    gather(unit)


def post_forward(unit):
    free(unit)


def pre_backward(unit):
    gather(unit)


def post_backward(unit):
    handle = unit.reduce_scatter_grads()
    free(unit)
    return handle
