"""The communication layer: collectives are right, the ring all-reduce equals all_reduce, tallies
are ring bytes, and agree() tells every rank alike whether all ranks hold the same number."""

import pytest
import torch
from _workers import collectives

import minizero
from minizero import comm
from minizero.beyond import desync


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
        assert torch.allclose(
            out["reduce_scatter"], torch.arange(4 * r, 4 * r + 4.0) * mean_scale
        ), f"rank {r}"
        assert torch.equal(out["all_gather"], torch.arange(1.0, n + 1).repeat_interleave(3)), (
            f"rank {r}"
        )
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
    chunk = -(-21 // n)                                      # the ring pads 21 elements to N chunks
    assert out["tally_ring"] == pytest.approx(2 * (n - 1) * chunk * 4)


def test_all_to_all_transposes_chunks(results):
    n, res = results
    for r, out in enumerate(res):
        assert torch.equal(out["all_to_all"], torch.arange(n, dtype=torch.float32) * 10 + r), (
            f"rank {r}"
        )


def test_mesh_groups_reduce_within_rows_and_columns(results):
    n, res = results
    if n % 2:
        pytest.skip("a mesh of rows of 2 needs an even world size")
    for r, out in enumerate(res):
        row, column = list(range(r - r % 2, r - r % 2 + 2)), list(range(r % 2, n, 2))
        assert list(out["row"]) == row and list(out["column"]) == column, f"rank {r}"
        assert torch.equal(out["row_sum"], torch.full((3,), float(sum(row)))), f"rank {r}: row"
        assert torch.equal(out["column_sum"], torch.full((3,), float(sum(column)))), (
            f"rank {r}: column"
        )
        # within the row of 2: index i gets chunk i of sum over the row of (arange(4) + rank)
        i = r % 2
        expected = 2 * torch.arange(2 * i, 2 * i + 2.0) + sum(row)
        assert torch.equal(out["row_reduce_scatter"], expected), (
            f"rank {r}: reduce-scatter in the row"
        )
        assert out["tally_group"] == pytest.approx((2 - 1) / 2 * 4 * 4)    # ring bytes over 2 ranks


def test_single_process_without_a_group_is_a_no_op():
    x = torch.ones(4)
    comm.reset_tally()
    comm.all_reduce(x)
    out = torch.empty(4)
    comm.all_gather(out, x)
    assert torch.equal(out, x) and torch.equal(x, torch.ones(4))
    assert comm.tally()["total"] == 0


def test_nccl_on_an_older_torch_is_one_line_before_any_group(monkeypatch):
    """torch < 2.13 lacks the collectives comm issues on NCCL: comm.init says so, before it touches
    a GPU or a store, rather than an AttributeError at the first step (the GPU image that ran
    test_cuda had torch 2.11: fine at N = 1, where no collective runs)."""
    monkeypatch.delattr(torch.distributed, "all_gather_single")
    with pytest.raises(RuntimeError, match=r"needs torch >= 2\.13 for NCCL with 2 ranks"):
        comm.init(0, 2, backend="nccl")
    assert not torch.distributed.is_initialized()


def agreements() -> list[bool]:
    """desync.agree on: one value everywhere; one rank's off by one; the largest value it takes
    everywhere, then one rank's off by one (exact: no rounding); one rank's negated."""
    desync.open_agreement()
    r, big = comm.rank(), 2**62 - 1
    agree = desync.agree
    return [agree(7), agree(7 + (r == 1)), agree(big), agree(big - (r == 2)),
            agree(-5 if r == 0 else 5)]


def test_agree_is_exact_and_the_same_answer_on_every_rank():
    assert minizero.launch(agreements, 3) == [[True, False, True, False, False]] * 3
