"""Exercise 14, answer: the launch policy of minizero's reducer (minizero/reducer.py,
GradBuckets), the bucket size that policy runs fastest with on a given link, and stage 3's prefetch
(minizero/zero3.py)."""

from collections import deque

MOST_BUCKETS = 256


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


def bucket_size(gradient_bytes, backward_s, world_size, latency, bandwidth, max_in_flight):
    n = world_size

    def step_s(buckets):                            # BucketLauncher's schedule, played on paper
        each = 2 * (n - 1) * latency + 2 * (n - 1) / n * gradient_bytes / buckets / bandwidth
        now = link = 0.0                            # where backward is; when the link is free
        in_flight: deque = deque()                  # end times, oldest first
        for _ in range(buckets):
            now += backward_s / buckets             # this bucket's gradients are computed
            if len(in_flight) >= max_in_flight:
                now = max(now, in_flight.popleft())  # backward waits for the oldest
            link = max(now, link) + each
            in_flight.append(link)
        return max(now, link)

    return gradient_bytes / min(range(1, MOST_BUCKETS + 1), key=step_s)


class Prefetcher:
    def __init__(self, order, gather, free, depth):
        self.order, self.gather, self.free, self.depth = order, gather, free, depth
        self.gathered = {}                              # unit -> its all-gather (done or in flight)

    def upcoming(self, k):
        return self.order[k + 1:k + 1 + self.depth]     # the units of the next `depth` visits

    def use(self, k):
        for unit in [self.order[k], *self.upcoming(k)]:
            if unit not in self.gathered:
                self.gathered[unit] = self.gather(unit)  # runs while order[k] computes
        self.gathered[self.order[k]].wait()

    def done(self, k):
        unit = self.order[k]
        if unit not in self.upcoming(k):                # forward's last unit is backward's first
            self.free(unit)
            del self.gathered[unit]
