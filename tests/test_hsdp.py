"""Hierarchical sharding (shard_group_size=S: FSDP2's HSDP, DeepSpeed's MiCS) at stages 1-3, and
ZeRO++'s hpZ (hpz_group_size=R) at stage 3: parity with one process and with FSDP2's 2-D-mesh HSDP,
memory and bytes per kind of collective next to minizero.memory's formulas, checkpoints, bad input.

    python -m pytest tests/test_hsdp.py

One launch at N = 4 runs every configuration, FSDP2's HSDP and the hpZ memory probe, one
after another.
"""

from __future__ import annotations

import functools

import pytest
import torch
from _checks import AWKWARD, assert_matches_reference, assert_memory_matches_formula

import minizero
from minizero import comm
from minizero.checkpoint import read_manifest
from minizero.cli.run import main as run_main
from minizero.lab.data import global_batch, local_batch
from minizero.deepspeed.config import ConfigError, load_deepspeed_config
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.peers import peer_worker
from minizero.lab.reference import tolerance
from minizero.lab.report import theory
from minizero.lab.train import TrainConfig, loss_fn, train_worker
from minizero.memory import (
    comm_volume, comm_volume_by_kind, comm_volume_by_node, estimate, estimate_breakdown,
    secondary_partition_bytes, within_padding,
)
from minizero.beyond.network import Network, set_network
from minizero.wrap import check

N, S, R = 4, 2, 2
# SGD (a wrong average is a wrong step; Adam would hide a constant scale), two micro-batches, odd
# sizes, a frozen and an unused parameter (AWKWARD).
# Stages 1-2 with two micro-batches; stage 3 with one, so that its all-gathers are one step's
# (memory's formulas count one forward and one backward).
BASE = dict(
    world_size=N, steps=3, batch_size=24, optimizer="sgd", lr=0.5, return_state=True, **AWKWARD
)
CONFIGS = {
    "stage1": TrainConfig(stage=1, shard_group_size=S, grad_accum=2, **BASE),
    # clipping: the norm's sum of squares runs over one shard group (a replica), not over all
    # N ranks
    "stage2_clip": TrainConfig(
        stage=2, shard_group_size=S, grad_accum=2, clip_grad_norm=0.3, **BASE
    ),
    "stage3": TrainConfig(stage=3, shard_group_size=S, **BASE),
    "stage3_hpz": TrainConfig(stage=3, hpz_group_size=R, **BASE),
    # both groups, parameter shards on the host (the secondaries stay on the device)
    "stage3_S2_hpz_offload": TrainConfig(
        stage=3, shard_group_size=S, hpz_group_size=R, offload="params", **BASE
    ),
}
PEER = TrainConfig(stage=3, shard_group_size=S, world_size=N, steps=3, batch_size=16, grad_accum=2,
                   model="tiny", optimizer="sgd", lr=0.5, return_state=True)


def hpz_memory_probe() -> dict:
    """Stage 3 + hpZ on the default GPT: parameter bytes between steps and at the end of forward
    (when every unit's secondary partition is alive and no unit is gathered)."""
    engine = minizero.wrap(make_model(GPTConfig()), 3, functools.partial(torch.optim.SGD, lr=0.1),
                           hpz_group_size=R)
    between = engine.memory()["params"]
    x, y = local_batch(*global_batch(0, 8, 32), comm.rank(), comm.world_size())
    loss = loss_fn(engine(x), y)
    after_forward = engine.memory()["params"]
    engine.backward(loss)
    engine.step()
    return {
        "between": between,
        "after_forward": after_forward,
        "after_step": engine.memory()["params"],
        "num_params": sum(p.numel() for p in engine.module.parameters()),
    }


def everything(directory: str) -> dict:
    # Nodes of R ranks for the tally's intra/inter-node split (an infinitely fast network:
    # no delays).
    set_network(Network(ranks_per_node=R))
    out = {name: train_worker(cfg) for name, cfg in CONFIGS.items()}
    out["fsdp2_hsdp"] = peer_worker(PEER, "fsdp2_hsdp")
    out["ours_vs_peer"] = train_worker(PEER)
    out["hpz_memory"] = hpz_memory_probe()
    # checkpoints at S < N: saved by the first shard group, as by S ranks; resumed at S < N (same
    # layout: bit-exact) and by the paper's ZeRO at N (resharded)
    half = TrainConfig(**{**vars(CONFIGS["stage2_clip"]), "steps": 2, "save_dir": directory})
    out["saved"] = train_worker(half)
    out["resumed"] = train_worker(
        TrainConfig(**{**vars(CONFIGS["stage2_clip"]), "load_dir": directory})
    )
    out["resharded"] = train_worker(
        TrainConfig(
            **{**vars(CONFIGS["stage2_clip"]), "load_dir": directory, "shard_group_size": None}
        )
    )
    return out


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def runs(checkpoint_dir):
    return minizero.launch(everything, N, checkpoint_dir)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_single_process_reference(runs, name):
    assert_matches_reference(CONFIGS[name], [r[name] for r in runs], atol=tolerance("fp32"))


