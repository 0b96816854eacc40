"""Every notebook runs headless, its sources match, and the numbers its plots draw agree with the
formulas.

    python -m pytest tests/test_notebooks.py -q      # every notebook, with TINY's small settings

Each notebook is executed by nbclient (a timeout per cell; the kernel starts in notebooks/, where
plots.py is); a cell that raises fails the test with its traceback. The notebook is run with small
settings: TINY's lines go into a cell right after the one tagged "parameters" (papermill's
convention), so the cells a learner reads carry no switch for tests. Afterwards one more cell writes
what READ names, from the kernel's own variables, to a JSON file; the checks below recompute every
formula from minizero.memory themselves instead of trusting what the notebook computed.

Every notebook is edited as its jupytext percent-format source, notebooks/NAME.py, and paired with
NAME.ipynb (`jupytext --sync notebooks/NAME.py`): a test fails when the two hold different cells.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import statistics
import subprocess
import sys

import pytest

from minizero.lab import source, stepthrough
from minizero.lab.reference import tolerance
from minizero.lab.train import state_bytes
from minizero.memory import (
    CATEGORIES, activation_bytes, comm_volume, element_bytes, estimate, estimate_breakdown,
    optimizer_k, within_padding,
)

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
CELL_TIMEOUT_S = 300

# the small settings, run after each notebook's "parameters" cell: the tiny model, 2 steps, N = 1, 4
_TINY_RUNS = 'MODEL, STEPS = "tiny", 2\nWORLD_SIZES = (WORLD_SIZES[0], WORLD_SIZES[-1])'
TINY = {
    "00_communication": "NUMEL, WORLD_SIZES = 10_000, (2, 4)",
    "01_ddp": _TINY_RUNS,
    "02_zero1": _TINY_RUNS,
    "03_zero2": _TINY_RUNS,
    "04_zero3": _TINY_RUNS,
    "05_offload": _TINY_RUNS,
    "06_compare": _TINY_RUNS + '\nBENCH_SIZES, BENCH_REPEATS, PEERS = ("tiny",), 1, ("torch",)',
    "07_activations": _TINY_RUNS + "\nSEQS, BATCHES = (8, 16), (2, 4)",
    "08_beyond": 'MODEL, BUCKET_SIZE, QSTEPS = "tiny", 400, 4',
    "09_what_goes_wrong": "STEPS = 2",
    "10_tensor_parallel": "STEPS = 2",
    "11_muon": 'STEPS, COST_MODEL, COST_WORLD_SIZES = 2, "tiny", (2, 3)',
    "12_two_layouts": 'MODEL, STEPS = "tiny", 3\nWORLD_SIZES = (2, 3)',
}
# what the checks read from the executed kernel: {name: expression over the notebook's variables}
READ = {
    "00_communication": {"00_communication": '{"collectives": list(results.values())}',
                         "ring_0": '{"ring": ring}'},
    "01_ddp": {"stage_0": '{"runs": list(runs.values())}', "steps_0": '{"steps": steps}'},
    "02_zero1": {"stage_1": '{"runs": list(runs.values())}', "steps_1": '{"steps": steps}'},
    "03_zero2": {"stage_2": '{"runs": list(runs.values())}', "steps_2": '{"steps": steps}'},
    "04_zero3": {"stage_3": '{"runs": list(runs.values())}', "steps_3": '{"steps": steps}',
                 "timeline_3": '{"intervals": {str(p): ivs for p, ivs in intervals.items()}, '
                               '"unit_names": timelines[True]["unit_names"]}',
                 "lora_3": '{"lora": lora}'},
    "05_offload": {"offload_5": '{"runs": [r for v in measured.values() for r in v.values()]}',
                   "loss_scale_5": '{"loss_scale": fp16}', "steps_5": '{"steps": steps}'},
    "06_compare": {"compare_6": '{"runs": [r for v in stages.values() for r in v.values()]}',
                   "bench_6": '{"bench": report}'},
    "07_activations": {"activations_7": '{"runs": [r for v in measured.values() '
                                        'for r in v.values()]'
                                        ', "activations": rows, "memory_timelines": timelines}',
                       "steps_7": '{"steps": steps}'},
    "08_beyond": {"network_8": '{"network": out}', "steps_8": '{"steps": steps}'},
    "09_what_goes_wrong": {"faults_9": '{"faults": {"verdict": verdict, "seconds": seconds, '
                                       '"recorder": flight_recorder, "verdicts": verdicts, '
                                       '"numel": w.numel(), "shape": list(w.shape), '
                                       '"outside": outside, "held": held, "inside": inside, '
                                       '"gathers": len(gathers), "tokens": TOKENS, '
                                       '"units": len(engine.units), "fault_rank": FAULT_RANK}}'},
    "10_tensor_parallel": {"mesh_10": '{"mesh": {"pair": pair, "runs": list(runs.values()), '
                                      '"block": steps, "checkpointed": checkpointed}}'},
    "11_muon": {"muon_11": '{"muon": {"parity": parity, "costs": records}}'},
    "12_two_layouts": {"steps_12": '{"steps": flat}',
                       "layouts_12": '{"fully_shard_steps": per_parameter, '
                                     '"layouts": list(reports.values()), "features": found}'},
}
# the collectives a stage's step-through must show, in order of first appearance
STEP_COLLECTIVES = {0: ["all_reduce"], 1: ["reduce_scatter", "all_gather"],
                    2: ["reduce_scatter", "all_gather"], 3: ["all_gather", "reduce_scatter"]}
# notebook 08, shard groups of S < N ranks (HSDP / MiCS): the all-reduce across groups in between
GROUPED_COLLECTIVES = {1: ["reduce_scatter", "all_reduce_across", "all_gather"],
                       2: ["reduce_scatter", "all_reduce_across", "all_gather"],
                       3: ["all_gather", "reduce_scatter", "all_reduce_across"]}
# what drives a notebook's interactive control (ipywidgets): every notebook has one
CONTROLS = ("plots.step_widget(", "plots.ring_widget(", "interact(")
# the stage notebooks: the worker its ranks run is a cell; one cell shows a real buffer in-process
STAGE_NOTEBOOKS = ("01_ddp", "02_zero1", "03_zero2", "04_zero3", "05_offload")


def notebooks() -> list[pathlib.Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def with_tiny_settings(nb, name: str):
    """`nb` with TINY[name] run right after its cell tagged "parameters" (exactly one must be)."""
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{name}: {len(tagged)} cells tagged 'parameters'"
    nb.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(TINY[name]))
    return nb


def test_every_notebook_is_tested():
    assert [p.stem for p in notebooks()] == sorted(TINY) == sorted(READ)


def _cells(nb) -> list[tuple]:
    return [(c.cell_type, c.source, c.metadata.get("tags", [])) for c in nb.cells]


def test_each_notebook_is_its_jupytext_source():
    """The .py a person edits and the .ipynb JupyterLab opens hold the same cells (types, sources,
    tags)."""
    jupytext = pytest.importorskip("jupytext")
    for path in notebooks():
        source = path.with_suffix(".py")
        assert source.exists(), f"{source.name} missing: jupytext --set-formats ipynb,py:percent"
        ipynb, text = _cells(nbformat.read(path, as_version=4)), _cells(jupytext.read(source))
        differ = next((i for i, (a, b) in enumerate(zip(ipynb, text)) if a != b),
                      min(len(ipynb), len(text)))
        assert ipynb == text, (f"{path.name} and {source.name} differ from cell {differ} on: "
                               f"jupytext --sync notebooks/{source.name}")


def test_notebooks_are_committed_without_outputs():
    for path in notebooks():
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            assert not cell.get("outputs") and not cell.get("execution_count"), path.name


def test_learner_cells_carry_no_test_plumbing_and_no_file_writes_notebooks():
    for path in notebooks():
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type == "code":
                found = re.search(r"export\(|\btests?\b|MINIZERO_SMALL|\bCI\b", cell.source)
                assert not found, f"{path.name}, cell {i}: {found.group(0)!r} in a learner's cell"
    for path in NOTEBOOKS.glob("*.py"):
        assert not re.search(r"new_(code|markdown)_cell|new_notebook", path.read_text()), path.name


def test_markdown_is_never_indented_into_a_code_block():
    """A paragraph indented by 4+ spaces renders as a code block (the step-through's introduction
    did)."""
    for path in notebooks():
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type == "markdown":
                fenced = False
                for line in cell.source.splitlines():
                    fenced ^= line.lstrip().startswith("```")
                    indented = re.match(r" {4,}[A-Za-z`(]", line)
                    assert fenced or not indented, f"{path.name}, cell {i}: {line!r}"


def test_every_notebook_has_a_control_and_ends_with_what_to_try():
    for path in notebooks():
        nb = nbformat.read(path, as_version=4)
        code = [c.source for c in nb.cells if c.cell_type == "code"]
        assert any(c in src for src in code for c in CONTROLS), f"{path.name}: no widget"
        last = nb.cells[-1]
        assert last.cell_type == "markdown", path.name
        assert last.source.startswith(("## What to try", "**What to try**")), path.name


# what the stage notebook launches notebooks/ranks.py with, and what it shows of minizero's source
STAGE_CODE = {"01_ddp": (0, "AllReducedGradients.reduce"),
              "02_zero1": (1, "GradientsReducedAtStep.parts"),
              "03_zero2": (2, "GradientShard.reduce"), "04_zero3": (3, "Unit.gather"),
              "05_offload": (2, "HostShardOptimizer._grads_for_masters")}


@pytest.mark.parametrize("name", STAGE_NOTEBOOKS)
def test_a_stage_notebook_shows_the_mechanism_in_its_cells(name):
    """The ranks run the one shared worker, notebooks/ranks.py (wrap, backward, step, memory), at
    notebook's stage; a cell shows the stage's own lines read from minizero's files
    (source.show), not a copy; and a cell builds the stage's buffers in this process
    (minizero.flat or minizero.wrap)."""
    code = [c.source for c in nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4).cells
            if c.cell_type == "code"]
    assert not any(src.startswith("%%writefile") for src in code), f"{name}: a worker copy"
    worker = (NOTEBOOKS / "ranks.py").read_text()
    for call in ("minizero.wrap(", ".backward(", ".step()", ".memory()"):
        assert call in worker, f"ranks.py does not call {call}"
    stage, shown = STAGE_CODE[name]
    assert any(re.search(rf"minizero\.launch\(ranks\.train, N, {stage}\b", src) for src in code), (
        f"{name}: no launch of ranks.train at stage {stage}")
    shows = [src for src in code if "source.show(" in src]
    assert any(shown.split(".")[1] in src for src in shows), f"{name}: {shown} not shown"
    in_process = re.compile(r"FlatLayout\.build\(|minizero\.wrap\(")
    assert any(in_process.search(src) and "minizero.launch" not in src and not src.startswith("%%")
               for src in code), f"{name}: no in-process cell"


def test_stage_notebooks_say_what_is_new_not_the_same_paragraphs():
    """No paragraph of more than 200 characters appears in two stage notebooks: each says what its
    stage changes and points to notebook 01 for what they share."""
    seen: dict[str, str] = {}
    for name in STAGE_NOTEBOOKS:
        nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
        for cell in nb.cells:
            if cell.cell_type != "markdown":
                continue
            for paragraph in cell.source.split("\n\n"):
                text = " ".join(paragraph.split())
                if len(text) > 200:
                    assert text not in seen, f"{name} repeats {seen[text]}: {text[:80]}..."
                    seen[text] = name


EDITED_WORKER = """
import importlib, os, sys, time
import minizero
def write(value):
    with open("cell_worker.py", "w") as f:
        f.write(f"def train():\\n    return {value}\\n")
