"""Mutant: waits for each bucket right after launching it: a blocking collective, no overlap."""

from solutions.ex14_overlap_buckets import BucketLauncher as Right


class BucketLauncher(Right):
    def launch_ready(self):
        while self.next < self.num_buckets and self.is_ready[self.next]:
            self.launch(self.next).wait()
            self.next += 1
