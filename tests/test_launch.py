"""minizero.launch: results by rank, a failing rank named, nobody left behind, bad input refused."""

import time

import pytest
from _workers import raise_on, rank_and_size

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


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4"])
def test_bad_world_size(bad):
    with pytest.raises(ValueError, match="world_size"):
        minizero.launch(rank_and_size, bad)
