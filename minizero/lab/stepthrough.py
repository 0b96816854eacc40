"""One training step, rank by rank: what every rank holds after each phase, recorded from a
real engine.

    from minizero.lab import stepthrough
    steps = stepthrough.record(stepthrough.StepConfig(stage=2, world_size=3))  # one minizero.launch
    steps["phases"][k]["label"], steps["phases"][k]["ranks"][r]["gradient shard"]
    stepthrough.check(steps)          # every phase against one process stepping the whole batch
    ring = stepthrough.ring(3)        # minizero.ring.ring_all_reduce, one exchange at a time

Notebooks 01-05, 07 and 08 (hierarchical sharding: StepConfig(shard_group_size=2, world_size=4))
draw `record` (notebooks/plots.py: step_table, step_grid, step_widget), notebook 00 draws `ring`;
tests/test_notebooks.py runs `check` and `check_ring` on what the notebooks export. Notebook 12
also records minizero.fully_shard: StepConfig(stage=3, layout="per-parameter") hands record and
check to stepthrough_fully_shard.py (FSDP2's dim-0 shards, drawn in the same grid).

The model is tiny on purpose: Linear(2, 3), tanh, Linear(3, 2), Ψ = 17, which none of N = 2, 3, 4
divides, so every value fits on screen and padding shows. Every buffer is drawn in the coordinates
of the engine's flat layout (flat.FlatLayout): element j of a rank's row is element j of the padded
flat buffer, and a rank that does not hold element j (another rank's partition, a freed unit) has
None there.

How the phases are observed: through minizero's event stream (minizero/events.py), for one step,
with nothing in the engine replaced:
  * "collective" and "collective done" (minizero.comm): a snapshot before a gradient collective
    during backward (each rank's own gradients) and one after it. Inside comm.synchronous() every
    collective completes as it is issued, so no snapshot reads a buffer a collective is still
    writing. Each names its group: with shard groups (shard_group_size), step()'s all-reduce across
    them is a phase of its own, "all_reduce_across";
  * wrap(..., buckets_in_flight=1): one bucket in flight (minizero lets two overlap), so the phases
    come bucket by bucket;
  * stage 3: "unit freed" (its gathers are the all-gathers above); prefetch on, so backward's
    pre_backward starts the next unit's all-gather (forward's from the second step, once the
    first has recorded the order; inside comm.synchronous() it completes as it is issued);
  * "optimizer step", and the end of forward and of backward.
None of it changes a value: `check` compares every phase with one process stepping the whole batch.

Each phase also names the line of minizero that produced it ("source": file, line, function) and
the lines that led there ("stack"), found by walking the call stack of the event being observed
(source.stack: the subscriber runs inside events.emit, so the emitting frames are on the stack):
for a collective the stage's call to it, for a free Unit.free, for the step the optimizer home's
call of torch's optimizer (seen from torch's own step hook). The recorder's own snapshots (start,
end of forward, end of backward) name the engine method that had just run. plots.step_widget shows
that function with the line marked; `ran(steps, "Unit.pre_forward", ...)` finds every line of a
function that led to an event, for a notebook to show with source.show: only lines that ran are
marked, wherever they move.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import linecache
import math
from collections import OrderedDict

import torch
from torch import nn

from minizero import comm, events
from minizero.lab import source
from minizero.ring import ring_all_reduce
from minizero.launcher import launch
from minizero.wrap import check as check_settings
from minizero.wrap import wrap

GRADIENTS = ("gradients", "gradients in flight")    # the local, full gradients a collective reduces
KINDS = ("all_reduce", "reduce_scatter", "all_gather")   # the collectives whose phases are shown


@dataclasses.dataclass(frozen=True)
class StepConfig:
    stage: int = 2
    world_size: int = 3
    offload: bool = False             # stages 1-3: the optimizer (masters, momentum) in host memory
    checkpointing: bool = False       # activation checkpointing of the units (notebook 07)
    # stages 1-3: HSDP / MiCS, partitioned within rows of S ranks (nb 08)
    shard_group_size: int | None = None
    # stage 3: ZeRO++'s hpZ, backward's all-gather within rows of R ranks
    hpz_group_size: int | None = None
    lr: float = 0.1                 # SGD with momentum: step 1 is p - lr * g, easy to follow by eye
    momentum: float = 0.9
    bucket_elems: int = 8              # stages 0 and 2: two buckets (8 and 9 elements)
    rows: int = 12                     # global batch: 12 rows, 12 / N per rank
    seed: int = 0
    # stage 3: "flat" (minizero.wrap: FairScale's, DeepSpeed's, FSDP1's layout) or "per-parameter"
    # (minizero.fully_shard: FSDP2's dim-0 shards, recorded by stepthrough_fully_shard.py)
    layout: str = "flat"


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(OrderedDict(l1=nn.Linear(2, 3), act=nn.Tanh(), l2=nn.Linear(3, 2)))


def global_batch(cfg: StepConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return torch.randn(cfg.rows, 2, generator=g), torch.randn(cfg.rows, 2, generator=g)


def _optimizer(cfg: StepConfig):
    return functools.partial(torch.optim.SGD, lr=cfg.lr, momentum=cfg.momentum)


# --------------------------------------------------------------------------------------------------
# The recorder, inside each rank
# --------------------------------------------------------------------------------------------------

class _Recorder:
    def __init__(self, engine):
        self.engine, self.phases, self.in_backward = engine, [], False
        # every minizero line on the stack of an event seen: (file, line, function) -> event names
        self.ran: dict[tuple[str, int, str], set[str]] = {}
        self.step_stack: list[dict] = []       # where the optimizer stepped (its torch hook)
        self.issued: dict[int, tuple] = {}       # collective seq -> (kind, group, bucket) till done
        # flat ranges a reduce-scatter left undefined: None
        self.workspace: list[tuple[int, int]] = []
        names = {id(p): name for name, p in engine.module.named_parameters()}
        self.segments = [(names[id(p)], b.start + off, p.numel())
                         for b in engine.layout.buckets for p, off in zip(b.params, b.offsets)]

    def _bucket_of(self, t: torch.Tensor):
        e, ptr = self.engine, t.data_ptr()
        for b in e.layout.buckets:
            flats = [getattr(family, "flat", None) for family in (e.params, e.grads)]
            if any(f is not None and f[b.start:].data_ptr() == ptr for f in flats):
                return b
            staged = getattr(e.grads, "staging", {}).get(b.index)
            if staged is not None and staged.data_ptr() == ptr:
                return b
            if e.replicate_group is not None:    # step()'s all-reduce across the shard groups: this
                # rank's partition of the gradients
                part = (e.layout.shard(e.grads.shard, b) if e.stage >= 2 else
                        e.layout.my_partition(e.layout.full(e.grads.flat, b), b))
                if part.data_ptr() == ptr:
                    return b
        for unit in getattr(e, "units", []):
            if unit.bucket is not None and unit.full.numel() and unit.full.data_ptr() == ptr:
                return unit.bucket
        raise AssertionError("a collective on a buffer the recorder does not know")

    def owned(self, b) -> int:
        """Where this rank's part of bucket b starts, in flat coordinates (its rank within its
        shard group)."""
        e = self.engine
        return b.start + (e.layout.rank * b.shard_numel if e.sharded else 0)

    def _name(self, b) -> str:
        """Stage 3: the unit whose bucket b is, as its tag names it (units in forward order)."""
        units = {u.bucket.index: u for u in getattr(self.engine, "units", []) if u.bucket}
        return units[b.index].tag if b.index in units else f"bucket {b.index}"

    def snap(self, label: str, kind: str, bucket=None, where: list[dict] = ()) -> None:
        """Record every buffer now, as the end of a phase; `where`: the lines of minizero that
        produced it, innermost first (source.stack, or [source.of(...)])."""
        self.phases.append(
            {
                "label": label,
                "kind": kind,
                "bucket": None if bucket is None else bucket.index,
                "buffers": self.state(),
                "activations": self.engine.activations.alive,
                "source": where[0] if where else None,
                "stack": list(where),
            }
        )

    def state(self) -> dict[str, list]:
        """Every buffer this rank holds now, in flat coordinates (None: not held here)."""
        e, layout = self.engine, self.engine.layout
        out = {}

        def empty():
            return torch.full((layout.padded_numel,), math.nan)

        def put(vec, start, values):
            vec[start: start + values.numel()] = values.detach().float().cpu().reshape(-1)
            return vec

        if e.stage < 3:
            out["parameters"] = put(empty(), 0, e.params.flat)
        else:
            full, shard = empty(), empty()
            for unit in e.units:
                if unit.bucket is not None:
                    if unit.full.untyped_storage().size():  # allocated: gathered, or being gathered
                        put(full, unit.bucket.start, unit.full)
                    put(shard, self.owned(unit.bucket), unit.shard)
            out["parameters"], out["parameter shard"] = full, shard
            if e.hpz_group is not None:               # [Note: hpZ] (beyond/hpz.py): fwd to bwd
                secondary, i, r = (
                    empty(),
                    comm.group_rank(e.hpz_group),
                    comm.group_size(e.hpz_group),
                )
                for unit in e.units:
                    if unit.bucket is not None and unit.secondary is not None:
                        put(
                            secondary,
                            unit.bucket.start + i * (unit.full.numel() // r),
                            unit.secondary[0],
                        )
                out["secondary partition (hpZ)"] = secondary
        if e.stage < 2:
            out["gradients"] = put(empty(), 0, e.grads.flat)
        else:
            in_flight, shard = empty(), empty()
            for index, staged in e.grads.staging.items():
                put(in_flight, layout.buckets[index].start, staged)
            for b in layout.buckets:
                put(shard, self.owned(b), layout.shard(e.grads.shard, b))
            out["gradients in flight"], out["gradient shard"] = in_flight, shard
        opt = e.optimizer                      # its parts: one per bucket, this rank's (stages 1-3)
        where = " (host)" if e.offload else ""
        if any(m.data_ptr() != p.data_ptr() for m, p in zip(opt.masters, opt.param_parts)):
            out["master weights" + where] = empty()    # a separate fp32 copy (offload, bf16)
        if hasattr(opt, "host_grads"):
            out["gradients (host)"] = empty()          # offload: what the host steps on
        out["momentum" + where] = empty()
        # the state as the optimizer home hands it to a checkpoint: one entry per bucket's part
        # (homes.BucketState.state_dict; torch's own state is keyed by the cache-sized views)
        state = opt.state_dict()["state"]
        for i, (b, master) in enumerate(zip(layout.buckets, opt.masters)):
            if "master weights" + where in out:
                put(out["master weights" + where], self.owned(b), master)
            if "gradients (host)" in out:
                put(out["gradients (host)"], self.owned(b), opt.host_grads[i])
            momentum = state.get(i, {}).get("momentum_buffer")
            if momentum is not None:
                put(out["momentum" + where], self.owned(b), momentum)
        for key in GRADIENTS:                    # what a reduce-scatter used as workspace (comm.py)
            for start, stop in self.workspace if key in out else ():
                out[key][start:stop] = math.nan
        return {
            name: [None if math.isnan(v) else v for v in vec.tolist()] for name, vec in out.items()
        }

    @contextlib.contextmanager
    def watching(self):
        """For one step: every collective run to completion as it is issued (comm.synchronous()),
        and a snapshot at the events that end a phase (events.py)."""
        with comm.synchronous(), events.subscribed(self._on_event):
            yield

    def saw(self, name: str, frames: list[dict]) -> None:
        for f in frames:             # (a line that only announces the event is no mechanism)
            if "events.emit(" not in linecache.getline(str(source.ROOT / f["file"]), f["line"]):
                self.ran.setdefault((f["file"], f["line"], f["function"]), set()).add(name)

    def optimizer_stepped(self, optimizer, args, kwargs) -> None:
        """torch's step post-hook on the optimizer home's torch optimizer: where it stepped."""
        self.step_stack = source.stack()
        self.saw("torch optimizer step", self.step_stack)

    def _on_event(self, name: str, fields: dict) -> None:
        e, where = self.engine, source.stack()        # the lines of minizero that emitted it
        self.saw(name, where)
        if name == "collective" and fields["kind"] in KINDS and fields["numel"]:
            b = self._bucket_of(fields["tensor"])
            self.issued[fields["seq"]] = (fields["kind"], fields["group"], b)
            if fields["kind"] != "all_gather" and self.in_backward:
                self.snap(
                    f"{self._name(b)}: its gradients are complete, each rank's from its own rows",
                    "ready",
                    b,
                    where,
                )
        elif name == "collective done" and fields["seq"] in self.issued:
            self._after_collective(*self.issued.pop(fields["seq"]), where)
        elif name == "unit freed" and fields["engine"] is e:
            self.snap(
                f"free {fields['unit'].tag}: only the shard is left",
                "free",
                fields["unit"].bucket,
                where,
            )
        elif name == "optimizer step" and fields["engine"] is e:
            what = "its partition" if e.sharded else "every parameter (all ranks the same)"
            self.snap(f"optimizer step: each rank updates {what}", "step",
                      where=self.step_stack or where)
        elif name == "unit gather" and fields["engine"] is e and fields["prefetch"]:
            self.phases[-1]["label"] += (" (a prefetch: started while the unit before it in "
                                         "backward computes)")

    def _after_collective(self, kind: str, group, b, where: list[dict]) -> None:
        e, name = self.engine, self._name(b)
        snap = functools.partial(self.snap, where=where)
        if kind == "reduce_scatter":                   # only this rank's partition is defined now
            mine = self.owned(b)
            self.workspace += [(b.start, mine), (mine + b.shard_numel, b.start + b.padded_numel)]
        # [Note: hierarchical sharding]: group is the shard group (a row of S ranks), the
        # replicate group (a column: the ranks holding the same partition) or hpZ's row of R
        # ranks; None: all N
        within = "" if group is None else f" within each group of {group.size}"
        if kind == "all_reduce" and group is not None and group is e.replicate_group:
            snap(
                f"all-reduce {name} across the {group.size} shard groups: partition p of every "
                f"group holds the average over all N ranks",
                "all_reduce_across",
                b,
            )
        elif kind == "all_reduce":
            snap(
                f"all-reduce {name}: every rank holds the average of all ranks' gradients", kind, b
            )
        elif kind == "reduce_scatter" and group is not None:
            snap(
                f"reduce-scatter {name}{within}: each rank's partition holds its group's average "
                f"(the rest was workspace)",
                kind,
                b,
            )
        elif kind == "reduce_scatter":
            snap(
                f"reduce-scatter {name}: rank r's partition r holds the average (the rest was "
                f"workspace)",
                kind,
                b,
            )
        elif e.stage == 3:
            when = "for its backward" if self.in_backward else "for its forward"
            hpz = (
                " (hpZ: from the secondary partitions)"
                if group is not None and group is e.hpz_group
                else ""
            )
            snap(
                f"all-gather {name} {when}{within}{hpz}: its full parameters on every rank", kind, b
            )
        else:
            snap(
                f"all-gather {name}{within}: every rank's updated partition, on every rank", kind, b
            )


def worker(cfg: StepConfig) -> dict:
    """Worker: wrap the tiny model at cfg.stage, train one step on this rank's rows, recording
    every phase."""
    r, n = comm.rank(), comm.world_size()
    options = {0: {"bucket_size": 4 * cfg.bucket_elems, "buckets_in_flight": 1}, 1: {},
               2: {"bucket_size": 4 * cfg.bucket_elems, "buckets_in_flight": 1},
               3: {"prefetch": True, "buckets_in_flight": 1}}[cfg.stage]
    groups = {"shard_group_size": cfg.shard_group_size, "hpz_group_size": cfg.hpz_group_size}
    options.update({name: size for name, size in groups.items() if size is not None})
    engine = wrap(tiny_model(cfg.seed), cfg.stage, _optimizer(cfg), offload=cfg.offload,
                  activation_checkpointing=cfg.checkpointing, **options)
    x, y = (t[r * cfg.rows // n: (r + 1) * cfg.rows // n] for t in global_batch(cfg))
    rec, kind = _Recorder(engine), type(engine)
    built = type(engine.params).__init__                      # where the parameters were laid out
    # torch's own hook on the optimizer the home steps (homes.SteppedHome.optimizer): the stack of
    # the partitioned step, ShardOptimizer.step's call of it
    hook = engine.optimizer.optimizer.register_step_post_hook(rec.optimizer_stepped)
    with rec.watching():
        rec.snap("start: each rank holds only its parameter shard, partition r of every unit"
                 if cfg.stage == 3 else "start: every rank holds rank 0's initial parameters",
                 "start", where=[source.of(built)])
        loss = nn.functional.mse_loss(engine(x), y)
        rec.snap("end of forward: each rank has its loss on its own rows; every unit was gathered "
                 "for it and freed again (the phases above)" if cfg.stage == 3 else
                 "end of forward: each rank has its loss on its own rows (nothing communicated)",
                 "forward", where=[source.of(kind.__call__)])
        rec.in_backward = True
        engine.backward(loss)
        rec.in_backward = False
        rec.snap("end of backward", "backward", where=[source.of(kind.backward)])
        engine.step()
    hook.remove()
    # The last phase against the engine's own result: full_state_dict all-gathers the masters.
    final, state = rec.phases[-1]["buffers"], engine.full_state_dict()
    held = final["parameters" if cfg.stage < 3 else "parameter shard"]
    for name, start, numel in rec.segments:
        for got, want in zip(held[start: start + numel], state[name].reshape(-1).tolist()):
            assert got is None or got == want, (
                f"rank {r}, {name}: recorded {got}, the engine holds {want}"
            )
    ran = [{"file": f, "line": line, "function": fn, "events": sorted(names)}
           for (f, line, fn), names in sorted(rec.ran.items())]
    return {"phases": rec.phases, "segments": rec.segments, "loss": loss.item(), "ran": ran,
            "buckets": [
                {
                    "index": b.index,
                    "start": b.start,
                    "numel": b.numel,
                    "padded": b.padded_numel,
                    "shard": b.shard_numel,
                }
                for b in engine.layout.buckets
            ],
            "partitioned": engine.sharded, "padded": engine.layout.padded_numel}


def _per_parameter(cfg: StepConfig) -> bool:
    """Whether cfg asks for fully_shard's layout; what it cannot record is refused in one line."""
    if cfg.layout not in ("flat", "per-parameter"):
        raise ValueError(f"layout must be 'flat' or 'per-parameter', got {cfg.layout!r}")
    if cfg.layout == "flat":
        return False
    if cfg.stage != 3 or cfg.offload or cfg.checkpointing or cfg.shard_group_size \
            or cfg.hpz_group_size:
        raise ValueError("the per-parameter step-through records fully_shard at its defaults: "
                         "stage 3, no offload, checkpointing, shard or hpZ groups")
    return True


