"""Mutant: prefetches unit u + 1, the next one of forward, also in backward, where the next unit is
u - 1."""

from solutions.ex14_overlap_buckets import Prefetcher as Right


class Prefetcher(Right):
    def use(self, k):
        unit, units = self.order[k], len(self.order) // 2
        for u in (unit, unit + 1):
            if u < units and u not in self.gathered:
                self.gathered[u] = self.gather(u)
        self.gathered[unit].wait()
