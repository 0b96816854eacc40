"""Where a step's memory peak goes: torch.profiler's categories at the peak, next to what minizero
counts.

    python scripts/peak_breakdown.py                # stages 0-3, fp32, the default GPT, N = 1
    python scripts/peak_breakdown.py --stages 0 2 --dtype bf16 --batch-size 8

engine.memory() counts the model states (P_os, P_g, P_p), and the activation meter counts what
forward saved for backward. Their sum is not the allocator's peak, which the first GPU run showed
(docs/gpus.md: 105-269 kB above at stages 0-2). The peak falls inside backward:
  * some of the saved activations are already freed;
  * autograd holds the gradients flowing from one operation to the next (its "autograd detail"),
    which no ZeRO stage shards: they are activation-sized, ZeRO-R's territory;
  * the batch is alive too.
torch.profiler's memory timeline (profile_memory=True) tags every allocation with a category, so
the split is visible on any device. This script profiles the second step (the first creates the
optimizer state) at N = 1 and prints the categories at the peak.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))   # this checkout's minizero

# export_memory_timeline's columns: an unused first one, then torch's categories in this order
# (torch.profiler._memory_profiler._CATEGORY_TO_INDEX; tests/test_activations.py checks it), with
# this table's short labels
COLUMNS = {"parameter": "param", "optimizer state": "optim", "input": "input",
           "temporary": "temp", "activation": "activ.", "gradient": "grad",
           "autograd detail": "autograd", "unknown": "unknown"}


def breakdown(stage: int, dtype: str, batch_size: int) -> dict:
    """Worker (N = 1): {"profiler": {category: bytes at the step's peak}, "peak": their sum,
    "model_states": engine.memory()'s peak, "activations": the meter's} for the second step."""
    import minizero
    from minizero import comm
    from minizero.lab.model import make_model
    from minizero.lab.train import TrainConfig, forward_backward
    cfg = TrainConfig(stage=stage, dtype=dtype, world_size=1, steps=2, batch_size=batch_size,
                      optimizer="adamw")
    engine = minizero.wrap(make_model(cfg.model_config(), seed=cfg.seed), stage,
                           cfg.optimizer_factory(), **cfg.engine_options())
    forward_backward(cfg, 0, engine, engine.backward, engine.no_sync)
    engine.step()                                        # the optimizer state exists from here
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda"
                                           else [])
    with profile(activities=activities, profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        forward_backward(cfg, 1, engine, engine.backward, engine.no_sync)
        engine.step()
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "timeline.json"
        prof.export_memory_timeline(str(path), device=str(comm.device()))
        _, sizes = json.loads(path.read_text())          # [times], [[bytes per column]]
    at_peak = max(sizes, key=sum)
    memory = engine.memory()
    return {"profiler": dict(zip(COLUMNS, at_peak[1:])), "peak": sum(at_peak),
            "model_states": memory["peak"], "activations": memory["activations"]}


def format_table(rows: dict[int, dict]) -> str:
    kb = lambda x: f"{x / 1e3:9.1f}"      # noqa: E731
    lines = ["kB at the step's peak, by torch.profiler's category; minizero's counts beside",
             f"{'stage':>5} {'peak':>9} " + " ".join(f"{label:>9}" for label in COLUMNS.values())
             + f" {'mz states':>9} {'mz activ.':>9} {'neither':>9}"]
    for stage, r in rows.items():
        neither = r["peak"] - r["model_states"] - r["activations"]
        columns = " ".join(kb(r["profiler"][category]) for category in COLUMNS)
        lines.append(f"{stage:>5} {kb(r['peak'])} {columns} {kb(r['model_states'])} "
                     f"{kb(r['activations'])} {kb(neither)}")
    lines.append("mz states: engine.memory()'s peak of params + grads + optimizer; mz activ.: the "
                 "activation meter; neither: peak - both")
    return "\n".join(lines)


def main() -> None:
    import minizero
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=range(4))
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--batch-size", type=int, default=8, help="rows per step (default 8)")
    args = ap.parse_args()
    rows = {stage: minizero.launch(breakdown, 1, stage, args.dtype, args.batch_size)[0]
            for stage in args.stages}
    print(format_table(rows))


if __name__ == "__main__":
    main()
