"""The GPU path: every stage on CUDA with NCCL ends where one CPU process does, and the GPU holds
what engine.memory() counts.

    python -m pytest tests/test_cuda.py -q      # every test skipped, saying why, without CUDA
    scripts/gpu_smoke.sh                         # on a GPU machine: these tests, then a summary

Run once on one H200, at N = 1 (its figures: docs/gpus.md); the N = 2 tests have not run yet.
Its training runs are rehearsed on CPU by tests/test_cuda_rehearsal.py, so that they cannot rot
unseen. One process per GPU: N = 1, and N = 2 where there are two GPUs (NCCL refuses two ranks on
one GPU), through `minizero.launch(..., backend="nccl")`, one launch per N for all the training
runs.

What runs differently on CUDA, and the test that runs it:
  comm.init picks NCCL, each rank its GPU ..... test_nccl_is_the_default_and_each_rank_has_its_gpu
  where shards, units and optimizer state live . test_allocator_frees_what_memory_counts (the bytes
      CUDA's allocator frees when the engine is dropped = engine.memory()'s device categories)
  offload moves bytes off the device .......... test_offload_takes_the_formulas_bytes_off_the_device
  pinned host buffers (offload.py; zero3.py's shard) ... test_offload_host_buffers_are_pinned
  non_blocking copies; the stream synchronised before the host's optimizer step
      ......................................... test_offload_waits_for_its_copies (a stalled stream)
  activation checkpointing's inputs on pinned host memory, copied back non-blocking, the CUDA RNG
      state restored for the recompute; sharded_init's partitions cast onto the GPU
      ............................ test_matches_reference[checkpointing-cpu], [sharded-init]
  offload="disk": a GPU's parameters stepped through a host master of their own
      ............................ test_matches_reference[disk-stage2], [disk-stage3-bf16]
  Hugging Face's GPT-2 ........................ test_hf_gpt2_matches_reference
  N = 2: NCCL's collectives (N = 1 runs none: comm skips them), and stage 3's prefetch in a
      torch.profiler trace .................... test_prefetch_overlaps_the_next_gather_with_compute
  `python -m minizero.bench --device cuda` at N = 1: every peer (PyTorch's, DeepSpeed's) in a
      group of one, clocks read after torch.cuda.synchronize, MFU against the GPU's measured GEMM
      peak ..................................... test_bench_runs_every_pair_on_one_gpu
Every run is compared with the single-process CPU reference (minizero/lab/reference.py) at
reference.tolerance (fp32 1e-4; bf16 5e-2, against fp32): a GPU's kernels round differently from a
CPU's, so nothing here asks for bitwise equality.

Nothing here touches CUDA when the module is imported: the launcher's forkserver imports it to find
the workers, and torch refuses CUDA in a process forked after CUDA was initialised. So the skip
conditions are strings (pytest evaluates them when a test runs), and minizero is imported inside the
functions, which also keeps the skipped run on a CPU machine short.
"""

from __future__ import annotations

import functools
import gc
import json
import tempfile

import pytest
import torch

pytestmark = pytest.mark.skipif("not torch.cuda.is_available()",
                                reason="needs CUDA: torch.cuda.is_available() is False here")
TWO_GPUS = pytest.mark.skipif("torch.cuda.is_available() and torch.cuda.device_count() < 2",
                              reason="N = 2 over NCCL needs two GPUs (one GPU per rank)")
WORLD_SIZES = [1, pytest.param(2, marks=TWO_GPUS)]

# (stage, offload): every stage, optimizer offload at stages 1-3, parameter offload at stage 3
SETTINGS = [(0, False), (1, False), (1, True), (2, False), (2, True), (3, False), (3, True),
            (3, "params")]
