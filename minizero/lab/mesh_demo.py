"""The experiments of notebooks/10_tensor_parallel.ipynb: tensor parallelism alone, then ZeRO on a
2-D mesh of N_m x N_d ranks, measured next to the formulas with M.

    from minizero.lab import mesh_demo
    pair = mesh_demo.column_then_row()          # 2 ranks: Megatron's MLP pair vs one process
    runs = mesh_demo.measure_meshes({"2 x 2": TrainConfig(stage=3, world_size=4,
                                                          tensor_parallel=2)})
    steps = mesh_demo.record_block()            # one step of a two-block GPT on 2 x 2, rank by rank
    mesh_demo.check_block(steps)

Every collective a rank issues is recorded from the event stream (minizero/events.py: "collective"
before it runs, "collective done" after), with the line of minizero that issued it
(source.origin): beyond/tensor_parallel.py's f and g, zero3.py's gathers, zero2.py's
reduce-scatters. The recorder changes nothing; comm.synchronous() only makes each collective
complete before the next one is issued, so that each one's result can be read.
"""

from __future__ import annotations

import copy
import dataclasses
import types

import torch
import torch.nn.functional as F
from torch import nn

from minizero import comm, events
from minizero.beyond import mesh, tensor_parallel
from minizero.lab import source
from minizero.lab.model import make_model
from minizero.lab.reference import max_abs_diff, reference_train, tolerance
from minizero.lab.report import summarize
from minizero.lab.train import TrainConfig, forward_backward, train_several
from minizero.launcher import launch
from minizero.wrap import wrap

SHOWN = 4                 # values of each tensor a phase shows per rank (the first ones)


# --------------------------------------------------------------------------------------------------
# Recording the collectives, with the line that issued each
# --------------------------------------------------------------------------------------------------

class Recorder:
    """Every collective this rank issues while `with recorder:` runs: kind, tag, group (its
    ranks), shape, the first values of its buffer before and after, and the issuing line."""

    def __init__(self):
        self.phases: list[dict] = []
        self._open: dict[int, tuple[dict, torch.Tensor]] = {}

    def __call__(self, name: str, fields: dict) -> None:
        if name == "collective":
            group = fields["group"]
            tensor = fields["tensor"]
            phase = {"kind": fields["kind"], "tag": fields["tag"], "numel": fields["numel"],
                     "group": list(group.ranks) if group is not None else list(
                         range(comm.world_size())),
                     "before": _first(tensor), "source": source.origin()}
            self._open[fields["seq"]] = (phase, tensor)
            self.phases.append(phase)
        elif name == "collective done" and fields["seq"] in self._open:
            phase, tensor = self._open.pop(fields["seq"])
            phase["after"] = _first(tensor)

    def __enter__(self):
        self._stop = events.subscribe(self)
        self._sync = comm.synchronous()
        self._sync.__enter__()
        return self

    def __exit__(self, *exc):
        self._sync.__exit__(*exc)
        self._stop()


def _first(tensor: torch.Tensor) -> list[float]:
    return tensor.detach().flatten()[:SHOWN].float().tolist()


# --------------------------------------------------------------------------------------------------
# Tensor parallelism alone: a column-parallel then a row-parallel layer (Megatron's MLP)
# --------------------------------------------------------------------------------------------------

def _mlp_pair(hidden: int, seed: int) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(seed)
    return nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)


