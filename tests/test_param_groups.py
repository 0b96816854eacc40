"""Optimizer parameter groups and frozen model_parameters (minizero/optim.py, [Note: parameter
groups]): with three groups (own lr, weight_decay 0 on biases and the norm, own betas and eps) and a
frozen parameter, every stage, offload and the disk tier end where ONE process running torch's AdamW
with the same groups on the global batch ends (one launch at N = 3, an odd-sized model, so the
groups straddle the ranks' partitions); so does minizero.initialize with model_parameters as group
dicts, as an optimizer with several groups, and a LoRA-like model (frozen base) given
model.parameters(); initialize ends where deepspeed.initialize ends with the same groups (N = 2,
skipped without DeepSpeed); grouped checkpoints resume bit-exact and reshard.
Run: python -m pytest tests/test_param_groups.py -q"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn

import minizero
from minizero import comm
from minizero.checkpoint import CheckpointError
from minizero.lab import deepspeed_peer
from minizero.lab.reference import max_abs_diff

N = 3
STEPS = 3
ROWS = 12                                  # the global batch: N equal shares
LR = 1e-2
CASES = {"stage 0": (0, {"bucket_size": 100}), "stage 1": (1, {}),
         "stage 2": (2, {"bucket_size": 100}), "stage 3": (3, {}),
         "stage 2 + offload": (2, {"offload": True}), "stage 1 + disk": (1, {"offload": "disk"})}
CONFIG = {"train_micro_batch_size_per_gpu": ROWS // N, "gradient_accumulation_steps": 1,
          "gradient_clipping": 0}


def build(seed: int = 0) -> nn.Module:
    """35 + 7 + 7 + 7 + 21 + 3 = 80 parameters, the first bias frozen: 73 trained, odd."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3))
    model[0].bias.requires_grad_(False)
    return model


def groups(model: nn.Module) -> list[dict]:
    """Hugging Face's split (no decay on biases and the norm) and a third group with its own lr,
    betas and eps; the frozen bias sits in a group, as a plain named_parameters() split puts it."""
    first, norm, last = model
    return [{"params": [last.weight], "weight_decay": 0.1},
            {"params": [norm.weight, norm.bias, last.bias, first.bias], "weight_decay": 0.0,
             "lr": 3e-2, "betas": (0.8, 0.9)},
            {"params": [first.weight], "lr": 5e-3, "betas": (0.7, 0.95), "eps": 1e-6}]


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, 5, generator=g), torch.randn(ROWS, 3, generator=g)


def my_rows(t: torch.Tensor) -> torch.Tensor:
    return t.chunk(comm.world_size())[comm.rank()]


def loss_of(model, step: int, rows=lambda t: t) -> torch.Tensor:
    x, y = data(step)
    return (model(rows(x)).float() - rows(y)).pow(2).mean()


def reference(model: nn.Module, params, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """One process, torch's AdamW over `params` (groups or parameters), the global batch."""
    optimizer = torch.optim.AdamW(params, lr=LR)
    for step in range(steps):
        loss_of(model, step).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().float() for k, v in model.state_dict().items()}


def settings(optimizer: torch.optim.Optimizer) -> list[tuple]:
    return [(g["lr"], g["weight_decay"], tuple(g["betas"]), g["eps"])
            for g in optimizer.param_groups]


class LoRA(nn.Module):
    """A frozen base and a trainable low-rank adapter: what peft makes of a Linear."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.base = nn.Linear(5, 3)
        self.base.requires_grad_(False)
        self.a, self.b = nn.Parameter(torch.randn(5, 2)), nn.Parameter(torch.randn(2, 3) / 4)

    def forward(self, x):
        return self.base(x) + x @ self.a @ self.b


def train(engine, steps: int = STEPS, start: int = 0) -> None:
    for step in range(start, start + steps):
        engine.backward(loss_of(engine, step, my_rows))
        engine.step()


def every_way(folder: str) -> dict:
    """Worker: each case of CASES through wrap(param_groups=...), then minizero.initialize three
    ways; the full state and the torch optimizer's group settings of each. Saves the stage-2 run."""
    out = {}
    for name, (stage, options) in CASES.items():
        if options.get("offload") == "disk":
            options = {**options, "offload_path": folder}
        model = build()
        engine = minizero.wrap(model, stage, functools.partial(torch.optim.AdamW, lr=LR),
                               param_groups=groups(model), **options)
        train(engine)
        if name == "stage 2":
            engine.save(f"{folder}/ckpt")
        out[name] = (engine.full_state_dict(), settings(engine.optimizer.optimizer))
    for stage in (1, 3):
        config = {**CONFIG, "zero_optimization": {"stage": stage},
                  "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}}
        model = build()
        engine, optimizer, *_ = minizero.initialize(model=model, model_parameters=groups(model),
                                                    config=config)
        train(engine)
        out[f"initialize dicts {stage}"] = (engine.full_state_dict(), settings(optimizer))
        model = build()
        engine, optimizer, *_ = minizero.initialize(
            model=model, optimizer=torch.optim.AdamW(groups(model), lr=LR),
            config={**CONFIG, "zero_optimization": {"stage": stage}})
        train(engine)
        out[f"initialize optimizer {stage}"] = (engine.full_state_dict(), settings(optimizer))
        model = LoRA()
        engine, optimizer, *_ = minizero.initialize(
            model=model, model_parameters=model.parameters(), config=config)
        train(engine)
        out[f"lora {stage}"] = (engine.full_state_dict(), settings(optimizer))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("groups"))
    per_rank = minizero.launch(every_way, N, folder, backend="gloo", timeout=300)
    return per_rank, folder