def test_matches_fsdp2_hsdp(runs):
    """FSDP2's HSDP (fully_shard on a ("replicate", "shard") mesh of 2 x 2) runs on gloo: the same
    end point."""
    for r in runs:
        for name, expected in r["fsdp2_hsdp"]["state_dict"].items():
            diff = (
                (r["ours_vs_peer"]["state_dict"][name].double() - expected.double())
                .abs()
                .max()
                .item()
            )
            assert diff <= 1e-6, (
                f"rank {r['ours_vs_peer']['rank']}, {name}: "
                f"max |minizero - FSDP2 HSDP| = {diff:.3g}"
            )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_memory_per_rank_has_s_in_place_of_n(runs, name):
    assert_memory_matches_formula(CONFIGS[name], [r[name] for r in runs])
    if CONFIGS[name].shard_group_size:       # and differs from the paper's ZeRO over all N
        psi = runs[0][name]["num_params"] - runs[0][name]["num_frozen"]
        assert (
            estimate_breakdown(psi, N, 3, shard_group_size=S)["optimizer"]
            == 2 * estimate_breakdown(psi, N, 3)["optimizer"]
        )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bytes_per_kind_of_collective(runs, name):
    """Each kind as the ring tally counts it: reduce-scatter in the group, all-reduce across groups,
    all-gathers in the group (hpZ: backward's within R ranks)."""
    cfg = CONFIGS[name]
    elem = 4
    for r in runs:
        res = r[name]
        expected = comm_volume_by_kind(
            res["num_params"] - res["num_frozen"],
            N,
            cfg.stage,
            bytes_per_elem=elem,
            frozen=res["num_frozen"],
            shard_group_size=cfg.shard_group_size,
            hpz_group_size=cfg.hpz_group_size,
        )
        got = {
            k: v
            for k, v in res["comm_bytes_per_step"].items()
            if k not in ("total", "intra_node", "inter_node")
        }
        assert got.keys() == expected.keys(), (name, got, expected)
        for kind in expected:
            assert within_padding(got[kind], expected[kind], N, times=2), (
                f"{name} rank {res['rank']}: {kind} {got[kind]:.0f} "
                f"bytes, formula {expected[kind]:.0f}"
            )
        total = theory(cfg, res["num_params"], res["num_frozen"])["comm_bytes_per_step"]
        assert within_padding(res["comm_bytes_per_step"]["total"], total, N, times=3)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bytes_inside_and_across_nodes(runs, name):
    """Nodes of R = 2 ranks: the tally's intra/inter-node split (comm.py, by the group a
    collective runs in) equals memory.comm_volume_by_node. hpZ keeps backward's all-gather inside
    the node: 3Ψ -> 2Ψ."""
    cfg = CONFIGS[name]
    for r in runs:
        res = r[name]
        expected = comm_volume_by_node(
            res["num_params"] - res["num_frozen"],
            N,
            cfg.stage,
            R,
            rank=res["rank"],
            bytes_per_elem=4,
            frozen=res["num_frozen"],
            shard_group_size=cfg.shard_group_size,
            hpz_group_size=cfg.hpz_group_size,
        )
        for where in ("intra_node", "inter_node"):
            assert within_padding(res["comm_bytes_per_step"][where], expected[where], N, times=3), (
                f"{name} rank {res['rank']}: {where} {res['comm_bytes_per_step'][where]:.0f}, "
                f"formula {expected[where]:.0f}")
    if cfg.hpz_group_size and not cfg.shard_group_size:
        plain = comm_volume_by_node(1000, N, 3, R, bytes_per_elem=4)
        hpz = comm_volume_by_node(1000, N, 3, R, bytes_per_elem=4, hpz_group_size=R)
        assert hpz["inter_node"] == pytest.approx(plain["inter_node"] * 2 / 3)