OFFLOADED = [s for s in SETTINGS if s[1]]
DTYPES = ("fp32", "bf16")
# Beyond SETTINGS: at stage 3, P_a+cpu (inputs on pinned host memory, copied back non-blocking, the
# CUDA RNG state restored for the recompute) and a model built partitioned (sharded_init onto the
# GPU); the disk tier, where a GPU's parameters get a host master of their own (beyond/disk.py). Its
# files are nameless (O_TMPFILE), so every rank's can share one folder.
EXTRAS = {"checkpointing-cpu": {"stage": 3, "activation_checkpointing": "cpu"},
          "sharded-init": {"stage": 3, "sharded_init": True},
          "disk-stage2": {"stage": 2, "offload": "disk", "offload_path": tempfile.gettempdir()},
          "disk-stage3-bf16": {"stage": 3, "offload": "disk", "dtype": "bf16",
                               "offload_path": tempfile.gettempdir()}}
# CUDA's caching allocator rounds each allocation up to a multiple of 512 bytes (kMinBlockSize):
# what it holds exceeds the tensors' own bytes by less than that, per allocation.
ALLOCATOR_ROUNDING = 512
STALL_CYCLES = 100_000_000      # torch.cuda._sleep: ~50 ms of GPU clock, far beyond a host step


def name(setting: tuple, dtype: str) -> str:
    stage, offload = setting
    offloaded = {False: "", True: "-offload", "params": "-offload-params"}[offload]
    return f"stage{stage}{offloaded}-{dtype}"


RUNS = [name(s, d) for s in SETTINGS for d in DTYPES]
TRAINED = RUNS + list(EXTRAS)          # the tiny awkward GPT, against the reference
MEASURED = RUNS                        # the default GPT, against the formulas and the allocator


def configs(n: int) -> dict[str, object]:
    """{"trained/<run>" | "measured/<run>": TrainConfig} at world size n."""
    from _checks import AWKWARD

    from minizero.lab.train import TrainConfig
    # tied, frozen and unused parameters, several buckets, accumulation (no_sync); Adam's moments
    # on the host under offload. No weight decay: it would move the unused parameter here and not in
    # the reference (reducer.py's docstring says why)
    trained = {**AWKWARD, "world_size": n, "steps": 3, "batch_size": 8, "grad_accum": 2,
               "return_state": True, "optimizer": "adamw", "lr": 1e-2,
               "optimizer_params": {"weight_decay": 0.0}}
    measured = {"world_size": n, "steps": 2, "batch_size": 8, "optimizer": "adamw"}
    out = {}
    for (stage, offload) in SETTINGS:
        for dtype in DTYPES:
            run = name((stage, offload), dtype)
            setting = {"stage": stage, "offload": offload, "dtype": dtype}
            out[f"trained/{run}"] = TrainConfig(**setting, **trained)
            out[f"measured/{run}"] = TrainConfig(**setting, **measured)
    for extra, options in EXTRAS.items():
        out[f"trained/{extra}"] = TrainConfig(**trained, **options)
    return out


# ------------------------------------------------------------------------------------------------
# Workers: they run in the launched ranks
# ------------------------------------------------------------------------------------------------

def where_am_i() -> tuple[str, str, int]:
    """(backend, comm.device(), torch's current device) here; comm.init chose the backend."""
    from minizero import comm
    return comm.backend(), str(comm.device()), torch.cuda.current_device()


def _allocated() -> tuple[int, int]:
    """(bytes, allocations) that CUDA's caching allocator holds for live tensors now."""
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.memory_stats()["allocation.all.current"]


def _host_buffers(engine) -> dict[str, torch.Tensor]:
    """The host tensors offload copies to or from the device: pinned (page-locked), or the copies
    are not asynchronous. (Adam's moments live on the host too, but never cross the bus.)"""
    buffers = {}
    if engine.offload in (True, "params"):       # "disk": the state crosses through its file
        buffers |= {f"host_grads[{i}]": t for i, t in enumerate(engine.optimizer.host_grads)}
        buffers |= {f"masters[{i}]": t for i, t in enumerate(engine.optimizer.masters)}
    if engine.offload == "params":
        buffers["param_shard"] = engine.params.shard
        buffers |= {f"{u.name}.frozen_shard": u.frozen_shard for u in engine.units
                    if u.frozen_shard.numel()}
    return buffers


