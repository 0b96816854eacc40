"""Failures: a rank that raises or is killed mid-training ends the whole run within seconds, names
the rank, and leaves no process behind (through minizero.launch and through the CLI); bad arguments
to minizero.wrap are refused with a one-line message."""

import functools
import os
import subprocess
import sys
import time
import uuid

import pytest
import torch

import minizero
from minizero.lab.faults import Fault
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.train import TrainConfig, train_worker

FAST = 30          # seconds: a failure must end the run well before any collective timeout (120 s)


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) for every process, from /proc."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    state, ppid = f.read().rsplit(")", 1)[1].split()[:2]  # the name may hold spaces
            except OSError:
                continue                                                    # exited meanwhile
            table[int(name)] = (int(ppid), state)
    return table


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _leftover_descendants() -> list[int]:
    """Live processes below this one, except multiprocessing's long-lived helpers (the forkserver
    and the resource_tracker, direct children of this process). Workers are forked by the
    forkserver, so they show up as its children."""
    table = _processes()
    children = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    left, frontier = [], list(children.get(os.getpid(), []))
    while frontier:
        pid = frontier.pop()
        frontier += children.get(pid, [])
        helper = table[pid][0] == os.getpid() and any(
            h in _cmdline(pid) for h in ("forkserver", "resource_tracker")
        )
        if not helper and table[pid][1] != "Z":             # a zombie has exited
            left.append(pid)
    return left


def _assert_nothing_left(find) -> None:
    deadline = time.monotonic() + 5
    while find() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not find(), f"processes outlived the failed run: {[_cmdline(p) for p in find()]}"


def _failing(mode: str, stage: int, n: int) -> TrainConfig:
    return TrainConfig(stage=stage, world_size=n, steps=5, model="tiny", batch_size=12,
                       fault=Fault(rank=1, step=2, mode=mode))


def test_a_rank_that_raises_ends_the_run_and_is_named():
    start = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"^rank 1 failed: RuntimeError: injected failure on rank 1 at step 2"
    ):
        minizero.launch(train_worker, 3, _failing("raise", stage=2, n=3))
    assert time.monotonic() - start < FAST
    _assert_nothing_left(_leftover_descendants)


def test_a_killed_rank_ends_the_run():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^rank \d failed: ") as info:
        minizero.launch(train_worker, 4, _failing("kill", stage=3, n=4))
    assert time.monotonic() - start < FAST
    _assert_nothing_left(_leftover_descendants)
    message = str(info.value).splitlines()[0]
    # the survivors' "connection reset" errors may reach the parent first: launch must still
    # blame rank 1
    assert message.startswith("rank 1 failed: process died (exit code -9)"), message[:200]
    assert "killed by SIGKILL" in message, message[:200]   # also what the kernel's OOM killer sends
    # the flight recorder (minizero/beyond/desync.py): every rank's last collectives, the dead one's
    # too
    report = str(info.value).split("--- the last 20 collectives of each rank")[1]
    assert [line.split(":")[0] for line in report.splitlines() if line.startswith("rank")] == \
        ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert "rank 1: nothing recorded" not in report


def test_cli_exits_nonzero_naming_the_rank_and_leaves_nothing(tmp_path):
    tag = uuid.uuid4().hex                      # inherited by every process the CLI starts
    env = dict(
        os.environ,
        MINIZERO_FAIL_RANK="1",
        MINIZERO_FAIL_STEP="1",
        MINIZERO_FAIL_MODE="raise",
        MINIZERO_TEST_TAG=tag,
    )
    start = time.monotonic()
    p = subprocess.run(
        [
            sys.executable, "-m", "minizero.run", "--stage", "1", "--world-size", "2", "--steps",
            "4", "--model", "tiny", "--batch-size", "8", "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert time.monotonic() - start < FAST
    assert p.returncode == 1, p.stderr[-2000:]
    assert p.stderr.startswith(
        "minizero.run: rank 1 failed: RuntimeError: injected failure on rank 1 at step 1"
    )

    def tagged() -> list[int]:
        found = []
        for pid in _processes():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if f"MINIZERO_TEST_TAG={tag}".encode() in f.read().split(b"\0"):
                        found.append(pid)
            except OSError:
                pass
        return [pid for pid in found if _processes().get(pid, (0, "Z"))[1] != "Z"]

    _assert_nothing_left(tagged)


# --- bad arguments to wrap: one line, before anything runs ----------------------------------------

SGD = functools.partial(torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("args, kwargs, error, message", [
    ((7, SGD), {}, ValueError, "stage must be one of 0, 1, 2, 3 (0 = DDP), got 7"),
    ((2, SGD), {"units": []}, TypeError, "stage 2 does not take option(s) units"),
    ((1, SGD), {"bucket_size": 1e6}, TypeError, "stage 1 does not take option(s) bucket_size"),
    ((2, SGD), {"dtype": "fp8"}, ValueError, "dtype must be one of fp32, bf16, fp16, got 'fp8'"),
    ((2, SGD), {"dtype": "bf16", "loss_scale": 8.0}, ValueError, "loss_scale is for dtype='fp16'"),
    ((0, SGD), {"offload": True}, ValueError, "offload needs ZeRO stage 1, 2 or 3"),
    ((2, SGD), {"offload": "params"}, ValueError, "offload='params' needs stage 3"),
    ((3, SGD), {"offload": "nvme"}, ValueError, "offload must be one of"),
    ((3, SGD), {"offload": "disk"}, ValueError, "offload='disk' needs offload_path"),
    ((2, SGD), {"clip_grad_norm": 0}, ValueError, "clip_grad_norm must be > 0, got 0"),
    ((2, "adamw"), {}, TypeError, "optimizer must be a factory params -> torch.optim.Optimizer"),
    ((True, SGD), {}, ValueError, "stage must be one of 0, 1, 2, 3 (0 = DDP), got True"),
    ((2, SGD), {"bucket_size": 0}, ValueError,
     "bucket_size must be a positive number of bytes, got 0"),
    ((3, SGD), {"prefetch": "yes"}, TypeError, "prefetch must be True or False, got 'yes'"),
    ((3, SGD), {"units": [1]}, TypeError, "units must be a list of the model's submodules"),
    ((3, SGD), {"units": [torch.nn.Linear(2, 2)]}, TypeError,
     "units must be a list of the model's submodules"),
    ((2, lambda params: "not an optimizer"), {}, TypeError,
     "the optimizer factory must return a torch.optim.Optimizer, got str"),
])
def test_bad_wrap_arguments_are_refused_in_one_line(args, kwargs, error, message):
    model = make_model(GPTConfig.named("tiny"))
    with pytest.raises(error) as info:
        minizero.wrap(model, *args, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_model_without_trainable_parameters_is_refused():
    model = make_model(GPTConfig.named("tiny")).requires_grad_(False)
    with pytest.raises(ValueError, match="^model has no trainable parameters"):
        minizero.wrap(model, 2, SGD)


def test_a_model_that_is_not_a_module_is_refused():
    with pytest.raises(TypeError, match=r"^model must be a torch.nn.Module, got OrderedDict$"):
        minizero.wrap(make_model(GPTConfig.named("tiny")).state_dict(), 2, SGD)
