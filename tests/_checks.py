"""Checks every stage's tests share: same parameters as the single-process reference, memory and
communication as the ZeRO paper predicts. Each stage's test module launches once per world size and
runs several configurations in that one process group (launches are the expensive part)."""

from __future__ import annotations

import dataclasses

import pytest
from _workers import accumulate_without_no_sync

import minizero
from minizero.lab.peers import PEER_OF_STAGE, peer_worker
from minizero.lab.reference import reference_train
from minizero.lab.report import theory
from minizero.lab.train import TrainConfig, train_several
from minizero.memory import CATEGORIES, within_padding

WORLD_SIZES = (1, 2, 3, 4)

# Tied embedding/head, a frozen parameter, a parameter forward never uses, a buffer, odd sizes
# (n_embd 14, vocab 12, block 17: no parameter count divisible by 3 or 4), several gradient buckets.
AWKWARD = dict(model="tiny", model_overrides={"frozen": ("pos_emb.weight",), "unused_param": True},
               bucket_size=3000)

# One whole block of the default GPT frozen (a quarter of its parameters): fine-tuning's frozen base
# in small, and in stage 3 a unit with nothing to train.
FROZEN_BLOCK = tuple(
    f"blocks.1.{name}.{kind}"
    for name in ("ln1", "attn.qkv", "attn.proj", "ln2", "mlp.0", "mlp.2")
    for kind in ("weight", "bias")
)

# fp32 tolerances: SGD is linear in the gradient, so 1e-6 catches any wrong scale; Adam
# divides by the gradient's own magnitude and amplifies rounding differences of near-zero
# gradients to ~lr * 1e-3.
ATOL = {"sgd_awkward_accum": 1e-6, "sgd_awkward_clip": 1e-6, "adamw": 5e-5}


def configs(stage: int, n: int, **stage_options) -> dict[str, TrainConfig]:
    """The named configurations every stage is tested with at world size n."""
    base = dict(
        stage=stage, world_size=n, steps=3, batch_size=24, return_state=True, **stage_options
    )
    return {
        # SGD: Adam is invariant to a constant gradient scale and would hide a wrong average.
        "sgd_awkward_accum": TrainConfig(**base, **AWKWARD, optimizer="sgd", lr=0.5, grad_accum=2),
        # Clipping rescales to a fixed norm, which would hide a wrong average: tested on its own. A
        # norm computed per shard instead of globally gives each rank another scale and fails here.
        "sgd_awkward_clip": TrainConfig(
            **base, **AWKWARD, optimizer="sgd", lr=0.5, clip_grad_norm=0.3
        ),
        "adamw": TrainConfig(**base, model="tiny", optimizer="adamw", lr=1e-2),
        "bf16": TrainConfig(**base, model="tiny", optimizer="adamw", lr=1e-2, dtype="bf16"),
        # memory is compared with the formulas on the default GPT, and with part of it frozen (Ψ_f:
        # no gradient, no optimizer state; replicated in stages 0-2, partitioned in stage 3)
        "memory_bf16": TrainConfig(**{**base, "steps": 2, "return_state": False}, dtype="bf16"),
        # bf16 gradients reduced and accumulated in fp32: 2 + 4 + K bytes, gradient collectives
        # at 4 bytes
        "memory_bf16_reduce_fp32": TrainConfig(
            **{**base, "steps": 2, "return_state": False}, dtype="bf16", reduce_dtype="fp32"
        ),
        "memory_fp32": TrainConfig(**{**base, "steps": 2, "return_state": False}, dtype="fp32"),
        "memory_frozen": TrainConfig(**{**base, "steps": 2, "return_state": False}, dtype="fp32",
                                     model_overrides={"frozen": FROZEN_BLOCK}),
    }


def launch_all(stage: int, world_sizes=WORLD_SIZES, **stage_options) -> dict:
    """{(n, name): (cfg, [per-rank result])} for every world size and configuration."""
    out = {}
    for n in world_sizes:
        cfgs = configs(stage, n, **stage_options)
        per_rank = minizero.launch(train_several, n, list(cfgs.values()))
        for i, (name, cfg) in enumerate(cfgs.items()):
            out[(n, name)] = (cfg, [rank_results[i] for rank_results in per_rank])
    return out


_reference_cache: dict = {}


def launch_per_world_size(scenarios, world_sizes) -> dict:
    """A PyTorch front end's scenarios, one launch per N: {N: each rank's results}. Their N = 3 runs
    train on a group of ranks 0 and 2 while rank 1 waits, where the desync watch, which compares
    every rank's collectives (minizero/beyond/desync.py), must not agree (check_every=0)."""
    return {n: minizero.launch(scenarios, n, backend="gloo", check_every=0 if n == 3 else 1)
            for n in world_sizes}


def each_rank(runs: dict):
    """(N, rank, that rank's results) over launch_per_world_size's runs."""
    for n, results in runs.items():
        for r, rank in enumerate(results):
            yield n, r, rank


def reference(cfg: TrainConfig) -> dict:
    key = repr(dataclasses.replace(cfg, world_size=1, backend=None))
    if key not in _reference_cache:
        _reference_cache[key] = reference_train(cfg)
    return _reference_cache[key]