def _train(cfg) -> tuple[dict, object]:
    """lab.train.train_worker's result for cfg, and the engine it trained."""
    import minizero
    from minizero.lab.train import train_worker
    engines = []

    def keep(*args, **kwargs):
        engines.append(minizero.wrap(*args, **kwargs))
        return engines[-1]
    return train_worker(cfg, make_engine=keep), engines.pop()


def train_and_release(cfgs: list) -> list[dict]:
    """Worker: train each config; then, every step done and nothing in flight, drop the engine: the
    bytes the allocator frees are what the engine held on the device. Workspaces (cuBLAS', NCCL's)
    are allocated on both sides of that difference, so they cancel out."""
    out = []
    for cfg in cfgs:
        gc.collect()
        start, _ = _allocated()
        torch.cuda.reset_peak_memory_stats()
        result, engine = _train(cfg)
        now = engine.memory()
        buffers = sum(b.untyped_storage().nbytes() for b in engine.module.buffers() if b.is_cuda)
        host = _host_buffers(engine)
        result |= {"device": str(engine.device), "buffers": buffers,
                   "params_on": sorted({str(p.device) for p in engine.module.parameters()}),
                   "unpinned": sorted(k for k, t in host.items() if not t.is_pinned()),
                   "frozen_shards": sorted(k for k in host if k.endswith("frozen_shard")),
                   "counted_now": now["params"] + now["grads"] + now["optimizer"],
                   "peak_above_start": torch.cuda.max_memory_allocated() - start}
        gc.collect()                      # what training left in reference cycles goes first
        held, allocations = _allocated()
        del engine, host
        gc.collect()                      # the engine's hooks make reference cycles with the model
        after, allocations_after = _allocated()
        result |= {"released": held - after,
                   "released_allocations": allocations - allocations_after}
        out.append(result)
    return out


def train_with_a_stalled_stream(cfgs: list) -> list[dict]:
    """Worker: train with the GPU's stream stalled before every engine.step(), so that the step's
    device -> host gradient copies (non_blocking) land ~50 ms after the host could read them. The
    host's optimizer step must wait for them (offload.py synchronises the stream) or it steps stale
    gradients."""
    import minizero
    from minizero.lab.model import make_model
    from minizero.lab.train import forward_backward
    out = []
    for cfg in cfgs:
        engine = minizero.wrap(make_model(cfg.model_config(), seed=cfg.seed), cfg.stage,
                               cfg.optimizer_factory(), offload=cfg.offload, **cfg.engine_options())
        for step in range(cfg.steps):
            forward_backward(cfg, step, engine, engine.backward, engine.no_sync)
            torch.cuda._sleep(STALL_CYCLES)          # every copy enqueued from here waits behind it
            engine.step()
        out.append({"rank": engine.rank, "state_dict": engine.full_state_dict()})
    return out


def forward_trace(prefetch: bool, path: str) -> None:
    """Worker: a profiled stage-3 forward of a GPT wide enough that a unit's kernels outlast their
    launches (4 blocks of 12.6M parameters, bf16, 16 x 256 tokens); rank 0 writes its Chrome trace
    to `path`."""
    import minizero
    from minizero import comm
    from minizero.lab.model import GPTConfig, make_model
    cfg = GPTConfig(n_layer=4, n_head=8, n_embd=1024, block_size=256)
    engine = minizero.wrap(make_model(cfg), 3, functools.partial(torch.optim.AdamW, lr=1e-3),
                           dtype="bf16", prefetch=prefetch)
    x = torch.randint(0, cfg.vocab_size, (16, cfg.block_size), device=comm.device())
    with torch.no_grad():
        for _ in range(2):               # records the forward order, builds NCCL's communicator
            engine(x)
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            engine(x)
            torch.cuda.synchronize()
    if comm.rank() == 0:
        prof.export_chrome_trace(path)


