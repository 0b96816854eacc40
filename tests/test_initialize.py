"""minizero.initialize, DeepSpeed's front end: examples/deepspeed_style.py ends where DeepSpeed
0.19.8 ends (stages 1, 2, 3 and 2 + offload, AdamW and WarmupLR from the config, accumulation 2; one
launch, DeepSpeed inside minizero.launch's process group as tests/test_deepspeed.py runs it; skipped
without DeepSpeed); the schedules give DeepSpeed's learning rates; accumulation as DeepSpeed counts
it matches one process; bad configs are one line.
Run: python -m pytest tests/test_initialize.py -q"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

import minizero
from minizero.deepspeed.config import SCHEDULES, ConfigError, build_scheduler
from minizero.lab import deepspeed_peer
from minizero.lab.reference import max_abs_diff

EXAMPLE = Path(__file__).parent.parent / "examples" / "deepspeed_style.py"
CASES = {"stage 1": (1, False), "stage 2": (2, False), "stage 3": (3, False),
         "stage 2 + offload": (2, True)}


def example():
    spec = importlib.util.spec_from_file_location("deepspeed_style", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def both_libraries(cases: list[tuple[int, bool]]) -> list[dict]:
    """Worker: the example's train() with minizero, then with DeepSpeed, for each case."""
    script = example()
    out = []
    for stage, offload in cases:
        ours = script.train(minizero, script.ds_config(stage, offload))
        theirs = script.train(deepspeed_peer.join(), script.ds_config(stage, offload))
        out.append({"losses": (ours[0], theirs[0]),
                    "max_param_diff": max_abs_diff(ours[1], theirs[1])})
    return out


@pytest.fixture(scope="module")
def runs():
    if not deepspeed_peer.available():
        pytest.skip("DeepSpeed is not installed (DS_BUILD_OPS=0 pip install -e '.[peers]')")
    per_rank = minizero.launch(both_libraries, 2, list(CASES.values()), backend="gloo", timeout=300)
    return {name: [r[i] for r in per_rank] for i, name in enumerate(CASES)}


@pytest.mark.parametrize("name", CASES)
def test_the_example_ends_where_deepspeed_ends(runs, name):
    for rank in runs[name]:
        assert rank["max_param_diff"] <= 1e-6, (name, rank["max_param_diff"])
        ours, theirs = rank["losses"]
        assert ours == pytest.approx(theirs, abs=1e-6), name


def _lrs(schedule, steps: int) -> list[float]:
    """The learning rate each of `steps` optimizer steps runs at."""
    out = []
    for _ in range(steps):
        out.append(schedule.optimizer.param_groups[0]["lr"])
        schedule.step()
    return out


