"""Grader for exercise 14 (overlapping bucket launches):  pytest exercises -k ex14

(1) Two ranks run a simulated backward: 16 buckets whose gradients become ready out of order, each
after COMPUTE_S of sleep (the compute), each all-reduced in COMM_S under minizero's network model
(each collective's wait() returns when the modelled link has carried it). The grader counts launches
and waits; it times the step with your BucketLauncher and with one that launches everything after
backward (the serial baseline). (2) Your bucket_size on two links, played on a virtual clock with
your BucketLauncher and the network model's time for each collective: exact, instant. (3) Your
Prefetcher on the same clock, over stage 3's forward and backward visits of 8 units.
"""

import math
import time
from collections import deque
from types import SimpleNamespace

import pytest
import torch

import _grading as g
from minizero import comm
from minizero.flat import DEFAULT_BUCKET_BYTES
from minizero.beyond.network import Network, set_network

N, K, ELEMENTS = 2, 2, 1024
# buckets 3, 7, 11, 15 are ready before 2, 6, 10, 14
READY = [j for i in range(0, 16, 4) for j in (i, i + 1, i + 3, i + 2)]
COMPUTE_S, COMM_S = 0.01, 0.02            # communication is the larger part: 16 x 20 ms vs 16 x 10
SLACK = 1.15

# (2) the bucket size: Ψ = 100 M fp32 gradients, N = 16, on a 100 Gb/s link with and without latency
GRADIENT_BYTES, BACKWARD_S, WORLD = 400e6, 0.25, 16
LINKS = {"latency-bound": Network(bandwidth=12.5e9, latency=0.5e-3),
         "bandwidth-bound": Network(bandwidth=12.5e9, latency=0.0)}
MOST_BUCKETS = 256                        # the candidates: 1 to 256 buckets
NEAR_BEST = 1.05

# (3) stage 3's prefetch: 8 units of 25 M fp32 parameters, N = 8, a 100 Gb/s link (7.1 ms a gather)
UNITS, UNIT_BYTES, UNIT_WORLD = 8, 100e6, 8
ORDER = list(range(UNITS)) + list(reversed(range(UNITS)))     # forward, then backward
COMPUTE = [0.010] * UNITS + [0.020] * UNITS                      # seconds per visit
GATHER_LINK = Network(bandwidth=12.5e9, latency=20e-6)


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
        set_network(Network(bandwidth=4 * ELEMENTS / COMM_S))
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
        set_network(None)

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


class VirtualHandle:
    """A collective on the virtual clock: wait() moves the clock to its end."""

    def __init__(self, clock, end):
        self.clock, self.end = clock, end

    def wait(self):
        self.clock.now = max(self.clock.now, self.end)
        return True


def modelled_step(launcher_class, bucket_bytes: float, network: Network) -> float:
    """Seconds of one backward on a virtual clock: GRADIENT_BYTES produced at an even pace over
    BACKWARD_S, cut into buckets of bucket_bytes (the last smaller), each all-reduced in the time
    the network model gives it, one after another on the rank's link, launched and waited for by
    launcher_class. The step ends when backward and the link are both done."""
    count = math.ceil(GRADIENT_BYTES / bucket_bytes - 1e-9)
    sizes = [min(bucket_bytes, GRADIENT_BYTES - i * bucket_bytes) for i in range(count)]
    clock = SimpleNamespace(now=0.0, link=0.0)

    def launch(i):
        start = max(clock.now, clock.link)
        sent = comm.ring_bytes("all_reduce", sizes[i], WORLD)
        clock.link = start + network.time("all_reduce", sent, WORLD, inter_node=True)
        return VirtualHandle(clock, clock.link)

    launcher = g.call(launcher_class, count, launch, K)
    for i, size in enumerate(sizes):
        clock.now += BACKWARD_S * size / GRADIENT_BYTES
        g.call(launcher.ready, i)
    g.call(launcher.finish)
    return max(clock.now, clock.link)


def check_bucket_size(impl: str) -> None:
    __tracebackhide__ = True
    g.guard(impl)
    answer = g.learner(impl)
    for name, link in LINKS.items():
        where = (f"on the {name} link ({link.latency * 1e3:g} ms a hop, "
                 f"{link.bandwidth / 1e9:g} GB/s)")
        size = g.call(answer.bucket_size, GRADIENT_BYTES, BACKWARD_S, WORLD, link.latency,
                      link.bandwidth, K)
        if not (isinstance(size, (int, float)) and GRADIENT_BYTES / MOST_BUCKETS <= size):
            raise AssertionError(f"bucket_size {where} = {size!r}: expected bytes per bucket, at "
                                 f"most {MOST_BUCKETS} buckets of the {GRADIENT_BYTES / 1e6:g} MB")
        yours = modelled_step(answer.BucketLauncher, size, link)
        steps = {b: modelled_step(answer.BucketLauncher, GRADIENT_BYTES / b, link)
                 for b in range(1, MOST_BUCKETS + 1)}
        best = min(steps, key=steps.get)
        default = modelled_step(answer.BucketLauncher, DEFAULT_BUCKET_BYTES, link)
        told = (f"{where}, your {size / 1e6:.3g} MB buckets make the step {yours * 1e3:.1f} ms; "
                f"the 25 MB default {default * 1e3:.1f} ms, {best} buckets of "
                f"{GRADIENT_BYTES / best / 1e6:.3g} MB {steps[best] * 1e3:.1f} ms (backward alone "
                f"{BACKWARD_S * 1e3:g} ms)")
        if name == "latency-bound" and yours >= default:
            raise AssertionError(f"{told}: on a latency-bound link, choose a size that beats the "
                                 "default (each bucket pays 2(N-1)α)")
        if yours > NEAR_BEST * steps[best]:
            raise AssertionError(f"{told}: come within {NEAR_BEST} x the best")


