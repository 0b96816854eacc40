"""One training step of `minizero.fully_shard`, rank by rank: each rank's dim-0 shards, gathered
parameters and gradients after each collective, recorded from the real front end.

    from minizero.lab import stepthrough
    steps = stepthrough.record(stepthrough.StepConfig(stage=3, layout="per-parameter"))
    stepthrough.check(steps)      # every phase against one process stepping the whole batch

The sibling of stepthrough.py's recorder (the flat layout of minizero.wrap's stage 3), with the same
tiny model, data and SGD, and a result of the same shape, so notebooks/plots.py draws both alike
(step_table, step_grid, step_widget with a `layout` menu). Notebook 12 draws the two side by side.

The coordinates: [Note: dim-0 shards] in minizero/pytorch/fsdp_param.py cuts each parameter on its
own into N shards of chunk = ceil(d0/N) rows, the last ones padded. So each parameter is drawn as
its own padded segment of N·chunk·row elements ("buckets" below: one per parameter, in the units'
forward order), rank r's shard its r-th piece; element j of a rank's row is element j of that
padded layout, None where the rank does not hold it. Padding is per parameter here, per unit in
the flat layout: the grid shows where each design pads.

What is observed, with nothing in fully_shard replaced: minizero's event stream (events.py)
inside comm.synchronous(), as in stepthrough.py: "collective" / "collective done" (the
all-gather's buffer, the reduce-scatter's input), "unit gather" (a prefetch), "unit gathered" (the
whole parameters copied out of the all-gather's buffer), "unit freed", "bucket arrived" (a
reduce-scatter finished: its rows added to the shards' .grad, fsdp_reduce.py); and torch's step
post-hook on the user's optimizer. Each phase names the line of minizero that produced it (the
collective's call, from the event's call stack: source.stack). And every line of minizero that
executed during the step is recorded ("ran", for stepthrough.ran and source.show to mark) by a
line tracer (sys.settrace, Python's hook for debuggers and coverage tools: it watches, it changes
nothing): the copies into and out of the collectives' buffers emit no event, yet a learner should
see that they ran, and which branches did not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pathlib
import sys

import torch
from torch import nn

from minizero import comm, events
from minizero.lab import source
from minizero.lab.stepthrough import _optimizer, global_batch, tiny_model   # the same step
from minizero.launcher import launch
from minizero.pytorch import FSDPModule, fully_shard
from minizero.pytorch.fsdp_param import ShardedParam, shard_rows
from minizero.pytorch.fsdp_root import Root
from minizero.pytorch.fsdp_unit import Unit
from minizero.zero3 import ShardState

ROWS = ("parameters", "parameter shard", "gradients in flight", "gradient shard", "momentum")


def units_of(model: nn.Module) -> list:
    """fully_shard's units under `model` in module order: the numbers the root gives them at its
    first forward (fsdp_root.py: unit 0 the root), known before it."""
    found = {}
    for m in model.modules():
        if isinstance(m, FSDPModule):
            found.setdefault(id(m._fsdp_unit), m._fsdp_unit)
    return list(found.values())


def layout(model: nn.Module, n: int) -> tuple[list[dict], list[tuple[str, int, int]], int]:
    """(buckets, segments, padded): each parameter's padded segment in the drawing's coordinates,
    in the units' forward order; the same on every rank."""
    names = {id(p): name for name, p in model.named_parameters()}
    buckets, segments, start = [], [], 0
    for index, unit in enumerate(units_of(model)):
        for sp in unit.params:
            name, width = names[id(sp.sharded)], sp.chunk * sp.row
            buckets.append({"index": len(buckets), "start": start, "numel": sp.shape.numel(),
                            "padded": n * width, "shard": width, "unit": index,
                            "name": name, "shape": list(sp.shape), "chunk": sp.chunk,
                            "row": sp.row,
                            "rows": [shard_rows(sp.shape[0], n, r) for r in range(n)]})
            segments.append((name, start, sp.shape.numel()))
            start += n * width
    return buckets, segments, start


