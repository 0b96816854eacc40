"""minizero.bench: every stage next to PyTorch's peer and DeepSpeed (when installed) in one launch
(tiny model, N = 2, 2 steps), the sizes it can compare at, and its one-line usage errors;
minizero.scale's searches (the tiny model's largest micro-batch at N = 2) and its --rss demo under a
real per-rank memory cap (N = 2, a 10.4 M GPT).
Run: python -m pytest tests/test_bench.py -q"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

import minizero
from minizero.cli.bench import main as bench_command
from minizero.cli.scale import main as scale_command
from minizero.lab import bench, deepspeed_peer, rss, scale
from minizero.lab.model import GPT, SIZES, GPTConfig, count_params
from minizero.lab.train import TrainConfig
from minizero.memory import activation_bytes, comm_volume, estimate


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    code = bench_command(["--world-size", "2", "--model", "tiny", "--steps", "2", "--repeats", "1",
                       "--json", str(path)])
    assert code == 0
    return json.loads(path.read_text())


def test_every_pair_is_reported(report):
    torch_peers = [
        ("0", "ddp"),
        ("1", "zero_redundancy"),
        ("2", "fsdp2_no_reshard"),
        ("3", "fsdp2"),
    ]
    ds = [(v, "deepspeed") for v in bench.VARIANTS] if deepspeed_peer.available() else []
    expected = sorted(torch_peers + ds, key=lambda vp: list(bench.VARIANTS).index(vp[0]))
    assert [(p["world_size"], p["variant"], p["peer"]) for p in report["pairs"]] == [
        (2, v, p) for v, p in expected
    ]
    for p in report["pairs"]:
        assert p["ratio"] > 0 and all(t > 0 for t in p["step_time_s"].values())
        for side in bench.SIDES:
            assert len(p["memory"][side]) == 2 and all(
                set(m) == set(bench.MEMORY_KEYS) for m in p["memory"][side]
            )
    assert report["config"]["sizes"] == {"tiny": count_params(GPTConfig.named("tiny"))}
    assert {k: report["config"][k] for k in ("device", "backend", "dtype", "gpu")} == {
        "device": "cpu", "backend": "gloo", "dtype": "fp32", "gpu": None}
    # every pair ran; without DeepSpeed (the README's fresh machine) 2 + offload has no peer
    assert [a["variant"] for a in report["alone"]] == [
        v for v in bench.VARIANTS if not bench.peers_of(v)]
    assert report["skipped"] == []


def test_the_profile_splits_every_step_into_its_phases(report):
    for p in report["pairs"]:
        for side in bench.SIDES:
            phases = p["phase_s"][side]
            assert list(phases) == list(bench.PHASES) and all(t > 0 for t in phases.values()), (
                p["variant"],
                side,
            )
            # each phase's slowest rank may differ from the step's, so the sum of the phases'
            # maxima is not the step: at most the sum over the N ranks of their steps, N times the
            # slowest (1.54 was measured at N = 2 on a loaded machine, over the 1.5 once here)
            assert 0.5 < sum(phases.values()) / p["step_time_s"][side] < p["world_size"], (
                p["variant"],
                p["peer"],
                side,
                phases,
            )
    profile = (
        bench.format_table(report, phases=True)
        .split("where the time goes")[1]
        .split("activation meter")[0]
    )
    assert len(
        [line for line in profile.splitlines() if line.count(" / ") == len(bench.PHASES)]
    ) == len(report["pairs"])


def test_minizero_ends_where_every_peer_ends(report):
    for p in report["pairs"]:
        assert p["max_param_diff"] < 1e-5, (p["variant"], p["peer"], p["max_param_diff"])
        assert p["final_loss"]["minizero"] == pytest.approx(p["final_loss"]["peer"], abs=1e-5)


def test_memory_and_comm_are_the_stages(report):
    # PyTorch's
    by_stage = {p["stage"]: p for p in report["pairs"] if p["peer"] in bench.PEER_COLLECTIVES}
    device = {
        s: sum(p["memory"]["minizero"][0][k] for k in bench.DEVICE_KEYS)
        for s, p in by_stage.items()
    }
    assert device[0] > device[1] > device[2] > device[3]          # each stage shards one more thing
    torch_ddp = sum(by_stage[0]["memory"]["peer"][0].values())
    assert device[0] == pytest.approx(torch_ddp, rel=0.01)           # both replicate everything
    psi = by_stage[0]["num_params"]
    for p in report["pairs"]:                               # minizero's tally: 2Ψ or 3Ψ (+ padding)
        assert p["comm_bytes_per_step"]["minizero"] == pytest.approx(
            comm_volume(psi, 2, p["stage"], bytes_per_elem=4), rel=0.01
        )
    # ZeroRedundancyOptimizer all-reduces, then broadcasts the stepped partitions: 3Ψ, not stage
    # 1's 2Ψ
    assert by_stage[1]["comm_bytes_per_step"]["peer"] == pytest.approx(
        1.5 * by_stage[0]["comm_bytes_per_step"]["peer"]
    )
    offload = [p for p in report["pairs"] if p["offload"]]
    assert all(
        p["memory"]["minizero"][0]["offloaded"] > 0 and p["memory"]["minizero"][0]["optimizer"] == 0
        for p in offload
    )


def test_the_activation_meter_is_timed_on_and_off_and_only_observes(report):
    assert [m["variant"] for m in report["meter"]] == list(bench.VARIANTS)
    for m in report["meter"]:
        assert all(t > 0 for t in m["step_time_s"].values()) and m["cost"] > -1
        assert min(m["activations"]["on"]) > 0 and m["activations"]["off"] == [0, 0], (
            "off: the meter never ran"
        )
        assert m["losses"]["on"] == m["losses"]["off"], m["variant"]           # bit for bit


def test_sizes_are_what_they_say():
    for name in SIZES:
        psi = count_params(GPTConfig.named(name))
        assert psi == pytest.approx(
            float(name[:-1]) * 1e6, rel=0.01
        ) and f"{psi:,}" in bench.size_label(name)
    assert GPT(GPTConfig.named("1M")).num_params() == count_params(GPTConfig.named("1M"))


@pytest.mark.parametrize(
    "argv",
    [
        ["--world-size", "1"],
        ["--steps", "1"],
        ["--model", "huge"],
        ["--stages", "5"],
        ["--world-size", "3"],
        ["--bogus"],
        ["--sizes", "3M"],
        ["--sizes", ""],
        ["--peers", "jax"],
        ["--device", "tpu"],
        ["--dtype", "fp16"],
        ["--scale", "--budget-mb", "0"],
        ["--scale", "--world-size", "0"],
        ["--scale", "--micro-batch", "--model", "huge"],
        ["--scale", "--model", "tiny"],
        ["--scale", "--micro-batch", "--budget-mb", "-1"],
        ["--scale", "--rss-cap-mb", "9"],
        ["--scale", "--rss", "--world-size", "1"],
        ["--scale", "--rss", "--rss-cap-mb", "0"],
        ["--scale", "--rss", "--world-size", "2", "4"],
        ["--scale", "--rss", "--budget-mb", "4"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, capsys):
    assert bench_command(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "error" in err and len(err.splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA --device cuda runs the bench")
def test_device_cuda_without_a_gpu_is_one_line_and_exit_2():
    p = subprocess.run([sys.executable, "-m", "minizero.bench", "--device", "cuda"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "", p
    assert p.stderr.startswith("python -m minizero.bench: error: --device cuda: no GPU here")
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr


def test_device_cuda_takes_at_most_one_rank_per_gpu(monkeypatch, capsys):
    """Checked before anything launches (a machine with one GPU, as far as the parent can tell)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert bench_command(["--device", "cuda", "--world-size", "1", "2"]) == 2
    err = capsys.readouterr().err
    assert "every N must be between 1 and the 1 GPU(s) here" in err and err.count("\n") == 1