def test_hpz_secondary_partition_costs_psi_over_r_until_backward(runs):
    for r in runs:
        m = r["hpz_memory"]
        extra = secondary_partition_bytes(m["num_params"], R, param_bytes=4)
        assert within_padding(m["after_forward"] - m["between"], extra, N), (m, extra)
        assert m["after_step"] == m["between"]                   # freed by backward


def test_checkpoint_at_s_below_n_resumes_exactly_and_reshards(runs, checkpoint_dir):
    manifest = read_manifest(checkpoint_dir)    # the checkpoint of S ranks: the first group's files
    assert manifest["world_size"] == S and set(manifest["files"]) == {
        "rank0.pt",
        "rank1.pt",
        "replicated.pt",
    }
    for r in runs:
        for key, value in r["stage2_clip"]["state_dict"].items():
            assert torch.equal(r["resumed"]["state_dict"][key], value), key
            assert (
                r["resharded"]["state_dict"][key].double() - value.double()
            ).abs().max() <= 1e-6, key


def test_formulas_without_processes():
    psi, n = 1200, 8
    assert estimate(psi, n, 3, shard_group_size=4) == estimate(psi, 4, 3) == 16 * psi / 4
    assert estimate(psi, n, 1, shard_group_size=n) == estimate(psi, n, 1)
    # hierarchical all-reduce: the same total bytes (stages 1-2), only 2(N/S-1)/N·Ψ of them
    # between groups
    by_node = comm_volume_by_node(psi, n, 2, 4, shard_group_size=4)
    assert comm_volume(psi, n, 2, shard_group_size=4) == pytest.approx(comm_volume(psi, n, 2))
    assert by_node == pytest.approx(
        {"intra_node": 2 * 3 / 4 * 2 * psi, "inter_node": 2 * (2 - 1) / n * 2 * psi}
    )
    # hpZ with R = ranks per node: inter-node 3(N-1)/N·Ψ -> 2(N-1)/N·Ψ, the backward
    # all-gather intra-node
    plain, hpz = (comm_volume_by_node(psi, n, 3, 4, hpz_group_size=r) for r in (None, 4))
    assert plain == pytest.approx({"intra_node": 0, "inter_node": 3 * (n - 1) / n * 2 * psi})
    assert hpz == pytest.approx(
        {"intra_node": 3 / 4 * 2 * psi, "inter_node": 2 * (n - 1) / n * 2 * psi}
    )
    assert secondary_partition_bytes(psi, 4) == 2 * psi / 4


def test_deepspeed_config_keys():
    overrides, warnings = load_deepspeed_config(
        {"zero_optimization": {"stage": 3, "mics_shard_size": 2, "zero_hpz_partition_size": 2}}, 4)
    assert (
        overrides["shard_group_size"] == 2 and overrides["hpz_group_size"] == 2 and warnings == []
    )
    off, _ = load_deepspeed_config(
        {"zero_optimization": {"mics_shard_size": -1, "zero_hpz_partition_size": 1}}, 4
    )
    assert "shard_group_size" not in off and "hpz_group_size" not in off         # DeepSpeed's "off"
    with pytest.raises(ConfigError, match="shard_group_size must be a divisor of the world size 4"):
        load_deepspeed_config({"zero_optimization": {"stage": 2, "mics_shard_size": 3}}, 4)


@pytest.mark.parametrize("kwargs, message", [
    ({"stage": 0, "shard_group_size": 2}, "needs ZeRO stage 1, 2 or 3"),
    ({"stage": 2, "shard_group_size": 3}, "must be a divisor of the world size 4"),
    ({"stage": 3, "shard_group_size": 8}, "must be a divisor of the world size 4"),
    ({"stage": 2, "hpz_group_size": 2}, "needs stage 3"),
    ({"stage": 3, "shard_group_size": 2, "hpz_group_size": 4},
     "must be a divisor of the shard group size 2"),
])
def test_bad_group_sizes_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        check(**kwargs, world_size=4)


@pytest.mark.parametrize("flags, message", [
    (["--stage", "1", "--shard-group-size", "3"],
     "shard_group_size must be a divisor of the world size 4"),
    (["--stage", "0", "--shard-group-size", "2"], "shard_group_size needs ZeRO stage 1, 2 or 3"),
    (["--stage", "2", "--hpz-group-size", "2"], "hpz_group_size needs stage 3"),
])
def test_cli_bad_group_sizes_exit_2_with_one_line(flags, message, capsys):
    assert run_main([*flags, "--world-size", "4"]) == 2          # before any process starts
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