def _optimizer(lr: float = 0.5) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_warmup_lr_is_deepspeeds_log_warmup():
    spec = {"type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 3}}
    lrs = _lrs(build_scheduler(_optimizer(), spec), 5)
    # built at i = -1 (min), then log(i + 1)/log(3): the first two steps at 0, then 0.631 of the
    # way, then max
    assert lrs == pytest.approx([0.0, 0.0, 1e-2 * math.log(2) / math.log(3), 1e-2, 1e-2])


@pytest.mark.parametrize("spec", [
    {"type": "WarmupLR",
     "params": {"warmup_min_lr": 0.001, "warmup_num_steps": 4, "warmup_type": "linear"}},
    {"type": "WarmupDecayLR", "params": {"total_num_steps": 9, "warmup_num_steps": 3}},
    {"type": "WarmupCosineLR",
     "params": {"total_num_steps": 9, "warmup_num_steps": 3, "warmup_min_ratio": 0.1}},
])
def test_schedules_give_deepspeeds_learning_rates(spec):
    if not deepspeed_peer.available():
        pytest.skip("DeepSpeed is not installed")
    from deepspeed.runtime import lr_schedules
    theirs = getattr(lr_schedules, spec["type"])(_optimizer(), **spec["params"])
    ours = build_scheduler(_optimizer(), spec)
    assert _lrs(ours, 12) == pytest.approx(_lrs(theirs, 12), abs=1e-12)
    assert set(SCHEDULES) == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"}


def test_accumulation_as_deepspeed_counts_it_matches_one_process():
    """One rank, 2 micro-batches per step: backward + step after each, the optimizer steps every
    second."""
    torch.manual_seed(0)
    model, data = torch.nn.Linear(3, 2), torch.randn(4, 8, 3)
    reference = torch.nn.Linear(3, 2)
    reference.load_state_dict(model.state_dict())
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "gradient_clipping": 0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, optimizer, _, schedule = minizero.initialize(model=model, config=config)
    assert schedule is None and optimizer is engine.optimizer
    boundaries = []
    for batch in data:
        for micro in batch.split(4):
            boundaries.append(engine.is_gradient_accumulation_boundary())
            engine.backward(engine(micro).pow(2).mean())
            engine.step()
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    for batch in data:
        reference(batch).pow(2).mean().backward()
        sgd.step()
        sgd.zero_grad()
    assert boundaries == [False, True] * 4 and engine.global_steps == 4 and engine.micro_steps == 8
    assert max_abs_diff(engine.full_state_dict(), reference.state_dict()) <= 1e-6


def test_an_optimizer_object_a_scheduler_factory_and_training_data():
    """DeepSpeed's other ways in: optimizer= an Optimizer (its class and settings are used,
    over this rank's partition), lr_scheduler= a factory over minizero's optimizer,
    training_data= a Dataset."""
    model = torch.nn.Linear(3, 2)
    mine = torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.5)
    data = torch.utils.data.TensorDataset(torch.arange(10.0))
    engine, optimizer, loader, schedule = minizero.initialize(
        model=model, optimizer=mine, training_data=data,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        config={"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1})
    assert type(optimizer) is torch.optim.SGD and optimizer is not mine
    assert optimizer.param_groups[0]["momentum"] == 0.5 and schedule.optimizer is optimizer
    engine.backward(engine(torch.ones(4, 3)).sum())
    engine.step()
    assert engine.get_lr() == [0.125]                     # the scheduler stepped with the optimizer
    assert [len(batch[0]) for batch in loader] == [4, 4, 2]


@pytest.mark.parametrize("config, message", [
    ({"scheduler": {"type": "OneCycle"}},
     "scheduler.type must be one of WarmupLR, WarmupDecayLR, WarmupCosineLR"),
    ({"scheduler": {"type": "WarmupDecayLR"}},
     "scheduler.params.total_num_steps is required by WarmupDecayLR"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "exp"}}},
     "warmup_type must be one of log, linear"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
     "\"auto\" that nothing in minizero.initialize decides: optimizer.params.lr (the Trainer's "
     "learning_rate"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1.0}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}},
     "scheduler.params.warmup_num_steps (the Trainer's warmup_steps)"),
    ({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 4},
     "train_batch_size 6 is not divisible"),
    ({}, "no optimizer: give the config an optimizer section or pass optimizer="),
])
def test_bad_configs_are_one_line(config, message):
    with pytest.raises((ConfigError, ValueError, TypeError)) as info:
        minizero.initialize(model=torch.nn.Linear(2, 2), config=config)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_auto_is_resolved_where_the_batch_or_the_model_decides():
    class WithConfig(torch.nn.Linear):
        config = type("Config", (), {"hidden_size": 8})()
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
              "gradient_accumulation_steps": 3,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}
    engine, *_ = minizero.initialize(model=WithConfig(2, 2), config=config)
    assert engine.train_batch_size() == 6 and engine.gradient_accumulation_steps() == 3
    assert engine.engine.options.bucket_size == 8 * 8 * 4   # h² elements of fp32 (HF's rule)


RESUME_CONFIG = {
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 8}}}


def _resumable():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def _train(engine, batches) -> list[float]:
    """DeepSpeed's loop: backward and step per micro-batch; the learning rate of each."""
    lrs = []
    for x in batches:
        lrs.append(engine.get_lr()[0])
        engine.backward(engine(x.to(engine.engine.dtype)).float().pow(2).mean() * 1e3)
        engine.step()
    return lrs


@pytest.mark.parametrize("precision", [{"zero_optimization": {"stage": 2}},
                                       {"zero_optimization": {"stage": 1},
                                        "fp16": {"enabled": True, "initial_scale_power": 30,
                                                 "loss_scale_window": 2, "hysteresis": 1}}],
                         ids=["stage2", "stage1_fp16"])
