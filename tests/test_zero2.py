"""ZeRO stage 2 (P_os+g): reference, memory 2Ψ + (2+K)Ψ/N, traffic 2Ψ, gradients reduced
during backward."""

from _checks import StageSuite


class TestZero2(StageSuite):
    stage = 2


def test_stage2_keeps_less_gradient_memory_than_stage1():
    import minizero
    from minizero.lab.train import TrainConfig, train_several
    cfgs = [TrainConfig(stage=s, world_size=2, steps=2, bucket_size=50_000) for s in (1, 2)]
    s1, s2 = minizero.launch(train_several, 2, cfgs)[0]
    # stage 2 frees full gradients bucket by bucket: even its peak stays below stage 1's full buffer
    assert s2["memory"]["grads"] * 2 <= s1["memory"]["grads"] + 64
    assert s2["peak"] < s1["peak"]


def test_buckets_are_reduce_scattered_while_backward_runs():
    from _workers import buckets_launched_during_backward

    import minizero
    buckets, overlapped = minizero.launch(buckets_launched_during_backward, 2, 2)[0]
    assert buckets >= 4 and overlapped == buckets