class GatherHandle(VirtualHandle):
    """A unit's all-gather on the virtual clock: waiting for it makes the unit usable."""

    def __init__(self, clock, end, unit, units):
        super().__init__(clock, end)
        self.unit, self.units = unit, units

    def wait(self):
        super().wait()
        if self.units.get(self.unit) is self:
            self.units[self.unit] = "gathered"
        return True


def modelled_pass(prefetcher_class, depth: int) -> dict:
    """Stage 3's visits (ORDER) on a virtual clock with prefetcher_class: {"seconds", "gathers"
    (units in the order their all-gathers were issued), "most" (units materialized at once), "left"
    (units still materialized at the end), "gather_s" (one all-gather)}."""
    clock = SimpleNamespace(now=0.0, link=0.0)
    units: dict = {}                   # materialized unit -> its handle in flight, or "gathered"
    gathers, most = [], 0
    seconds = GATHER_LINK.time("all_gather", comm.ring_bytes("all_gather", UNIT_BYTES, UNIT_WORLD),
                               UNIT_WORLD, inter_node=True)

    def gather(unit):
        nonlocal most
        if unit in units:
            raise AssertionError(f"unit {unit} gathered again while still materialized")
        clock.link = max(clock.now, clock.link) + seconds
        units[unit] = GatherHandle(clock, clock.link, unit, units)
        gathers.append(unit)
        most = max(most, len(units))
        return units[unit]

    def free(unit):
        if unit not in units:
            raise AssertionError(f"free({unit}): unit {unit} is not materialized")
        del units[unit]

    prefetcher = g.call(prefetcher_class, list(ORDER), gather, free, depth)
    for k, unit in enumerate(ORDER):
        g.call(prefetcher.use, k)
        if units.get(unit) != "gathered":
            raise AssertionError(f"depth {depth}, visit {k}: unit {unit} computes but use({k}) "
                                 "returned before its all-gather was waited for")
        clock.now += COMPUTE[k]
        g.call(prefetcher.done, k)
    return {"seconds": clock.now, "gathers": gathers, "most": most, "left": sorted(units),
            "gather_s": seconds}


def check_prefetch(impl: str) -> None:
    __tracebackhide__ = True
    g.guard(impl)
    prefetcher_class = g.learner(impl).Prefetcher
    want = list(dict.fromkeys(ORDER[:UNITS])) + ORDER[UNITS + 1:]
    for depth in (1, 2):
        res = modelled_pass(prefetcher_class, depth)
        order = (f"depth {depth}: all-gathers issued for units {res['gathers']}, expected {want}: "
                 "each unit once per pass, in the order of the visits; forward's last unit stays "
                 "for backward")
        if res["gathers"] != want[:len(res["gathers"])]:        # a wrong or an extra all-gather
            raise AssertionError(order)
        if res["most"] > depth + 1:
            raise AssertionError(f"depth {depth}: {res['most']} units materialized at once, at "
                                 f"most depth + 1 = {depth + 1}: free each unit when its visit is "
                                 "done")
        if res["left"]:
            raise AssertionError(f"depth {depth}: units {res['left']} are still materialized after "
                                 "the last visit: done(k) frees the unit it no longer needs")
        if res["gathers"] != want:
            raise AssertionError(order)
        compute, work = sum(COMPUTE), len(want) * res["gather_s"]
        bound = SLACK * max(compute, work)
        if res["seconds"] > bound:
            raise AssertionError(
                f"depth {depth}: the pass took {res['seconds'] * 1e3:.1f} ms for "
                f"{compute * 1e3:.0f} ms of compute and {work * 1e3:.1f} ms of all-gathers; "
                f"prefetched it takes at most {bound * 1e3:.1f} ms ({SLACK} x the larger): start "
                "the next visits' gathers before waiting for this one")


@pytest.mark.points(2)
def test_buckets_go_in_order_at_most_k_in_flight(impl):
    check_policy(impl)


@pytest.mark.points(2)
def test_communication_hides_behind_backward(impl):
    check_overlap(impl)


@pytest.mark.points(2)
def test_the_bucket_size_fits_the_link(impl):
    check_bucket_size(impl)


@pytest.mark.points(2)
def test_stage_3_prefetches_in_the_order_of_the_visits(impl):
    check_prefetch(impl)