def expected_settings() -> list[tuple]:
    return settings(torch.optim.AdamW(groups(build()), lr=LR))


@pytest.mark.parametrize("name", CASES)
def test_every_stage_steps_each_group_with_its_settings(runs, name):
    model = build()
    expected = reference(model, groups(model))
    for rank in runs[0]:
        state, got = rank[name]
        assert max_abs_diff(state, expected) <= 1e-5, name
        assert got == expected_settings(), name              # the user's groups, in order


@pytest.mark.parametrize("stage", (1, 3))
@pytest.mark.parametrize("how", ("initialize dicts", "initialize optimizer", "lora"))
def test_initialize_takes_groups_an_optimizer_with_groups_and_frozen_parameters(runs, how, stage):
    model = LoRA() if how == "lora" else build()
    params = model.parameters() if how == "lora" else groups(model)
    expected = reference(model, params)
    for rank in runs[0]:
        state, got = rank[f"{how} {stage}"]
        assert max_abs_diff(state, expected) <= 1e-5, how
        assert len(got) == (1 if how == "lora" else 3)


def test_a_grouped_checkpoint_reshards_three_ranks_to_one(runs):
    """The stage-2 run's checkpoint (N = 3) loaded by one rank at stage 1 (one bucket): two more
    steps end where one process's five steps end."""
    model = build()
    engine = minizero.wrap(model, 1, functools.partial(torch.optim.AdamW, lr=LR),
                           param_groups=groups(model))
    engine.load(f"{runs[1]}/ckpt")
    assert settings(engine.optimizer.optimizer) == expected_settings()
    train(engine, 2, start=STEPS)
    model = build()
    expected = reference(model, groups(model), STEPS + 2)
    assert max_abs_diff(engine.full_state_dict(), expected) <= 1e-6


def one_rank(stage: int, steps: int = 0, start: int = 0, left_out: str | None = None,
             **options):
    """One rank, grouped; `left_out`: the name of a trainable parameter kept out of every group."""
    model = build()
    mine = groups(model)
    if left_out:
        out = model.get_parameter(left_out)
        for group in mine:
            group["params"] = [p for p in group["params"] if p is not out]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "1 trainable parameters")
        engine = minizero.wrap(model, stage, functools.partial(torch.optim.AdamW, lr=LR),
                               param_groups=mine, **options)
    train(engine, steps, start)
    return engine


@pytest.mark.parametrize("stage, options", [(1, {}), (3, {}), (2, {"bucket_size": 100})],
                         ids=["same layout", "stage 3", "other buckets"])
@pytest.mark.parametrize("left_out", (None, "1.weight"), ids=["", "a parameter in no group"])
def test_a_grouped_checkpoint_resumes_bit_exact(tmp_path, stage, options, left_out):
    """Resumed on the same layout (one bucket) or resharded into others; with a parameter in no
    group in the middle of the bucket (a run no view steps: its state is zeros in the file)."""
    whole = one_rank(1, 4, left_out=left_out).full_state_dict()
    one_rank(1, 2, left_out=left_out).save(tmp_path / "ckpt")
    engine = one_rank(stage, left_out=left_out, **options)
    engine.load(tmp_path / "ckpt")
    train(engine, 2, start=2)
    assert max_abs_diff(engine.full_state_dict(), whole) == 0.0


def test_a_checkpoint_loads_only_into_the_same_groups(tmp_path):
    one_rank(1, 1).save(tmp_path / "ckpt")
    engine = minizero.wrap(build(), 1, functools.partial(torch.optim.AdamW, lr=LR))
    with pytest.raises(CheckpointError, match="other parameter groups"):
        engine.load(tmp_path / "ckpt")


@pytest.mark.parametrize("front", ("wrap", "initialize"))
def test_trainable_parameters_in_no_group_are_not_trained_and_said_so(front):
    """DeepSpeed builds its optimizer over model_parameters only: a trainable parameter left out
    keeps its value."""
    model = build()
    before = model[2].bias.detach().clone()
    mine = groups(model)
    mine[1]["params"] = [p for p in mine[1]["params"] if p is not model[2].bias]
    with pytest.warns(UserWarning, match=r"1 trainable parameters \(2.bias, ...\) are in no"):
        if front == "wrap":
            engine = minizero.wrap(model, 2, functools.partial(torch.optim.AdamW, lr=LR),
                                   param_groups=mine)
        else:                                    # parameters, not groups: every one but 2.bias
            engine, *_ = minizero.initialize(
                model=model, model_parameters=[p for g in mine for p in g["params"]],
                optimizer=functools.partial(torch.optim.AdamW, lr=LR), config=CONFIG)
    train(engine)
    state = engine.full_state_dict()
    assert torch.equal(state["2.bias"], before) and not torch.equal(state["2.weight"],
                                                                    build()[2].weight.detach())


