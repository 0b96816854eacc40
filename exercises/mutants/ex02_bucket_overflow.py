"""Mutant: closes a bucket only once it holds *more* than bucket_bytes (PyTorch's rule is "at
least")."""

from solutions.ex02_ddp_bucket import all_reduce_bucket  # noqa: F401  (the correct half)


def split_into_buckets(params, bucket_bytes):
    buckets, current, size = [], [], 0
    for p in params:
        current.append(p)
        size += p.numel() * p.element_size()
        if size > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])
