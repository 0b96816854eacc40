"""Every notebook runs headless, and the numbers its plots draw agree with the ZeRO paper's formulas.

    python -m pytest tests/test_notebooks.py -q        # all notebooks with MINIZERO_SMALL=1

Each notebook is executed by nbclient (a timeout per cell; the kernel starts in notebooks/, where
plots.py is); a cell that raises fails the test with its traceback. A notebook hands the data behind its
figures to `minizero.lab.demo.export`, which writes $MINIZERO_NOTEBOOK_DATA/<name>.json; the checks below
recompute every formula from minizero.memory themselves instead of trusting what the notebook computed.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from minizero.lab import stepthrough
from minizero.lab.reference import tolerance
from minizero.lab.train import state_bytes
from minizero.memory import (
    CATEGORIES,
    activation_bytes,
    comm_volume,
    element_bytes,
    estimate,
    estimate_breakdown,
    optimizer_k,
    within_padding,
)

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
CELL_TIMEOUT_S = 300

# notebook -> the files it exports
EXPORTS = {
    "00_communication": ["00_communication", "ring_0"],
    "01_ddp": ["stage_0", "steps_0"],
    "02_zero1": ["stage_1", "steps_1"],
    "03_zero2": ["stage_2", "steps_2"],
    "04_zero3": ["stage_3", "timeline_3", "lora_3", "steps_3"],
    "05_offload": ["offload_5", "loss_scale_5", "steps_5"],
    "06_compare": ["compare_6"],
    "07_activations": ["activations_7", "steps_7"],
    "08_beyond": ["network_8", "steps_8"],
}
# the collectives a stage's step-through must show, in order of first appearance
STEP_COLLECTIVES = {0: ["all_reduce"], 1: ["reduce_scatter", "all_gather"], 2: ["reduce_scatter", "all_gather"],
                    3: ["all_gather", "reduce_scatter"]}
# notebook 08, shard groups of S < N ranks (HSDP / MiCS): the all-reduce across the groups comes in between
GROUPED_COLLECTIVES = {1: ["reduce_scatter", "all_reduce_across", "all_gather"],
                       2: ["reduce_scatter", "all_reduce_across", "all_gather"],
                       3: ["all_gather", "reduce_scatter", "all_reduce_across"]}
# what drives a notebook's interactive control (ipywidgets): every notebook has one
CONTROLS = ("plots.step_widget(", "plots.ring_widget(", "interact(")


def test_every_notebook_is_tested():
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == sorted(EXPORTS)


def test_notebooks_are_committed_without_outputs():
    for path in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            assert not cell.get("outputs") and not cell.get("execution_count"), f"{path.name} has outputs"


def test_every_notebook_has_a_control_and_ends_with_what_to_try():
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        code = [c.source for c in nb.cells if c.cell_type == "code"]
        assert any(control in src for src in code for control in CONTROLS), f"{path.name}: no widget"
        last = nb.cells[-1]
        assert last.cell_type == "markdown" and last.source.startswith(("## What to try", "**What to try**")), path.name


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_notebook_runs_and_its_plots_match_the_formulas(name, tmp_path, monkeypatch):
    monkeypatch.setenv("MINIZERO_SMALL", "1")
    monkeypatch.setenv("MINIZERO_NOTEBOOK_DATA", str(tmp_path))       # the kernel inherits the environment
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    for export in EXPORTS[name]:
        data = json.loads((tmp_path / f"{export}.json").read_text())
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


def check_steps(steps: dict, notebook: int) -> None:
    """The step-through: stepthrough.check replays every phase against one process stepping the whole batch
    (each reduced bucket = the mean of the ranks' own gradients = the whole batch's gradient, on the owning
    rank only; the step changes the owned partition only; the last phase holds the one-process result);
    and the stage's collectives are there, on at least 2 ranks, with the padding N forces. Notebook 08:
    shard groups of S < N ranks, so owners are one rank per group and each bucket's partition is all-reduced
    across the groups after the reduce-scatter within them (stepthrough.check, group-aware)."""
    cfg = steps["config"]
    assert cfg["stage"] == {0: 0, 1: 1, 2: 2, 3: 3, 5: cfg["stage"], 7: cfg["stage"], 8: cfg["stage"]}[notebook], \
        cfg
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
    assert kinds.count(STEP_COLLECTIVES[cfg["stage"]][0]) >= 2 or cfg["stage"] == 1, kinds    # per bucket / unit
    for k, phase in enumerate(steps["phases"]):      # recorded after it ran: the groups' means became all N's
        assert phase["kind"] != "all_reduce_across" or phase["ranks"] != steps["phases"][k - 1]["ranks"], k
    if notebook == 5:
        assert cfg["offload"] and any("(host)" in name for name in steps["phases"][-1]["ranks"][0])
    if notebook == 7:
        assert cfg["checkpointing"] and max(max(p["activations"]) for p in steps["phases"]) > 0


def check_ring(ring: dict) -> None:
    """Every exchange of comm.ring_all_reduce moved one chunk to the right neighbour, added (first N-1) or
    copied (last N-1) there, and every rank ends with the sum."""
    stepthrough.check_ring(ring)
    n = ring["world_size"]
    assert n >= 3 and ring["numel"] % n, "a ring of 3+ ranks over a size N does not divide shows more"


def check_loss_scale(run: dict) -> None:
    """Every rank skipped exactly the injected steps (the inf was in one rank's partition only) and its
    scale moved as minizero.loss_scale.LossScaler's rule says, replayed here on the injected pattern:
    hysteresis first, then halving, doubling after the window."""
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
        assert owned == [k for k, r in faults.items() if r == res["rank"]], f"rank {res['rank']}: {owned}"
        assert res["skipped_steps"] == len(faults)


def check_network(out: dict) -> None:
    """Under the network model: each run's bytes per step are the ring formula (memory.comm_volume,
    recomputed here); with a model (one rank per node) they all cross nodes, without one (one machine) none
    do; and the recorded step lasted at least as long as the modelled link was busy."""
    for run in out["runs"]:
        n, stage, sent = run["world_size"], run["stage"], run["comm"]
        formula = comm_volume(run["num_params"], n, stage, bytes_per_elem=4)
        assert within_padding(sent["total"], formula, n, times=3), f"{run['label']}: {sent['total']} vs {formula}"
        assert sent["inter_node" if run["network"] else "intra_node"] == sent["total"], run["label"]
        busy = sum(end - start for start, end, _ in run["timeline"]["transfers"])
        assert (busy > 0) == (run["network"] is not None) and run["timeline"]["end"] >= busy, run["label"]


def check_training_runs(records: list[dict]) -> None:
    assert len({r["world_size"] for r in records}) >= 2, "a plot over N needs at least two world sizes"
    for rec in records:
        n, psi, stage, offload = rec["world_size"], rec["num_params"], rec["stage"], rec["offload"]
        where = f"stage {stage}, N={n}, offload={offload}"
        elem = element_bytes(rec["dtype"])
        k = optimizer_k(state_bytes(rec["optimizer"]), rec["dtype"], offload)
        formula = estimate_breakdown(psi, n, stage, param_bytes=elem, grad_bytes=elem, k=k, offload=offload)
        device = estimate(psi, n, stage, param_bytes=elem, grad_bytes=elem, k=k, offload=offload)
        # the formula the plot draws is the paper's
        assert rec["theory"]["device_total"] == pytest.approx(device), where
        for cat in CATEGORIES:
            assert rec["theory"][cat] == pytest.approx(formula[cat]), f"{where}, {cat}: plotted formula"
            for r in rec["ranks"]:
                got = r["memory"][cat]
                assert within_padding(got, formula[cat], n), (
                    f"{where}, rank {r['rank']}, {cat}: measured {got} bytes, formula {formula[cat]:.0f}")
        sent_formula = comm_volume(psi, n, stage, bytes_per_elem=elem)
        for r in rec["ranks"]:
            sent = r["comm_bytes_per_step"]["total"]
            assert within_padding(sent, sent_formula, n, times=3), f"{where}: {sent} bytes per step"
        atol = tolerance(rec["dtype"])
        assert rec["max_abs_diff"] <= atol, f"{where}: {rec['max_abs_diff']} from the reference"
        assert rec["losses"] == pytest.approx(rec["reference_losses"], rel=atol), where


def check_activations(rows: list[dict], runs: list[dict], timelines: list[dict]) -> None:
    """Measured activations within 10 % of memory.activation_bytes (recomputed here), checkpointing halves
    them in every run, and each timeline's activations rise through forward and end at zero."""
    for r in rows:
        estimate = activation_bytes(r["layers"], r["hidden"], r["heads"], r["seq"], r["batch"],
                                    bytes_per_elem=r["bytes_per_elem"], mlp_ratio=r["mlp_ratio"],
                                    checkpointing=r["checkpointing"])
        assert abs(r["measured"] - estimate) <= 0.1 * estimate, r
    by_setting = {}
    for rec in runs:
        by_setting.setdefault((rec["stage"], rec["world_size"]), []).append(rec["ranks"][0]["memory"]["activations"])
    for (stage, n), (kept, checkpointed) in by_setting.items():
        assert checkpointed <= 0.6 * kept, f"stage {stage}, N={n}: {checkpointed} of {kept} bytes checkpointed"
    for t in timelines:
        forward = [b["activations"] for _, event, b in t["events"] if event.startswith("forward")]
        assert forward == sorted(forward) and t["events"][-1][2]["activations"] == 0, t["events"]


