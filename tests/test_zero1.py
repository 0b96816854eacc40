"""ZeRO stage 1 (P_os) against the single-process reference, the paper's memory formula and its
2Ψ traffic."""

from _checks import StageSuite


class TestZero1(StageSuite):
    stage = 1