@pytest.mark.parametrize("param_groups, error, message", [
    ({"params": []}, TypeError, "param_groups must be a list of dicts"),
    ([], ValueError, "param_groups is empty"),
    ([{"lr": 1.0}], TypeError, "param_groups[0] must be a dict with 'params'"),
    ([{"params": [torch.nn.Parameter(torch.ones(1))]}], ValueError, "not a parameter of the model"),
    ("twice", ValueError, "is in parameter groups 0 and 1"),
])
def test_bad_groups_are_one_line(param_groups, error, message):
    model = build()
    if param_groups == "twice":
        param_groups = [{"params": [model[2].bias]}, {"params": [model[2].bias]}]
    with pytest.raises(error) as info:
        minizero.wrap(model, 1, functools.partial(torch.optim.AdamW, lr=LR),
                      param_groups=param_groups)
    assert message in str(info.value) and "\n" not in str(info.value)


# --- against DeepSpeed ----------------------------------------------------------------------------

DS_CASES = {"stage 1": (1, False), "stage 2": (2, False), "stage 3": (3, False),
            "stage 2 + offload": (2, True)}


def both_libraries(cases: list[tuple[int, bool]]) -> list[dict]:
    """Worker: minizero.initialize, then deepspeed.initialize, with the same group dicts (and an
    empty one, which DeepSpeed drops) and optimizer factory; the largest parameter difference and
    both learning rates per case."""
    deepspeed = deepspeed_peer.join()
    out = []
    for stage, offload in cases:
        zero = {"stage": stage}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        config = {**CONFIG, "train_micro_batch_size_per_gpu": ROWS // 2, "zero_optimization": zero,
                  "zero_force_ds_cpu_optimizer": False}
        result = []
        for library in (minizero, deepspeed):
            model = build()
            engine, optimizer, *_ = library.initialize(
                model=model, model_parameters=groups(model) + [{"params": [], "lr": 1.0}],
                config=config,
                optimizer=functools.partial(torch.optim.AdamW, lr=LR))
            train(engine)
            result.append((deepspeed_peer.full_state_dict(engine) if library is deepspeed
                           else engine.full_state_dict(), engine.get_lr()))
            if library is deepspeed:
                engine.destroy()
        (ours, our_lr), (theirs, their_lr) = result
        out.append({"max_param_diff": max_abs_diff(ours, {k: v.float() for k, v in
                                                          theirs.items()}),
                    "lrs": (our_lr, their_lr)})
    return out


def test_initialize_ends_where_deepspeed_ends_with_the_same_groups():
    if not deepspeed_peer.available():
        pytest.skip("DeepSpeed is not installed (DS_BUILD_OPS=0 pip install -e '.[peers]')")
    per_rank = minizero.launch(both_libraries, 2, list(DS_CASES.values()), backend="gloo",
                               timeout=300)
    for rank in per_rank:
        for name, case in zip(DS_CASES, rank):
            # bitwise (measured): the same AdamW on the same elements, reduced the same way
            assert case["max_param_diff"] == 0.0, (name, case["max_param_diff"])
            assert case["lrs"][0] == case["lrs"][1] == [LR, 3e-2, 5e-3], name


def test_bf16_groups_step_alike_in_memory_on_the_host_and_on_disk(tmp_path):
    """bf16: the masters are separate fp32 copies (the disk tier keeps them in its file, cut into
    pieces of views); grouped, with a parameter in no group, all three homes end bit-identical,
    optimizer state included."""
    ends = []
    for options in ({}, {"offload": True}, {"offload": "disk", "offload_path": str(tmp_path)}):
        model = build()
        mine = groups(model)                   # 2.bias in no group: a run no view of it steps
        mine[1]["params"] = [p for p in mine[1]["params"] if p is not model[2].bias]
        with pytest.warns(UserWarning, match="in no parameter group"):
            engine = minizero.wrap(model, 3, functools.partial(torch.optim.AdamW, lr=LR),
                                   param_groups=mine, dtype="bf16", **options)
        for step in range(STEPS):
            x, y = data(step)
            engine.backward((engine(x.bfloat16()).float() - y).pow(2).mean())
            engine.step()
        moments = engine.optimizer.state_dict()["state"]             # per bucket, as checkpoints
        ends.append({**engine.full_state_dict(), **{f"{b} {name}": value.float()
                                                    for b, state in moments.items()
                                                    for name, value in state.items()}})
    assert max_abs_diff(ends[0], ends[1]) == max_abs_diff(ends[0], ends[2]) == 0.0