def check_collectives(results: list[dict]) -> None:
    factors = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1, "ring_all_reduce": 2}
    for res in results:
        n, size = res["world_size"], res["full_bytes"]
        for kind, factor in factors.items():
            formula = factor * (n - 1) / n * size
            assert formula - 1e-6 <= res["sent"][kind] <= formula + 8 * n, f"N={n} {kind}: {res['sent'][kind]}"
        assert res["ring_max_abs_diff"] < 1e-4
        shown = res["shown_all"]
        inputs = [s["input"] for s in shown]
        sums = [sum(col) for col in zip(*inputs)]
        for r, s in enumerate(shown):
            assert s["all_reduce"] == pytest.approx(sums)
            assert s["reduce_scatter"] == pytest.approx([sums[r]])
            assert s["all_gather"] == pytest.approx([x[0] for x in inputs])
            assert s["broadcast"] == pytest.approx(inputs[0])


def check_timeline(data: dict) -> None:
    names = data["unit_names"]
    for prefetch, intervals in data["intervals"].items():
        for b, name in enumerate(names):
            mine = [iv for iv in intervals if iv["unit"] == b]
            assert [iv["phase"] for iv in mine] == ["forward", "backward"], f"prefetch={prefetch}, {name}"
            assert all(iv["start"] <= iv["end"] for iv in mine)
        prefetched = any(iv["how"] == "prefetch" for iv in intervals)
        assert prefetched == (prefetch == "True"), f"prefetch={prefetch}: prefetch events {prefetched}"


