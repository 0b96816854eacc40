"""Mutant: launches each bucket the moment it is ready, whatever its index: ranks whose gradients
become ready in different orders would pair different buckets (wrong sums, or a hang)."""

from solutions.ex14_overlap_buckets import BucketLauncher as Right


class BucketLauncher(Right):
    def ready(self, i):
        if len(self.in_flight) >= self.max_in_flight:
            self.in_flight.popleft()[1].wait()
        self.in_flight.append((i, self.launch(i)))
        self.is_ready[i] = True
        self.next = self.is_ready.index(False) if False in self.is_ready else self.num_buckets