def column_then_row_worker(hidden: int, rows: int) -> dict:
    """This rank's half of Y = GELU(X A) B (A column-parallel, B row-parallel) next to the whole
    pair on this process: the output, the input's gradient and each weight's gradient (this rank's
    slice of the whole one), as max |difference|; and the collectives it took."""
    group, device = mesh.row_group(comm.world_size()), comm.device()
    first, second = (layer.to(device) for layer in _mlp_pair(hidden, seed=0))   # the same weights
    column = tensor_parallel.ColumnParallelLinear(copy.deepcopy(first), group)
    row = tensor_parallel.RowParallelLinear(copy.deepcopy(second), group)
    torch.manual_seed(1)
    x = torch.randn(rows, hidden).to(device)
    target = torch.randn(rows, hidden).to(device)               # dL/dY = target: a fixed direction
    whole_x, split_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    whole_y = second(F.gelu(first(whole_x)))
    (whole_y * target).sum().backward()
    with Recorder() as recorder:
        split_y = row(F.gelu(column(split_x)))                  # f inside column, g inside row
        (split_y * target).sum().backward()
    width = 4 * hidden // group.size                            # this rank's hidden units
    part = slice(group.index * width, (group.index + 1) * width)
    diffs = {
        "output": split_y - whole_y,
        "input gradient": split_x.grad - whole_x.grad,
        "column weight gradient": column.weight.grad - first.weight.grad[part],
        "row weight gradient": row.weight.grad - second.weight.grad[:, part],
    }
    return {"rank": comm.rank(), "diffs": {k: v.abs().max().item() for k, v in diffs.items()},
            "bitwise": {k: bool((v == 0).all()) for k, v in diffs.items()},
            "shapes": {"column weight": list(column.weight.shape),
                       "row weight": list(row.weight.shape)},
            "phases": recorder.phases}


def column_then_row(hidden: int = 8, rows: int = 4, world_size: int = 2) -> list[dict]:
    """column_then_row_worker on `world_size` ranks: one result per rank."""
    return launch(column_then_row_worker, world_size, hidden, rows)


# --------------------------------------------------------------------------------------------------
# ZeRO on the mesh: every stage at every (N_m, N_d), measured against one process and the formula
# --------------------------------------------------------------------------------------------------

def split_state(state: dict, cfg: TrainConfig, index: int) -> dict:
    """The whole model's `state` as rank `index` of a tensor-parallel row of cfg.tensor_parallel
    holds it (parallelize_gpt's split; splitting needs no collective)."""
    if cfg.tensor_parallel == 1:
        return state
    model = make_model(cfg.model_config(), seed=cfg.seed)
    model.load_state_dict(state)
    row = types.SimpleNamespace(size=cfg.tensor_parallel, index=index)
    return tensor_parallel.parallelize_gpt(model, row).state_dict()


def measure_meshes(variants: dict, backend: str | None = None) -> dict:
    """{name: record} for TrainConfigs of one world size (one launch): minizero.lab.report's
    summary (each rank's memory next to the formula with M, `theory`) plus `max_abs_diff`, the
    largest |parameter - the one-process run's, split as the rank holds it|."""
    cfgs = list(variants.values())
    n = cfgs[0].world_size
    if any(cfg.world_size != n for cfg in cfgs):
        raise ValueError("measure_meshes: one world size per launch")
    cfgs = [dataclasses.replace(cfg, return_state=True, backend=backend) for cfg in cfgs]
    per_rank = launch(train_several, n, cfgs, backend=backend)
    out = {}
    references: dict = {}
    for i, (name, cfg) in enumerate(zip(variants, cfgs)):
        key = dataclasses.replace(cfg, world_size=1, stage=0, tensor_parallel=1,
                                  activation_checkpointing=False, return_state=False)
        if repr(key) not in references:                # one reference per model, steps and batch
            references[repr(key)] = reference_train(key)
        ref = references[repr(key)]
        results = [rank_results[i] for rank_results in per_rank]
        record = summarize(cfg, results)
        record["max_abs_diff"] = max(
            max_abs_diff(r.pop("state_dict"), split_state(ref["state_dict"], cfg,
                                                          r["rank"] % cfg.tensor_parallel))
            for r in results)
        record["tolerance"] = tolerance(cfg.dtype)
        record["reference_losses"] = ref["losses"]
        record |= {"optimizer": cfg.optimizer, "batch_size": cfg.batch_size,
                   "activation_checkpointing": cfg.activation_checkpointing,
                   "model": dataclasses.asdict(cfg.model_config())}
        out[name] = record
    return out


