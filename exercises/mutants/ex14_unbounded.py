"""Mutant: never waits before launching: every bucket's buffer in flight at once."""

from solutions.ex14_overlap_buckets import BucketLauncher as Right


class BucketLauncher(Right):
    def launch_ready(self):
        while self.next < self.num_buckets and self.is_ready[self.next]:
            self.in_flight.append((self.next, self.launch(self.next)))
            self.next += 1