def record(cfg: StepConfig = StepConfig(), backend: str = "gloo") -> dict:
    """One launch: {"config", "buckets", "segments", "padded", "partitioned", "phases":
    [{"label", "kind", "bucket", "source": {"file", "line", "function"} of the minizero line that
    produced it, "stack": the minizero lines that led to it, innermost first, "ranks": [rank r's
    buffers], "activations": [bytes per rank]}], "ran": [{"file", "line", "function", "events"}:
    every minizero line on the stack of an event of the step, and those events]};
    the end of backward is left out where it changed nothing on any rank (DDP: the last
    all-reduce ended it)."""
    # one line, no launch
    check_settings(cfg.stage, offload=cfg.offload, shard_group_size=cfg.shard_group_size,
                   hpz_group_size=cfg.hpz_group_size, world_size=cfg.world_size)
    if _per_parameter(cfg):
        from minizero.lab import stepthrough_fully_shard
        return stepthrough_fully_shard.record(cfg, backend)
    per_rank = launch(worker, cfg.world_size, cfg, backend=backend)
    first = per_rank[0]
    phases = []
    for k, phase in enumerate(first["phases"]):
        ranks = [res["phases"][k]["buffers"] for res in per_rank]
        activations = [res["phases"][k]["activations"] for res in per_rank]
        if phase["kind"] == "backward" and (ranks, activations) == (
            phases[-1]["ranks"],
            phases[-1]["activations"],
        ):
            continue
        phases.append(
            {
                "label": phase["label"],
                "kind": phase["kind"],
                "bucket": phase["bucket"],
                "source": phase["source"],        # rank 0's: every rank runs the same code
                "stack": phase["stack"],
                "ranks": ranks,
                "activations": activations,
            }
        )
    return {
        "config": dataclasses.asdict(cfg),
        "buckets": first["buckets"],
        "segments": first["segments"],
        "padded": first["padded"],
        "partitioned": first["partitioned"],
        "phases": phases,
        "losses": [res["loss"] for res in per_rank],
        "ran": first["ran"],
    }