if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    write(1)
    import cell_worker
    first = minizero.launch(cell_worker.train, 2)     # the kernel's first launch starts the server
    time.sleep(1.1)                                       # a newer file for the import system
    write(2)                                          # the learner edits the cell, reruns both
    importlib.reload(cell_worker)
    print(first, minizero.launch(cell_worker.train, 2))
"""


def test_an_edited_worker_cell_reaches_the_ranks(tmp_path):
    """A worker file (as notebooks/ranks.py) launched first in a kernel, edited, launched again:
    the ranks run the edit (a forkserver that preloaded the first version would hand every later
    rank the stale module)."""
    (tmp_path / "kernel.py").write_text(EDITED_WORKER)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(NOTEBOOKS.parent), os.environ.get("PYTHONPATH")])
        ),
    }
    out = subprocess.run([sys.executable, "kernel.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "[1, 1] [2, 2]", out.stdout


@pytest.mark.parametrize("name", sorted(READ))
def test_notebook_runs_and_its_plots_match_the_formulas(name, tmp_path):
    nb = with_tiny_settings(nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4), name)
    found = tmp_path / "read.json"
    entries = ", ".join(f"{key!r}: {expr}" for key, expr in READ[name].items())
    nb.cells.append(nbformat.v4.new_code_cell(f"import json as _json\n"
                                              f"with open({str(found)!r}, 'w') as _f:\n"
                                              f"    _json.dump({{{entries}}}, _f)"))
    nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    recorded = set()               # the minizero lines on the stacks of the events the run recorded
    recordings = []
    for export, data in json.loads(found.read_text()).items():
        for key in ("steps", "fully_shard_steps"):
            recordings += [data[key]] if key in data else []
            recorded |= {(r["file"], r["line"]) for r in data.get(key, {}).get("ran", [])}
        recorded |= {(w["file"], w["line"]) for w in data.get("ring", {}).get("sources", [])}
        if "runs" in data:
            check_training_runs(data["runs"])
        if "collectives" in data:
            check_collectives(data["collectives"])
        if "intervals" in data:
            check_timeline(data)
        if "lora" in data:
            check_lora(data["lora"])
        if "activations" in data:
            check_activations(data["activations"], data["runs"], data["memory_timelines"])
        if "loss_scale" in data:
            check_loss_scale(data["loss_scale"])
        if "network" in data:
            check_network(data["network"])
        if "steps" in data:
            check_steps(data["steps"], int(export.split("_")[1]))
        if "ring" in data:
            check_ring(data["ring"])
        if "bench" in data:
            check_bench(data["bench"])
        if "faults" in data:
            check_faults(data["faults"])
        if "mesh" in data:
            check_mesh(data["mesh"])
        if "muon" in data:
            check_muon(data["muon"])
        if "fully_shard_steps" in data:
            check_fully_shard_steps(data["fully_shard_steps"])
        if "layouts" in data:
            check_layouts(data["layouts"], data["features"])
    if recorded:
        check_marked_lines_ran(nb, recorded, name, recordings)


# what a notebook's "lines that did it" must mark: a line of each function, or ("phase", kind) the
# line a phase of that kind names (the collective's own line)
MUST_MARK = {"02_zero1": ["ShardOptimizer.step", ("phase", "reduce_scatter")],
             "04_zero3": ["Unit.pre_forward", "Unit._prefetch", "Unit.pre_backward",
                          ("phase", "reduce_scatter")],
             "12_two_layouts": ["ShardedParam.copy_shard_into", "Unit._copy_out",
                                "ShardedParam.copy_grad_into", "Reduction.finish",
                                ("phase", "reduce_scatter")]}


def marked_lines(nb) -> list[tuple[str, int, str, str]]:
    """(file, line, function, text) of every line a source.Code shown in the executed notebook
    marks (its text form: a "# file:line, in function" title, "▶" before a marked line's
    number)."""
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            file = function = None
            shown = out.get("data", {}).get("text/plain") or out.get("text") or ""
            for text in shown.split("\n"):
                title = re.match(r"# (minizero/\S+\.py):\d+, in (\S+)$", text)
                file, function = title.groups() if title else (file, function)
                marked = re.match(r"▶ +(\d+)  (.*)", text)
                if marked and file:
                    found.append((file, int(marked.group(1)), function, marked.group(2).strip()))
    return found


def check_marked_lines_ran(nb, recorded: set[tuple[str, int]], name: str, steps: list) -> None:
    """Every line of minizero a notebook highlights ran in that notebook's own recording and led to
    an event there (it is on the call stack of one): no line of another setting (notebook 01 once
    marked Engine.step's all-reduce across shard groups, which DDP never runs). And MUST_MARK's
    lines are among them."""
    shown = marked_lines(nb)
    assert shown or not any("source.show(" in c.source for c in nb.cells), "no marked line found"
    for file, line, _, text in shown:
        assert (file, line) in recorded, (
            f"{file}:{line} ({text!r}) is highlighted, but led to no event in this notebook's run")
    for must in MUST_MARK.get(name, []):
        if isinstance(must, tuple):
            lines = {(p["source"]["file"], p["source"]["line"]) for s in steps
                     for p in s["phases"] if p["kind"] == must[1]}
            assert lines & {(f, n) for f, n, _, _ in shown}, f"{name}: no {must[1]} line marked"
        else:
            assert any(f == must for _, _, f, _ in shown), f"{name}: nothing of {must} marked"


# the backend would end the hang after comm.DEFAULT_TIMEOUT_S (120 s): the verdict comes long before
HANG_NAMED_WITHIN_S = 30


def check_faults(f: dict) -> None:
    """Notebook 09. The skipped block at stage 3 ends in one line naming the rank out of step,
    within HANG_NAMED_WITHIN_S, each rank's flight recorder below it; an extra micro-batch
    desynchronizes stages 2 and 3 alike; a stage-3 parameter keeps its shape and reads NaN outside
    forward (no unit holds a byte), and its values inside engine.gathered(); T forwards through U
    units are T·U all-gathers."""
    out_of_step = f"ranks out of step: rank {f['fault_rank']} issued "
    verdict = f["verdict"]
    assert verdict.startswith(out_of_step) and "where rank 0 issued" in verdict, verdict
    assert f["seconds"] < HANG_NAMED_WITHIN_S, f"the hang was named after {f['seconds']:.1f} s"
    recorder = "\n".join(f["recorder"])
    assert "rank 0: issued" in recorder and f"rank {f['fault_rank']}: issued" in recorder, recorder
    for stage, line in f["verdicts"].items():
        assert line.startswith(out_of_step), f"stage {stage}, an extra micro-batch: {line}"
    assert f["shape"] == [f["numel"]] and f["outside"] is True and f["held"] == 0, f
    assert f["inside"] >= element_bytes("fp32") * f["numel"], f
    assert f["gathers"] == f["tokens"] * f["units"], f


def check_muon(muon: dict) -> None:
    """Notebook 11. At N = 3 matrices straddle; every design at every stage ends within rounding of
    DDP at the same N (1e-5, fp32's bar; 9e-7 measured), the slice alone far from it (> 1e-2; 5.5e-2
    measured); each design's Muon bytes and momentum on every rank equal its formula at every N
    (format_costs asserts it too)."""
    for p in muon["parity"]:
        if p["design"] == "slice alone":
            assert p["vs DDP"] > 1e-2, p
        else:
            assert p["vs DDP"] < 1e-5, p
    assert max(p["straddlers"] for p in muon["parity"]) >= 1
    for record in muon["costs"]:
        for rank in record["ranks"] if record["design"] != "AdamW" else ():
            assert rank["muon"] == rank["muon_formula"], record
            assert rank["momentum"] == rank["momentum_formula"], record


def check_mesh(mesh: dict) -> None:
    """Notebook 10. The column/row pair on 2 ranks equals one process (1e-6; weight gradients
    bitwise) with one g forward and one f backward, each beyond/tensor_parallel.py's all-reduce;
    every (mesh, stage) ends at one process's parameters with each rank's model states =
    estimate_breakdown(Ψ_rank, N_d) (recomputed here); the 2 x 2 step-through replays (g's sums)
    and names f, g and ZeRO's collectives by their lines; the activation meter = activation_bytes
    with M for each checkpointing mode, P_a below no checkpointing."""
    from minizero.lab import mesh_demo
    from minizero.lab.data import sequence_length
    for r in mesh["pair"]:
        assert max(r["diffs"].values()) < 1e-6, r["diffs"]
        assert r["bitwise"]["column weight gradient"] and r["bitwise"]["row weight gradient"], r
        functions = [(p["tag"], p["source"]["function"]) for p in r["phases"]]
        assert functions == [("tensor parallel g", "_ReduceFromGroup.forward"),
                             ("tensor parallel f", "_CopyToGroup.backward")], functions
        for p in r["phases"]:
            code = source.Code(p["source"]["file"], p["source"]["line"])
            assert "all_reduce(" in code.lines[p["source"]["line"] - code.first], p["source"]
    meshes = {(r["tensor_parallel"], r["world_size"] // r["tensor_parallel"]) for r in mesh["runs"]}
    assert {(2, 2), (4, 1), (1, 4)} <= meshes, meshes
    for r in mesh["runs"]:
        m, n_d = r["tensor_parallel"], r["world_size"] // r["tensor_parallel"]
        assert r["max_abs_diff"] <= tolerance(r["dtype"]), (m, r["stage"], r["max_abs_diff"])
        elem = element_bytes(r["dtype"])
        formula = estimate_breakdown(r["num_params"], n_d, r["stage"], param_bytes=elem,
                                     grad_bytes=elem,
                                     k=optimizer_k(state_bytes(r["optimizer"]), r["dtype"]))
        for rank in r["ranks"]:
            for cat in ("params", "grads", "optimizer"):
                assert within_padding(rank["memory"][cat], formula[cat], n_d), (
                    f"{m} x {n_d}, stage {r['stage']}, rank {rank['rank']}, {cat}: "
                    f"{rank['memory'][cat]} vs {formula[cat]}")
    block = mesh["block"]
    mesh_demo.check_block(block)
    layers = mesh_demo.BLOCK_MODEL["n_layer"]
    expected = {("tensor parallel g", "_ReduceFromGroup.forward"): 2 * layers + 1,   # + embedding
                ("tensor parallel f", "_CopyToGroup.backward"): 2 * layers + 1,      # + the head
                ("all_gather", "Unit.gather"): 2 * (layers + 1)}       # each unit, fwd and bwd
    for phases in block["ranks"]:
        seen = [(p["tag"] if p["tag"].startswith("tensor parallel") else p["kind"],
                 p["source"]["function"]) for p in phases]
        for key, count in expected.items():
            assert seen.count(key) == count, (key, seen)
        assert all(p["source"]["file"] == "minizero/beyond/tensor_parallel.py" for p in phases
                   if p["tag"].startswith("tensor parallel")), phases
        assert sum(p["kind"] == "reduce_scatter" for p in phases) == layers + 1, phases
    kept = {}
    for r in mesh["checkpointed"]:
        c, mode = r["model"], r["activation_checkpointing"]
        rows = r["batch_size"] // (r["world_size"] // r["tensor_parallel"])
        estimate = activation_bytes(c["n_layer"], c["n_embd"], c["n_head"],
                                    sequence_length(c["block_size"]), rows,
                                    mlp_ratio=c["mlp_ratio"], checkpointing=mode,
                                    tensor_parallel=r["tensor_parallel"])
        kept[mode] = r["ranks"][0]["memory"]["activations"]
        for rank in r["ranks"]:
            assert rank["memory"]["activations"] == estimate, (mode, rank, estimate)
    assert kept["partitioned+cpu"] < kept["partitioned"] < kept[False], kept


def check_bench(report: dict) -> None:
    """Every pair ends at the peer's parameters; its figure has a ratio for each repeat to draw."""
    for p in report["pairs"]:
        assert p["max_param_diff"] < 1e-5, p
        ratios = p["repeat_ratios"]
        assert len(ratios) == report["config"]["repeats"] and min(ratios) > 0, p


def check_steps(steps: dict, notebook: int) -> None:
    """The step-through: stepthrough.check replays every phase against one process stepping the
    whole batch (each reduced bucket = the mean of the ranks' own gradients = the whole batch's
    gradient, on the owning rank only; the step changes the owned partition only; the last phase
    holds the one-process result); and the stage's collectives are there, on at least 2 ranks, with
    the padding N forces. Notebook 08: shard groups of S < N ranks, so owners are one rank per group
    and each bucket's partition is all-reduced across the groups after the reduce-scatter within
    them (stepthrough.check, group-aware)."""
    cfg = steps["config"]
    assert (
        cfg["stage"]
        == {0: 0, 1: 1, 2: 2, 3: 3, 5: cfg["stage"], 7: cfg["stage"], 8: cfg["stage"],
            12: 3}[notebook]
    ), cfg
    assert 2 <= cfg["world_size"] <= 4 and len(steps["phases"][0]["ranks"]) == cfg["world_size"]
    grouped = notebook == 8
    assert grouped == (cfg.get("shard_group_size") is not None), cfg
    if grouped:
        assert cfg["stage"] >= 1 and 1 < cfg["shard_group_size"] < cfg["world_size"], cfg
    stepthrough.check(steps)
    kinds = [p["kind"] for p in steps["phases"]
             if p["kind"] in ("all_reduce", "reduce_scatter", "all_gather", "all_reduce_across")]
    expected = (GROUPED_COLLECTIVES if grouped else STEP_COLLECTIVES)[cfg["stage"]]
    assert list(dict.fromkeys(kinds)) == expected, kinds
    # per bucket / unit
    assert kinds.count(STEP_COLLECTIVES[cfg["stage"]][0]) >= 2 or cfg["stage"] == 1, kinds
    # recorded after it ran: the groups' means became all N's
    for k, phase in enumerate(steps["phases"]):
        assert (
            phase["kind"] != "all_reduce_across"
            or phase["ranks"] != steps["phases"][k - 1]["ranks"]
        ), k
    check_sources(steps)
    if notebook == 5:
        assert cfg["offload"] and any("(host)" in name for name in steps["phases"][-1]["ranks"][0])
    if notebook == 7:
        assert cfg["checkpointing"] and max(max(p["activations"]) for p in steps["phases"]) > 0


def check_fully_shard_steps(steps: dict) -> None:
    """Notebook 12's per-parameter step-through (lab/stepthrough_fully_shard.py):
    stepthrough.check replays every phase against one process (each rank's rows of every
    parameter, gradient and momentum; each all-gather whole, each free empty); at this N some
    parameter is padded and some rank's momentum covers fewer elements than another's; every
    collective phase names fully_shard's call of that collective; and the recorded lines include
    the copies into and out of the collectives' buffers, which no event announces."""
    cfg = steps["config"]
    assert cfg["layout"] == "per-parameter" and 2 <= cfg["world_size"] <= 4, cfg
    stepthrough.check(steps)
    kinds = [p["kind"] for p in steps["phases"] if p["kind"] in ("all_gather", "reduce_scatter")]
    assert list(dict.fromkeys(kinds)) == ["all_gather", "reduce_scatter"], kinds
    assert any(b["padded"] > b["numel"] for b in steps["buckets"]), "nothing padded at this N"
    held = [sum(v is not None for v in rank["momentum"]) for rank in steps["phases"][-1]["ranks"]]
    assert len(set(held)) > 1, f"the momentum is even at this N: {held}"
    calls = {"all_gather": "all_gather(", "ready": "reduce_scatter(",
             "reduce_scatter": "reduce_scatter(", "free": "events.emit(\"unit freed\"",
             "arrived": "events.emit(\"bucket arrived\""}
    for k, phase in enumerate(steps["phases"]):
        where = phase["source"]
        if phase["kind"] not in calls:
            continue
        assert where["file"].startswith("minizero/pytorch/"), (k, where)
        code = source.Code(where["file"], where["line"])
        assert code.function == where["function"], (where, code.function)
        line = code.lines[where["line"] - code.first]
        assert calls[phase["kind"]] in line, f"phase {k} ({phase['kind']}): {line.strip()!r}"
    ran = {r["function"] for r in steps["ran"]}
    for function in ("ShardedParam.copy_shard_into", "Unit._copy_out",
                     "ShardedParam.copy_grad_into", "ShardedParam.add_grad"):
        assert function in ran, f"{function} not recorded as run"
    assert all("/lab/" not in r["file"] for r in steps["ran"]), "the recorder's own lines"


def check_layouts(reports: list[dict], features: list[dict]) -> None:
    """Notebook 12. Per N and design, every rank's model states equal the formulas, recomputed
    here from the model's shapes (flat: 4·Σ_u ⌈Ψ_u/N⌉ each for parameters and gradients;
    per-parameter: 4·Σ_p ⌈d0/N⌉·row, AdamW's moments over the rank's real rows, 4 B per
    parameter's step count); the per-parameter optimizer state differs between ranks; the
    collectives are 2 all-gathers and 1 reduce-scatter per unit (the root kept gathered: one
    all-gather fewer) and their ring bytes the tally's; gloo's wire carries at least the ring's
    bytes; the per-parameter layout copies more; every design ends at the same parameters. And
    each claim of what per-parameter sharding buys holds on every rank (layout_features.py)."""
    from minizero.lab.model import GPTConfig, make_model
    from minizero.units import default_units
    for report in reports:
        n = report["world_size"]
        model = make_model(GPTConfig.named(report["model"]))
        units = [list(u.parameters()) for u in default_units(model)]
        in_units = {id(p) for u in units for p in u}
        units.insert(0, [p for p in model.parameters() if id(p) not in in_units])
        flat_unit = [-(-sum(p.numel() for p in u) // n) * n for u in units]        # padded
        per_unit = [sum(-(-p.shape[0] // n) * n * p[0].numel() for p in u) for u in units]
        designs = report["designs"]
        for design, rec in designs.items():
            padded = flat_unit if design == "flat" else per_unit
            for rank, mem in enumerate(rec["memory"]):
                where = f"N = {n}, {design}, rank {rank}"
                assert mem["params"] == mem["grads"] == 4 * sum(padded) // n, (where, mem)
                if design == "flat":
                    extra = mem["optimizer"] - 8 * sum(padded) // n       # 4 B per view stepped
                    assert extra > 0 and extra % 4 == 0, (where, mem)
                else:
                    rows = sum(max(0, min(-(-p.shape[0] // n), p.shape[0] - rank
                                          * -(-p.shape[0] // n))) * p[0].numel()
                               for p in model.parameters())
                    count = len(list(model.parameters()))
                    assert mem["optimizer"] == 8 * rows + 4 * count, (where, mem)
            gathers = 2 * len(units) - (design == "per-parameter, root kept")
            assert rec["collectives"] == {"all_gather": gathers, "reduce_scatter": len(units)}, (
                n, design, rec["collectives"])
            ring = (n - 1) / n * 4
            want = ring * (2 * sum(padded) - (padded[0] if "root kept" in design else 0)
                           + sum(padded))
            assert rec["bytes_per_step"]["total"] == pytest.approx(want), (n, design)
            assert all(w is None or w >= want for w in rec["wire_per_step"]), (n, design)
        per = designs["per-parameter"]
        assert len({m["optimizer"] for m in per["memory"]}) > 1, f"N = {n}: even optimizer"
        assert per["copies"]["bytes"] > designs["flat"]["copies"]["bytes"], n
        assert report["max_param_diff"] <= tolerance("fp32"), report["max_param_diff"]
    for rank in features:
        flat, per = rank["flat"], rank["per-parameter"]
        assert flat["clip"]["norm"] == 0 and flat["clip"]["grads"] == 0, flat["clip"]
        one = per["clip"]["one_process_norm"]
        for norm in (per["clip"]["norm"], flat["clip"]["engine_clip_norm"]):
            assert norm == pytest.approx(one, rel=1e-6), (norm, one)
        assert per["clip"]["clipped_vs_one_process"] <= 1e-6, per["clip"]
        assert per["clip"]["collectives"]["DTensor"] == {"all_reduce": 1}, per["clip"]
        assert flat["mixed"]["collectives"]["minizero"]["all_gather"] > \
            per["mixed"]["collectives"]["minizero"]["all_gather"], rank["rank"]
        assert flat["mixed"]["moved"] == 0 and per["mixed"]["vs_one_process"] <= 1e-6, rank
        assert per["mixed"]["moved"] > 100 * per["mixed"]["vs_one_process"], per["mixed"]
        own = per["state dict"]["model.state_dict()"]
        assert not own["minizero"] and not own["DTensor"] and own["wire"] in (0, None), own
        assert not per["state dict"]["entry"]["nan"] and flat["state dict"]["entry"]["nan"]
        assert flat["state dict"]["engine.full_state_dict()"]["minizero"]["all_gather"] >= 1
        assert flat["optimizer"]["muon"].startswith("ValueError: Muon only supports 2D")
        assert all(len(s) == 1 for s in flat["optimizer"]["shapes"]), flat["optimizer"]
        assert per["optimizer"]["muon"] == "stepped" and per["optimizer"]["vs_one_process"] < 1e-2
        assert all(len(s) == 2 for s in per["optimizer"]["shapes"]), per["optimizer"]
        assert min(v for k, v in rank["step cost"].items() if k != "tensors") > 0


# what the line a phase names must call, by the phase's kind (the collective's name in the stage's
# call of it, a free's resize_(0) in the function shown)
CALLS = {"all_reduce": "all_reduce(", "all_reduce_across": "all_reduce(",
         "reduce_scatter": "reduce_scatter(", "ready": ("reduce_scatter(", "all_reduce("),
         "all_gather": "all_gather("}


def check_sources(steps: dict) -> None:
    """Every phase names a line of minizero's implementation (not of lab/, events.py or comm.py's
    plumbing) and the function the widget shows is the one that ran it: a collective's line calls
    that collective; a free's function releases the storage (resize_(0)); the step's calls the
    optimizer."""
    for k, phase in enumerate(steps["phases"]):
        where = phase["source"]
        assert where is not None, f"phase {k} ({phase['label']}) names no line"
        assert where["file"].startswith("minizero/") and "/lab/" not in where["file"], where
        assert pathlib.Path(where["file"]).name not in source.PLUMBING, where
        code = source.Code(where["file"], where["line"])
        assert code.function == where["function"], (where, code.function)
        ran = code.lines[where["line"] - code.first]
        if phase["kind"] in CALLS:
            calls = CALLS[phase["kind"]]
            assert any(c in ran for c in ((calls,) if isinstance(calls, str) else calls)), (
                f"phase {k} ({phase['label']}): {where['file']}:{where['line']} is {ran.strip()!r}")
        if phase["kind"] == "free":
            assert any("resize_(0)" in line for line in code.lines), (k, code.function)
        if phase["kind"] == "step":
            assert any("optimizer.step(" in line for line in code.lines), (k, code.function)


def test_shown_code_is_read_from_the_file_as_it_is_now(tmp_path):
    """source.Code reads the function around a line from the file each time: an edit that moves
    the function shows at once (no copy, no stale parse)."""
    path = tmp_path / "edited.py"
    path.write_text("def step():\n    return 1\n")
    assert source.Code(str(path), 2).lines == ["def step():", "    return 1"]
    path.write_text("import os\n\n\ndef step():\n    return 2\n")
    code = source.Code(str(path), 5)
    assert (code.function, code.first, code.lines[-1]) == ("step", 4, "    return 2")


def test_the_momentum_row_holds_the_optimizers_momentum():
    """With SGD momentum, the step-through's momentum row is empty until the step; from the step
    on, each rank's row holds what one process's torch.optim.SGD holds for the elements that rank
    steps (every element at stage 0, its partition at stages 1-3), and nothing elsewhere."""
    import torch
    for stage in range(4):
        steps = stepthrough.record(stepthrough.StepConfig(stage=stage, world_size=2))
        cfg = stepthrough.StepConfig(**steps["config"])
        model = stepthrough.tiny_model(cfg.seed)
        x, y = stepthrough.global_batch(cfg)
        torch.nn.functional.mse_loss(model(x), y).backward()
        sgd = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
        sgd.step()
        params = dict(model.named_parameters())
        want = {start + i: v for name, start, numel in steps["segments"] for i, v in
                enumerate(sgd.state[params[name]]["momentum_buffer"].reshape(-1).tolist())}
        stepped = next(k for k, p in enumerate(steps["phases"]) if p["kind"] == "step")
        for k, phase in enumerate(steps["phases"]):
            for r, rank in enumerate(phase["ranks"]):
                row = rank["momentum"]
                for j, value in want.items():
                    b = next(b for b in steps["buckets"]
                             if b["start"] <= j < b["start"] + b["padded"])
                    mine = not steps["partitioned"] or (j - b["start"]) // b["shard"] == r
                    where = f"stage {stage}, phase {k} ({phase['label']}), rank {r}, element {j}"
                    if k < stepped or not mine:
                        assert row[j] is None, f"{where}: momentum {row[j]} shown"
                    else:
                        assert row[j] is not None and abs(row[j] - value) <= 1e-6, (
                            f"{where}: momentum {row[j]}, torch's SGD holds {value}")


def test_each_phase_names_the_line_that_produced_it():
    """The recorder walks the stack of each event to minizero's line (no copy of the source): at
    stage 3 the all-gathers are Unit.gather's, the frees Unit.free's, the reduce-scatters the
    stage's; the ring's exchanges are ring_all_reduce's two calls, phase 1's then phase 2's."""
    steps = stepthrough.record(stepthrough.StepConfig(stage=3, world_size=2))
    check_sources(steps)
    functions = {p["kind"]: p["source"]["function"] for p in steps["phases"]}
    assert functions["all_gather"] == "Unit.gather" and functions["free"] == "Unit.free"
    ring = stepthrough.ring(3)
    lines = [where["line"] for where in ring["sources"]]
    assert {w["function"] for w in ring["sources"]} == {"ring_all_reduce"}, ring["sources"]
    assert lines[:2] == [lines[0]] * 2 and lines[2:] == [lines[2]] * 2 and lines[0] < lines[2]


def check_ring(ring: dict) -> None:
    """Every exchange of ring.py's ring_all_reduce moved one chunk to the right neighbour,
    added (first N-1) or copied (last N-1) there, and every rank ends with the sum."""
    stepthrough.check_ring(ring)
    n = ring["world_size"]
    assert n >= 3 and ring["numel"] % n, (
        "a ring of 3+ ranks over a size N does not divide shows more"
    )


def check_loss_scale(run: dict) -> None:
    """Every rank skipped exactly the injected steps (the inf was in one rank's partition only) and
    its scale moved as minizero.loss_scale.LossScaler's rule says, replayed here on the injected
    pattern: hysteresis first, then halving, doubling after the window."""
    from minizero.loss_scale import LossScaler
    faults = {int(k): r for k, r in run["faults"].items()}
    replay = LossScaler(dict(run["loss_scale"]))
    expected = []
    for step in range(len(run["ranks"][0]["trace"])):
        before = replay.scale
        replay.update(step in faults)
        expected.append((step, before, step in faults, replay.scale))
    assert sum(1 for _, b, _, a in expected if a == b / 2) >= 2, "the pattern must halve the scale"
    for res in run["ranks"]:
        got = [(t["step"], t["scale"], t["skipped"], t["scale_after"]) for t in res["trace"]]
        assert got == expected, f"rank {res['rank']}: (step, scale, skipped, scale after) {got}"
        owned = [t["step"] for t in res["trace"] if t["local_overflow"]]
        assert owned == [k for k, r in faults.items() if r == res["rank"]], (
            f"rank {res['rank']}: {owned}"
        )
        assert res["skipped_steps"] == len(faults)


def check_network(out: dict) -> None:
    """Under the network model: each run's bytes per step are the ring formula
    (memory.comm_volume, recomputed here); with a model (one rank per node) they all cross nodes,
    without one (one machine) none do; and the recorded step lasted at least as long as the
    modelled link was busy."""
    for run in out["runs"]:
        n, stage, sent = run["world_size"], run["stage"], run["comm"]
        formula = comm_volume(run["num_params"], n, stage, bytes_per_elem=4)
        assert within_padding(sent["total"], formula, n, times=3), (
            f"{run['label']}: {sent['total']} vs {formula}"
        )
        assert sent["inter_node" if run["network"] else "intra_node"] == sent["total"], run["label"]
        busy = sum(end - start for start, end, _ in run["timeline"]["transfers"])
        assert (busy > 0) == (run["network"] is not None) and run["timeline"]["end"] >= busy, run[
            "label"
        ]


def check_training_runs(records: list[dict]) -> None:
    assert len({r["world_size"] for r in records}) >= 2, (
        "a plot over N needs at least two world sizes"
    )
    for rec in records:
        n, psi, stage, offload = rec["world_size"], rec["num_params"], rec["stage"], rec["offload"]
        where = f"stage {stage}, N={n}, offload={offload}"
        elem = element_bytes(rec["dtype"])
        k = optimizer_k(state_bytes(rec["optimizer"]), rec["dtype"], offload)
        formula = estimate_breakdown(
            psi, n, stage, param_bytes=elem, grad_bytes=elem, k=k, offload=offload
        )
        device = estimate(psi, n, stage, param_bytes=elem, grad_bytes=elem, k=k, offload=offload)
        # the formula the plot draws is the paper's
        assert rec["theory"]["device_total"] == pytest.approx(device), where
        for cat in CATEGORIES:
            assert rec["theory"][cat] == pytest.approx(formula[cat]), (
                f"{where}, {cat}: plotted formula"
            )
            for r in rec["ranks"]:
                got = r["memory"][cat]
                assert within_padding(got, formula[cat], n), (
                    f"{where}, rank {r['rank']}, {cat}: measured "
                    f"{got} bytes, formula {formula[cat]:.0f}"
                )
        sent_formula = comm_volume(psi, n, stage, bytes_per_elem=elem)
        for r in rec["ranks"]:
            sent = r["comm_bytes_per_step"]["total"]
            assert within_padding(sent, sent_formula, n, times=3), f"{where}: {sent} bytes per step"
        # the step-time panel: a bar at the median of the dots it draws, one per timed step
        assert rec["step_time_s"] == pytest.approx(statistics.median(rec["step_times_s"])), where
        atol = tolerance(rec["dtype"])
        assert rec["max_abs_diff"] <= atol, f"{where}: {rec['max_abs_diff']} from the reference"
        assert rec["losses"] == pytest.approx(rec["reference_losses"], rel=atol), where


def check_activations(rows: list[dict], runs: list[dict], timelines: list[dict]) -> None:
    """Measured activations within 10 % of memory.activation_bytes (recomputed here),
    checkpointing halves them in every run, and each timeline's activations rise through forward
    and end at zero."""
    for r in rows:
        estimate = activation_bytes(r["layers"], r["hidden"], r["heads"], r["seq"], r["batch"],
                                    bytes_per_elem=r["bytes_per_elem"], mlp_ratio=r["mlp_ratio"],
                                    checkpointing=r["checkpointing"])
        assert abs(r["measured"] - estimate) <= 0.1 * estimate, r
    by_setting = {}
    for rec in runs:
        by_setting.setdefault((rec["stage"], rec["world_size"]), []).append(
            rec["ranks"][0]["memory"]["activations"]
        )
    for (stage, n), (kept, checkpointed) in by_setting.items():
        assert checkpointed <= 0.6 * kept, (
            f"stage {stage}, N={n}: {checkpointed} of {kept} bytes checkpointed"
        )
    for t in timelines:
        forward = [b["activations"] for _, event, b in t["events"] if event.startswith("forward")]
        assert forward == sorted(forward) and t["events"][-1][2]["activations"] == 0, t["events"]


def check_collectives(results: list[dict]) -> None:
    factors = {
        "all_reduce": 2,
        "reduce_scatter": 1,
        "all_gather": 1,
        "broadcast": 1,
        "ring_all_reduce": 2,
    }
    for res in results:
        n, size = res["world_size"], res["full_bytes"]
        for kind, factor in factors.items():
            formula = factor * (n - 1) / n * size
            assert formula - 1e-6 <= res["sent"][kind] <= formula + 8 * n, (
                f"N={n} {kind}: {res['sent'][kind]}"
            )
        assert res["ring_max_abs_diff"] < 1e-4
        check_wire(res)
        shown = res["shown_all"]
        inputs = [s["input"] for s in shown]
        sums = [sum(col) for col in zip(*inputs)]
        for r, s in enumerate(shown):
            assert s["all_reduce"] == pytest.approx(sums)
            assert s["reduce_scatter"] == pytest.approx([sums[r]])
            assert s["all_gather"] == pytest.approx([x[0] for x in inputs])
            assert s["broadcast"] == pytest.approx(inputs[0])


def check_wire(res: dict) -> None:
    """Notebook 00's measured bytes (memory/wire.py): each collective alone sent what gloo sends
    for it, within 1 kB of headers per peer (measured: 1,728 B for an all-reduce of 40 kB on 4
    ranks): the ring's bytes, twice them for a reduce-scatter (an
    all-reduce underneath), the ring's own sends for ring_all_reduce; a broadcast's bytes summed
    over the ranks are (N-1)·S (a tree from the root)."""
    if res["wire"] is None:
        assert res["wire_unavailable"], "no measured bytes, and no reason why"
        return
    n, size = res["world_size"], res["full_bytes"]
    headers = 1024 * (n - 1)
    for r, wire in enumerate(res["wire_all"]):
        expected = {"all_reduce": 2 * (n - 1) / n * size,
                    "reduce_scatter": 2 * (n - 1) / n * size, "all_gather": (n - 1) / n * size,
                    "ring_all_reduce": res["sent"]["ring_all_reduce"]}    # the same on every rank
        for kind, want in expected.items():
            assert want <= wire[kind] <= want + headers, f"N={n}, rank {r}, {kind}: {wire[kind]}"
    broadcast = sum(w["broadcast"] for w in res["wire_all"])
    assert (n - 1) * size <= broadcast <= (n - 1) * size + n * headers, f"N={n}: {broadcast}"


def check_timeline(data: dict) -> None:
    names = data["unit_names"]
    for prefetch, intervals in data["intervals"].items():
        for b, name in enumerate(names):
            mine = [iv for iv in intervals if iv["unit"] == b]
            assert [iv["phase"] for iv in mine] == ["forward", "backward"], (
                f"prefetch={prefetch}, {name}"
            )
            assert all(iv["start"] <= iv["end"] for iv in mine)
        prefetched = any(iv["how"] == "prefetch" for iv in intervals)
        assert prefetched == (prefetch == "True"), (
            f"prefetch={prefetch}: prefetch events {prefetched}"
        )


def check_lora(rows: list[dict]) -> None:
    """Frozen weights sharded: parameter bytes per rank = (Ψ + Ψ_f)·4/N up to padding, recomputed
    here; building normally held the whole model at most (measured); and building under
    sharded_init held less than half of it (N > 1)."""
    for r in rows:
        n = r["world_size"]
        formula = estimate_breakdown(
            r["trainable"], n, 3, param_bytes=4, grad_bytes=4, k=8, frozen=r["frozen"]
        )
        assert within_padding(r["params"], formula["params"], n), (r, formula)
        whole = 4 * (r["trainable"] + r["frozen"])
        assert r["construction_peak"]["normal"] == whole
        if n > 1:
            assert r["construction_peak"]["sharded_init"] < whole / 2 and r["params"] < whole / 2, r


def test_a_widget_menu_computes_again_and_its_slider_follows(monkeypatch, capsys):
    """plots.stepper, which every step-through and the ring use: a new menu value calls compute once
    (then cached), the slider's range follows the new result, and a setting the engine refuses shows
    its line."""
    pytest.importorskip("ipywidgets")
    import matplotlib
    matplotlib.use("Agg")
    monkeypatch.syspath_prepend(str(NOTEBOOKS))
    import matplotlib.pyplot as plt
    import plots

    calls = []

    def compute(n):
        calls.append(n)
        if n == 5:
            raise ValueError("five is refused")
        return {"n": n}

    captions = []
    box = plots.stepper(
        {"n": 2},
        compute,
        lambda result, i: plt.figure(),
        lambda result: result["n"],
        {"n": [2, 3, 5]},
        (2,),
        caption=lambda result, i: captions.append((result["n"], i)),
    )
    (menu,), (play, slider) = box.children[0].children, box.children[1].children
    assert slider.max == 1 and calls == [] and captions == [(2, 0)]   # the code under the figure
    menu.value = 3
    assert calls == [3] and slider.max == play.max == 2
    menu.value = 2
    menu.value = 3
    assert calls == [3]                        # both settings cached
    menu.value = 5
    assert calls == [3, 5] and slider.max == 2
    assert "five is refused" in capsys.readouterr().out       # (into the Output widget in a kernel)
