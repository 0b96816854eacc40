"""minizero.launch: results by rank, a failing rank named, nobody left behind, bad input refused."""

import time

import pytest
from _workers import exit_leaving_the_pipe_open, raise_on, rank_and_size

import minizero


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()          # a zombie has exited
    except FileNotFoundError:
        return False


def test_returns_each_ranks_value_in_rank_order():
    assert minizero.launch(rank_and_size, 3) == [(0, 3), (1, 3), (2, 3)]


def test_a_raising_rank_is_named_and_no_process_is_left(tmp_path):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 failed: ValueError: boom from the test"):
        minizero.launch(raise_on, 3, 1, str(tmp_path))
    assert time.monotonic() - start < 30
    pids = [
        int((tmp_path / f"{r}.pid").read_text())
        for r in range(3)
        if (tmp_path / f"{r}.pid").exists()
    ]
    assert pids, "the workers never started"
    assert not [p for p in pids if _alive(p)], "worker processes outlived launch()"


def test_a_rank_gone_whose_pipe_stays_open_is_named_not_waited_for():
    """A rank exits without a result while a process it started keeps its pipe open (no EOF will
    come): launch names it within seconds instead of waiting for that process (a notebook once sat
    15 minutes with no rank left). Seen failing: without the check it took the whole 20 s."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 0 failed: process died \(exit code 3\).*pipe"):
        minizero.launch(exit_leaving_the_pipe_open, 2, 20.0)
    assert time.monotonic() - start < 12


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4"])
def test_bad_world_size(bad):
    with pytest.raises(ValueError, match="world_size"):
        minizero.launch(rank_and_size, bad)


def test_a_worker_that_cannot_be_sent_is_refused_in_one_line_before_any_rank_starts():
    """A lambda or a nested function cannot be pickled to the ranks: one TypeError saying what the
    worker must be, raised before any process starts (it was pickle's AttributeError)."""
    def nested():
        return 1

    for worker in (lambda: 1, nested):
        with pytest.raises(TypeError, match=r"^launch sends the worker .* by pickle, which failed: "
                                            r".*\(the worker must be importable") as refused:
            minizero.launch(worker, 2)
        assert "\n" not in str(refused.value)
