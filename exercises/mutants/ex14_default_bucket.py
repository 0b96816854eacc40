"""Mutant: PyTorch's 25 MB whatever the link: 16 buckets pay 2(N-1)α each on a slow-hop link."""

from solutions.ex14_overlap_buckets import BucketLauncher  # noqa: F401


def bucket_size(gradient_bytes, backward_s, world_size, latency, bandwidth, max_in_flight):
    return 25e6