# --------------------------------------------------------------------------------------------------
# One step of a two-block GPT on a 2 x 2 mesh, rank by rank
# --------------------------------------------------------------------------------------------------

# two blocks: stage 3's units are then the blocks and the root (units.default_units), each gathered
# where it is used
BLOCK_MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 8, "block_size": 6, "mlp_ratio": 2}


def block_worker(cfg: TrainConfig) -> dict:
    """One training step of the two-block GPT on this rank of the mesh, every collective
    recorded."""
    model = make_model(cfg.model_config(), seed=cfg.seed)
    engine = wrap(model, cfg.stage, cfg.optimizer_factory(), **cfg.engine_options())
    with Recorder() as recorder:
        loss = forward_backward(cfg, 0, engine, engine.backward, engine.no_sync)
        engine.step()
    return {"rank": comm.rank(), "loss": loss, "phases": recorder.phases}


def record_block(stage: int = 3, mesh: tuple[int, int] = (2, 2)) -> dict:
    """{"config", "ranks": [each rank's phases]}: one step of BLOCK_MODEL at `stage` on the
    (N_m, N_d) mesh, prefetch off (each unit's gather where it is used)."""
    m, n_d = mesh
    cfg = TrainConfig(stage=stage, world_size=m * n_d, tensor_parallel=m, steps=1,
                      batch_size=2 * n_d, model="tiny", model_overrides=BLOCK_MODEL,
                      optimizer="sgd", lr=0.1, prefetch=False)
    results = launch(block_worker, cfg.world_size, cfg)
    return {"config": {"stage": stage, "tensor_parallel": m, "data_parallel": n_d,
                       "world_size": cfg.world_size},
            "ranks": [r["phases"] for r in results], "losses": [r["loss"] for r in results]}


def check_block(steps: dict) -> None:
    """Replay every recorded collective from the ranks' own records: all ranks issue the same
    sequence; an all-reduce (sum) leaves every member of its group the sum of their inputs (g's
    partial sums, f's partial gradients); an all-gather puts each member's piece at its place;
    tensor parallelism's collectives stay in a row (consecutive ranks), ZeRO's in a column."""
    ranks, m = steps["ranks"], steps["config"]["tensor_parallel"]
    count = len(ranks[0])
    assert all(len(r) == count for r in ranks), [len(r) for r in ranks]
    for k in range(count):
        phases = [r[k] for r in ranks]
        kind, group = phases[0]["kind"], phases[0]["group"]
        assert all((p["kind"], p["tag"]) == (kind, phases[0]["tag"]) for p in phases), phases
        tp = phases[0]["tag"].startswith("tensor parallel")
        assert (group == list(range(group[0], group[0] + m))) == tp or m == 1, (k, phases[0])
        if kind == "all_reduce" and tp:
            for r, p in enumerate(phases):
                inputs = [phases[q]["before"] for q in ranks_of(r, phases)]
                sums = [sum(v) for v in zip(*inputs)]
                # the loss's first all-reduce takes the max of the logits (cross_entropy)
                maxima = [max(v) for v in zip(*inputs)] if p["tag"].endswith("loss") else sums
                assert close(p["after"], sums) or close(p["after"], maxima), (
                    f"collective {k}, rank {r}: {p['tag']} gave {p['after']}, the inputs "
                    f"{inputs}")
        if kind == "all_gather":                    # every member of the column holds the same
            for r, p in enumerate(phases):
                assert all(close(phases[q]["after"], p["after"]) for q in ranks_of(r, phases)), (
                    k, r)


def close(a: list[float], b: list[float]) -> bool:
    """Equal up to fp32 rounding (a sum of M partial sums in another order)."""
    return len(a) == len(b) and all(abs(x - y) <= 1e-6 + 1e-5 * abs(y) for x, y in zip(a, b))


def ranks_of(r: int, phases: list[dict]) -> list[int]:
    """The ranks whose phase names the same group as rank r's."""
    return [q for q, p in enumerate(phases) if p["group"] == phases[r]["group"]]
