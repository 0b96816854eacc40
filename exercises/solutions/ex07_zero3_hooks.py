"""Exercise 7, answer: what minizero's stage 3 does in Unit.gather (a prefetch is its async_op=True)
and Unit.free (zero3.py), without its bookkeeping, and where it does it (Unit.pre_forward ...
post_backward)."""

from minizero import comm

# unit -> the handle of the all-gather started for it, not yet waited for
_in_flight: dict = {}


def start_gather(unit) -> None:
    """Allocate the unit's full buffer and start all-gathering the N shards into it (unless on its
    way)."""
    full = unit.full
    if unit in _in_flight or full.untyped_storage().nbytes():
        return
    full.untyped_storage().resize_(full.numel() * full.element_size())   # allocate [Ψ_u padded]
    _in_flight[unit] = comm.all_gather(full, unit.shard, async_op=True)  # N partitions -> full unit


def gather(unit) -> None:
    start_gather(unit)                               # nothing to do if a prefetch started it
    handle = _in_flight.pop(unit, None)
    if handle is not None:
        handle.wait()


def free(unit) -> None:
    handle = _in_flight.pop(unit, None)              # never free a buffer an all-gather is writing
    if handle is not None:
        handle.wait()
    # 0 bytes held, shape kept (minizero then points the parameters away: unit.point_params)
    unit.full.untyped_storage().resize_(0)


def pre_forward(unit, following):
    gather(unit)
    if following is not None:
        start_gather(following)                      # fetched while this unit computes


def post_forward(unit):
    free(unit)


def pre_backward(unit, following):
    pre_forward(unit, following)                     # the same: materialize, prefetch the next


def post_backward(unit):
    handle = unit.reduce_scatter_grads()
    free(unit)
    return handle
