"""Grader for exercise 5 (clipping by the global norm over partitions):  pytest exercises -k ex05

Three ranks hold uneven partitions (ZeRO's: each bucket padded to a multiple of N and cut in N) of
two gradients whose norm the grader knows; each calls your clip_grad_norm_ on its own partitions.
Every rank's result must be its slice of what torch.nn.utils.clip_grad_norm_ does to the whole
gradients, its returned norm the global one, and what it sends (comm.tally) at most a few numbers.
"""

import pytest
import torch
from torch import nn

import _grading as g
from minizero import comm

N = 3
SHAPES = [(7, 5), (11,)]                   # two buckets: 35 elements padded to 36, 11 padded to 12
# a few fp32 numbers per rank; the gradients are 184 bytes
MAX_BYTES = 16
CASES = {"clipping applies": 0.25, "norm below max_norm": 10.0}      # max_norm as a multiple of ‖g‖


def gradients() -> list[torch.Tensor]:
    """Magnitudes that differ along each tensor, so every rank's partitions have a norm of their
    own."""
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(shape, generator=gen) * torch.linspace(0.1, 3.0, shape[-1]) for shape in SHAPES
    ]


def partitions(grads: list[torch.Tensor], rank: int) -> list[torch.Tensor]:
    """Rank `rank`'s partition of each bucket, padding zeros included."""
    out = []
    for grad in grads:
        size = -(-grad.numel() // N)
        padded = torch.zeros(size * N)
        padded[: grad.numel()] = grad.reshape(-1)
        out.append(padded[rank * size: (rank + 1) * size].clone())
    return out


def clipped(max_norm: float) -> tuple[list[torch.Tensor], float]:
    """torch's clip_grad_norm_ on the whole gradients: (clipped gradients, total norm)."""
    params = [nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    for p, grad in zip(params, gradients()):
        p.grad = grad.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return [p.grad for p in params], norm.item()


def global_norm() -> float:
    return torch.cat([grad.reshape(-1) for grad in gradients()]).norm().item()


def worker(module_name: str) -> dict:
    answer, out = g.learner(module_name), {}
    for case, factor in CASES.items():
        mine = partitions(gradients(), comm.rank())
        comm.reset_tally()
        norm = g.call(answer.clip_grad_norm_, mine, factor * global_norm())
        out[case] = {"partitions": mine, "norm": norm, "sent": comm.tally()["total"]}
    return {"rank": comm.rank(), "cases": out}


def check_clipping(impl: str) -> None:
    __tracebackhide__ = True
    g.guard(impl)
    results = g.launch_once(worker, N, impl)
    for case, factor in CASES.items():
        expected_grads, expected_norm = clipped(factor * global_norm())
        for res in results:
            rank, got = res["rank"], res["cases"][case]
            where = f"rank {rank}, {case} (max_norm = {factor:g} x ‖g‖)"
            for i, (part, want) in enumerate(
                zip(got["partitions"], partitions(expected_grads, rank))
            ):
                if not torch.allclose(part, want, rtol=1e-5, atol=1e-7):
                    scale = (part.norm() / partitions(gradients(), rank)[i].norm()).item()
                    want_scale = min(1.0, factor * global_norm() / (expected_norm + 1e-6))
                    raise AssertionError(f"{where}: partition {i} was scaled by {scale:.4g}, "
                                         f"expected {want_scale:.4g}: every rank scales by "
                                         "max_norm / the norm of the whole gradient, the same "
                                         "number everywhere")
            if (
                not isinstance(got["norm"], float)
                or abs(got["norm"] - expected_norm) > 1e-4 * expected_norm
            ):
                raise AssertionError(f"{where}: clip_grad_norm_ returned {got['norm']!r}, expected "
                                     f"the global norm {expected_norm:.6g} (a float), over every "
                                     "rank's partitions")


def check_bytes(impl: str) -> None:
    __tracebackhide__ = True
    g.guard(impl)
    for res in g.launch_once(worker, N, impl):
        for case, got in res["cases"].items():
            if got["sent"] > MAX_BYTES:
                raise AssertionError(f"rank {res['rank']}, {case}: sent {got['sent']:g} bytes to "
                                     f"clip {sum(p.numel() for p in got['partitions'])} elements; "
                                     "the global norm needs one number per rank (at most "
                                     f"{MAX_BYTES} bytes): all-reduce the sum of squares, not the "
                                     "gradients")


@pytest.mark.points(2)
def test_every_rank_clips_by_the_global_norm(impl):
    check_clipping(impl)


@pytest.mark.points(1)
def test_the_norm_costs_one_number_per_rank(impl):
    check_bytes(impl)
