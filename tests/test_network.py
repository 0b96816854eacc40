"""The network model (minizero/beyond/network.py, applied in minizero/comm.py): specs, ring times,
the tally's intra/inter-node split, and what overlap and prefetch buy in measured step time under
it.

    python -m pytest tests/test_network.py -q          # two launches

Timings are only bounded from below by the model (a wait never returns before the modelled ring is
done), and compared with each other as loose inequalities: never a threshold in milliseconds.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import astuple

import pytest
import torch

import minizero
from minizero import comm
from minizero.cli.run import main as run_main
from minizero.lab.network_runs import BASE, by_label, measure, overlap_runs
from minizero.beyond import mesh, network
from minizero.beyond.network import Network, parse_network

# --------------------------------------------------------------------------------------------------
# Specs
# --------------------------------------------------------------------------------------------------


def test_parse_reads_units_and_keys():
    net = parse_network("1gbps,10us,ranks_per_node=2")
    assert net == Network(bandwidth=125e6, latency=10e-6, ranks_per_node=2)
    assert parse_network("125MB/s, 1.5ms") == Network(bandwidth=125e6, latency=1.5e-3)
    assert parse_network("ranks_per_node=4") == Network(ranks_per_node=4)  # topology only: no delay
    full = parse_network(
        "latency=5ns,bandwidth=100Mbps,intra_bandwidth=2.4Tbps,intra_latency=1us,ranks_per_node=8"
    )
    assert full == Network(bandwidth=12.5e6, latency=5e-9, ranks_per_node=8, intra_bandwidth=300e9,
                           intra_latency=1e-6)
    assert astuple(parse_network(str(full))) == pytest.approx(astuple(full))      # str() is a spec
    for off in ("", "off", "None"):
        assert parse_network(off) is None


@pytest.mark.parametrize("spec, says", [
    ("1gbs", "bandwidth '1gbs'"), ("0gbps", "bandwidth '0gbps'"), ("1gbps,10", "latency '10'"),
    ("1gbps,10us,2", "'2' is not one of"), ("1gbps,ranks_per_node=0", "ranks_per_node must be"),
    ("1gbps,bandwidth=2gbps", "bandwidth given twice"), ("1gb/s", "bandwidth '1gb/s'"),
    ("1gbps,nodes=2", "'nodes=2' is not one of"),
])
def test_bad_specs_are_one_line(spec, says):
    with pytest.raises(ValueError, match=says) as e:
        parse_network(spec)
    assert "\n" not in str(e.value)


def test_cli_rejects_a_bad_network_in_one_line(capsys, monkeypatch):
    assert run_main(["--network", "fast"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--network: network 'fast'" in err
    monkeypatch.setenv("MINIZERO_NETWORK", "1gbps,ranks_per_node=x")
    assert run_main([]) == 2
    assert "MINIZERO_NETWORK: network" in capsys.readouterr().err


def test_ring_time_is_the_alpha_beta_formula():
    net = Network(bandwidth=100e6, latency=1e-3, ranks_per_node=2)
    sent = comm.ring_bytes("all_reduce", 1_000_000, 4)                      # 2·3/4 MB
    assert net.time("all_reduce", sent, 4, inter_node=True) == pytest.approx(6e-3 + 1.5e6 / 100e6)
    assert net.time("all_gather", 750_000, 4, inter_node=True) == pytest.approx(3e-3 + 7.5e-3)
    assert net.time("all_reduce", sent, 4, inter_node=False) == 0          # unlimited inside a node
    assert net.time("all_reduce", 0, 1, inter_node=True) == 0


# --------------------------------------------------------------------------------------------------
# One launch of 4 ranks, 2 per node: time of a collective, queueing, the tally's split
# --------------------------------------------------------------------------------------------------

NET = Network(bandwidth=10e6, latency=1e-3, ranks_per_node=2)              # 10 MB/s, 1 ms a hop
MB = 250_000                                                               # fp32 elements


def network_probe() -> dict:
    network.set_network(NET)
    out = {}
    comm.barrier()
    start = time.perf_counter()
    comm.all_reduce(torch.zeros(MB))                    # synchronous, over every rank: across nodes
    out["sync"] = time.perf_counter() - start
    comm.barrier()
    start = time.perf_counter()
    handles = [comm.all_reduce(torch.zeros(MB), async_op=True) for _ in range(2)]
    for handle in handles:
        handle.wait()
    out["queued"] = time.perf_counter() - start         # two rings, one after the other on the link
    shard, replicate = mesh.mesh(2)                     # rows: one node; columns: across nodes
    comm.reset_tally()
    comm.all_reduce(torch.zeros(10), group=shard)         # 40 bytes over 2 ranks: 40 sent, intra
    comm.all_reduce(torch.zeros(10), group=replicate)     # ranks {r, r+2}: 40 sent, inter
    comm.all_gather(torch.zeros(40), torch.zeros(10))     # all 4 ranks: 3/4 of 160 = 120, inter
    out["tally"] = network.tally()
    network.set_network(None)
    return out


@pytest.fixture(scope="module")
def probes():
    return minizero.launch(network_probe, 4)


def test_a_collective_takes_no_less_than_its_ring(probes):
    ring = NET.time("all_reduce", comm.ring_bytes("all_reduce", 4 * MB, 4), 4, inter_node=True)
    assert ring == pytest.approx(0.156)                   # 6 hops of 1 ms + 1.5 MB at 10 MB/s
    for r, p in enumerate(probes):
        assert ring <= p["sync"] < 2 * ring + 0.2, (
            f"rank {r}: {p['sync']:.4f} s for a {ring:.4f} s ring"
        )
        assert 2 * ring <= p["queued"] < 3 * ring + 0.2, (
            f"rank {r}: {p['queued']:.4f} s for two queued rings"
        )


def test_tally_splits_intra_and_inter_node_bytes(probes):
    for r, p in enumerate(probes):
        t = p["tally"]
        assert (t["intra_node"], t["inter_node"], t["total"]) == (40, 160, 200), f"rank {r}: {t}"
        assert (t["all_reduce"], t["all_gather"]) == (80, 120)


def test_without_a_model_one_machine_is_one_node():
    network.set_network(None)
    assert network.network() is None and not network.spans_nodes(None)
    assert set(network.tally()) >= {"total", "intra_node", "inter_node"}


# --------------------------------------------------------------------------------------------------
# One launch of 2 ranks, 1 per node: step time under the model
# --------------------------------------------------------------------------------------------------

# The tiny GPT with 4 blocks, each of which also sleeps 20 ms in forward and in backward: compute a
# busy CPU cannot stretch, so the gains below are not lost in the noise of other processes. Small
# buckets: several per step.
SLEEPY = dataclasses.replace(
    BASE, model="tiny", model_overrides={"n_layer": 4}, bucket_size=4000, steps=4
)


@pytest.fixture(scope="module")
def steps():
    runs = overlap_runs(0.5) + [
        ("DDP, ratio 0.25", {"stage": 0}, 0.25),
        ("DDP, ratio 2", {"stage": 0}, 2.0),
    ]
    return by_label(measure(runs, SLEEPY, block_sleep=0.02))


def test_every_step_lasts_at_least_its_modelled_communication(steps):
    for label, run in steps.items():
        busy = sum(end - start for start, end, _ in run["timeline"]["transfers"])
        assert busy > 0 and run["timeline"]["end"] >= busy, label
        # 2 nodes of 1 rank
        assert math.isclose(run["comm"]["inter_node"], run["comm"]["total"]), label


def test_the_model_and_the_variants_change_no_value(steps):
    # the same reductions in the same bucket order, only later (no overlap) or gathered later
    # (no prefetch)
    assert (
        steps["DDP"]["losses"]
        == steps["DDP, no overlap"]["losses"]
        == steps["DDP, ratio 2"]["losses"]
    )
    assert steps["stage 3"]["losses"] == steps["stage 3, no prefetch"]["losses"]


def test_overlap_and_prefetch_shorten_the_step(steps):
    t = {label: run["step_time_s"] for label, run in steps.items()}       # each run's fastest step
    assert t["DDP"] < t["DDP, no overlap"], t
    assert t["stage 3"] < t["stage 3, no prefetch"], t


def test_step_time_grows_as_bandwidth_falls(steps):
    t = {label: run["step_time_s"] for label, run in steps.items()}       # each run's fastest step
    assert (
        steps["DDP, ratio 2"]["bandwidth"]
        < steps["DDP"]["bandwidth"]
        < steps["DDP, ratio 0.25"]["bandwidth"]
    )
    assert t["DDP, ratio 0.25"] < t["DDP, ratio 2"] and t["DDP"] < t["DDP, ratio 2"], t


def test_overlap_is_a_stage_0_flag():
    import functools

    from torch import nn
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="overlap must be True or False"):
        minizero.wrap(nn.Linear(2, 2), 0, sgd, overlap="no")
    with pytest.raises(TypeError, match="stage 2 does not take option"):
        minizero.wrap(nn.Linear(2, 2), 2, sgd, overlap=False)
    assert not minizero.wrap(nn.Linear(2, 2), 0, sgd, overlap=False).reducer.overlap


def test_cli_no_overlap_is_for_ddp(capsys):
    assert run_main(["--stage", "2", "--no-overlap"]) == 2
    assert "stage 2 does not take option(s) overlap (only stage 0)" in capsys.readouterr().err
