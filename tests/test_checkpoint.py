"""Sharded checkpoints: resuming in fresh processes is bit-identical for every stage, a crash during
a save never costs the previous checkpoint, bad checkpoints are refused in one line with nothing
changed, and minizero.consolidate gives a plain state_dict that also continues training at another
world size."""

import functools
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from _checks import assert_matches_reference

import minizero
from minizero import checkpoint
from minizero.checkpoint import CheckpointError, consolidate
from minizero.cli.consolidate import main
from minizero.cli.run import build_parser, config_from_args
from minizero.cli.run import main as run_main
from minizero.lab.model import make_model
from minizero.lab.train import TrainConfig, train_several, train_worker

K, M, N = 2, 2, 2          # save after K steps, resume for M more, at world size N
# A frozen parameter, a parameter forward never uses, the tied weight, odd sizes, several buckets.
BASE = dict(world_size=N, model="tiny", batch_size=12, optimizer="adamw", lr=1e-2, bucket_size=3000,
            model_overrides={"frozen": ("pos_emb.weight",), "unused_param": True})
FP16_SCALE = {"initial_scale_power": 16, "hysteresis": 1, "loss_scale_window": 1}
VARIANTS = {
    "stage0": dict(stage=0),
    "stage1": dict(stage=1),
    "stage1_offload": dict(stage=1, offload=True),
    "stage2_accum_clip": dict(stage=2, grad_accum=2, clip_grad_norm=0.05),
    "stage2_bf16_offload": dict(stage=2, dtype="bf16", offload=True),
    "stage3": dict(stage=3),
    "stage3_offload_params": dict(stage=3, offload="params"),
    "stage3_bf16": dict(stage=3, dtype="bf16"),
    # fp16: by step K the scale has grown (window 1) and the next steps overflow at it; a resume
    # with a fresh scaler would start at 2**16 again and take the steps the uninterrupted run skips
    "stage2_fp16": dict(stage=2, dtype="fp16", loss_scale=FP16_SCALE),
    "stage1_fp16_offload": dict(stage=1, dtype="fp16", offload=True, loss_scale=FP16_SCALE),
}
# SGD has no state, so continuing from the consolidated weights at another N must track
# the reference.
SGD = dict(BASE, stage=2, optimizer="sgd", lr=0.5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Launch 1: every variant uninterrupted for K+M steps, and for K steps saving a checkpoint.
    Launch 2, fresh processes: every variant loads its checkpoint and trains to step K+M."""
    root = tmp_path_factory.mktemp("ckpt")
    dirs = {name: str(root / name) for name in [*VARIANTS, "sgd"]}
    first = []
    for name, opts in VARIANTS.items():
        cfg = dict(BASE, **opts, return_state=True)
        first += [TrainConfig(**cfg, steps=K + M), TrainConfig(**cfg, steps=K, save_dir=dirs[name])]
    first.append(TrainConfig(**SGD, steps=K, save_dir=dirs["sgd"]))
    before = minizero.launch(train_several, N, first)
    resumed = minizero.launch(
        train_several,
        N,
        [
            TrainConfig(**BASE, **opts, steps=K + M, return_state=True, load_dir=dirs[name])
            for name, opts in VARIANTS.items()
        ],
    )
    out = {}
    for i, name in enumerate(VARIANTS):
        out[name] = {"full": [r[2 * i] for r in before], "saved": [r[2 * i + 1] for r in before],
                     "resumed": [r[i] for r in resumed], "dir": dirs[name]}
    out["sgd"] = {"dir": dirs["sgd"]}
    return out


@pytest.mark.parametrize("name", VARIANTS)
def test_resume_in_fresh_processes_is_bit_identical(runs, name):
    run = runs[name]
    for full, resumed in zip(run["full"], run["resumed"]):
        assert resumed["losses"] == full["losses"][K:], (
            f"rank {full['rank']}: losses after resuming differ"
        )
        assert (resumed["loss_scales"], resumed["skipped_steps"]) == (
            full["loss_scales"][K:],
            full["skipped_steps"],
        ), f"rank {full['rank']}: the loss scale or the skipped steps after resuming differ"
        for key, expected in full["state_dict"].items():
            assert torch.equal(resumed["state_dict"][key], expected), (
                f"{name}, rank {full['rank']}, {key}: resumed parameters are not bit-identical")


@pytest.mark.parametrize("name", VARIANTS)
def test_consolidated_state_is_the_full_state_dict_and_loads_strictly(runs, name):
    expected = runs[name]["saved"][0]["state_dict"]       # engine.full_state_dict() at the save
    state = consolidate(runs[name]["dir"])
    assert list(state) == list(expected)                  # model.state_dict()'s keys, in order
    for key, value in expected.items():
        assert state[key].dtype == value.dtype and torch.equal(state[key], value), key
    opts = VARIANTS[name]
    model = make_model(TrainConfig(**BASE, **opts).model_config())
    model.load_state_dict(state, strict=True)             # no process group, no minizero engine


def test_consolidate_cli_then_continue_at_another_world_size(runs, tmp_path):
    out = tmp_path / "model.pt"
    p = subprocess.run([sys.executable, "-m", "minizero.consolidate", runs["sgd"]["dir"], str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert f"wrote {out}" in p.stdout and f"step {K}" in p.stdout
    # saved by stage 2 at N = 2; continued by stage 3 at N = 3 from the consolidated weights
    cfg = TrainConfig(
        **{**SGD, "stage": 3, "world_size": 3},
        steps=K + M,
        init_state=str(out),
        start_step=K,
        return_state=True,
    )
    results = minizero.launch(train_worker, 3, cfg)
    assert all(len(r["losses"]) == M for r in results)
    assert_matches_reference(cfg, results, atol=1e-6)   # = K + M uninterrupted single-process steps


# --- in the test process, one rank: crashes during a save, bad checkpoints ------------------------

ONE = dict(BASE, world_size=1, stage=2)


def _engine(**overrides):
    cfg = TrainConfig(**{**ONE, **overrides})
    model = make_model(cfg.model_config())
    return minizero.wrap(
        model, cfg.stage, cfg.optimizer_factory(), offload=cfg.offload, **cfg.engine_options()
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("one") / "ckpt")
    train_worker(TrainConfig(**ONE, steps=1, save_dir=d))
    return d


def test_a_crash_before_the_commit_keeps_the_previous_checkpoint(saved, tmp_path, monkeypatch):
    d = str(tmp_path / "ckpt")
    shutil.copytree(saved, d)
    engine = _engine()
    engine.load(d)
    x = torch.randint(0, 10, (4, 16))
    engine.backward(engine(x).float().mean())
    engine.step()
    real_write = checkpoint.write_atomic

    def crash_at_manifest(path, data):
        if path.endswith(checkpoint.MANIFEST):
            raise KeyboardInterrupt("simulated crash just before the commit")
        real_write(path, data)

    monkeypatch.setattr(checkpoint, "write_atomic", crash_at_manifest)
    with pytest.raises(KeyboardInterrupt):
        engine.save(d)
    monkeypatch.undo()
    # v2: every shard, never committed
    assert sorted(os.listdir(d)) == ["manifest.json", "v1", "v2"]
    fresh = _engine()
    fresh.load(d)
    assert fresh.step_count == 1                                       # still the old checkpoint
    engine.save(d)                                                     # a complete save replaces it
    assert sorted(os.listdir(d)) == ["manifest.json", "v3"]
    fresh = _engine()
    fresh.load(d)
    assert fresh.step_count == 2
    assert all(torch.equal(a, b) for a, b in zip(fresh.full_state_dict().values(),
                                                  engine.full_state_dict().values()))


def _damage(d, how):
    version = checkpoint.read_manifest(d)["version"]
    shard = os.path.join(d, version, "rank0.pt")
    if how == "missing file":
        os.remove(shard)
    elif how == "truncated file":
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
    elif how == "flipped byte":
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 1]))
    elif how == "damaged manifest":
        with open(os.path.join(d, "manifest.json"), "w") as f:
            f.write('{"format": "minizero-chec')
    elif how == "no manifest":
        os.remove(os.path.join(d, "manifest.json"))


@pytest.mark.parametrize("how, overrides, message", [
    ("other optimizer", {"optimizer": "sgd"},
     "saved with optimizer AdamW, this engine has optimizer SGD"),
    ("other shapes", {"model_overrides": {**BASE["model_overrides"], "n_embd": 16}},
     "has shape [12, 14] there"),
    ("missing file", {}, "rank0.pt is missing"),
    ("truncated file", {}, "rank0.pt is truncated or damaged"),
    ("flipped byte", {}, "rank0.pt is damaged: its sha256 differs"),
    ("damaged manifest", {}, "manifest.json is damaged"),
    ("no manifest", {}, "has no manifest.json"),
])
def test_a_bad_checkpoint_is_refused_in_one_line_and_nothing_changes(
    saved, tmp_path, how, overrides, message
):
    d = str(tmp_path / "ckpt")
    shutil.copytree(saved, d)
    _damage(d, how)
    engine = _engine(**overrides)
    before = engine.full_state_dict()
    with pytest.raises(CheckpointError, match=re.escape(message)) as info:
        engine.load(d)
    assert "\n" not in str(info.value)
    assert engine.step_count == 0 and not engine.optimizer.optimizer.state
    assert all(torch.equal(before[k], v) for k, v in engine.full_state_dict().items())


def test_a_checkpoint_between_backward_and_step_is_refused_in_one_line(saved, tmp_path):
    """A checkpoint holds no gradients: save() would lose those of a backward whose step() has not
    run (here accumulated in no_sync()), load() would let that step() apply them to the loaded
    weights. Both refuse, and the step goes on as if nothing had been asked."""
    engine, twin = _engine(), _engine()
    x = torch.randint(0, 10, (4, 16))
    for e in (engine, twin):
        with e.no_sync():
            e.backward(e(x).float().mean())
    before = engine.full_state_dict()
    for verb, call in (("save", lambda: engine.save(tmp_path / "mid")),
                       ("load", lambda: engine.load(saved))):
        with pytest.raises(CheckpointError, match=rf"^engine\.{verb}\(\) between backward\(\) "
                           r"and step\(\): .*; call it between steps$") as info:
            call()
        assert "\n" not in str(info.value)
    assert not (tmp_path / "mid").exists() and engine.step_count == 0
    assert all(torch.equal(before[k], v) for k, v in engine.full_state_dict().items())
    for e in (engine, twin):
        e.step()
    assert all(torch.equal(twin.full_state_dict()[k], v)
               for k, v in engine.full_state_dict().items())
    engine.save(tmp_path / "after")                                     # between steps: saved
    assert checkpoint.read_manifest(str(tmp_path / "after"))["step"] == 1


class _TwoNumbersPerParameter(torch.optim.SGD):
    """An optimizer whose state is neither per element nor a scalar: it cannot be resharded."""

    def step(self, closure=None):
        super().step(closure)
        for p in self.param_groups[0]["params"]:
            self.state[p]["stats"] = torch.zeros(2)


def test_the_loss_scaler_survives_resharding_and_an_older_checkpoint_without_it(runs, tmp_path):
    saved = runs["stage2_fp16"]["saved"][0]
    # it grew: not the default
    assert saved["skipped_steps"] == 0 and saved["loss_scale"] == 2.0 ** 17
    engine = _engine(stage=3, dtype="fp16", loss_scale=FP16_SCALE)          # N 2 -> 1, stage 2 -> 3
    engine.load(runs["stage2_fp16"]["dir"])
    assert engine.scaler.state_dict() == {
        "dynamic": True,
        "scale": 2.0**17,
        "credit": 1,
        "iteration": K,
        "last_overflow": -1,
        "skipped_steps": 0,
    }
    old = tmp_path / "old"                        # as saved before the scaler was: no "loss_scaler"
    shutil.copytree(runs["stage2_fp16"]["dir"], old)
    manifest = json.loads((old / "manifest.json").read_text())
    for name in manifest["files"]:
        if name.startswith("rank"):
            path = old / manifest["version"] / name
            shard = torch.load(path, weights_only=True)
            del shard["loss_scaler"]
            manifest["files"][name] = checkpoint._write_torch(str(path), shard)
    (old / "manifest.json").write_text(json.dumps(manifest))
    fresh = _engine(stage=2, dtype="fp16", loss_scale=FP16_SCALE)
    fresh.load(old)
    assert fresh.step_count == K and fresh.loss_scale == 2.0 ** 16 and fresh.skipped_steps == 0


def test_a_state_that_is_not_per_element_is_refused_in_one_line(tmp_path):
    def engine(stage):
        model = make_model(TrainConfig(**ONE).model_config())
        return (
            minizero.wrap(
                model, stage, functools.partial(_TwoNumbersPerParameter, lr=0.1), bucket_size=3000
            )
            if stage == 2
            else minizero.wrap(model, stage, functools.partial(_TwoNumbersPerParameter, lr=0.1))
        )
    saved = engine(2)
    saved.backward(saved(torch.randint(0, 10, (4, 16))).float().mean())
    saved.step()
    saved.save(tmp_path / "ckpt")
    with pytest.raises(
        CheckpointError, match=r"state 'stats' is neither one value per element nor one scalar"
    ):
        engine(1).load(tmp_path / "ckpt")                                # one bucket: must reshard


def test_consolidated_with_optimizer_state_loads_into_any_engine(runs, tmp_path, capsys):
    out = tmp_path / "full.pt"
    assert main([runs["stage3"]["dir"], str(out), "--optimizer-state"]) == 0
    assert f"wrote {out}: parameters and optimizer state, step {K}" in capsys.readouterr().out
    from_dir, from_file = _engine(stage=1), _engine(stage=1, offload=True)       # N = 1, stage 1
    from_dir.load(runs["stage3"]["dir"])
    from_file.load(out)
    assert from_file.step_count == from_dir.step_count == K
    assert all(torch.equal(a, b) for a, b in zip(from_dir.full_state_dict().values(),
                                                  from_file.full_state_dict().values()))
    state = [e.optimizer.optimizer.state_dict()["state"][0] for e in (from_dir, from_file)]
    assert state[0].keys() == state[1].keys() == {"step", "exp_avg", "exp_avg_sq"}
    assert all(torch.equal(state[0][k], state[1][k]) for k in state[0])


@pytest.mark.parametrize("how, message", [
    ("no manifest", "has no manifest.json"),
    ("truncated file", "rank0.pt is truncated"),
    ("no such directory", "no such checkpoint directory"),
    ("one argument", "the following arguments are required: out"),
])
def test_consolidate_bad_input_is_one_line_exit_2_and_out_untouched(
    saved, tmp_path, capsys, how, message
):
    d = str(tmp_path / "ckpt")
    shutil.copytree(saved, d)
    _damage(d, how)
    out = tmp_path / "out.pt"
    out.write_bytes(b"previous content")
    args = {"no such directory": [str(tmp_path / "nowhere"), str(out)], "one argument": [d]}.get(
        how, [d, str(out)]
    )
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert out.read_bytes() == b"previous content"
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "out.pt"]        # no temporary file left either


# --- periodic saves: a run killed at any moment and restarted with the same command ---------------

PERIODIC = [
    "--stage", "2", "--world-size", "2", "--model", "tiny", "--batch-size", "12", "--quiet",
    "--steps", "6", "--save-every", "2", "--keep-last", "2", "--resume",
]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("periodic")
    assert run_main(PERIODIC + ["--save", str(d / "run"), "--json", str(d / "full.json")]) == 0
    losses = json.loads((d / "full.json").read_text())["losses"]
    return losses, consolidate(checkpoint.latest(d / "run")), d / "run"


@pytest.mark.parametrize(
    "fault, resumed_from",
    [
        # mid-step
        ({"MINIZERO_FAIL_RANK": "1", "MINIZERO_FAIL_STEP": "3", "MINIZERO_FAIL_MODE": "kill"}, 2),
        (
            {
                "MINIZERO_FAIL_RANK": "0",
                "MINIZERO_FAIL_STEP": "4",
                "MINIZERO_FAIL_MODE": "kill-in-save",
            },
            2,
        ),  # mid-save
    ],
)
def test_a_killed_run_restarted_with_the_same_command_ends_bit_identical(
    uninterrupted, tmp_path, fault, resumed_from
):
    command = PERIODIC + ["--save", str(tmp_path / "run"), "--json", str(tmp_path / "out.json")]
    # A process of its own: the launcher's forkserver would not see environment variables set here.
    p = subprocess.run(
        [sys.executable, "-m", "minizero.run", *command],
        env=dict(os.environ, **fault),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1 and "exit code -9" in p.stderr, p.stderr[-2000:]     # SIGKILL'ed
    assert checkpoint.latest(tmp_path / "run").endswith(f"step-{resumed_from:06d}")
    assert run_main(command) == 0                                      # the same command, no fault
    losses, state, _ = uninterrupted
    assert json.loads((tmp_path / "out.json").read_text())["losses"] == losses[resumed_from:]
    assert sorted(os.listdir(tmp_path / "run")) == ["step-000004", "step-000006"]    # --keep-last 2
    resumed = consolidate(checkpoint.latest(tmp_path / "run"))
    assert all(torch.equal(resumed[k], v) for k, v in state.items()), "not bit-identical"


def test_a_run_directory_loads_and_consolidates_as_its_newest_checkpoint(uninterrupted, tmp_path,
                                                                         capsys):
    _, state, run = uninterrupted                  # step-000004 and step-000006 (--keep-last 2)
    out = tmp_path / "model.pt"
    assert main([str(run), str(out)]) == 0
    err = capsys.readouterr().err
    assert f"reading {run / 'step-000006'}, the newest complete checkpoint of {run}" in err
    consolidated = torch.load(out, weights_only=True)
    assert all(torch.equal(consolidated[k], v) for k, v in state.items())
    cfg = config_from_args(build_parser().parse_args(["--model", "tiny", "--load", str(run)]))
    assert cfg.load_dir == str(run / "step-000006")
    assert f"loading {run / 'step-000006'}" in capsys.readouterr().err
    broken = tmp_path / "broken"                   # its only save was killed before its commit
    (broken / "step-000002").mkdir(parents=True)
    assert main([str(broken), str(out)]) == 2
    assert run_main(["--model", "tiny", "--load", str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.count("no complete checkpoint") == 2 and err.count("\n") == 2, err


# --- universal loading: another world size, another stage, with Adam's moments carried ------------

UNI = dict(BASE, optimizer="adamw", lr=1e-3)
RESHARD = {                     # name: (saved with, resumed with): stage, N and options of each
    "N 4->2": (dict(stage=2, world_size=4), dict(stage=2, world_size=2)),
    "N 2->3, offload": (dict(stage=2, world_size=2), dict(stage=2, world_size=3, offload=True)),
    "stage 2->3": (dict(stage=2, world_size=2), dict(stage=3, world_size=2)),
    "stage 3->1": (dict(stage=3, world_size=2), dict(stage=1, world_size=2)),
    "stage 3->0, N 3->1": (dict(stage=3, world_size=3), dict(stage=0, world_size=1)),
}


def _cfg(opts, **more):
    return TrainConfig(**{**UNI, **opts, **more})


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """Per world size one launch: the uninterrupted runs and the saves of the sources of that size,
    then the resumes of the targets of that size (each launch's runs go in order, so 2 -> 2 resumes
    see the save). A fresh optimizer from the consolidated weights shows what carrying the moments
    is worth."""
    root = tmp_path_factory.mktemp("reshard")
    d = {name: str(root / name.replace(" ", "_").replace(">", "")) for name in RESHARD}
    plain = str(root / "model.pt")
    per_n: dict[int, list] = {n: [] for n in (4, 2, 3, 1)}         # n: [(tag, cfg)] in launch order
    for name, (src, dst) in RESHARD.items():
        per_n[src["world_size"]] += [((name, "full"), _cfg(src, steps=K + M, return_state=True)),
                                     ((name, "save"), _cfg(src, steps=K, save_dir=d[name]))]
    for name, (src, dst) in RESHARD.items():
        per_n[dst["world_size"]].append(((name, "resumed"), _cfg(dst, steps=K + M, load_dir=d[name],
                                                                return_state=True)))
    per_n[2].append(
        (
            ("N 4->2", "fresh"),
            _cfg(
                RESHARD["N 4->2"][1], steps=K + M, init_state=plain, start_step=K, return_state=True
            ),
        )
    )
    out = {}
    for n, runs in per_n.items():
        if n == 2:
            torch.save(consolidate(d["N 4->2"]), plain)
        cfgs = [cfg for _, cfg in runs]
        ranks = minizero.launch(train_several, n, cfgs) if n > 1 else [train_several(cfgs)]
        out.update({tag: ranks[0][i] for i, (tag, _) in enumerate(runs)})
    return out


def _max_difference(a, b) -> float:
    return max(
        (a[k].double() - v.double()).abs().max().item()
        for k, v in b.items()
        if v.is_floating_point()
    )


@pytest.mark.parametrize("name", RESHARD)
def test_a_checkpoint_resumes_at_another_stage_and_world_size_with_its_optimizer_state(
    resharded, name
):
    full, resumed = resharded[name, "full"], resharded[name, "resumed"]
    assert len(resumed["losses"]) == M              # (a rank's loss is over its rows: N changes it)
    assert _max_difference(resumed["state_dict"], full["state_dict"]) <= 1e-6


def test_restarting_the_optimizer_instead_would_not_be_within_tolerance(resharded):
    assert (
        _max_difference(
            resharded["N 4->2", "fresh"]["state_dict"], resharded["N 4->2", "full"]["state_dict"]
        )
        > 1e-3
    )
