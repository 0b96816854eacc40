"""Grader for exercise 1 (ring all-reduce):  pytest exercises -k ex01

Three ranks run your ring_all_reduce on rank-dependent tensors of several sizes, with every
collective of torch.distributed disabled and the bytes handed to point-to-point sends counted.
"""

import math

import pytest
import torch
import torch.distributed as dist

import _grading as g
from minizero import comm

N = 3
SHAPES = [(10,), (4, 6), (2,)]        # not divisible by N; 2 elements: fewer than ranks
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_tensor", "broadcast", "reduce", "all_to_all_single",
)
# minizero.comm's collectives and the door they pass through are refused in the source too (g.guard)
REFUSED = tuple(f"minizero.comm.{name}" for name in ("issue", *COLLECTIVES))


def rank_tensor(shape, rank: int) -> torch.Tensor:
    return (torch.arange(math.prod(shape), dtype=torch.float32) * (rank + 1) + 100 * rank).reshape(
        shape
    )


def _forbid(name):
    def forbidden(*args, **kwargs):
        raise AssertionError(f"ex01 must not call torch.distributed.{name}: the exercise builds "
                             "all-reduce from exchange() (point-to-point sends) alone")
    return forbidden


def worker(module_name: str) -> list[dict]:
    """Runs on every rank: your ring on each shape, the bytes this rank sent for it."""
    ring = g.learner(module_name).ring_all_reduce
    sent = [0]
    batch, send, isend = dist.batch_isend_irecv, dist.send, dist.isend

    def counting_batch(ops):
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is isend)
        return batch(ops)

    def counting_send(tensor, *args, **kwargs):
        sent[0] += tensor.numel() * tensor.element_size()
        return send(tensor, *args, **kwargs)

    dist.batch_isend_irecv, dist.send = counting_batch, counting_send     # this rank's process only
    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, _forbid(name))
    out = []
    for shape in SHAPES:
        tensor, before = rank_tensor(shape, comm.rank()), sent[0]
        returned = ring(tensor)
        out.append({"tensor": tensor, "returned": returned if torch.is_tensor(returned) else None,
                    "sent": sent[0] - before})
    return out


def check(impl: str) -> None:
    g.guard(impl, REFUSED)
    results = g.launch(worker, N, impl)
    for rank, per_shape in enumerate(results):
        for shape, res in zip(SHAPES, per_shape):
            expected = sum(rank_tensor(shape, q) for q in range(N))
            got, numel = res["tensor"], math.prod(shape)
            chunk = -(-numel // N)
            if not torch.allclose(got, expected):
                if res["returned"] is not None and torch.allclose(res["returned"], expected):
                    raise AssertionError(f"rank {rank}, tensor of shape {shape}: you returned the "
                                         "right sum but the tensor passed in was not changed: "
                                         "write the sum in place")
                i = int((got - expected).abs().reshape(-1).argmax())
                raise AssertionError(
                    f"rank {rank}, tensor of shape {shape}, element {i} (chunk {i // chunk} of {N}"
                    f", {chunk} elements each): expected the sum over ranks "
                    f"{expected.reshape(-1)[i].item():g}, got {got.reshape(-1)[i].item():g}. Rank "
                    f"r's tensor started as arange({numel}) * (r + 1) + 100 r.")
            want = 2 * (N - 1) * chunk * got.element_size()
            if res["sent"] != want:
                raise AssertionError(
                    f"rank {rank}, tensor of shape {shape}: sent {res['sent']} bytes through "
                    f"exchange(); a ring sends 2(N-1) = {2 * (N - 1)} chunks of ceil({numel}/{N}) "
                    f"= {chunk} elements, {want} bytes"
                    + (" (whole tensors instead of chunks?)" if res["sent"] > want else ""))


@pytest.mark.points(3)
def test_ring_all_reduce_sums_in_place_with_ring_traffic(impl):
    check(impl)