class _Recorder:
    """Inside one rank: a snapshot of every row at each event that ends a phase."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, tracer: LinesRun):
        self.model, self.optimizer, self.tracer = model, optimizer, tracer
        self.rank, self.n = comm.rank(), comm.world_size()
        self.units = units_of(model)                 # in module order: unit i is units[i]
        self.buckets, self.segments, self.padded = layout(model, self.n)
        self.params = list(zip(self.buckets, (sp for u in self.units for sp in u.params)))
        self.phases: list[dict] = []
        self.in_backward = False
        self.gathered: dict[int, torch.Tensor] = {}   # unit -> its all-gather's buffer, filled
        self.staging: dict[int, torch.Tensor] = {}    # unit -> its reduce-scatter's input
        self.issued: dict[int, tuple] = {}            # seq -> (kind, unit, the collective's buffer)
        self.stacks: dict[tuple, list[dict]] = {}     # (kind, unit) -> the collective's call stack
        self.prefetched: set[int] = set()

    # --- what a rank holds now, in the drawing's coordinates ----------------------------------
    def of(self, unit: int) -> list[tuple[dict, ShardedParam]]:
        return [(b, sp) for b, sp in self.params if b["unit"] == unit]

    def state(self) -> dict[str, list]:
        out = {name: torch.full((self.padded,), math.nan) for name in ROWS}

        def put(row, start, values):
            out[row][start:start + values.numel()] = values.detach().float().reshape(-1)

        def by_rank(row, unit, buffer):       # a collective's buffer [N, Σ chunk·row], by rank
            columns, offset = buffer.view(self.n, -1), 0
            for b, _ in self.of(unit):
                for q in range(self.n):
                    put(row, b["start"] + q * b["shard"], columns[q, offset:offset + b["shard"]])
                offset += b["shard"]

        for i, unit in enumerate(self.units):
            if unit.state == ShardState.GATHERED:
                for b, sp in self.of(i):
                    put("parameters", b["start"], sp.full)         # [N·chunk·row], padding too
            elif i in self.gathered:                               # a prefetch, not copied out
                by_rank("parameters", i, self.gathered[i])
            if i in self.staging:
                by_rank("gradients in flight", i, self.staging[i])
        for b, sp in self.params:
            mine = b["start"] + self.rank * b["shard"]
            put("parameter shard", mine, sp.padded)                 # [chunk, *rest], padded
            if sp.sharded.grad is not None:                         # [rows, *rest]: unpadded
                put("gradient shard", mine, sp.sharded.grad.to_local())
            momentum = self.optimizer.state.get(sp.sharded, {}).get("momentum_buffer")
            if momentum is not None:                                # [rows, *rest]: unpadded
                put("momentum", mine, momentum.to_local())
        return {name: [None if math.isnan(v) else v for v in vec.tolist()]
                for name, vec in out.items()}

    def snap(self, label: str, kind: str, unit: int | None = None,
             where: list[dict] = ()) -> None:
        self.phases.append({"label": label, "kind": kind, "bucket": unit,
                            "buffers": self.state(), "activations": None,
                            "source": where[0] if where else None, "stack": list(where)})

    # --- the events ----------------------------------------------------------------------------
    def on_event(self, name: str, fields: dict) -> None:
        with self.tracer.paused():                   # the recorder's own reads did not "run"
            if name in ("collective", "collective done"):
                self._collective(name, fields)
            elif fields.get("engine") is self.model:
                i = self.units.index(fields.get("unit", fields.get("bucket")))
                self._unit_event(name, i, fields.get("prefetch", False))

    def _unit_event(self, name: str, i: int, prefetch: bool) -> None:
        tag, when = self.units[i].tag, "its backward" if self.in_backward else "its forward"
        if name == "unit gather" and prefetch:          # issued, and (synchronous) complete
            self.prefetched.add(i)
            self.snap(f"all-gather {tag} for {when}, started early (a prefetch, as the unit that "
                      f"ran after it in forward begins its backward); its parameters wait in the "
                      f"all-gather's buffer [N, Σ chunk·row] until its own backward copies each "
                      f"one out", "all_gather", i, self.stacks["all_gather", i])
        elif name == "unit gathered":
            if i not in self.prefetched:             # (after a prefetch: the same values, moved)
                self.snap(f"all-gather {tag} for {when}: every rank's padded shards side by side "
                          f"in one buffer [N, Σ chunk·row], each parameter's column copied out: "
                          f"its whole parameters on every rank", "all_gather", i,
                          self.stacks["all_gather", i])
            self.prefetched.discard(i)
            self.gathered.pop(i, None)
        elif name == "unit freed":
            self.snap(f"free {tag} after {when}: the module holds its shards again (the whole "
                      f"parameters 0 bytes)", "free", i, source.stack())
        elif name == "bucket arrived":
            self.snap(f"{tag}'s reduce-scatter finished (when the next one starts, or backward "
                      f"ends: one in flight): rank r's rows of the average added to its shards' "
                      f".grad, unpadded", "arrived", i, source.stack())

    def _collective(self, name: str, fields: dict) -> None:
        if name == "collective":
            tags = [u.tag for u in self.units]
            if fields["tag"] not in tags or fields["kind"] not in ("all_gather", "reduce_scatter"):
                return
            i, kind = tags.index(fields["tag"]), fields["kind"]
            self.issued[fields["seq"]] = (kind, i, fields["tensor"])
            self.stacks[kind, i] = source.stack()
            if kind == "reduce_scatter":
                self.staging[i] = fields["tensor"]
                self.snap(f"{fields['tag']}: its gradients complete, each rank's from its own "
                          f"rows, laid out by rank (padded to N·chunk rows) in the "
                          f"reduce-scatter's buffer [N, Σ chunk·row]", "ready", i,
                          self.stacks[kind, i])
        elif fields["seq"] in self.issued:
            kind, i, buffer = self.issued.pop(fields["seq"])
            if kind == "all_gather":
                self.gathered[i] = buffer
            else:
                del self.staging[i]
                self.snap(f"reduce-scatter {fields['tag']}: rank r receives the average over the "
                          f"ranks of row r of the buffer, its rows of every gradient of the unit "
                          f"(the buffer was workspace)", "reduce_scatter", i,
                          self.stacks[kind, i])

    def optimizer_stepped(self, optimizer, args, kwargs) -> None:
        """torch's step post-hook on the user's optimizer (no line of minizero steps it)."""
        with self.tracer.paused():
            self.snap("optimizer step (the user's torch.optim.SGD over the DTensors): each rank "
                      "updates its own rows of every parameter, and keeps momentum for those rows "
                      "only", "step")


class LinesRun:
    """Every line of minizero (outside lab/ and the event plumbing) that executes in this thread
    while it is on (`with tracer:`), except while paused (the recorder's own reads):
    (file, line, function) in `lines`. sys.settrace only watches."""

    def __init__(self):
        self.lines: set[tuple[str, int, str]] = set()
        self._paused = 0

    def _local(self, frame, event, arg):
        if event == "line" and not self._paused:
            self.lines.add((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_qualname))
        return self._local

    def _on_call(self, frame, event, arg):
        path = pathlib.Path(frame.f_code.co_filename)
        if (not self._paused and path.is_relative_to(source.PACKAGE)
                and not path.is_relative_to(source.PACKAGE / "lab")
                and path.name not in source.PLUMBING):
            return self._local
        return None

    def __enter__(self):
        self._previous = sys.gettrace()
        sys.settrace(self._on_call)
        return self

    def __exit__(self, *exc):
        sys.settrace(self._previous)

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1


def worker(cfg) -> dict:
    """Worker: fully_shard the tiny model (each Linear a unit, then the root), train one step on
    this rank's rows with SGD, recording every phase."""
    r, n = comm.rank(), comm.world_size()
    model = tiny_model(cfg.seed)
    for linear in (model.l1, model.l2):
        fully_shard(linear)
    fully_shard(model)
    optimizer = _optimizer(cfg)(model.parameters())
    x, y = (t[r * cfg.rows // n: (r + 1) * cfg.rows // n] for t in global_batch(cfg))
    tracer = LinesRun()
    rec = _Recorder(model, optimizer, tracer)
    hook = optimizer.register_step_post_hook(rec.optimizer_stepped)
    with comm.synchronous(), events.subscribed(rec.on_event), tracer:
        rec.snap("start: each rank holds its shard of every parameter, ceil(d0/N) rows each, the "
                 "last rows zeros where N does not divide d0", "start",
                 where=[source.of(ShardedParam.__init__)])
        loss = nn.functional.mse_loss(model(x), y)
        rec.snap("end of forward: each rank has its loss on its own rows; every unit was gathered "
                 "for it and freed again (the phases above)", "forward",
                 where=[source.of(Unit.end_forward)])
        rec.in_backward = True
        loss.backward()
        rec.in_backward = False
        rec.snap("end of backward: every reduce-scatter finished", "backward",
                 where=[source.of(Root.finish_backward)])
        optimizer.step()
    hook.remove()
    final = rec.phases[-1]["buffers"]["parameter shard"]
    for b, sp in rec.params:           # the last phase against the shards themselves, whole
        whole = sp.sharded.full_tensor().reshape(-1).tolist()      # DTensor's own all-gather
        mine = b["start"] + r * b["shard"]
        for i, got in enumerate(final[mine: mine + b["rows"][r] * b["row"]]):
            assert got == whole[r * b["shard"] + i], f"rank {r}, {b['name']}: recorded {got}"
    ran = sorted((source.relative(file), line, function) for file, line, function in tracer.lines)
    return {"phases": rec.phases, "segments": rec.segments, "buckets": rec.buckets,
            "padded": rec.padded, "loss": loss.item(),
            "ran": [{"file": f, "line": line, "function": fn, "events": ["executed"]}
                    for f, line, fn in ran]}


def record(cfg, backend: str = "gloo") -> dict:
    """One launch; stepthrough.record's result for the per-parameter layout ("buckets": one per
    parameter, with its unit, shape, chunk, row and each rank's rows)."""
    per_rank = launch(worker, cfg.world_size, cfg, backend=backend)
    first, phases = per_rank[0], []
    for k, p in enumerate(first["phases"]):
        ranks = [res["phases"][k]["buffers"] for res in per_rank]
        if p["kind"] == "backward" and ranks == phases[-1]["ranks"]:
            continue                   # the last reduce-scatter's arrival ended backward
        phases.append({"label": p["label"], "kind": p["kind"], "bucket": p["bucket"],
                       "source": p["source"], "stack": p["stack"], "ranks": ranks,
                       "activations": [res["phases"][k]["activations"] for res in per_rank]})
    return {"config": dataclasses.asdict(cfg), "buckets": first["buckets"],
            "segments": first["segments"], "padded": first["padded"], "partitioned": True,
            "phases": phases, "losses": [res["loss"] for res in per_rank], "ran": first["ran"]}


# --------------------------------------------------------------------------------------------------
# The check: every phase against one process stepping the whole batch
# --------------------------------------------------------------------------------------------------

def check(steps: dict) -> None:
    """Raise AssertionError naming the phase, the rank and the element where a recording is wrong:
    each rank's shards are rows r·chunk.. of every parameter (zeros past d0); each all-gather
    leaves the unit's parameters whole on every rank; a free leaves none; the gradients a
    reduce-scatter averages are the whole batch's; each finished reduce-scatter gives rank r its
    rows of that gradient, the step its rows of one process's SGD (parameters and momentum), and
    nothing else on that rank; each unit gathered and freed for forward and for backward, reduced
    once."""
    from minizero.lab.stepthrough import StepConfig, _close, reference
    cfg = StepConfig(**steps["config"])
    n, buckets, phases = cfg.world_size, steps["buckets"], steps["phases"]
    ref = reference(cfg, steps["segments"], steps["padded"])

    def held(b, r):                      # rank r's elements of parameter b: real, then padding
        mine = b["start"] + r * b["shard"]
        real = range(mine, mine + b["rows"][r] * b["row"])
        return real, range(real.stop, mine + b["shard"])

    def expect(where, got, want):
        assert _close(got, want), f"{where}: {got}, expected {want}"

    stepped = False
    for k, phase in enumerate(phases):
        label = f"phase {k} ({phase['label'][:60]}...)"
        stepped = stepped or phase["kind"] == "step"
        for r, rank in enumerate(phase["ranks"]):
            for b in buckets:
                real, pad = held(b, r)
                for j in range(b["start"], b["start"] + b["padded"]):
                    where = f"{label}: rank {r}, {b['name']} element {j - b['start']}"
                    if j in real:
                        expect(f"{where}, its shard", rank["parameter shard"][j],
                               ref["stepped" if stepped else "start"][j])
                    elif j in pad:
                        assert rank["parameter shard"][j] == 0, f"{where}: padding not zero"
                    else:
                        for row in ("parameter shard", "gradient shard", "momentum"):
                            assert rank[row][j] is None, f"{where}: another rank's, in {row}"
                    if rank["gradient shard"][j] is not None:
                        assert j in real, f"{where}: a gradient for padding"
                        expect(f"{where}, gradient", rank["gradient shard"][j], ref["grad"][j])
                    if rank["momentum"][j] is not None:
                        assert stepped and j in real, f"{where}: momentum before the step"
                        expect(f"{where}, momentum", rank["momentum"][j], ref["momentum"][j])
                    if stepped and j in real:
                        assert rank["momentum"][j] is not None, f"{where}: no momentum"
        unit = [b for b in buckets if b["unit"] == phase["bucket"]]
        if phase["kind"] == "all_gather":
            for r, rank in enumerate(phase["ranks"]):
                for b in unit:
                    for j in range(b["start"], b["start"] + b["numel"]):
                        expect(f"{label}: rank {r}, {b['name']} element {j - b['start']}",
                               rank["parameters"][j], ref["start"][j])
        if phase["kind"] == "free":
            for r, rank in enumerate(phase["ranks"]):
                assert all(rank["parameters"][j] is None for b in unit
                           for j in range(b["start"], b["start"] + b["padded"])), (
                    f"{label}: rank {r} still holds the unit's parameters")
        if phase["kind"] == "ready":
            for b in unit:
                for j in range(b["start"], b["start"] + b["numel"]):
                    local = [rank["gradients in flight"][j] for rank in phase["ranks"]]
                    assert None not in local, f"{label}: rank {local.index(None)} lacks {j}"
                    expect(f"{label}: {b['name']} element {j - b['start']}, the ranks' mean",
                           sum(local) / n, ref["grad"][j])
        if phase["kind"] == "arrived":
            for r, rank in enumerate(phase["ranks"]):
                for b in unit:
                    real, _ = held(b, r)
                    assert all(rank["gradient shard"][j] is not None for j in real), (
                        f"{label}: rank {r} lacks its rows of {b['name']}'s gradient")
    units = sorted({b["unit"] for b in buckets})
    for u in units:
        kinds = [p["kind"] for p in phases if p["bucket"] == u]
        gathers = [x for x in kinds if x in ("all_gather", "free")]
        assert gathers == ["all_gather", "free"] * 2, f"unit {u}: {gathers}"
        for kind in ("ready", "reduce_scatter", "arrived"):
            assert kinds.count(kind) == 1, f"unit {u}: {kinds.count(kind)} '{kind}' phases"
    assert [p["kind"] for p in phases].count("step") == 1