def ran(steps: dict, *functions: str) -> list[tuple[str, int]]:
    """(file, line) of every line of the named functions (qualified names: "Unit.pre_forward")
    that was on the call stack of an event in the recorded step: the lines that ran and led to
    what the phases show, found wherever they are now, for source.show to mark. A function none
    of whose lines did: ValueError (renamed, or not run at this setting)."""
    missing = [f for f in functions if not any(r["function"] == f for r in steps["ran"])]
    if missing:
        raise ValueError(f"{', '.join(missing)}: no line of it led to an event in this step "
                         f"(stage {steps['config']['stage']})")
    return [(r["file"], r["line"]) for f in functions for r in steps["ran"] if r["function"] == f]


# --------------------------------------------------------------------------------------------------
# The checks: every phase against one process stepping the whole batch
# --------------------------------------------------------------------------------------------------

def reference(cfg: StepConfig, segments, padded: int) -> dict[str, list]:
    """One process, the whole batch, plain torch.optim: the gradient, the stepped parameters and
    the optimizer's momentum after the step, laid out in the engine's flat coordinates (None at
    padding)."""
    model = tiny_model(cfg.seed)
    x, y = global_batch(cfg)
    nn.functional.mse_loss(model(x), y).backward()
    params = dict(model.named_parameters())
    out = {"start": [None] * padded, "grad": [None] * padded}
    for name, start, numel in segments:
        out["start"][start: start + numel] = params[name].detach().reshape(-1).tolist()
        out["grad"][start: start + numel] = params[name].grad.reshape(-1).tolist()
    optimizer = _optimizer(cfg)(model.parameters())
    optimizer.step()
    out["stepped"], out["momentum"] = [None] * padded, [None] * padded
    for name, start, numel in segments:
        out["stepped"][start: start + numel] = params[name].detach().reshape(-1).tolist()
        momentum = optimizer.state[params[name]]["momentum_buffer"]
        out["momentum"][start: start + numel] = momentum.reshape(-1).tolist()
    return out


