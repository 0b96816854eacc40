"""Grader for exercise 14 (overlapping bucket launches):  pytest exercises -k ex14

Two ranks run a simulated backward: 8 buckets whose gradients become ready out of order, each after
COMPUTE_S of sleep (the compute), each all-reduced in COMM_S under minizero's network model (each
collective's wait() returns when the modelled link has carried it: deterministic time). The grader
counts launches and waits; it times the step with your BucketLauncher and with one that launches
everything after backward (the serial baseline).
"""

import time
from collections import deque

import pytest
import torch

import _grading as g
from minizero import comm
from minizero.network import Network

N, K, ELEMENTS = 2, 2, 1024
READY = [0, 1, 3, 2, 4, 5, 7, 6]          # bucket 3 is ready before bucket 2, 7 before 6
COMPUTE_S, COMM_S = 0.02, 0.04            # communication is the larger part: 8 x 40 ms vs 8 x 20 ms
SLACK = 1.15


class Serial:
    """The baseline: nothing launched during backward; finish() launches and waits for each
    bucket."""

    def __init__(self, num_buckets, launch, max_in_flight):
        self.num_buckets, self.launch = num_buckets, launch

    def ready(self, i):
        pass

    def finish(self):
        handles = deque(self.launch(i) for i in range(self.num_buckets))
        while handles:
            handles.popleft().wait()


class Tracked:
    """A bucket's handle that tells the step when it is waited for."""

    def __init__(self, handle, step, i):
        self.handle, self.step, self.i = handle, step, i

    def wait(self):
        self.handle.wait()
        if self.i not in self.step.waited:
            self.step.waited.add(self.i)
            self.step.in_flight -= 1
        return True


class Step:
    """One simulated backward with launcher_class: what was launched when, and how long it took."""

    def __init__(self, launcher_class):
        # bytes / COMM_S: a ring all-reduce over N = 2 ranks sends 2(N-1)/N = 1 x the bucket's bytes
        comm.set_network(Network(bandwidth=4 * ELEMENTS / COMM_S))
        self.buffers = [torch.ones(ELEMENTS) for _ in READY]
        self.launched, self.waited, self.in_flight, self.most_in_flight = [], set(), 0, 0
        launcher = g.call(launcher_class, len(READY), self.launch, K)
        comm.barrier()                                 # both ranks start the step together
        self.compute, start = 0.0, time.perf_counter()
        for i in READY:
            began = time.perf_counter()
            time.sleep(COMPUTE_S)                      # backward computing bucket i's gradients
            self.compute += time.perf_counter() - began
            g.call(launcher.ready, i)
        g.call(launcher.finish)
        self.seconds = time.perf_counter() - start
        comm.set_network(None)

    def launch(self, i):
        self.launched.append(i)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        return Tracked(comm.all_reduce(self.buffers[i], op="sum", async_op=True), self, i)

    def report(self) -> dict:
        return {"launched": self.launched, "waited": sorted(self.waited),
                "most": self.most_in_flight, "seconds": self.seconds, "compute": self.compute}


def worker(module_name: str) -> dict:
    yours = Step(g.learner(module_name).BucketLauncher).report()
    return {"rank": comm.rank(), "yours": yours, "serial": Step(Serial).report()}


def launched(impl: str) -> list[dict]:
    __tracebackhide__ = True
    g.guard(impl)
    return g.launch_once(worker, N, impl)


def check_policy(impl: str) -> None:
    __tracebackhide__ = True
    for res in launched(impl):
        yours, where = res["yours"], f"rank {res['rank']}"
        if yours["launched"] != sorted(READY):
            raise AssertionError(f"{where}: buckets launched in the order {yours['launched']}, "
                                 f"ready in the order {READY}: launch strictly 0, 1, 2, ... (a "
                                 "bucket ready early waits for those before it), each once")
        if yours["most"] > K:
            raise AssertionError(f"{where}: {yours['most']} buckets were in flight at once, at "
                                 f"most max_in_flight = {K}: wait for the oldest before launching "
                                 "more")
        if yours["waited"] != sorted(READY):
            raise AssertionError(f"{where}: finish() returned before waiting for buckets "
                                 f"{sorted(set(READY) - set(yours['waited']))}")


def check_overlap(impl: str) -> None:
    __tracebackhide__ = True
    for res in launched(impl):
        yours, serial = res["yours"], res["serial"]
        work = len(READY) * COMM_S
        assert serial["seconds"] >= 0.9 * (serial["compute"] + work), ("grader: the model did not "
                                                                       "hold")
        bound = SLACK * max(yours["compute"], work)
        if yours["seconds"] > bound:
            raise AssertionError(
                f"rank {res['rank']}: your step took {yours['seconds'] * 1e3:.0f} ms for "
                f"{yours['compute'] * 1e3:.0f} ms of compute and {work * 1e3:.0f} ms of "
                f"communication; overlapped it takes at most {bound * 1e3:.0f} ms ({SLACK} x the "
                f"larger), serial {serial['seconds'] * 1e3:.0f} ms. Launch each bucket as soon as "
                "it and those before it are ready, and never wait for one you just started")


@pytest.mark.points(2)
def test_buckets_go_in_order_at_most_k_in_flight(impl):
    check_policy(impl)


@pytest.mark.points(2)
def test_communication_hides_behind_backward(impl):
    check_overlap(impl)