# ------------------------------------------------------------------------------------------------
# The launch per world size, and what the tests print
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"N={n}")
def runs(request) -> dict[str, tuple[object, list[dict]]]:
    """{config name: (cfg, per-rank results)} of one launch over NCCL at world size N. (pytest keeps
    a failed launch's error for every test that needs it: one launch, not one per test.)"""
    import minizero
    n, cfgs = request.param, configs(request.param)
    per_rank = minizero.launch(train_and_release, n, list(cfgs.values()), backend="nccl",
                               timeout=600)
    return {key: (cfg, [results[i] for results in per_rank])
            for i, (key, cfg) in enumerate(cfgs.items())}


def summary(text: str) -> None:
    """One line of the summary scripts/gpu_smoke.sh collects (pytest -s shows them)."""
    print(f"\ngpu-smoke: {text}")


def kb(x: float) -> str:
    return f"{x / 1e3:.1f} kB"


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", WORLD_SIZES)
def test_nccl_is_the_default_and_each_rank_has_its_gpu(n):
    import minizero
    assert minizero.launch(where_am_i, n) == [("nccl", f"cuda:{r}", r) for r in range(n)]


@pytest.mark.parametrize("run", TRAINED)
def test_matches_reference(runs, run):
    from _checks import assert_matches_reference

    from minizero.lab.reference import tolerance
    cfg, results = runs[f"trained/{run}"]
    for r in results:
        assert r["device"] == f"cuda:{r['rank']}" and r["params_on"] == [r["device"]], (
            f"rank {r['rank']} computes on {r['device']}, its parameters are on {r['params_on']}")
    assert_matches_reference(cfg, results, atol=tolerance(cfg.dtype))


@pytest.mark.parametrize("run", MEASURED)
def test_memory_and_comm_match_the_paper(runs, run):
    from _checks import assert_comm_matches_formula, assert_memory_matches_formula
    assert_memory_matches_formula(*runs[f"measured/{run}"])
    assert_comm_matches_formula(*runs[f"measured/{run}"])


