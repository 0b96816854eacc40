"""The experiments behind notebooks/: the functions the launched ranks run, and the helpers that
collect what they return into the numbers a notebook both plots and checks (one source for the
figure and the test).


    from minizero.lab.demo import measure_stage
    runs = measure_stage(2, world_sizes=(1, 2, 4))     # {N: record}, one minizero.launch per N
    runs[4]["max_abs_diff"], runs[4]["ranks"][0]["memory"], runs[4]["theory"]

Every launched rank imports the function it runs by module name, and a notebook's cells are no
module: the workers of these longer experiments live here; the short worker the stage notebooks
launch is notebooks/ranks.py, a file a learner edits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import statistics
import time
import warnings
import weakref

import torch

from minizero import comm
from minizero.lab.record import recorded
from minizero.ring import ring_all_reduce
from minizero.lab.data import global_batch, local_batch
from minizero.lab.model import make_model
from minizero.lab.reference import max_abs_diff, reference_train, tolerance
from minizero.lab.report import summarize
from minizero.lab.train import (
    TrainConfig, forward_backward, loss_fn, train_several, train_worker,
)
from minizero.launcher import launch
from minizero.loss_scale import LossScaler
from minizero.memory import CATEGORIES, within_padding, wire
from minizero.wrap import check as check_settings
from minizero.wrap import wrap


def backend_and_world_sizes() -> tuple[str, tuple[int, ...]]:
    """gloo processes on the CPU with N = 1, 2, 4; with two or more GPUs, NCCL with N up to min(4,
    GPUs). Always explicit: with one GPU, comm.init would otherwise pick NCCL for ranks that have
    no GPU."""
    gpus = torch.cuda.device_count()
    if gpus >= 2:
        return "nccl", tuple(sorted({1, 2, min(4, gpus)}))
    return "gloo", (1, 2, 4)


# --------------------------------------------------------------------------------------------------
# Training runs: memory, communication, time and correctness of one or more configurations
# --------------------------------------------------------------------------------------------------

def measure(variants: dict[str, TrainConfig], world_sizes, backend: str | None = None) -> dict:
    """{name: {N: record}}: every variant trained at every world size, one launch per world size.

    A record is minizero.lab.report.summarize's (per-rank memory and comm tally, the paper's
    formulas as `theory`, losses, step times) plus `max_abs_diff`, the largest
    |parameter - reference| over all ranks and parameters, `tolerance`, and the reference's losses.
    """
    backend = backend or backend_and_world_sizes()[0]
    references = {name: reference_train(dataclasses.replace(cfg, world_size=1))
                  for name, cfg in variants.items()}          # a reference does not depend on N
    out: dict = {name: {} for name in variants}
    for n in world_sizes:
        cfgs = [dataclasses.replace(cfg, world_size=n, backend=backend, return_state=True)
                for cfg in variants.values()]
        for cfg in cfgs:
            # a bad setting fails here, in one line
            check_settings(cfg.stage, cfg.dtype, cfg.offload)
        per_rank = launch(train_several, n, cfgs, backend=backend)
        for i, (name, cfg) in enumerate(zip(variants, cfgs)):
            results = [rank_results[i] for rank_results in per_rank]
            ref = references[name]
            record = summarize(cfg, results)
            record["max_abs_diff"] = max(
                max_abs_diff(r.pop("state_dict"), ref["state_dict"]) for r in results
            )
            record["tolerance"] = tolerance(cfg.dtype)
            record["reference_losses"] = ref["losses"]
            record["optimizer"] = cfg.optimizer
            out[name][n] = record
    return out


def measure_stage(stage: int, world_sizes=None, dtype: str = "fp32", *, offload: bool | str = False,
                  steps: int = 10, model: str = "default", backend: str | None = None) -> dict:
    """{N: record} for one stage (see `measure`); world sizes and backend default to
    this machine's."""
    default_backend, default_sizes = backend_and_world_sizes()
    cfg = TrainConfig(
        stage=stage, dtype=dtype, offload=offload, steps=steps, model=model, batch_size=24
    )
    return measure({"run": cfg}, world_sizes or default_sizes, backend or default_backend)["run"]