def _close(a, b, tol: float = 1e-6) -> bool:
    return a is not None and b is not None and abs(a - b) <= tol * (1 + abs(b))


def check(steps: dict) -> None:
    """Raise AssertionError naming the phase, the rank and the element where a recording is wrong.

    With shard_group_size=S < N ([Note: hierarchical sharding] in beyond/hierarchical.py): rank r
    owns partition r % S of its row of S consecutive ranks; the reduce-scatter averages over the
    row, one all-reduce per bucket across the rows ("all_reduce_across") then gives every owner the
    whole-batch mean. The per-parameter layout: stepthrough_fully_shard.check."""
    cfg = StepConfig(**steps["config"])
    if _per_parameter(cfg):
        from minizero.lab import stepthrough_fully_shard
        return stepthrough_fully_shard.check(steps)
    ref = reference(cfg, steps["segments"], steps["padded"])
    real = [j for j, v in enumerate(ref["start"]) if v is not None]
    buckets = {b["index"]: b for b in steps["buckets"]}
    n, phases, params = (
        cfg.world_size,
        steps["phases"],
        "parameters" if cfg.stage < 3 else "parameter shard",
    )
    s = cfg.shard_group_size or n             # shard group: ranks s·(r // s) ... s·(r // s) + s - 1

    def row(r):
        return range(r - r % s, r - r % s + s)

    def owns(r, j):                                     # rank r steps element j (every rank: DDP)
        b = _bucket_at(steps, j)
        return not steps["partitioned"] or (j - b["start"]) // b["shard"] == r % s

    reduce = "all_reduce" if cfg.stage == 0 else "reduce_scatter"
    reduced = [p["bucket"] for p in phases if p["kind"] in ("all_reduce", "reduce_scatter")]
    assert sorted(reduced) == sorted(buckets), (
        f"one {reduce} per bucket expected, got buckets {reduced}"
    )
    across = [p["bucket"] for p in phases if p["kind"] == "all_reduce_across"]
    assert sorted(across) == (sorted(buckets) if s < n else []), (
        f"shard groups of {s} of {n} ranks: one all-reduce "
        f"across the groups per bucket expected, got {across}"
    )
    for r, rank in enumerate(phases[0]["ranks"]):
        assert all(
            rank[params][j] is None or _close(rank[params][j], ref["start"][j]) for j in real
        ), f"start, rank {r}"
    for k, phase in enumerate(phases):
        where = f"phase {k} ({phase['label']})"
        if phase["kind"] in ("all_reduce", "reduce_scatter"):
            b = buckets[phase["bucket"]]
            before, after = phases[k - 1]["ranks"], phase["ranks"]
            key = next(name for name in GRADIENTS if name in after[0])
            for j in range(b["start"], b["start"] + b["numel"]):
                local = [rank[key][j] for rank in before]
                assert None not in local, (
                    f"{where}: rank {local.index(None)} lacks its gradient {j} before"
                )
                assert _close(sum(local) / n, ref["grad"][j]), (
                    f"{where}: element {j}: the ranks' mean "
                    f"{sum(local) / n} is not the whole batch's gradient {ref['grad'][j]}"
                )
                for r, rank in enumerate(after):
                    # the collective's workspace
                    if phase["kind"] == "reduce_scatter" and not owns(r, j):
                        assert rank[key][j] is None, (
                            f"{where}: rank {r}, element {j}: not its partition, but shown"
                        )
                        continue
                    want = sum(local[q] for q in row(r)) / s
                    assert _close(rank[key][j], want), (
                        f"{where}: rank {r}, element {j}: {rank[key][j]}, "
                        f"expected its group average {want}"
                    )
        # each owner's partition: its row's mean -> all N's
        if phase["kind"] == "all_reduce_across":
            b = buckets[phase["bucket"]]
            key = "gradients" if cfg.stage == 1 else "gradient shard"
            before, after = phases[k - 1]["ranks"], phase["ranks"]
            for j in range(b["start"], b["start"] + b["numel"]):
                owners = [r for r in range(n) if owns(r, j)]              # one per shard group
                assert len(owners) == n // s, f"{where}: element {j} owned by {owners}"
                for r in owners:
                    assert _close(after[r][key][j], ref["grad"][j]), (
                        f"{where}: rank {r}, element {j}: "
                        f"{after[r][key][j]}, expected the whole batch's gradient {ref['grad'][j]}"
                    )
                for r in range(n):
                    if r not in owners:
                        assert after[r][key][j] == before[r][key][j], (
                            f"{where}: rank {r} changed element {j}"
                        )
        # a unit's full parameters, before the step
        if phase["kind"] == "all_gather" and cfg.stage == 3:
            b = buckets[phase["bucket"]]
            for r, rank in enumerate(phase["ranks"]):
                for j in range(b["start"], b["start"] + b["numel"]):
                    assert _close(rank["parameters"][j], ref["start"][j]), (
                        f"{where}: rank {r}, element {j}: "
                        f"{rank['parameters'][j]}, expected {ref['start'][j]}"
                    )
        # hpZ: kept from forward's gather, before the step
        for r, rank in enumerate(phase["ranks"]):
            for j, v in enumerate(rank.get("secondary partition (hpZ)", [])):
                assert v is None or j not in real or _close(v, ref["start"][j]), \
                    f"{where}: rank {r}, secondary element {j}: {v}, expected {ref['start'][j]}"
        if phase["kind"] == "step":
            for r, rank in enumerate(phase["ranks"]):
                held = rank[params]
                for j in real:
                    mine = owns(r, j)
                    want = ref["stepped"][j] if mine else ref["start"][j]
                    if held[j] is not None or mine:
                        assert _close(held[j], want), (
                            f"{where}: rank {r}, parameter element {j}: {held[j]}, "
                            f"expected {'the stepped ' if mine else 'the unchanged '}{want}"
                        )
    # the optimizer state: none before the step; after it, torch's momentum where the rank steps
    stepped = next(k for k, p in enumerate(phases) if p["kind"] == "step")
    for k, phase in enumerate(phases):
        for r, rank in enumerate(phase["ranks"]):
            row = next(v for name, v in rank.items() if name.startswith("momentum"))
            for j in real:
                if k < stepped or not owns(r, j):
                    assert row[j] is None, f"phase {k} ({phase['label']}): rank {r}, momentum {j}"
                else:
                    assert _close(row[j], ref["momentum"][j]), (
                        f"phase {k} ({phase['label']}): rank {r}, momentum element {j}: "
                        f"{row[j]}, one process's optimizer holds {ref['momentum'][j]}")
    last = phases[-1]["ranks"]
    for r, rank in enumerate(last):
        held = rank[params]
        for j in real:
            assert held[j] is None or _close(held[j], ref["stepped"][j]), (
                f"end: rank {r}, element {j}"
            )
        if cfg.stage < 3:
            assert None not in [held[j] for j in real], f"end: rank {r} lacks parameters"
    if cfg.stage == 3:                # each unit: gathered for forward and for backward, then freed
        for b in steps["buckets"]:
            kinds = [
                p["kind"]
                for p in phases
                if p["bucket"] == b["index"] and p["kind"] in ("all_gather", "free")
            ]
            assert kinds == ["all_gather", "free"] * 2, f"unit of bucket {b['index']}: {kinds}"


