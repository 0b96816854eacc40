"""Mutant: gathers each unit when its visit begins and waits: right, but nothing overlaps."""

from solutions.ex14_overlap_buckets import Prefetcher as Right


class Prefetcher(Right):
    def use(self, k):
        unit = self.order[k]
        if unit not in self.gathered:
            self.gathered[unit] = self.gather(unit)
        self.gathered[unit].wait()