def test_a_peer_refusing_a_group_of_one_is_skipped_with_its_reason(monkeypatch):
    """At N = 1 (--device cuda on one GPU) a peer that raises is skipped, its reason reported, and
    minizero's run stands alone in the table; with more ranks the error fails the launch. Runs
    bench_worker in this process: no group, so comm's world size is 1."""
    run = bench._run

    def refusing(impl, cfg):
        if impl == "ddp":
            raise RuntimeError("no group of one, please\n(details)")
        return run(impl, cfg)
    monkeypatch.setattr(bench, "_run", refusing)
    cfg = TrainConfig(stage=0, world_size=1, steps=2, model="tiny", backend="gloo")
    threads = torch.get_num_threads()
    try:
        (record,) = bench.bench_worker([(cfg, ["ddp"])], 2, False)
    finally:
        torch.set_num_threads(threads)                 # bench_worker's one thread, for this process
    assert record["skipped"] == {"ddp": "RuntimeError: no group of one, please"}
    assert record["impls"] == ["minizero"] and list(record["times"]) == ["minizero"]
    pairs, alone, skipped, _ = bench._records([(cfg, ["ddp"], "0")], [[record]], meter=False)
    assert pairs == [] and [a["reason"] for a in alone] == ["ddp refused N = 1"]
    assert alone[0]["throughput"]["tokens_per_s"] > 0 and 0 < alone[0]["throughput"]["mfu"] < 1
    assert skipped == [{"world_size": 1, "size": "tiny", "variant": "0", "peer": "ddp",
                        "reason": "RuntimeError: no group of one, please"}]
    assert not bench._may_skip("minizero")               # minizero's own failure is never skipped
    monkeypatch.setattr(bench.comm, "world_size", lambda: 2)
    assert not bench._may_skip("ddp")