def _bucket_at(steps: dict, j: int) -> dict:
    return next(b for b in steps["buckets"] if b["start"] <= j < b["start"] + b["padded"])


# --------------------------------------------------------------------------------------------------
# Notebook 00: minizero.ring.ring_all_reduce, exchange by exchange
# --------------------------------------------------------------------------------------------------

def ring_worker(numel: int) -> dict:
    """Worker: rank r sums 10 r + [1, 2, ..., numel] with ring.py's ring_all_reduce, while its
    point-to-point exchanges are observed: before each one, the rank's padded buffer and the chunk
    it sends."""
    r = comm.rank()
    tensor = 10.0 * r + torch.arange(1, numel + 1, dtype=torch.float32)
    inputs, states, sends, lines = tensor.tolist(), [], [], []

    def observed(name: str, fields: dict) -> None:
        if name == "ring exchange":
            states.append(fields["buffer"].tolist())        # the ring's padded buffer, as it is now
            sends.append(fields["send"])
            # ring_all_reduce's call of the exchange (phase 1 or phase 2), not the helper's inside
            lines.append(source.origin(skip=("events.py",),
                                       skip_functions=("ring_all_reduce.<locals>.exchange",)))
    with events.subscribed(observed):
        ring_all_reduce(tensor)
    padding = states[-1][numel:]                               # chunk sums of zeros stay zeros
    return {"inputs": inputs, "states": states + [tensor.tolist() + padding], "sends": sends,
            "sources": lines}