def memory_table(records: dict) -> list[dict]:
    """Rank 0's measured bytes next to the formula, per world size and category: what the
    plots draw."""
    rows = []
    for n, rec in sorted(records.items()):
        measured = rec["ranks"][0]["memory"]
        for cat in CATEGORIES:
            rows.append({"world_size": n, "category": cat, "measured": measured[cat],
                         "formula": rec["theory"][cat]})
    return rows


def check(records: dict) -> None:
    """Raise if any record strays from the reference or from the paper's formulas (up to padding:
    minizero.memory.within_padding)."""
    for n, rec in records.items():
        assert rec["max_abs_diff"] <= rec["tolerance"], (
            f"N={n}: max |param - reference| = {rec['max_abs_diff']:.3g} > {rec['tolerance']}")
        for r in rec["ranks"]:
            for cat in CATEGORIES:
                got, want = r["memory"][cat], rec["theory"][cat]
                assert within_padding(got, want, n), (
                    f"N={n}, rank {r['rank']}, {cat}: measured {got} bytes, formula {want:.0f}")
            sent, want = r["comm_bytes_per_step"]["total"], rec["theory"]["comm_bytes_per_step"]
            assert within_padding(sent, want, n, times=3), (
                f"N={n}: {sent:.0f} bytes sent, ring theory {want:.0f}"
            )


# --------------------------------------------------------------------------------------------------
# 00_communication: what each collective does, and the bytes it moves per rank
# --------------------------------------------------------------------------------------------------

