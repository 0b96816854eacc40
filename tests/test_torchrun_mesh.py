"""torchrun with --tensor-parallel: the 2 x 2 mesh (stage 3) built from torchrun's process group
trains exactly as the one minizero.launch starts, and a model the mesh cannot split is one line
before any training.

    python -m pytest tests/test_torchrun_mesh.py -q
"""

import json
import subprocess
import sys

from minizero.cli.run import main

MESH = ["--stage", "3", "--tensor-parallel", "2", "--steps", "2", "--quiet"]
TIMINGS = {"step_time_s", "step_times_s", "throughput"}     # the only fields two runs may differ in


def test_torchrun_mesh_trains_like_the_launched_one(tmp_path):
    torchrun, launched = tmp_path / "torchrun.json", tmp_path / "launched.json"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "4", "-m", "minizero.run", *MESH,
                        "--json", str(torchrun)],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[:3000]
    assert main([*MESH, "--world-size", "4", "--json", str(launched)]) == 0
    got, want = json.loads(torchrun.read_text()), json.loads(launched.read_text())
    assert (got["world_size"], got["tensor_parallel"]) == (4, 2)
    # the losses, every rank's memory and bytes sent (the tally's), the theory: equal, not close;
    # bytes measured on the wire depend on how collectives overlapped: not compared
    for r in got["ranks"] + want["ranks"]:
        r.pop("wire_bytes_per_step", None)
    for key in sorted(want.keys() - TIMINGS):
        assert got[key] == want[key], f"--json {key}: torchrun {got[key]}, launched {want[key]}"


def test_a_model_the_mesh_cannot_split_is_one_line(capsys):
    """The tiny GPT has one head: refused before any process starts (not by each rank)."""
    assert main(["--model", "tiny", "--world-size", "2", "--tensor-parallel", "2"]) == 2
    err = capsys.readouterr().err
    assert err == ("minizero.run: error: tensor parallelism over 2 ranks: the number of heads = "
                   "1 is not divisible by 2\n"), err
