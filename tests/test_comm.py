"""The communication layer: collectives are right, the ring all-reduce equals all_reduce, tallies are ring bytes."""

import pytest
import torch
from _workers import collectives

import minizero
from minizero import comm


@pytest.fixture(scope="module", params=[3, 4])
def results(request):
    return request.param, minizero.launch(collectives, request.param)


def test_collectives_compute_the_right_values(results):
    n, res = results
    for r, out in enumerate(res):
        expected_sum = n * torch.arange(10.0) + 100 * sum(range(n))
        assert torch.equal(out["all_reduce"], expected_sum), f"rank {r}: all_reduce"
        # rank r receives the average over ranks of chunk r of arange(4n) * (rank + 1)
        mean_scale = sum(k + 1 for k in range(n)) / n
        assert torch.allclose(out["reduce_scatter"], torch.arange(4 * r, 4 * r + 4.0) * mean_scale), f"rank {r}"
        assert torch.equal(out["all_gather"], torch.arange(1.0, n + 1).repeat_interleave(3)), f"rank {r}"
        assert torch.equal(out["broadcast"], torch.full((5,), float(n - 1))), f"rank {r}: broadcast"


def test_ring_all_reduce_equals_all_reduce(results):
    _, res = results
    assert all(out["ring_matches"] for out in res)


def test_tally_counts_ring_bytes(results):
    n, res = results
    out = res[0]
    assert out["tally_all_reduce"] == pytest.approx(2 * (n - 1) / n * 10 * 4)
    assert out["tally_reduce_scatter"] == pytest.approx((n - 1) / n * 4 * n * 4)
    assert out["tally_all_gather"] == pytest.approx((n - 1) / n * 3 * n * 4)
    chunk = -(-21 // n)                                       # the ring pads 21 elements to N chunks
    assert out["tally_ring"] == pytest.approx(2 * (n - 1) * chunk * 4)


def test_single_process_without_a_group_is_a_no_op():
    x = torch.ones(4)
    comm.reset_tally()
    comm.all_reduce(x)
    out = torch.empty(4)
    comm.all_gather(out, x)
    assert torch.equal(out, x) and torch.equal(x, torch.ones(4))
    assert comm.tally()["total"] == 0