@pytest.mark.parametrize("run", MEASURED)
def test_allocator_frees_what_memory_counts(runs, run):
    """Between steps, the device bytes engine.memory() counts (params + grads + optimizer, plus the
    model's buffers) are what CUDA's allocator frees when the engine goes, up to its rounding: every
    shard, unit and optimizer state lives where it is counted, and stage 3's freed units hold no
    device memory. At the peak the allocator also holds activations and temporaries: never less."""
    from minizero.lab.report import theory
    cfg, results = runs[f"measured/{run}"]
    formula = theory(cfg, results[0]["num_params"], results[0]["num_frozen"])["device_total"]
    for r in results:
        counted = r["counted_now"] + r["buffers"]
        slack = ALLOCATOR_ROUNDING * r["released_allocations"]
        summary(f"N={cfg.world_size} {run:<22} rank {r['rank']}: model states on the device: "
                f"formula {kb(formula)}, engine.memory() {kb(r['counted_now'])} + buffers "
                f"{kb(r['buffers'])}, allocator freed {kb(r['released'])} in "
                f"{r['released_allocations']} allocations; peak: engine.memory() {kb(r['peak'])} "
                f"+ activations {kb(r['memory']['activations'])}, max_memory_allocated "
                f"{kb(r['peak_above_start'])}")
        assert abs(r["released"] - counted) <= slack, (
            f"rank {r['rank']}: the allocator freed {r['released']} bytes, engine.memory() counts "
            f"{counted} on the device, buffers included (the allocator's rounding allows {slack})")
        assert r["peak_above_start"] >= r["peak"], (
            f"rank {r['rank']}: engine.memory()'s peak is {r['peak']} device bytes, the "
            f"allocator's {r['peak_above_start']}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("setting", OFFLOADED, ids=lambda s: name(s, "")[:-1])
def test_offload_takes_the_formulas_bytes_off_the_device(runs, setting, dtype):
    """From the same stage without offload, the device bytes fall by the formula's (KΨ/N of
    optimizer state; offload="params" also the parameter shard): engine.memory() up to padding,
    and the allocator as much as engine.memory() up to its rounding."""
    from minizero.lab.report import theory
    from minizero.memory import within_padding
    cfg_on, on = runs[f"measured/{name(setting, dtype)}"]
    cfg_off, off = runs[f"measured/{name((setting[0], False), dtype)}"]
    n, psi, frozen = cfg_on.world_size, on[0]["num_params"], on[0]["num_frozen"]
    formula = (theory(cfg_off, psi, frozen)["device_total"]
               - theory(cfg_on, psi, frozen)["device_total"])
    for r_on, r_off in zip(on, off, strict=True):
        counted, freed = (r_off[k] - r_on[k] for k in ("counted_now", "released"))
        slack = ALLOCATOR_ROUNDING * (r_on["released_allocations"] + r_off["released_allocations"])
        summary(f"N={n} {name(setting, dtype):<22} rank {r_on['rank']}: the device holds "
                f"{kb(freed)} less (allocator), {kb(counted)} (engine.memory()), "
                f"formula {kb(formula)}")
        assert within_padding(counted, formula, n), (
            f"rank {r_on['rank']}: engine.memory() counts {counted} device bytes less, the formula "
            f"{formula:.0f}")
        assert abs(freed - counted) <= slack, (
            f"rank {r_on['rank']}: the allocator holds {freed} bytes less, engine.memory() "
            f"{counted}")


@pytest.mark.parametrize("run", [name(s, d) for s in OFFLOADED for d in DTYPES])
def test_offload_host_buffers_are_pinned(runs, run):
    """What crosses the bus (offload's fp32 gradients and masters; with offload="params" stage 3's
    parameter shard and the frozen parameters' shards too) is pinned: only then are offload's
    non_blocking copies asynchronous."""
    cfg, results = runs[f"trained/{run}"]
    for r in results:
        if cfg.offload == "params":   # the awkward GPT's frozen position embedding, offloaded too
            assert r["frozen_shards"], "the awkward GPT has a frozen parameter, so a frozen shard"
        assert not r["unpinned"], f"rank {r['rank']}: host buffers not pinned: {r['unpinned']}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_offload_waits_for_its_copies(dtype):
    """With the GPU's stream stalled before each step, offload still steps this step's gradients:
    every offload setting ends where the reference does."""
    from _checks import assert_matches_reference

    import minizero
    from minizero.lab.reference import tolerance
    cfgs = [cfg for key, cfg in configs(1).items()
            if key.startswith("trained/") and cfg.offload and cfg.dtype == dtype]
    per_rank = minizero.launch(train_with_a_stalled_stream, 1, cfgs, backend="nccl", timeout=300)
    for i, cfg in enumerate(cfgs):
        assert_matches_reference(cfg, [results[i] for results in per_rank], atol=tolerance(dtype))


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_hf_gpt2_matches_reference(n):
    """Hugging Face's GPT-2 (tied head) at every stage and offload setting on the GPU
    (tests/_hf.py's worker moves each batch to comm.device()), against one CPU process."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from _hf import Case, reference_train, train_cases

    import minizero
    from minizero.lab.reference import max_abs_diff, tolerance
    cases = [Case("gpt2", stage, offload, world_size=n) for stage, offload in SETTINGS]
    per_rank = minizero.launch(train_cases, n, cases, backend="nccl", timeout=300)
    for i, case in enumerate(cases):
        expected = reference_train(case)["state_dict"]
        for results in per_rank:
            diff = max_abs_diff(results[i]["state_dict"], expected)
            assert diff <= tolerance("fp32"), (
                f"{case}, rank {results[i]['rank']}: max |GPU - CPU reference| = {diff:.3g}")


def kernel_overlap(trace: str) -> tuple[float, float]:
    """(µs NCCL's all-gather kernels ran beside compute kernels, µs they ran) in a Chrome trace.
    Compute kernels run one at a time on the compute stream, so the intersections add up."""
    with open(trace) as f:
        kernels = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    spans = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in kernels]
    gathers = [(a, b) for a, b, kernel in spans
               if kernel.startswith("nccl") and "AllGather" in kernel]
    compute = [(a, b) for a, b, kernel in spans if not kernel.startswith("nccl")]
    overlap = sum(max(0.0, min(g1, c1) - max(g0, c0)) for g0, g1 in gathers for c0, c1 in compute)
    return overlap, sum(g1 - g0 for g0, g1 in gathers)


@TWO_GPUS
def test_prefetch_overlaps_the_next_gather_with_compute(tmp_path):
    """Stage 3 at N = 2: with prefetch, unit k+1's all-gather is issued before unit k's forward
    kernels, so NCCL's kernel runs beside them. Without, each all-gather waits for the compute
    before it and the compute after waits for it: no overlap at all. The traces stay in tmp_path."""
    import minizero
    overlap = {}
    for prefetch in (True, False):
        trace = str(tmp_path / f"stage3-forward-prefetch-{prefetch}.json")
        minizero.launch(forward_trace, 2, prefetch, trace, backend="nccl", timeout=300)
        overlap[prefetch], gathering = kernel_overlap(trace)
        assert gathering > 0, f"no NCCL all-gather kernel in {trace}"
        summary(f"N=2 stage 3 forward, prefetch={prefetch}: all-gathers {gathering:.0f} µs, "
                f"{overlap[prefetch]:.0f} µs of it beside compute kernels ({trace})")
    assert overlap[True] > 0, "with prefetch, no all-gather ran beside a unit's forward"
    assert overlap[False] <= 0.05 * overlap[True], "without prefetch, gathers overlapped compute"


def test_bench_runs_every_pair_on_one_gpu(tmp_path):
    """python -m minizero.bench --device cuda at N = 1, fp32 (the peers' precision), the default
    GPT, 4 steps, 1 repeat: every pair ran (a peer that refused a group of one would be in
    "skipped", with its reason), with tokens/s and an MFU between 0 and 1 against the GPU's own
    fp32 GEMM peak on both sides; only a variant with no installed peer runs alone (2 + offload
    where DeepSpeed is not installed). The table goes to the summary."""
    from minizero.cli.bench import main as bench_command
    from minizero.lab import bench
    path = tmp_path / "bench.json"
    assert bench_command(["--device", "cuda", "--world-size", "1", "--steps", "4", "--repeats",
                          "1", "--quiet", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    c = report["config"]
    assert (c["device"], c["backend"], c["dtype"]) == ("cuda", "nccl", "fp32")
    assert c["world_sizes"] == [1]
    assert c["gpu"], "rank 0 names its GPU"
    assert report["skipped"] == [], report["skipped"]
    assert [a["variant"] for a in report["alone"]] == [
        v for v in bench.VARIANTS if not bench.peers_of(v)], report["alone"]
    assert [(p["variant"], p["peer"]) for p in report["pairs"]] == [
        (v, peer) for v in bench.VARIANTS for peer in bench.peers_of(v)]
    for p in report["pairs"]:
        for side in bench.SIDES:
            t = p["throughput"][side]
            assert t["tokens_per_s"] > 0 and 0 < t["mfu"] < 1, (p["variant"], p["peer"], side, t)
    for line in bench.format_table(report).splitlines():
        summary(line)
