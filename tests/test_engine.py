"""What every stage shares (minizero/engine.py): engine.gathered() reads and writes full parameters
between steps, at every stage, with frozen parameters and with offload."""

import pytest
import torch

import minizero
from _workers import gathered_round_trips

SETTINGS = [(0, {}), (1, {}), (1, {"offload": True}), (2, {"dtype": "bf16"}), (2, {}),
            (3, {}), (3, {"offload": "params"}), (3, {"dtype": "bf16"})]


@pytest.fixture(scope="module")
def round_trips():
    return minizero.launch(gathered_round_trips, 2, SETTINGS)


@pytest.mark.parametrize("i", range(len(SETTINGS)), ids=[f"stage{s}-{o}" for s, o in SETTINGS])
def test_gathered_reads_full_parameters_and_rank_1_writes_reach_every_rank(round_trips, i):
    ranks = [per_rank[i] for per_rank in round_trips]
    for r, res in enumerate(ranks):
        assert res["read_ok"], f"rank {r}: gathered() did not show the full trained parameters"
        assert res["written_ok"], f"rank {r}: what rank 1 wrote inside gathered(modifier_rank=1) is not there"
    # and the step after it kept the replicas identical
    assert all(torch.equal(ranks[0]["state"][k], ranks[1]["state"][k]) for k in ranks[0]["state"])