def check_lora(rows: list[dict]) -> None:
    """Frozen weights sharded: parameter bytes per rank = (Ψ + Ψ_f)·4/N up to padding, recomputed here; and
    building under sharded_init held less than the whole model (N > 1)."""
    for r in rows:
        n = r["world_size"]
        formula = estimate_breakdown(r["trainable"], n, 3, param_bytes=4, grad_bytes=4, k=8, frozen=r["frozen"])
        assert within_padding(r["params"], formula["params"], n), (r, formula)
        whole = 4 * (r["trainable"] + r["frozen"])
        assert r["construction_peak"]["normal"] == whole
        if n > 1:
            assert r["construction_peak"]["sharded_init"] < whole / 2 and r["params"] < whole / 2, r


def test_a_widget_menu_computes_again_and_its_slider_follows(monkeypatch, capsys):
    """plots.stepper, which every step-through and the ring use: a new menu value calls compute once (then
    cached), the slider's range follows the new result, and a setting the engine refuses shows its line."""
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

    box = plots.stepper({"n": 2}, compute, lambda result, i: plt.figure(), lambda result: result["n"],
                        {"n": [2, 3, 5]}, (2,))
    (menu,), (play, slider) = box.children[0].children, box.children[1].children
    assert slider.max == 1 and calls == []
    menu.value = 3
    assert calls == [3] and slider.max == play.max == 2
    menu.value = 2
    menu.value = 3
    assert calls == [3]                        # both settings cached
    menu.value = 5
    assert calls == [3, 5] and slider.max == 2
    assert "five is refused" in capsys.readouterr().out        # (into the Output widget in a kernel)