def assert_matches_reference(cfg: TrainConfig, results: list[dict], atol: float) -> None:
    ref = reference(cfg)["state_dict"]
    for res in results:
        sd = res["state_dict"]
        assert sd.keys() == ref.keys(), f"rank {res['rank']}: state dict keys differ"
        for name, expected in ref.items():
            got = sd[name]
            assert got.shape == expected.shape, f"rank {res['rank']} {name}: shape {got.shape}"
            diff = (got.double() - expected.double()).abs().max().item() if got.numel() else 0.0
            assert diff <= atol, (
                f"rank {res['rank']}, {name}: max |minizero - reference| = {diff:.3g} "
                f"> {atol:g} ({cfg.stage=}, N={cfg.world_size})"
            )


def assert_losses_track_reference(cfg: TrainConfig, results: list[dict], rtol: float) -> None:
    ref = reference(dataclasses.replace(cfg, dtype="fp32"))["losses"]
    mean = [sum(r["losses"][i] for r in results) / len(results) for i in range(cfg.steps)]
    for i, (a, b) in enumerate(zip(mean, ref)):
        assert abs(a - b) <= rtol * b, f"step {i}: loss {a:.5f} vs fp32 reference {b:.5f}"


def assert_memory_matches_formula(cfg: TrainConfig, results: list[dict]) -> None:
    """Measured bytes per category = the paper's formula, up to padding (< N elements
    per bucket)."""
    n = cfg.world_size
    th = theory(cfg, results[0]["num_params"], results[0]["num_frozen"])
    for res in results:
        m = res["memory"]
        for cat in CATEGORIES:
            assert within_padding(m[cat], th[cat], n), (
                f"rank {res['rank']}, {cat}: measured {m[cat]} bytes, formula {th[cat]:.0f} "
                f"(stage {cfg.stage}, N={n}, {cfg.dtype}, offload={cfg.offload})")


def assert_comm_matches_formula(cfg: TrainConfig, results: list[dict]) -> None:
    """Bytes per step = 2Ψ (stages 0-2) or 3Ψ + 2Ψ_f (stage 3) ring volume, up to padding."""
    n = cfg.world_size
    expected = theory(cfg, results[0]["num_params"], results[0]["num_frozen"])[
        "comm_bytes_per_step"
    ]
    for res in results:
        got = res["comm_bytes_per_step"]["total"]
        assert within_padding(got, expected, n, times=3), (
            f"rank {res['rank']}: {got:.0f} bytes per step, ring "
            f"theory {expected:.0f} (stage {cfg.stage}, N={n})"
        )


class StageSuite:
    """The tests every stage passes; a stage's module subclasses it (class TestZero2(StageSuite):
    stage = 2) and adds what is specific to that stage."""
    stage: int
    options: dict = {}

    @pytest.fixture(scope="class")
    @classmethod
    def runs(cls):
        return launch_all(cls.stage, **cls.options)

    @pytest.mark.parametrize("n", WORLD_SIZES)
    @pytest.mark.parametrize("name", list(ATOL))
    def test_matches_single_process_reference(self, runs, n, name):
        assert_matches_reference(*runs[(n, name)], atol=ATOL[name])

    def test_matches_pytorch_peer(self):
        """Same end point as PyTorch's own implementation (DDP, ZeroRedundancyOptimizer, FSDP2)."""
        cfg = TrainConfig(
            stage=self.stage,
            world_size=3,
            steps=3,
            batch_size=12,
            grad_accum=2,
            model="tiny",
            optimizer="sgd",
            lr=0.5,
            return_state=True,
            **self.options,
        )
        ours = minizero.launch(train_several, 3, [cfg])
        theirs = minizero.launch(peer_worker, 3, cfg, PEER_OF_STAGE[self.stage])
        for mine, peer in zip(ours, theirs):
            for name, expected in peer["state_dict"].items():
                diff = (mine[0]["state_dict"][name].double() - expected.double()).abs().max().item()
                assert diff <= 1e-6, (f"rank {peer['rank']}, {name}: max |minizero - "
                                      f"{PEER_OF_STAGE[self.stage]}| = {diff:.3g}")

    def test_accumulation_without_no_sync(self):
        results = minizero.launch(accumulate_without_no_sync, 3, self.stage, self.options)
        cfg = TrainConfig(stage=self.stage, world_size=3, steps=2, batch_size=12, model="tiny",
                          optimizer="sgd", lr=0.5)
        assert_matches_reference(cfg, results, atol=1e-6)

    @pytest.mark.parametrize("n", WORLD_SIZES)
    def test_bf16_tracks_fp32_reference(self, runs, n):
        cfg, results = runs[(n, "bf16")]
        assert_matches_reference(cfg, results, atol=3e-2)
        assert_losses_track_reference(cfg, results, rtol=2e-2)

    @pytest.mark.parametrize("n", WORLD_SIZES)
    @pytest.mark.parametrize(
        "name", ["memory_bf16", "memory_bf16_reduce_fp32", "memory_fp32", "memory_frozen"]
    )
    def test_memory_and_comm_match_the_paper(self, runs, n, name):
        assert_memory_matches_formula(*runs[(n, name)])
        assert_comm_matches_formula(*runs[(n, name)])
