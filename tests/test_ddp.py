"""DDP (stage 0): reference, memory (2+2+K)Ψ, an all-reduce of exactly 2(N-1)/N·Ψ bytes per step."""

from _checks import StageSuite


class TestDDP(StageSuite):
    stage = 0

    def test_tally_is_exactly_the_ring_all_reduce(self, runs):
        for n in (2, 3, 4):
            cfg, results = runs[(n, "memory_fp32")]
            tally = results[0]["comm_bytes_per_step"]
            assert set(tally) == {"all_reduce", "total", "intra_node", "inter_node"}
            assert tally["all_reduce"] == 2 * (n - 1) / n * results[0]["num_params"] * 4
            assert tally["intra_node"] == tally["total"]   # no network model: one machine, one node


def test_buckets_are_reduced_while_backward_runs():
    from _workers import buckets_launched_during_backward

    import minizero
    buckets, overlapped = minizero.launch(buckets_launched_during_backward, 2, 0)[0]
    # every bucket is sent from an autograd hook before backward returns (none is left for finish())
    assert buckets >= 4 and overlapped == buckets
