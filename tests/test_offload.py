"""CPU offload for stages 1-3 (optimizer on the host; stage 3 also parameters): same results as the
reference, device bytes drop by the optimizer states, which appear under 'offloaded'."""

from _checks import StageSuite


class TestOffloadStage1(StageSuite):
    stage, options = 1, {"offload": True}


class TestOffloadStage2(StageSuite):
    stage, options = 2, {"offload": True}


class TestOffloadParamsStage3(StageSuite):
    stage, options = 3, {"offload": "params"}
