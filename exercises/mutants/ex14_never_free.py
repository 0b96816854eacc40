"""Mutant: keeps every gathered unit: fast, but the whole model ends up materialized on each rank,
which is what stage 3 exists to avoid."""

from solutions.ex14_overlap_buckets import Prefetcher as Right


class Prefetcher(Right):
    def done(self, k):
        pass
