"""The per-parameter step-through (minizero/lab/stepthrough_fully_shard.py) records what
minizero.fully_shard did, and its check rejects a recording that shows anything else.

    python -m pytest tests/test_stepthrough_fully_shard.py

One launch at N = 3 (l2's two rows leave rank 2 with padding only); the corrupted recordings
below are what a wrong implementation would have shown: each must fail stepthrough.check with the
phase, rank and parameter named.
"""

from __future__ import annotations

import copy

import pytest

from minizero.lab import stepthrough


@pytest.fixture(scope="module")
def steps() -> dict:
    return stepthrough.record(stepthrough.StepConfig(stage=3, world_size=3,
                                                     layout="per-parameter"))


def test_the_recording_replays_against_one_process(steps):
    stepthrough.check(steps)
    kinds = [p["kind"] for p in steps["phases"]]
    assert kinds == ["start", "all_gather", "free", "all_gather", "free", "forward",
                     "all_gather", "all_gather", "free", "ready", "reduce_scatter", "free",
                     "ready", "reduce_scatter", "arrived", "arrived", "step"]
    assert "a prefetch" in steps["phases"][7]["label"]
    # rank 2 of 3 holds only padding of l2 (2 rows): no momentum there, none of its gradient
    l2 = [b for b in steps["buckets"] if b["name"].startswith("l2.")]
    assert [b["rows"] for b in l2] == [[1, 1, 0], [1, 1, 0]]
    last = steps["phases"][-1]["ranks"][2]
    for b in l2:
        assert all(last["momentum"][j] is None for j in range(b["start"], b["start"] + b["padded"]))


def test_the_lines_that_ran_include_the_copies_and_nothing_of_the_recorder(steps):
    ran = {r["function"] for r in steps["ran"]}
    assert {"Unit.gather", "Unit._copy_out", "ShardedParam.copy_shard_into",
            "ShardedParam.copy_grad_into", "Reduction.finish", "ShardedParam.add_grad"} <= ran
    assert not any("/lab/" in r["file"] for r in steps["ran"])
    gather = [r["line"] for r in steps["ran"] if r["function"] == "Unit.gather"]
    secondary = [r for r in stepthrough.ran(steps, "Unit.gather")
                 if "row.copy_(secondary[i])" in _line(r)]
    assert gather and not secondary, "reshard_after_forward=k's branch did not run"


def _line(where: tuple[str, int]) -> str:
    from minizero.lab import source
    return (source.ROOT / where[0]).read_text().splitlines()[where[1] - 1]


def _where(steps, kind: str, name: str) -> tuple[int, range]:
    """(the first phase of `kind`, the elements of parameter `name`)."""
    k = next(i for i, p in enumerate(steps["phases"]) if p["kind"] == kind)
    b = next(b for b in steps["buckets"] if b["name"] == name)
    return k, range(b["start"], b["start"] + b["padded"])


def corrupt_sum(steps):
    """The gradients summed over the ranks instead of averaged."""
    for phase in steps["phases"]:
        for rank in phase["ranks"]:
            rank["gradient shard"] = [None if v is None else 3 * v
                                      for v in rank["gradient shard"]]


def corrupt_rows(steps):
    """Ranks 0 and 1 keep each other's rows of l1.weight."""
    _, cols = _where(steps, "start", "l1.weight")
    for phase in steps["phases"]:
        a, b = phase["ranks"][0]["parameter shard"], phase["ranks"][1]["parameter shard"]
        width = len(cols) // 3
        for j in cols[:width]:
            a[j], b[j + width] = b[j + width], a[j]


def corrupt_padding(steps):
    """Rank 2's padding row of l2.weight not zero."""
    _, cols = _where(steps, "start", "l2.weight")
    steps["phases"][0]["ranks"][2]["parameter shard"][cols[-1]] = 0.5


def corrupt_free(steps):
    """A unit still gathered after its free."""
    k, cols = _where(steps, "free", "l1.weight")
    steps["phases"][k]["ranks"][1]["parameters"][cols[0]] = 0.1


@pytest.mark.parametrize("corrupt, message", [
    (corrupt_sum, r"rank \d, l\d\.\w+ element \d+, gradient: .*expected"),
    (corrupt_rows, r"phase 0 .*rank 0, l1\.weight element 0, its shard"),
    (corrupt_padding, r"phase 0 .*rank 2, l2\.weight element 8: padding not zero"),
    (corrupt_free, r"phase 2 .*rank 1 still holds the unit's parameters"),
])
def test_the_check_rejects_what_a_wrong_implementation_would_show(steps, corrupt, message):
    wrong = copy.deepcopy(steps)
    corrupt(wrong)
    with pytest.raises(AssertionError, match=message):
        stepthrough.check(wrong)


@pytest.mark.parametrize("config, message", [
    ({"layout": "columns"}, "layout must be 'flat' or 'per-parameter', got 'columns'"),
    ({"layout": "per-parameter", "stage": 2}, "records fully_shard at its defaults"),
    ({"layout": "per-parameter", "offload": True}, "records fully_shard at its defaults"),
])
def test_what_it_cannot_record_is_refused_in_one_line(config, message):
    with pytest.raises(ValueError, match=message) as refused:
        stepthrough.record(stepthrough.StepConfig(**{"stage": 3, **config}))
    assert "\n" not in str(refused.value)
