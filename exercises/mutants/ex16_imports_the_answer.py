"""Mutant: hands the buckets to minizero's own designs instead of writing them."""

from minizero.beyond.muon.round_robin import RoundRobin  # noqa: F401
from minizero.beyond.muon.straddle import GatherStraddlers  # noqa: F401
from solutions.ex16_muon_designs import (  # noqa: F401
    orthogonalize_round_robin,
    orthogonalize_straddlers,
)