def test_load_checkpoint_resumes_where_save_checkpoint_stopped(tmp_path, precision):
    """save_checkpoint after 3 optimizer steps, then 3 more; a fresh engine's load_checkpoint
    (the tag `latest` names) continues bit-identically: the schedule, global_steps, micro_steps,
    the fp16 scale and its skipped steps, and the client_state come back."""
    config = {**RESUME_CONFIG, **precision}
    data = torch.randn(12, 4, 3)
    engine, *_ = minizero.initialize(model=_resumable(), config=config)
    _train(engine, data[:6])
    engine.save_checkpoint(tmp_path, client_state={"epoch": 7, "note": "mid-run"})
    lrs = _train(engine, data[6:])
    state, counters = engine.full_state_dict(), (engine.global_steps, engine.micro_steps)
    scale = (engine.loss_scale, engine.skipped_steps)

    fresh, *_ = minizero.initialize(model=_resumable(), config=config)
    path, client_state = fresh.load_checkpoint(tmp_path)
    assert path == str(tmp_path / "global_step3") and (tmp_path / "latest").read_text() == \
        "global_step3"
    assert client_state == {"epoch": 7, "note": "mid-run"}
    assert (fresh.global_steps, fresh.micro_steps) == (3, 6)
    assert _train(fresh, data[6:]) == lrs                # WarmupLR goes on, it does not restart
    assert (fresh.global_steps, fresh.micro_steps) == counters
    assert (fresh.loss_scale, fresh.skipped_steps) == scale
    if "fp16" in config:
        assert scale[1] > 0, "the fp16 case should skip steps (the scale starts too high)"
    assert max_abs_diff(fresh.full_state_dict(), state) == 0.0


def test_load_checkpoint_without_latest_tags_and_weights_only(tmp_path):
    engine, *_ = minizero.initialize(model=_resumable(), config=RESUME_CONFIG)
    with pytest.warns(UserWarning, match="has no 'latest' file, so nothing was loaded"):
        assert engine.load_checkpoint(tmp_path) == (None, None)    # DeepSpeed's answer
    with pytest.raises(minizero.checkpoint.CheckpointError, match="no such checkpoint directory"):
        engine.load_checkpoint(tmp_path, tag="nowhere")
    _train(engine, torch.randn(4, 4, 3))
    engine.save_checkpoint(tmp_path, tag="first", save_latest=False)
    assert not (tmp_path / "latest").exists()
    weights = engine.full_state_dict()
    fresh, *_ = minizero.initialize(model=_resumable(), config=RESUME_CONFIG)
    path, client_state = fresh.load_checkpoint(tmp_path, tag="first", load_module_only=True)
    assert client_state == {} and fresh.global_steps == 0       # weights only: counters untouched
    assert fresh.optimizer.state == {} and max_abs_diff(fresh.full_state_dict(), weights) == 0.0


def test_the_engine_answers_what_deepspeed_scripts_ask():
    config = {**RESUME_CONFIG, "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 2}
    engine, *_ = minizero.initialize(model=_resumable(), config=config)
    assert (engine.zero_optimization_stage(), engine.zero_optimization(), engine.fp16_enabled(),
            engine.bfloat16_enabled(), engine.gradient_clipping()) == (0, False, False, False, 1.0)
    assert (engine.global_rank, engine.local_rank, engine.world_size) == (0, 0, 1)
    assert engine.get_mom() == [(0.9, 0.999)] and engine.get_global_grad_norm() is None
    applied = []
    for x in torch.randn(4, 2, 3):
        engine.backward(engine(x).sum())
        engine.step()
        applied.append(engine.was_step_applied())
    assert applied == [False, True] * 2 and engine.global_samples == 2 * 4
    assert engine.get_global_grad_norm() > 0
    assert engine.eval() is engine and not engine.module.training
    engine.train()
    assert engine.module.training
    engine.backward(engine(torch.ones(2, 3)).sum())
    engine.zero_grad()                                   # DeepSpeed's: every .grad is None
    assert all(p.grad is None for p in engine.module.parameters())
    engine.empty_partition_cache()                       # DeepSpeed's tests call both: nothing
    engine.destroy()                                     # to do here, but they must exist