def test_bf16_runs_minizero_alone_and_says_why():
    """The peers are built in fp32 only: a bf16 bench has no pair, only minizero's rows, with
    tokens/s and MFU against the bf16 GEMM peak."""
    report = bench.compare((2,), sizes=("tiny",), steps=2, repeats=1, variants=("2",),
                           meter=False, dtype="bf16")
    assert report["pairs"] == [] and report["config"]["dtype"] == "bf16"
    (alone,) = report["alone"]
    assert (alone["variant"], alone["dtype"], alone["reason"]) == (
        "2", "bf16", "the peers run in fp32 only")
    assert 0 < alone["throughput"]["mfu"] < 1 and alone["comm_bytes_per_step"] > 0
    text = bench.format_table(report)
    assert "minizero alone, bf16" in text and "the peers run in fp32 only" in text
    assert "peer ms" not in text                          # no pair header without pairs


def test_collectives_are_timed_both_ways_and_agree(capsys):
    """--collectives: every row on both sides, and the worker's check that comm's way and
    gloo's agree."""
    from minizero.lab import collectives
    report = collectives.measure((2,), (1000,), repeats=1)
    (row,) = report["rows"]
    assert list(row["ms"]) == [
        "all_reduce (backend)", "reduce_scatter (backend)", "reduce_scatter (minizero)",
        "all_gather (backend)", "all_gather (minizero)",
    ]
    assert all(t > 0 for t in row["ms"].values()) and row["backend"] == "gloo"
    assert bench_command(["--collectives", "--numel", "0"]) == 2
    assert "--numel must be" in capsys.readouterr().err


def test_scale_table_names_every_variant():
    rows = [
        {"variant": v, "world_size": 1, "num_params": 100 * (i + 1), "width": 8}
        for i, (v, _, _) in enumerate(scale.VARIANTS)
    ]
    text = scale.format_table({"budget_bytes": 1e6, "world_sizes": [1], "n_layer": 8, "rows": rows,
                               "stage3_over_ddp": {1: 4.0}})
    assert all(v in text for v, _, _ in scale.VARIANTS) and "4.00" in text


def test_one_search_finds_the_boundary_from_any_guess():
    for answer in (0, 1, 5, 37, 64):
        for guess in (None, 1, answer, answer + 1, 3 * answer + 2):
            tried = []
            k, record, probes = scale.largest(
                lambda k: (tried.append(k) or k <= answer, {"k": k}), 50, guess
            )
            assert (k, probes) == (min(answer, 50), len(tried)) and (record or {"k": 0})["k"] == k
            assert all(1 <= t <= 50 for t in tried)
    exact = []
    scale.largest(lambda k: (exact.append(k) or k <= 20, {}), guess=20)
    assert exact == [20, 21], "a right guess costs two probes: itself and one more row"


@pytest.fixture(scope="module")
def micro_batches(tmp_path_factory):
    path = tmp_path_factory.mktemp("scale") / "scale.json"
    assert (
        scale_command(
            [
                "--micro-batch", "--model", "tiny", "--budget-mb", "0.5", "--world-size", "2",
                "--json", str(path),
            ]
        )
        == 0
    )
    return json.loads(path.read_text())


