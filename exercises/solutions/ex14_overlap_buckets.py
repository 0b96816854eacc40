"""Exercise 14, answer: the launch policy of minizero's reducer (minizero/reducer.py,
GradBuckets)."""

from collections import deque


class BucketLauncher:
    def __init__(self, num_buckets, launch, max_in_flight):
        self.num_buckets, self.launch, self.max_in_flight = num_buckets, launch, max_in_flight
        self.in_flight: deque = deque()                   # (bucket, handle), oldest first
        self.reset()

    def reset(self):
        self.is_ready = [False] * self.num_buckets
        self.next = 0                                     # the next bucket to launch, in order

    def ready(self, i):
        self.is_ready[i] = True
        self.launch_ready()

    def launch_ready(self):
        while self.next < self.num_buckets and self.is_ready[self.next]:
            if len(self.in_flight) >= self.max_in_flight:
                self.in_flight.popleft()[1].wait()        # bound the buffers in flight
            self.in_flight.append((self.next, self.launch(self.next)))
            self.next += 1

    def finish(self):
        self.is_ready = [True] * self.num_buckets         # what never became ready goes now
        self.launch_ready()
        while self.in_flight:
            self.in_flight.popleft()[1].wait()
        self.reset()