def ring(world_size: int, numel: int = 5, backend: str = "gloo") -> dict:
    """One launch: {"world_size", "numel", "chunk", "inputs": by rank, "states": [state before
    exchange s (the last: the result), by rank], "sends": [chunk each rank sends at exchange s,
    by rank], "sources": [the line of ring_all_reduce that ran exchange s]}."""
    per_rank = launch(ring_worker, world_size, numel, backend=backend)
    steps = len(per_rank[0]["sends"])
    return {"world_size": world_size, "numel": numel, "chunk": -(-numel // world_size),
            "sources": per_rank[0]["sources"],
            "inputs": [p["inputs"] for p in per_rank],
            "states": [[p["states"][s] for p in per_rank] for s in range(steps + 1)],
            "sends": [[p["sends"][s] for p in per_rank] for s in range(steps)]}


def check_ring(ring: dict) -> None:
    """2(N-1) exchanges; at each, rank r receives chunk i from rank r-1 and adds it (the first N-1)
    or takes it (the rest), nothing else changes; the end: the sum on every rank."""
    n, c, states, sends = ring["world_size"], ring["chunk"], ring["states"], ring["sends"]
    assert len(sends) == 2 * (n - 1), f"{len(sends)} exchanges for N = {n}"
    for s, sent in enumerate(sends):
        for r in range(n):
            left, i = (r - 1) % n, sent[(r - 1) % n]
            for j, (now, before) in enumerate(zip(states[s + 1][r], states[s][r])):
                if j // c != i:
                    assert now == before, (
                        f"exchange {s}: rank {r} changed element {j}, not in chunk {i}"
                    )
                else:
                    want = states[s][left][j] + (before if s < n - 1 else 0)
                    assert math.isclose(now, want, abs_tol=1e-5), (
                        f"exchange {s}: rank {r}, element {j}: {now}"
                    )
    total = [sum(col) for col in zip(*ring["inputs"])]
    for r, final in enumerate(states[-1]):
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(final, total)), (
            f"rank {r}: {final}"
        )