def test_checkpointing_fits_a_larger_micro_batch_at_every_stage(micro_batches):
    rows = micro_batches["rows"]
    for label, stage, offload in scale.VARIANTS:
        plain, ckpt = (
            next(r for r in rows if r["variant"] == label and r["checkpointing"] == c)
            for c in (False, True)
        )
        assert 1 <= plain["micro_batch"] < ckpt["micro_batch"] < scale.MAX_ROWS, label
        assert (
            plain["total"] <= micro_batches["budget_bytes"]
            and ckpt["total"] <= micro_batches["budget_bytes"]
        )


def test_measured_micro_batch_is_the_estimate_less_what_is_in_flight(micro_batches):
    from minizero.lab.model import GPTConfig
    cfg = GPTConfig.named("tiny")
    for r in micro_batches["rows"]:
        # activations: within the estimate's tolerance (tests/test_activations.py: 10 %)
        act = activation_bytes(
            cfg.n_layer,
            cfg.n_embd,
            cfg.n_head,
            micro_batches["seq"],
            r["micro_batch"],
            mlp_ratio=cfg.mlp_ratio,
            checkpointing=r["checkpointing"],
        )
        assert abs(r["activations"] - act) <= scale.TOLERANCE * act, r
        # model states: the paper's formula is a floor (buckets and gathered units in flight come on
        # top), so the estimate never promises fewer rows than fit; DDP has nothing in flight: the
        # same rows
        states = estimate(
            r["num_params"], 2, r["stage"], param_bytes=4, grad_bytes=4, k=8, offload=r["offload"]
        )
        assert r["peak"] >= states - 1e-6 and r["estimated_micro_batch"] >= r["micro_batch"], r
        if r["stage"] == 0:
            assert r["estimated_micro_batch"] == r["micro_batch"], r


def test_micro_batch_table_names_every_variant(micro_batches):
    text = scale.format_table(micro_batches)
    assert (
        all(v in text for v, _, _ in scale.VARIANTS) and "plain |  ckpt" in text and "N = 2" in text
    )


def test_under_a_memory_cap_ddp_runs_out_and_stage_3_trains():
    """The real-memory story at N = 2 with C = 150 MB: a GPT whose DDP model states (16Ψ) exceed C.
    DDP's ranks hit their RLIMIT_DATA and the launcher says which rank ran out of memory, in one
    line and quickly (nothing hangs); stage 3 trains under the same cap, resident above the baseline
    at least its formula's 16Ψ/N and less than C."""
    with pytest.raises(ValueError, match="memory_cap"):
        minizero.launch(rss.capped_worker, 2, memory_cap=0)
    report = rss.capped_runs(150, world_size=2, variants=rss.VARIANTS[:2])
    ddp, stage3 = report["rows"]
    assert 16 * report["num_params"] > report["cap_bytes"]
    assert not ddp["trained"], "DDP trained under the cap: was the cap set in the ranks?"
    cap_mb = f"{report['limit_bytes'] / 1e6:.0f}"
    assert re.match(
        r"rank [01] failed: out of memory under its cap "
        rf"of {cap_mb} MB \(RuntimeError: .*can't allocate",
        ddp["error"],
    ), ddp["error"]
    assert ddp["seconds"] < 30
    assert stage3["trained"], stage3.get("error")
    assert stage3["formula"] == 16 * report["num_params"] / 2
    assert stage3["formula"] <= stage3["above_baseline"] < report["cap_bytes"], stage3
    text = rss.format_rss_table(report)
    assert "DDP: rank" in text and "out of memory" in text and "trained in" in text


def test_stage_3_on_a_mesh_runs_next_to_pytorchs_tensor_parallelism_and_fsdp2(tmp_path):
    """--stages 3+tp2: minizero's stage 3 with tensor-parallel rows of 2 next to PyTorch's
    parallelize_module + fully_shard on a (dp, tp) DeviceMesh: both train the same blocks, split
    alike, and end at the same parameters (fp32, AdamW: within 1e-4 after 2 steps)."""
    path = tmp_path / "mesh.json"
    assert bench_command(["--world-size", "2", "--model", "default", "--stages", "3+tp2",
                          "--peers", "torch", "--steps", "2", "--repeats", "1", "--json",
                          str(path)]) == 0
    [pair] = json.loads(path.read_text())["pairs"]
    assert (pair["variant"], pair["peer"]) == ("3+tp2", "tp_fsdp2")
    assert pair["ratio"] > 0 and pair["max_param_diff"] < 1e-4
