"""flat.py: padding, equal partitions, parameters straddling ranks, views that write through."""

import torch
from torch import nn

from minizero.flat import FlatLayout, padded_size, split_into_buckets


def _params(*sizes):
    return [nn.Parameter(torch.arange(float(s)).reshape(s)) for s in sizes]


def test_padded_size():
    assert [padded_size(n, 4) for n in (1, 4, 15, 16, 17)] == [4, 4, 16, 16, 20]


def test_partitions_cover_the_buffer_once_and_parameters_straddle():
    ps = _params(6, 4, 5)                              # Ψ = 15, N = 4 -> padded 16, partitions of 4
    layouts = [FlatLayout.build([ps], 4, r) for r in range(4)]
    b = layouts[0].buckets[0]
    assert (b.numel, b.padded_numel, b.shard_numel) == (15, 16, 4)
    flat = layouts[0].flatten(torch.float32, torch.device("cpu"))
    parts = [
        lay.my_partition(lay.full(flat, b), b) for lay, b in ((l, l.buckets[0]) for l in layouts)
    ]
    assert torch.equal(torch.cat(parts), flat)
    assert flat[15] == 0                                    # padding is zero
    assert torch.equal(parts[1], torch.tensor([4.0, 5.0, 0.0, 1.0]))   # end of p0, start of p1


def test_point_params_into_makes_writes_visible():
    ps = _params(3, 2)
    lay = FlatLayout.build([ps], 2, 0)
    flat = lay.flatten(torch.float32, torch.device("cpu"))
    lay.point_params_into(flat)
    flat.fill_(7.0)
    assert all(torch.all(p == 7.0) for p in ps)


def test_buckets_and_shard_offsets():
    ps = _params(10, 10, 10, 3)
    groups = split_into_buckets(ps, bucket_bytes=80)        # 20 floats per bucket
    assert [len(g) for g in groups] == [2, 2]
    lay = FlatLayout.build(groups, 3, 1)
    assert [b.padded_numel for b in lay.buckets] == [21, 15]
    assert [b.shard_start for b in lay.buckets] == [0, 7]
    assert lay.shard_numel == 12 and lay.numel == 33


def test_unpadded_layout_for_ddp():
    lay = FlatLayout.build([_params(5)], 4, 0, pad=False)
    assert lay.buckets[0].padded_numel == 5 and lay.buckets[0].shard_numel == 5
