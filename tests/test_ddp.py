"""DDP (stage 0): reference, memory (2+2+K)Ψ, an all-reduce of exactly 2(N-1)/N·Ψ bytes per step."""

from _checks import StageSuite


class TestDDP(StageSuite):
    stage = 0

    def test_tally_is_exactly_the_ring_all_reduce(self, runs):
        for n in (2, 3, 4):
            cfg, results = runs[(n, "memory_fp32")]
            tally = results[0]["comm_bytes_per_step"]
            assert set(tally) == {"all_reduce", "total"}
            assert tally["all_reduce"] == 2 * (n - 1) / n * results[0]["num_params"] * 4
