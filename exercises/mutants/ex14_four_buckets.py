"""Mutant: tuned once for a slow-hop link, four buckets whatever the link: on a link without latency
more, smaller buckets leave less to send after backward."""

from solutions.ex14_overlap_buckets import BucketLauncher  # noqa: F401


def bucket_size(gradient_bytes, backward_s, world_size, latency, bandwidth, max_in_flight):
    return gradient_bytes / 4
