"""The ZeRO paper's Table 1 at small scale, measured (minizero/lab/table1.py): for every mesh of 4
ranks and every stage, the largest GPT of the ladder whose model states fit 1 MB per rank is
trained next to the one a size up; the measured model states are the formula's, the first within
the budget, the second over it.

    python -m pytest tests/test_table1.py -q
    python -m minizero.memory --table1 --measure --device-gb 0.001 --world-size 4
"""

import json

import pytest

from minizero.cli.memory import main
from minizero.lab.model import GPTConfig, count_params
from minizero.lab.table1 import LADDER, STATES, sizes
from minizero.memory import estimate_breakdown, within_padding
from minizero.memory.mesh import estimate_mesh

BUDGET, N = 1e6, 4


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("table1") / "table1.json"
    assert main(["--table1", "--measure", "--device-gb", str(BUDGET / 1e9), "--world-size",
                 str(N), "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_every_mesh_and_stage_is_measured(measured):
    assert (measured["device_bytes"], measured["world_size"]) == (BUDGET, N)
    cells = {(r["model_parallel"], r["data_parallel"], r["stage"]) for r in measured["measured"]}
    assert cells == {(m, N // m, s) for m in (1, 2, 4) for s in range(4)}


def test_the_largest_that_fits_fits_and_the_next_does_not(measured):
    """Measured model states (engine.memory(), rank 0) = estimate_breakdown(Ψ_rank, N_d, stage),
    recomputed here, up to padding; the chosen GPT within the budget, the next over it."""
    for r in measured["measured"]:
        cell = f"{r['model_parallel']} x {r['data_parallel']}, stage {r['stage']}"
        fit, over = r["rungs"]
        assert (fit["fits"], over["fits"], over["width"] > fit["width"]) == (True, False, True)
        for rung in (fit, over):
            assert rung["params"] == count_params(GPTConfig(n_embd=rung["width"], **LADDER))
            if r["model_parallel"] == 1:
                assert rung["params_per_rank"] == rung["params"], cell
            formula = estimate_breakdown(rung["params_per_rank"], r["data_parallel"], r["stage"],
                                         **sizes())
            total = sum(formula[c] for c in STATES)
            assert rung["formula"] == total, cell
            assert within_padding(rung["measured"], total, r["data_parallel"], times=3), (
                f"{cell}, h = {rung['width']}: measured {rung['measured']}, formula {total}")
        assert fit["measured"] <= BUDGET < over["measured"], (cell, fit, over)


def test_the_paper_estimate_is_the_budget_over_bytes_per_parameter(measured):
    """Ψ_max (every parameter split M ways) fills the budget exactly; a real split GPT keeps some
    parameters whole on every rank, so the largest that fits is at most Ψ_max."""
    for r in measured["measured"]:
        m, n_d = r["model_parallel"], r["data_parallel"]
        assert estimate_mesh(r["estimate"], m, n_d, r["stage"], **sizes()) == pytest.approx(BUDGET)
        assert r["rungs"][0]["params"] <= r["estimate"], r


@pytest.mark.parametrize("args, message", [
    (["--params", "1e6", "--world-size", "2", "--measure"], "--measure goes with --table1"),
    (["--table1", "--measure", "--device-gb", "1e-6"], "hold not even the narrowest GPT (h = 4)"),
])
def test_bad_input_is_one_line(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
