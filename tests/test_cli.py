"""python -m minizero.run: trains end to end, prints the table, writes --json, works under torchrun,
and rejects bad input with one line and exit code 2."""

import importlib
import json
import shutil
import subprocess
import sys

import pytest

from minizero.cli.run import main
from minizero.memory import within_padding

JSON_KEYS = {"stage", "world_size", "num_params", "dtype", "offload", "losses", "ranks"}


def _check_summary(data, stage, n, steps):
    assert JSON_KEYS <= data.keys()
    assert (data["stage"], data["world_size"], len(data["losses"])) == (stage, n, steps)
    assert [r["rank"] for r in data["ranks"]] == list(range(n))
    for r in data["ranks"]:
        assert {"params", "grads", "optimizer", "offloaded", "peak"} <= r["memory"].keys()
        assert r["memory"]["activations"] > 0
        assert r["comm_bytes_per_step"]["total"] > 0
    t = data["throughput"]                         # tokens/s, FLOP/s, MFU (lab/throughput.py)
    assert t["tokens_per_s"] > 0
    assert t["flops_per_s"] == pytest.approx(t["tokens_per_s"] * t["flops_per_token"])
    assert 0 < t["mfu"] < 1, t


def test_run_prints_table_and_writes_json(tmp_path):
    out = tmp_path / "run.json"
    p = subprocess.run(
        [
            sys.executable, "-m", "minizero.run", "--stage", "2", "--world-size", "3", "--steps",
            "4", "--batch-size", "12", "--model", "tiny", "--activation-checkpointing", "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert (
        "step    1/4" in p.stdout
        and "th." in p.stdout
        and "loss" in p.stdout
        and "activ." in p.stdout
    )
    assert "tokens/s" in p.stdout and "MFU" in p.stdout
    assert "fp32, gloo on cpu" in p.stdout             # where the ranks ran: no GPU here
    data = json.loads(out.read_text())
    _check_summary(data, 2, 3, 4)
    assert (data["backend"], data["device"]) == ("gloo", "cpu")
    estimate = data["theory"]["activations"]             # with checkpointing: about half of without
    assert all(abs(r["memory"]["activations"] - estimate) <= 0.1 * estimate for r in data["ranks"])


def test_run_under_torchrun_uses_its_process_group(tmp_path):
    out = tmp_path / "run.json"
    p = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "minizero.run", "--stage", "3", "--offload", "--steps", "2", "--model", "tiny",
            "--quiet", "--json", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    # the ranks' own words come first, torchrun's after
    assert p.returncode == 0, p.stderr[:3000]
    assert p.stdout.count("stage 3, N = 2") == 1            # rank 0 reports, once
    _check_summary(json.loads(out.read_text()), 3, 2, 2)


@pytest.mark.parametrize("args, message", [
    (["--stage", "7"], "stage must be one of 0, 1, 2, 3 (0 = DDP), got 7"),
    (["--world-size", "0"], "--world-size must be >= 1"),
    (["--dtype", "fp8"], "dtype must be one of fp32, bf16, fp16, got 'fp8'"),
    (["--dtype", "bf16", "--loss-scale", "8"], "loss_scale is for dtype='fp16'"),
    (["--dtype", "fp16", "--loss-scale", "-1"], "loss_scale must be > 0, got -1.0"),
    (["--stage", "0", "--offload"], "offload needs ZeRO stage 1, 2 or 3"),
    (["--stage", "2", "--offload", "params"], "offload='params' needs stage 3"),
    (["--world-size", "3", "--batch-size", "16"], "must be divisible"),
    (["--steps", "many"], "invalid int value"),
    (["--frobnicate"], "unrecognized arguments"),
    (["--save-every", "2"], "--save-every K needs --save DIR and K >= 1"),
    (["--save", "d", "--keep-last", "2"], "--keep-last M needs --save-every and M >= 1"),
    (["--save", "d", "--resume"], "--resume needs --save DIR --save-every K"),
    (["--save", __file__], "a file is there, not a folder"),
    (["--save", f"{__file__}/run", "--save-every", "1"], f"{__file__} is a file, not a folder"),
    (["--save", "/proc/minizero-run"], "cannot write in /proc"),
    (["--activation-checkpointing", "gpu"], "invalid choice: 'gpu' (choose from 'cpu')"),
    (["--reduce-dtype", "bf16"], "invalid choice: 'bf16' (choose from 'fp32')"),
    (["--world-size", "4", "--tensor-parallel", "3"], "tensor_parallel=3 must divide the world "
                                                      "size 4"),
    (["--world-size", "4", "--tensor-parallel", "2", "--shard-group-size", "2"],
     "tensor_parallel with shard_group_size: not supported yet"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ["run", "--stage", "1"], ["bench"], ["bench", "--peak"], ["bench", "--collectives"],
    ["bench", "--scale"], ["scale", "--infinity"], ["grade"], ["collectives"],
    ["memory", "--params", "1e6", "--world-size", "2"],
], ids=" ".join)
def test_json_into_a_missing_folder_is_a_usage_error_before_any_work(capsys, tmp_path, argv):
    """Every --json: a path that cannot be written stops the command as it reads its arguments,
    not with a traceback once the run is done (its results lost)."""
    from minizero.cli.commands import main as minizero_main
    missing = tmp_path / "no-such-folder" / "out.json"
    assert minizero_main([*argv, "--json", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"argument --json: no directory {missing.parent} to write out.json in" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert minizero_main([*argv, "--json", str(tmp_path)]) == 2             # a folder, not a file
    assert f"{tmp_path} is a directory" in capsys.readouterr().err
    assert minizero_main([*argv, "--json", "/proc/out.json"]) == 2     # root may, the kernel not
    assert "cannot write /proc/out.json" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []                              # nothing left behind


def test_fp16_run_reports_the_loss_scale_and_skipped_steps(tmp_path, capsys):
    out = tmp_path / "fp16.json"
    assert (
        main(
            [
                "--dtype", "fp16", "--loss-scale", "1024", "--world-size", "2", "--steps", "2",
                "--model", "tiny", "--quiet", "--json", str(out),
            ]
        )
        == 0
    )
    assert "fp16 loss scale 1024; 0 steps skipped on overflow" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert (data["dtype"], data["loss_scale"], data["skipped_steps"]) == ("fp16", 1024.0, 0)


def test_fp32_reduction_run_counts_4_byte_gradients(tmp_path, capsys):
    out = tmp_path / "reduce.json"
    assert (
        main(
            [
                "--dtype", "bf16", "--reduce-dtype", "fp32", "--world-size", "2", "--steps", "2",
                "--model", "tiny", "--quiet", "--json", str(out),
            ]
        )
        == 0
    )
    assert "bf16, gradients in fp32" in capsys.readouterr().out
    data = json.loads(out.read_text())
    psi, n = data["num_params"], 2                      # stage 2: 4Ψ/N bytes of fp32 gradient shard
    assert data["theory"]["grads"] == 4 * psi / n
    assert all(within_padding(r["memory"]["grads"], 4 * psi / n, n) for r in data["ranks"])


def test_save_then_load_resumes_bit_exactly(tmp_path, capsys):
    common = ["--stage", "2", "--world-size", "2", "--model", "tiny", "--quiet"]
    full, resumed, ckpt = tmp_path / "full.json", tmp_path / "resumed.json", str(tmp_path / "ckpt")
    assert main(common + ["--steps", "4", "--json", str(full)]) == 0
    assert main(common + ["--steps", "2", "--save", ckpt]) == 0
    assert main(common + ["--steps", "4", "--load", ckpt, "--json", str(resumed)]) == 0
    assert json.loads(resumed.read_text())["losses"] == json.loads(full.read_text())["losses"][2:]
    # another stage and N: resharded; another optimizer or model: refused before any process starts
    assert (
        main(
            [
                "--stage", "3", "--world-size", "4", "--model", "tiny", "--quiet", "--steps", "3",
                "--load", ckpt,
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(common + ["--load", ckpt, "--optimizer", "sgd"]) == 2
    assert "saved with optimizer AdamW, this run has --optimizer sgd" in capsys.readouterr().err
    assert main(["--stage", "3", "--world-size", "2", "--load", ckpt]) == 2     # --model default
    assert f"--load {ckpt} holds a different model: " in capsys.readouterr().err


@pytest.fixture(scope="module")
def saved_n2(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("cli") / "ckpt")
    assert (
        main(
            [
                "--stage", "2", "--world-size", "2", "--model", "tiny", "--quiet", "--steps", "1",
                "--save", d,
            ]
        )
        == 0
    )
    return d


@pytest.mark.parametrize("how, message", [
    ("truncated", "rank1.pt is truncated or damaged"),
    ("flipped", "rank1.pt is damaged: its sha256 differs"),
    ("missing", "rank1.pt is missing"),
    ("no manifest", "has no manifest.json"),
])
def test_a_damaged_checkpoint_is_refused_before_any_process_starts(
    saved_n2, tmp_path, capsys, monkeypatch, how, message
):
    d = tmp_path / "ckpt"
    shutil.copytree(saved_n2, d)
    shard = next(d.glob("v*/rank1.pt"))
    data = shard.read_bytes()
    if how == "truncated":
        shard.write_bytes(data[: len(data) // 2])
    elif how == "flipped":
        shard.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif how == "missing":
        shard.unlink()
    else:
        (d / "manifest.json").unlink()
    monkeypatch.setattr(
        "minizero.cli.run.launch", lambda *a, **k: pytest.fail("a process was launched")
    )
    capsys.readouterr()
    assert main(["--stage", "2", "--world-size", "2", "--model", "tiny", "--load", str(d)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def _stderr_on_a_terminal(*args: str) -> tuple[str, str]:
    """python -m minizero.run, stderr on a pseudo-terminal as a person sees it: (stdout, stderr)."""
    import os
    import pty
    master, slave = pty.openpty()
    p = subprocess.run([sys.executable, "-m", "minizero.run", *args], stdout=subprocess.PIPE,
                       stderr=slave, text=True, timeout=120, check=False)
    os.close(slave)
    err = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:                                  # EIO: the terminal's other end is closed
            break
        if not chunk:
            break
        err += chunk
    os.close(master)
    assert p.returncode == 0, err
    return p.stdout, err.decode(errors="replace")


def test_a_terminal_sees_a_progress_bar_and_quiet_or_a_pipe_does_not(tmp_path):
    out, err = _stderr_on_a_terminal("--world-size", "1", "--steps", "3", "--model", "tiny")
    assert "3/3" in err and "loss=" in err and "step    1/3" not in out    # the bar replaces them
    out, err = _stderr_on_a_terminal("--world-size", "1", "--steps", "3", "--model", "tiny",
                                     "--quiet")
    assert "3/3" not in err and "step    1/3" not in out and err == ""


def test_python_m_minizero_lists_and_dispatches_every_command(capsys):
    from minizero.cli.commands import COMMANDS
    from minizero.cli.commands import main as minizero_main
    assert minizero_main([]) == 2                              # the list, as a usage error
    listed = capsys.readouterr().out
    assert all(f"  {name}" in listed for name in COMMANDS)
    assert minizero_main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err
    assert minizero_main(["memory", "--params", "1e6", "--world-size", "2"]) == 0
    assert "stage" in capsys.readouterr().out
    for name in COMMANDS:                                      # each front end lives in cli/
        assert callable(importlib.import_module(f"minizero.cli.{name}").main)


def test_a_run_on_a_mesh_reports_each_ranks_part_next_to_the_formula_with_m(tmp_path):
    """--tensor-parallel 2 at N = 4: the GPT split over rows of 2, stage 3 over columns of 2. Every
    rank's model states, bytes sent and activations equal the theory with M (memory/mesh.py), and
    the first loss is the unsplit run's (the same model and data, computed in pieces)."""
    out = tmp_path / "mesh.json"
    argv = ["--stage", "3", "--world-size", "4", "--steps", "2", "--quiet"]
    assert main([*argv, "--tensor-parallel", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["tensor_parallel"] == 2
    th = data["theory"]
    for r in data["ranks"]:
        for category in ("params", "grads", "optimizer"):
            assert within_padding(r["memory"][category], th[category], 2), (r["rank"], category)
        assert r["comm_bytes_per_step"]["total"] == pytest.approx(th["comm_bytes_per_step"])
        assert r["memory"]["activations"] == th["activations"]       # activation_bytes with M
    assert main([*argv, "--json", str(tmp_path / "plain.json")]) == 0
    plain = json.loads((tmp_path / "plain.json").read_text())
    assert data["losses"][0] == pytest.approx(plain["losses"][0], rel=1e-6)