def collectives_worker(numel: int, repeats: int = 3) -> dict:
    """Worker: every collective on a small rank-dependent tensor (to see what it does), then on
    `numel` fp32 elements (rounded up to a multiple of N): the bytes comm's tally books for it (the
    ring formula: modelled), the bytes gloo's threads put on the wire for it (memory/wire.py:
    measured; None where it cannot measure, "wire_unavailable" says why) and the time; and the
    teaching ring all-reduce (minizero.ring) against all_reduce on the same
    data."""
    r, n, dev = comm.rank(), comm.world_size(), comm.device()
    # rank 2 of 4: [20, 21, 22, 23]
    small = 10.0 * r + torch.arange(n, dtype=torch.float32, device=dev)
    shown = {"input": small.tolist()}
    t = small.clone()
    comm.all_reduce(t, op="sum")
    shown["all_reduce"] = t.tolist()
    mine = torch.empty(1, device=dev)
    comm.reduce_scatter(mine, small.clone(), op="sum")          # its input is workspace (comm.py)
    shown["reduce_scatter"] = mine.tolist()
    gathered = torch.empty(n, device=dev)
    comm.all_gather(gathered, small[:1])
    shown["all_gather"] = gathered.tolist()
    t = small.clone()
    comm.broadcast(t, src=0)
    shown["broadcast"] = t.tolist()

    numel = -(-numel // n) * n
    big = torch.randn(numel, generator=torch.Generator().manual_seed(r)).to(dev)
    ops = {
        "all_reduce": lambda: comm.all_reduce(big.clone(), op="sum"),
        "reduce_scatter": lambda: comm.reduce_scatter(
            torch.empty(numel // n, device=dev), big.clone(), op="sum"
        ),
        "all_gather": lambda: comm.all_gather(torch.empty(numel, device=dev), big[: numel // n]),
        "broadcast": lambda: comm.broadcast(big.clone(), src=0),
        "ring_all_reduce": lambda: ring_all_reduce(big.clone()),
    }
    unavailable = wire.unavailable()
    sent, on_wire, seconds = {}, {}, {}
    for kind, op in ops.items():
        # the ring's point-to-point sends are written by this thread too (memory/wire.py), and
        # none of them is a collective of comm's: everything written while it runs is the ring's
        point_to_point = kind == "ring_all_reduce"
        with contextlib.nullcontext() if unavailable else wire.WireMeter(point_to_point) as meter:
            times = []
            for _ in range(repeats):
                comm.barrier()
                comm.reset_tally()
                if meter:
                    meter.reset()
                start = time.perf_counter()
                op()                                  # each one blocks: measured alone, exactly
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                sent[kind] = comm.tally()[kind]
                if meter:
                    measured = meter.bytes()
                    outside = measured["outside"] if point_to_point else 0
                    on_wire[kind] = measured.get(kind, 0) + outside
        seconds[kind] = statistics.median(times)
    expected, ring = big.clone(), big.clone()
    comm.all_reduce(expected, op="sum")
    ring_all_reduce(ring)
    return {"rank": r, "world_size": n, "shown": shown, "numel": numel, "full_bytes": numel * 4,
            "sent": sent, "wire": None if unavailable else on_wire, "wire_unavailable": unavailable,
            "seconds": seconds, "ring_max_abs_diff": (ring - expected).abs().max().item()}


def measure_collectives(
    world_sizes=(2, 3, 4), numel: int = 1_000_000, backend: str | None = None
) -> dict:
    """{N: rank 0's collectives_worker result, plus "shown_all": every rank's small example}."""
    backend = backend or backend_and_world_sizes()[0]
    if backend == "nccl":
        world_sizes = [n for n in world_sizes if n <= torch.cuda.device_count()]
    out = {}
    for n in world_sizes:
        per_rank = launch(collectives_worker, n, numel, backend=backend)
        out[n] = {**per_rank[0], "shown_all": [p["shown"] for p in per_rank],
                  "wire_all": [p["wire"] for p in per_rank],
                  "ring_max_abs_diff": max(p["ring_max_abs_diff"] for p in per_rank)}
    return out


# --------------------------------------------------------------------------------------------------
# 04_zero3: when each unit is gathered and freed, with and without prefetch
# --------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def unit_timeline(engine):
    """Inside the block: a list of (time, "gather" | "prefetch" | "free", unit index) for each of a
    stage-3 engine's units, from the event stream ("unit gather" and "unit freed", events.py)."""
    timeline: list[tuple[float, str, int]] = []
    with recorded("unit gather", "unit freed") as log:
        yield timeline
    timeline.extend(
        (
            t,
            ("prefetch" if f["prefetch"] else "gather") if name == "unit gather" else "free",
            f["unit"].index,
        )
        for t, name, f in log
        if f["engine"] is engine
    )


def zero3_timeline_worker(cfgs: list[TrainConfig]) -> list[dict]:
    """Worker: for each stage-3 configuration, one warm-up step (it records the unit order prefetch
    follows), then one step with `unit_timeline` recording every gather / prefetch / free."""
    out = []
    for cfg in cfgs:
        model = make_model(cfg.model_config(), seed=cfg.seed)
        engine = wrap(
            model, 3, cfg.optimizer_factory(), offload=cfg.offload, **cfg.engine_options()
        )
        marks = {}
        for step in range(2):
            x, y = local_batch(
                *global_batch(step, cfg.batch_size, cfg.model_config().block_size, cfg.seed),
                comm.rank(),
                comm.world_size(),
            )
            if step == 1:
                comm.barrier()
                marks["start"] = time.perf_counter()
            with unit_timeline(engine) if step == 1 else contextlib.nullcontext([]) as timeline:
                loss = loss_fn(engine(x.to(engine.device)), y.to(engine.device))
                marks["backward"] = time.perf_counter()
                engine.backward(loss)
                marks["step"] = time.perf_counter()
                engine.step()
                marks["end"] = time.perf_counter()
        t0 = marks["start"]
        out.append({"prefetch": cfg.prefetch, "unit_names": engine.unit_names,
                    "events": [(t - t0, event, b) for t, event, b in timeline],
                    "marks": {k: v - t0 for k, v in marks.items()},
                    "peak_params": engine.memory()["peak_params"], "num_params": sum(
                        p.numel() for p in model.parameters())})
    return out


def zero3_timelines(world_size: int, model: str = "default", backend: str | None = None) -> dict:
    """{prefetch (bool): rank 0's timeline record} for one stage-3 step, one launch for both."""
    backend = backend or backend_and_world_sizes()[0]
    cfgs = [TrainConfig(stage=3, world_size=world_size, model=model, batch_size=24, prefetch=p)
            for p in (False, True)]
    records = launch(zero3_timeline_worker, world_size, cfgs, backend=backend)[0]
    return {rec["prefetch"]: rec for rec in records}


def unit_intervals(record: dict) -> list[dict]:
    """Turn a timeline into intervals: each gather or prefetch of a unit until its next free. The
    first interval of a unit is its forward use, the second its backward use."""
    open_at, uses, out = {}, {}, []
    for t, event, b in record["events"]:
        if event in ("gather", "prefetch"):
            open_at[b] = (t, event)
        elif event == "free" and b in open_at:
            start, how = open_at.pop(b)
            phase = "forward" if uses.get(b, 0) == 0 else "backward"
            uses[b] = uses.get(b, 0) + 1
            out.append({"unit": b, "name": record["unit_names"][b], "start": start, "end": t,
                        "how": how, "phase": phase})
    return out


# --------------------------------------------------------------------------------------------------
# 04_zero3: fine-tuning (frozen weights sharded too) and sharded construction
# --------------------------------------------------------------------------------------------------

class ParameterBytes:
    """Context manager: the most bytes of parameters alive at once while modules are built inside it
    (`peak`), counted as sharded_init counts its own (construct.py): a parameter adds its bytes when
    a module registers it and gives them back when it is freed. For the normal build's figure,
    measured the same way as sharded_init's peak_bytes."""

    def __init__(self):
        self.held = self.peak = 0
        self._seen: set[int] = set()

    def _on_parameter(self, module, name, param) -> None:
        if param is None or id(param) in self._seen:
            return
        self._seen.add(id(param))
        nbytes = param.numel() * param.element_size()
        self.held += nbytes
        self.peak = max(self.peak, self.held)
        weakref.finalize(param, self._freed, id(param), nbytes)

    def _freed(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.held -= nbytes

    def __enter__(self) -> ParameterBytes:
        self._hook = torch.nn.modules.module.register_module_parameter_registration_hook(
            self._on_parameter)
        return self

    def __exit__(self, *exc) -> None:
        self._hook.remove()


def lora_worker(n_embd: int = 32, n_layer: int = 4) -> dict:
    """Worker: a Hugging Face GPT-2 with LoRA adapters (peft; the base frozen), built normally and
    under minizero.sharded_init, each wrapped at stage 3 (units: the decoder layers) and trained
    one step. Returns what building held at most (parameter bytes, measured: ParameterBytes,
    sharded_init.peak_bytes), and the model-state bytes after backward, for both builds."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from minizero.construct import sharded_init
    from minizero.lab.data import VOCAB_SIZE
    out = {}
    for sharded in (False, True):
        torch.manual_seed(0)
        with sharded_init() if sharded else ParameterBytes() as init:
            base = GPT2LMHeadModel(
                GPT2Config(
                    vocab_size=VOCAB_SIZE,
                    n_positions=16,
                    n_embd=n_embd,
                    n_layer=n_layer,
                    n_head=2,
                    bos_token_id=None,
                    eos_token_id=None,
                )
            )
            with warnings.catch_warnings():
                # peft reads model.is_gradient_checkpointing, which transformers 5 deprecates: a
                # FutureWarning per call about peft's code, nothing this run can change
                warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated",
                                        FutureWarning)
                model = get_peft_model(
                    base, LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
                )
        counts = {
            t: sum(p.numel() for p in model.parameters() if p.requires_grad == t)
            for t in (True, False)
        }
        held = init.peak_bytes if sharded else init.peak           # both measured
        engine = wrap(
            model, 3, functools.partial(torch.optim.AdamW, lr=1e-3), units=list(base.transformer.h)
        )
        x, y = local_batch(*global_batch(0, 8, 16), comm.rank(), comm.world_size())
        engine.backward(loss_fn(engine(input_ids=x, use_cache=False).logits, y))
        out["sharded_init" if sharded else "normal"] = {
            "construction_peak": held, "memory": engine.memory(), "trainable": counts[True],
            "frozen": counts[False]}
    return out


def lora_memory(world_sizes, backend: str | None = None) -> list[dict]:
    """[{world_size, trainable, frozen, params (rank 0, measured), formula, construction peaks}]
    per N."""
    from minizero.memory import estimate_breakdown
    rows = []
    for n in world_sizes:
        rec = launch(lora_worker, n, backend=backend or backend_and_world_sizes()[0])[0]
        run = rec["sharded_init"]
        formula = estimate_breakdown(
            run["trainable"], n, 3, param_bytes=4, grad_bytes=4, k=8, frozen=run["frozen"]
        )
        rows.append({"world_size": n, "trainable": run["trainable"], "frozen": run["frozen"],
                     "params": run["memory"]["params"], "formula": formula["params"],
                     "replicated_frozen_would_be": 4 * run["frozen"]
                     + formula["params"]
                     - 4 * run["frozen"] / n,
                     "construction_peak": {
                         k: rec[k]["construction_peak"] for k in ("normal", "sharded_init")
                     }})
    return rows


# --------------------------------------------------------------------------------------------------
# Checkpoints: a run moved to another world size (notebook 06)
# --------------------------------------------------------------------------------------------------

def move_run(from_n: int, to_n: int, steps: int, directory: str, model: str = "default",
             backend: str | None = None) -> dict:
    """A stage-2 run at N = from_n saves after steps // 2 and continues at N = to_n (engine.load
    reshards the masters and Adam's moments), next to the uninterrupted run and to a restart from
    the consolidated weights with a fresh optimizer. Two launches. Losses are the mean over ranks of
    each step."""
    from minizero import checkpoint
    half = max(steps // 2, 1)
    run = dict(
        stage=2, model=model, batch_size=24, steps=2 * half, return_state=True, backend=backend
    )
    ckpt, weights = os.path.join(directory, "ckpt"), os.path.join(directory, "model.pt")
    full, _ = zip(
        *launch(
            train_several,
            from_n,
            [
                TrainConfig(**run, world_size=from_n),
                TrainConfig(**{**run, "steps": half}, world_size=from_n, save_dir=ckpt),
            ],
            backend=backend,
        )
    )
    torch.save(checkpoint.consolidate(ckpt), weights)
    resumed, fresh = zip(*launch(train_several, to_n, [
        TrainConfig(**run, world_size=to_n, load_dir=ckpt),
        TrainConfig(**run, world_size=to_n, init_state=weights, start_step=half)], backend=backend))

    def mean_losses(results):
        return [statistics.fmean(step) for step in zip(*(r["losses"] for r in results))]

    return {"from_n": from_n, "to_n": to_n, "half": half, "full": mean_losses(full),
            "resumed": mean_losses(resumed), "fresh": mean_losses(fresh),
            "resumed_diff": max_abs_diff(resumed[0]["state_dict"], full[0]["state_dict"]),
            "fresh_diff": max_abs_diff(fresh[0]["state_dict"], full[0]["state_dict"])}


# --------------------------------------------------------------------------------------------------
# 07_activations: ZeRO-R, activations measured and estimated, checkpointing, one step's memory
# timeline
# --------------------------------------------------------------------------------------------------

CHECKPOINTING = (False, True, "cpu")


def activation_sweep(model: str, seqs, batches, dtype: str = "fp32") -> list[dict]:
    """Activations of one forward and backward next to memory.activation_bytes, for each sequence
    length, micro-batch and checkpointing mode. One process: they depend on a rank's micro-batch,
    not on N or the stage (a rank's activations are its own rows)."""
    from minizero.lab.data import sequence_length
    from minizero.lab.model import GPTConfig
    from minizero.memory import activation_bytes, element_bytes
    rows = []
    for mode in CHECKPOINTING:
        for block in seqs:
            for batch in batches:
                cfg = GPTConfig.named(model, block_size=block)
                engine = wrap(
                    make_model(cfg),
                    0,
                    functools.partial(torch.optim.SGD, lr=0.0),
                    dtype=dtype,
                    activation_checkpointing=mode,
                )
                x, y = global_batch(0, batch, block)
                engine.backward(loss_fn(engine(x), y))
                seq = sequence_length(block)
                rows.append(
                    {
                        "checkpointing": mode,
                        "seq": seq,
                        "batch": batch,
                        "layers": cfg.n_layer,
                        "hidden": cfg.n_embd,
                        "heads": cfg.n_head,
                        "mlp_ratio": cfg.mlp_ratio,
                        "bytes_per_elem": element_bytes(dtype),
                        "measured": engine.memory()["activations"],
                        "estimate": activation_bytes(
                            cfg.n_layer, cfg.n_embd, cfg.n_head, seq, batch,
                            bytes_per_elem=element_bytes(dtype),
                            mlp_ratio=cfg.mlp_ratio,
                            checkpointing=mode,
                        ),
                    }
                )
    return rows


def memory_timeline_worker(cfgs: list[TrainConfig]) -> list[dict]:
    """Worker: for each configuration one warm-up step, then one step inside
    engine.memory_timeline()."""
    out = []
    for cfg in cfgs:
        engine = wrap(
            make_model(cfg.model_config(), seed=cfg.seed),
            cfg.stage,
            cfg.optimizer_factory(),
            offload=cfg.offload,
            **cfg.engine_options(),
        )
        for step in range(2):
            with engine.memory_timeline() if step == 1 else contextlib.nullcontext([]) as timeline:
                forward_backward(cfg, step, engine, engine.backward, engine.no_sync)
                engine.step()
        t0 = timeline[0][0]
        out.append({"stage": cfg.stage, "checkpointing": cfg.activation_checkpointing,
                    "events": [(t - t0, event, b) for t, event, b in timeline]})
    return out


def memory_timelines(
    stages, world_size: int, model: str = "default", backend: str | None = None
) -> list[dict]:
    """Rank 0's timeline of one step for each stage, with and without checkpointing, in
    one launch."""
    backend = backend or backend_and_world_sizes()[0]
    cfgs = [
        TrainConfig(
            stage=s,
            world_size=world_size,
            model=model,
            batch_size=24,
            activation_checkpointing=mode,
        )
        for s in stages
        for mode in (False, True)
    ]
    return launch(memory_timeline_worker, world_size, cfgs, backend=backend)[0]


# --------------------------------------------------------------------------------------------------
# 05_offload, last section: fp16's dynamic loss scale, with overflows injected into one rank's
# partition
# --------------------------------------------------------------------------------------------------

class _FaultyScaler(LossScaler):
    """minizero's loss scaler, after an inf is put into one element of rank `faults[step]`'s
    gradient partition at each step of `faults` (the experiment's fault, never minizero's); it
    records per step the scale the gradients carried, whether this rank's own partition was finite,
    whether the step was skipped (the global decision) and the scale after it."""

    def __init__(self, loss_scale, faults: dict[int, int]):
        super().__init__(loss_scale)
        self.faults, self.trace = faults, []

    def unscale(self, grads):
        step, scale = self.iteration, self.scale
        if self.faults.get(step) == comm.rank():
            grads[0].view(-1)[0] = float("inf")
        local = any(not torch.isfinite(g).all() for g in grads)
        out = super().unscale(grads)
        self.trace.append(
            {
                "step": step,
                "scale": scale,
                "local_overflow": bool(local),
                "skipped": out is None,
                "scale_after": self.scale,
            }
        )
        return out


def loss_scale_worker(cfg: TrainConfig, faults: dict[int, int]) -> dict:
    """Worker: train cfg (fp16) with _FaultyScaler as the engine's scaler; this rank's trace
    and losses."""
    scaler = _FaultyScaler(cfg.loss_scale, faults)

    def build(model, stage, optimizer, **options):
        # a LossScaler as is
        return wrap(model, stage, optimizer, **{**options, "loss_scale": scaler})

    result = train_worker(cfg, make_engine=build)
    return {"rank": comm.rank(), "trace": scaler.trace, "losses": result["losses"],
            "skipped_steps": result["skipped_steps"]}


def loss_scale_run(
    world_size: int,
    faults: dict[int, int],
    loss_scale: dict,
    steps: int,
    stage: int = 2,
    model: str = "tiny",
    backend: str | None = None,
) -> dict:
    """One fp16 run at `stage` on `world_size` ranks with an inf injected into rank faults[k]'s
    partition at each step k: {"faults", "loss_scale" (the options), "ranks": every rank's
    worker result}."""
    backend = backend or backend_and_world_sizes()[0]
    cfg = TrainConfig(
        stage=stage,
        world_size=world_size,
        model=model,
        dtype="fp16",
        loss_scale=loss_scale,
        steps=steps,
        batch_size=24,
        optimizer="adamw",
        lr=1e-2,
    )
    ranks = launch(loss_scale_worker, world_size, cfg, faults, backend=backend)
    return {
        "faults": {str(k): r for k, r in faults.items()},
        "loss_scale": loss_scale,
        "world_size": world_size,
        "ranks": ranks,
    }
