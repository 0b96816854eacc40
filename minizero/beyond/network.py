"""A network model: each collective takes the time a ring on a described cluster network would take.

    python -m minizero.run --stage 0 --world-size 4 --network 1gbps,10us,ranks_per_node=2
    MINIZERO_NETWORK=1gbps,10us,ranks_per_node=2 torchrun --nproc-per-node 4 -m minizero.run
    network.set_network("1gbps,10us,ranks_per_node=2")   # Python: in a rank or before launch
    python -m pytest tests/test_network.py           # its tests; notebooks/08_beyond.ipynb shows it

Why. minizero's ranks are processes of one machine talking over loopback: next to the compute,
communication is almost free. So what the later ZeRO papers are about cannot be seen: whether DDP's
bucketed all-reduce really hides behind backward, what stage 3's prefetch buys, why stage 3's 3Ψ
costs more than 2Ψ. With a model set (off by default), every collective still runs for real over
gloo (its values stay exact), and its handle's wait() returns no earlier than the moment the
modelled network would have finished it.

What it models (this file, subscribed to comm.py's "collective" events while a model is set):
  * Topology: nodes of `ranks_per_node` consecutive ranks. A collective whose group lies inside one
    node runs on the intra-node links (NVLink-like: `intra_bandwidth`, default unlimited,
    `intra_latency`, default 0); one whose group spans nodes runs on the inter-node links
    (`bandwidth`, `latency`).
  * A ring. Over n ranks, a collective takes `RING_STEPS` hops, in each of which every rank sends
    one chunk to its neighbour; a rank sends comm.ring_bytes in all (2(n-1)/n·S for an all-reduce
    of S bytes). Hops are in lockstep, so the slowest link of the ring sets the pace: the α-β
    (Hockney) model
        time = steps · α + bytes one rank sends / β       α: latency per hop, β: bytes/s of the link
    with the inter-node α, β as soon as the ring crosses a node boundary.
  * Queuing. A rank's link is one resource (`Link`): a collective starts when it is issued or when
    the previous one on this rank's link ends, whichever is later. An asynchronous collective issued
    during backward therefore runs while autograd computes (overlap), and a synchronous one blocks
    its caller. Intra- and inter-node collectives share that one queue: a rank's collectives run in
    the order issued, as one NCCL communicator's do on its stream (it does not model two streams
    using two kinds of link).

What it ignores (so measured times are a lower bound of what a real cluster would show):
  * contention: every rank has an inter-node link of `bandwidth` to itself; on a real node the ranks
    share the node's NICs, and two rings crossing nodes at once (HSDP's replicate groups) would
    share them too;
  * protocols: message-size effects, tree algorithms (NCCL switches to trees for small messages at
    scale), in-network reduction, the cost of the reduction arithmetic;
  * the real gloo collective underneath, which still takes CPU time away from compute on the
    same cores;
  * clocks: each rank books its own link; the real collective is what keeps ranks in step.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass

from minizero import comm, events

ENV = "MINIZERO_NETWORK"    # read by the launcher and the run command: their ranks model it

# Hops of a ring over n ranks. An all-reduce is a reduce-scatter then an all-gather: twice n-1.
RING_STEPS = {
    "all_reduce": lambda n: 2 * (n - 1),
    "reduce_scatter": lambda n: n - 1,
    "all_gather": lambda n: n - 1,
    "broadcast": lambda n: n - 1,
    "all_to_all": lambda n: n - 1,
    "ring_all_reduce": lambda n: 2 * (n - 1),     # ring.py's, from send/recv
}


@dataclass(frozen=True)
class Network:
    """Bandwidths in bytes/s (math.inf: unlimited), latencies in seconds per ring hop."""
    bandwidth: float = math.inf          # each rank's inter-node link
    latency: float = 0.0
    ranks_per_node: int = 1
    intra_bandwidth: float = math.inf    # inside a node
    intra_latency: float = 0.0

    def time(self, kind: str, sent_bytes: float, n: int, inter_node: bool) -> float:
        """Seconds a ring over n ranks takes for a collective of `kind` in which each rank sends
        `sent_bytes` (comm.ring_bytes), over the inter-node links if the ring crosses nodes."""
        if n == 1:
            return 0.0
        alpha, beta = (
            (self.latency, self.bandwidth)
            if inter_node
            else (self.intra_latency, self.intra_bandwidth)
        )
        return RING_STEPS[kind](n) * alpha + sent_bytes / beta

    def __str__(self) -> str:
        """The spec parse_network reads back (rounded to 6 digits)."""
        fields = [
            _rate_str(self.bandwidth),
            _seconds_str(self.latency),
            f"ranks_per_node={self.ranks_per_node}",
        ]
        if self.intra_bandwidth != math.inf:
            fields.append(f"intra_bandwidth={_rate_str(self.intra_bandwidth)}")
        if self.intra_latency:
            fields.append(f"intra_latency={_seconds_str(self.intra_latency)}")
        return ",".join(fields)


# --------------------------------------------------------------------------------------------------
# Reading a spec: "1gbps,10us,ranks_per_node=2" (bandwidth, latency, then key=value in any order)
# --------------------------------------------------------------------------------------------------

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_PER_SECOND = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}       # 10us = 10 / 1e6 s
_NUMBER = r"(\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+(?:e[+-]?\d+)?)"
_KEYS = ("bandwidth", "latency", "ranks_per_node", "intra_bandwidth", "intra_latency")


def _rate(text: str) -> float:
    """'1gbps' / '10Gbps' (bits per second) or '125MB/s' (bytes per second) or 'inf' -> bytes
    per second."""
    if text.lower() in ("inf", "unlimited"):
        return math.inf
    bits = re.fullmatch(_NUMBER + r"\s*([kmgt]?)bps", text, re.IGNORECASE)
    octets = re.fullmatch(_NUMBER + r"\s*([kKmMgGtT]?)B/s", text)
    found = bits or octets
    if not found or float(found.group(1)) <= 0:
        raise ValueError(
            f"bandwidth {text!r} is not like 1gbps, 100mbps (bits/s), 125MB/s (bytes/s) or inf"
        )
    return float(found.group(1)) * _PREFIX[found.group(2).lower()] / (8 if bits else 1)


def _seconds(text: str) -> float:
    """'10us', '1.5ms', '0' -> seconds."""
    found = re.fullmatch(_NUMBER + r"\s*(s|ms|us|µs|ns)?", text, re.IGNORECASE)
    if not found or (found.group(2) is None and float(found.group(1)) != 0):
        raise ValueError(f"latency {text!r} is not like 10us, 1ms, 5ns or 0")
    return float(found.group(1)) / _PER_SECOND[(found.group(2) or "s").lower()]


def _rate_str(rate: float) -> str:
    if rate == math.inf:
        return "inf"
    bits = rate * 8
    prefix = next(p for p in "tgmk" if bits >= _PREFIX[p]) if bits >= 1e3 else ""
    return f"{bits / _PREFIX[prefix]:.6g}{prefix}bps"


def _seconds_str(seconds: float) -> str:
    return f"{seconds * 1e6:.6g}us"


def parse_network(text: str) -> Network | None:
    """A Network from a spec such as "1gbps,10us,ranks_per_node=2" (None for "", "off" or "none").

    Positional fields: the inter-node bandwidth, then its latency per hop; then any of bandwidth=,
    latency=, ranks_per_node=, intra_bandwidth=, intra_latency=. Raises ValueError, one line, on
    bad input.
    """
    if text.strip().lower() in ("", "off", "none"):
        return None
    values: dict = {}
    positional = iter(("bandwidth", "latency"))
    for field in (f.strip() for f in text.split(",")):
        key, has_key, value = field.partition("=")
        key = key.strip() if has_key else next(positional, None)
        value = value.strip() if has_key else field
        if key not in _KEYS:
            raise ValueError(f"network {text!r}: {field!r} is not one of bandwidth, latency, "
                             f"{', '.join(k + '=' for k in _KEYS[2:])}")
        if key in values:
            raise ValueError(f"network {text!r}: {key} given twice")
        try:
            if key == "ranks_per_node":
                if not value.isdigit() or int(value) < 1:
                    raise ValueError(f"ranks_per_node must be a positive integer, got {value!r}")
                values[key] = int(value)
            else:
                values[key] = _rate(value) if key.endswith("bandwidth") else _seconds(value)
        except ValueError as e:
            raise ValueError(f"network {text!r}: {e}") from None
    return Network(**values)


def network_from_env() -> Network | None:
    """The model MINIZERO_NETWORK describes, if set (ValueError naming the variable if it
    is bad)."""
    try:
        return parse_network(os.environ.get(ENV, ""))
    except ValueError as e:
        raise ValueError(f"{ENV}: {e}") from None


# --------------------------------------------------------------------------------------------------
# Nodes: the tally's bytes split by where their ring runs
# --------------------------------------------------------------------------------------------------

def ranks_per_node() -> int:
    """Ranks per node: the network model's; without one, torchrun's LOCAL_WORLD_SIZE, else every
    rank (minizero.launch runs them all on one machine)."""
    if _network is not None:
        return _network.ranks_per_node
    return int(os.environ.get("LOCAL_WORLD_SIZE", comm.world_size()))


def ranks_span_nodes(ranks, per_node: int) -> bool:
    """Whether these ranks sit on more than one node (ranks r and s share a node iff
    r // R == s // R). The one rule for tally()'s split and for memory.comm_volume_by_node."""
    return len({r // per_node for r in ranks}) > 1


def spans_nodes(group: comm.Group | None) -> bool:
    """Does the group's ring cross a node boundary?"""
    ranks = range(comm.world_size()) if group is None else group.ranks
    return ranks_span_nodes(ranks, ranks_per_node())


def tally() -> dict[str, float]:
    """comm.tally(), plus its total split into 'intra_node' (rings inside one node of
    ranks_per_node() consecutive ranks) and 'inter_node' (rings that span nodes)."""
    out = {**comm.tally(), "intra_node": 0.0, "inter_node": 0.0}
    for ranks, sent in comm.tally_by_ranks().items():
        every = range(comm.world_size()) if ranks is None else ranks
        out["inter_node" if ranks_span_nodes(every, ranks_per_node()) else "intra_node"] += sent
    return out


# --------------------------------------------------------------------------------------------------
# Time: a rank's link, booked from the event stream
# --------------------------------------------------------------------------------------------------

class Link:
    """One rank's link: collectives are booked on it one after another (time.perf_counter seconds).
    Each booking is told on the event stream as "collective modeled" (seq, kind, start, end)."""

    def __init__(self) -> None:
        self.free_at = 0.0

    def book(self, seconds: float) -> float:
        """Book a transfer of `seconds` issued now: it starts when the link is free; returns
        its end."""
        self.free_at = max(time.perf_counter(), self.free_at) + seconds
        return self.free_at


def sleep_until(deadline: float) -> None:
    """Never return before `deadline` (time.sleep may wake early by a rounding; it never wakes much
    late on an idle core, but on a busy one it can)."""
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)


_network: Network | None = None      # set_network; None: off
link = Link()                        # this rank's link under the model
_ends: dict[int, float] = {}         # seq of a collective in flight -> when the model delivers it
_subscribed = False


def set_network(model: Network | str | None) -> None:
    """Model the network from now on: a Network, a spec ("1gbps,10us,ranks_per_node=2") or None
    (off). Set in the parent, minizero.launch hands it to the ranks it starts."""
    global _network, _subscribed
    _network = parse_network(model) if isinstance(model, str) else model
    link.free_at = 0.0
    _ends.clear()
    if not _subscribed:
        events.subscribe(_on_event)
        _subscribed = True


def network() -> Network | None:
    return _network


def _on_event(name: str, fields: dict) -> None:
    """A collective issued is booked on this rank's link; its handle's wait() (its "collective
    done") returns no earlier than the booked end."""
    if _network is None:
        return
    if name == "collective":
        n = comm.group_size(fields["group"])
        if n > 1:
            seconds = _network.time(fields["kind"], fields["sent"], n, spans_nodes(fields["group"]))
            end = link.book(seconds)
            _ends[fields["seq"]] = end
            events.emit("collective modeled", seq=fields["seq"], kind=fields["kind"],
                        start=end - seconds, end=end)
    elif name == "collective done" and fields["seq"] in _ends:
        sleep_until(_ends.pop(fields["seq"]))
