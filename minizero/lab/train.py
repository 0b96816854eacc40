"""One training run, as every rank executes it: the loop behind `python -m minizero.run`, the tests
and the notebooks.

    import minizero
    from minizero.lab.train import TrainConfig, train_worker
    results = minizero.launch(train_worker, 4, TrainConfig(stage=2, steps=100))  # one dict per rank

Each step: `grad_accum` micro-batches (all but the last inside engine.no_sync()), then
engine.step(). The global batch of `batch_size` rows is split
[grad_accum][world_size][rows] (minizero.lab.data).
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from minizero import checkpoint, comm
from minizero.beyond import network, tensor_parallel
from minizero.deepspeed import muon
from minizero.deepspeed.config import OPTIMIZERS, build_scheduler
from minizero.flat import DEFAULT_BUCKET_BYTES
from minizero.lab.data import IGNORE, global_batch, local_batch
from minizero.lab.faults import Fault
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.throughput import peak_worker
from minizero.construct import sharded_init
from minizero.memory import wire
from minizero.options import takes
from minizero.wrap import wrap

def state_bytes(optimizer: str, params: dict | None = None) -> int:
    """Optimizer state per parameter, in bytes, for one of OPTIMIZERS (fp32 state; the paper's K
    minus the master copy, see minizero.memory.optimizer_k): Adam's two moments 8, SGD's momentum 4,
    plain SGD 0."""
    if optimizer in ("adam", "adamw"):
        return 8
    return 4 if (params or {}).get("momentum") else 0


@dataclass
class TrainConfig:
    stage: int = 2
    world_size: int = 2
    steps: int = 50
    dtype: str = "fp32"             # "fp32", "bf16" or "fp16" (16-bit compute, fp32 master weights)
    # fp16: None dynamic, a number static, a dict (loss_scale.py)
    loss_scale: float | dict | None = None
    # "fp32": bf16/fp16 gradients reduced and accumulated in fp32
    reduce_dtype: str | None = None
    offload: bool | str = False               # False, True/"optimizer", "params" (stage 3), "disk"
    offload_path: str | None = None           # offload="disk": its file's folder (beyond/disk.py)
    stall_timeout: float | None = None    # launch's: seconds without progress (beyond/desync.py)
    backend: str | None = None                # None: nccl if CUDA is available, else gloo
    # global rows per optimizer step (all ranks, all micro-batches)
    batch_size: int = 16
    grad_accum: int = 1                       # micro-batches per step
    clip_grad_norm: float | None = None
    optimizer: str = "adamw"                  # one of OPTIMIZERS, or "muon" (optimizer_and_groups)
    lr: float = 3e-3
    # extra keyword arguments (betas, momentum...; Muon's: DeepSpeed's, deepspeed/muon.py)
    optimizer_params: dict = field(default_factory=dict)
    muon_design: str | None = None            # wrap's muon_design (None: beyond/muon's default)
    scheduler: dict | None = None        # {"type", "params"}: DeepSpeed's (deepspeed/config.py)
    bucket_size: float = DEFAULT_BUCKET_BYTES           # bytes per gradient bucket (stages 0, 2)
    prefetch: bool = True                               # stage 3
    quantized_weights: bool = False                     # stage 3: ZeRO++ qwZ (beyond/quantize.py)
    quantized_gradients: bool = False                   # stages 2-3: ZeRO++ qgZ
    overlap: bool = True                                # stage 0: False all-reduces after backward
    # every collective completes before it returns (comm.synchronous()): no overlap, so the bytes
    # on the wire are measured per collective kind exactly (memory/wire.py)
    synchronous: bool = False
    # stages 1-3: partition within groups of S ranks (HSDP / MiCS)
    shard_group_size: int | None = None
    # stage 3: backward's all-gather within R ranks (ZeRO++ hpZ)
    hpz_group_size: int | None = None
    model: str = "default"                                  # GPTConfig.named(...)
    model_overrides: dict = field(default_factory=dict)
    seed: int = 0
    fixed_batch: bool = False                 # every step trains on step 0's batch (a demo's loss)
    log_every: int = 0                # rank 0 prints progress every N steps (0: quiet)
    return_state: bool = False        # include the final full_state_dict in the result
    sharded_init: bool = False        # stage 3: build the model partitioned (minizero.sharded_init)
    # True: recompute each block in backward; "cpu": inputs on the host
    activation_checkpointing: bool | str = False
    tensor_parallel: int = 1         # M: rows of M ranks split the GPT; ZeRO over N/M (the mesh)
    # Checkpoints (minizero/checkpoint.py). `steps` counts from step 0 of the data stream, so
    # resuming a run saved after k steps with steps=k+m trains the m steps an uninterrupted run
    # would have.
    save_dir: str | None = None      # engine.save() here after the last step
    save_every: int = 0              # > 0: save_dir is a run directory, checkpoint.save_numbered
    keep_last: int | None = None     # ... every save_every steps and after the last; keep this many
    load_dir: str | None = None      # engine.load() before the first: any stage and N, same model
    init_state: str | None = None    # a consolidated state dict (minizero.consolidate): any N,
    start_step: int = 0              # ... first step's index in the data stream (fresh optimizer)
    fault: Fault | None = None       # a failure to inject (lab/faults.py); else MINIZERO_FAIL_*
    measure_peak: bool = False       # after training: each rank's GEMM FLOP/s (MFU)
    progress: bool = False           # rank 0 shows a progress bar on stderr (progress_bar)

    def model_config(self) -> GPTConfig:
        return GPTConfig.named(self.model, **self.model_overrides)

    def optimizer_factory(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"optimizer must be one of {sorted(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        return functools.partial(OPTIMIZERS[self.optimizer], lr=self.lr, **self.optimizer_params)

    def optimizer_and_groups(self, model) -> tuple[Callable, list[dict] | None]:
        """(the factory wrap takes, its param_groups): for "muon" DeepSpeed's reading of a Muon
        config (the matrices named neither embed nor lm_head: Muon; the rest: AdamW), else
        optimizer_factory() over every parameter (None)."""
        if self.optimizer == "muon":
            return muon.factory_and_groups(model, {"lr": self.lr, **self.optimizer_params}, None)
        return self.optimizer_factory(), None

    def engine_options(self) -> dict:
        opts = {"dtype": self.dtype, "clip_grad_norm": self.clip_grad_norm}
        if self.loss_scale is not None:
            opts["loss_scale"] = self.loss_scale
        if self.reduce_dtype is not None:
            opts["reduce_dtype"] = self.reduce_dtype
        if takes(self.stage, "bucket_size"):
            opts["bucket_size"] = self.bucket_size
        if not self.overlap:                                  # only when off: wrap checks the stage
            opts["overlap"] = False
        if takes(self.stage, "prefetch"):
            opts["prefetch"] = self.prefetch
        # only when on: wrap checks the stage
        for name in ("quantized_weights", "quantized_gradients"):
            if getattr(self, name):
                opts[name] = True
        if self.offload_path is not None:
            opts["offload_path"] = self.offload_path
        if self.activation_checkpointing:
            opts["activation_checkpointing"] = self.activation_checkpointing
        for name in ("shard_group_size", "hpz_group_size"):
            if getattr(self, name) is not None:
                opts[name] = getattr(self, name)
        if self.tensor_parallel > 1:
            opts["tensor_parallel"] = self.tensor_parallel
        if self.muon_design is not None:
            opts["muon_design"] = self.muon_design
        return opts


def progress_wanted(quiet: bool = False, json_path: str | None = None) -> bool:
    """Progress bars only for a person watching: stderr a terminal, not --quiet, no --json -."""
    return not quiet and json_path != "-" and sys.stderr.isatty()


def progress_bar(total: int, desc: str, enabled: bool, **kwargs) -> tqdm:
    """A tqdm bar on stderr with time left; disabled, every call on it does nothing. Its size: the
    terminal's, or 80 x 24 where it reports 0 x 0 (a bare pseudo-terminal: tqdm shows nothing)."""
    size = shutil.get_terminal_size()
    # one process writes the bar: a thread lock, not tqdm's default multiprocessing one (a semaphore
    # that a rank leaving with os._exit leaks, and the resource tracker then warns about on stderr)
    tqdm.set_lock(threading.RLock())
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled, ncols=size.columns,
                nrows=size.lines, **kwargs)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the scored positions (in fp32 even when the model
    is bf16)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def forward_backward(
    cfg: TrainConfig, step: int, model, backward, no_sync, phases: dict | None = None
) -> float:
    """One step's forward and backward on this rank's rows: `grad_accum` micro-batches, all but the
    last inside no_sync(). Returns the step's loss. (peers.py drives PyTorch's implementations
    through it.) phases, if given, receives the seconds spent in "forward" (model and loss) and
    "backward" (backward(), including the collectives it waits for), summed over micro-batches: the
    bench's profile. On a mesh (tensor_parallel=M) the M ranks of a row share their rows of the
    batch, and the loss is taken from their vocabulary slices of the logits."""
    m, device = cfg.tensor_parallel, comm.device()
    rank, n = comm.rank() // m, comm.world_size() // m          # this rank's data-parallel index
    group = tensor_parallel.group_of(getattr(model, "module", model))    # an engine's, or a model's
    loss_of = (loss_fn if group is None else
               functools.partial(tensor_parallel.cross_entropy, group=group, ignore_index=IGNORE))
    x, y = global_batch(0 if cfg.fixed_batch else step, cfg.batch_size,
                        cfg.model_config().block_size, seed=cfg.seed)
    step_loss = 0.0
    times = dict.fromkeys(("forward", "backward"), 0.0)
    for micro in range(cfg.grad_accum):
        xm, ym = local_batch(x, y, rank, n, micro, cfg.grad_accum)
        last = micro == cfg.grad_accum - 1
        with contextlib.nullcontext() if last else no_sync():
            start = clock()
            loss = loss_of(model(xm.to(device)), ym.to(device)) / cfg.grad_accum
            middle = clock()
            backward(loss)
            times["forward"] += middle - start
            times["backward"] += clock() - middle
        step_loss += loss.item()
    if phases is not None:
        phases.update(times)
    return step_loss


def clock() -> float:
    """time.perf_counter() once this rank's device has run all it was given. CUDA runs kernels
    asynchronously: a clock read without waiting for them times their launches, not their work.
    (The cost on a GPU: the host stops running ahead of the device at each phase boundary, the same
    on every side the bench compares.)"""
    if comm.device().type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def timed_step(step_fn, phases: dict) -> None:
    """Run the optimizer step, its seconds into phases["step"] (the profile's third phase)."""
    start = clock()
    step_fn()
    phases["step"] = clock() - start


def train_worker(cfg: TrainConfig, make_engine: Callable = wrap) -> dict:
    """Train on this rank; return its losses, memory, communication and timing (and state if asked).

    make_engine(model, stage, optimizer, offload=..., **options) builds the engine: minizero.wrap,
    or (the exercise graders) a factory of an engine subclass that calls a learner's code."""
    rank = comm.rank()
    mcfg = cfg.model_config()
    with sharded_init() if cfg.sharded_init else contextlib.nullcontext() as init:
        model = make_model(mcfg, seed=cfg.seed)
    construction_peak = (
        init.peak_bytes if init else sum(p.numel() * p.element_size() for p in model.parameters())
    )
    if cfg.init_state:
        model.load_state_dict(torch.load(cfg.init_state, map_location="cpu", weights_only=True))
    factory, groups = cfg.optimizer_and_groups(model)
    engine = make_engine(model, cfg.stage, factory, offload=cfg.offload, **cfg.engine_options(),
                         **({} if groups is None else {"param_groups": groups}))
    if cfg.load_dir:
        engine.load(cfg.load_dir)               # also restores step_count: the data continues there
    first = engine.step_count if cfg.load_dir else cfg.start_step
    schedule = None
    if cfg.scheduler:                    # over the torch optimizer stepping this rank's masters
        schedule = build_scheduler(engine.optimizer.optimizer, cfg.scheduler,
                                   total_num_steps=cfg.steps)
        schedule.load_state_dict({"last_batch_iteration": first - 1})   # resumed
    fault = cfg.fault or Fault.from_env()
    if fault:
        fault.arm(engine)
    device = comm.device()
    losses, step_times, phase_times, comm_per_step, loss_scales = [], [], [], [], []
    memory = None
    bar = progress_bar(cfg.steps, f"stage {cfg.stage}", cfg.progress and rank == 0,
                       initial=first, unit="step")
    # bytes on the wire, measured beside the tally's ring bytes (memory/wire.py; None: not here)
    meter = None if wire.unavailable() else wire.WireMeter().start()
    wire_per_step = []
    for step in range(first, cfg.steps):
        comm.reset_tally()
        if meter:
            meter.reset()
        start, phases = clock(), {}
        with comm.synchronous() if cfg.synchronous else contextlib.nullcontext():
            step_loss = forward_backward(cfg, step, engine, engine.backward, engine.no_sync,
                                         phases)
            if step == cfg.steps - 1:
                memory = engine.memory()   # as held at the end of backward (optimizer state exists)
            skipped = engine.skipped_steps
            timed_step(engine.step, phases)
        if schedule is not None and engine.skipped_steps == skipped:   # DeepSpeed: not on overflow
            schedule.step()
        step_times.append(clock() - start)
        phase_times.append(phases)
        comm_per_step.append(network.tally())   # by kind, and intra/inter-node
        losses.append(step_loss)
        wire_per_step.append(meter.bytes() if meter else None)
        loss_scales.append(engine.loss_scale)     # S after the step (fp16; 1.0 otherwise)
        if cfg.log_every and rank == 0 and (step % cfg.log_every == 0 or step == cfg.steps - 1):
            print(f"step {step + 1:>4}/{cfg.steps}  rank 0's loss {step_loss:.4f}  "
                  f"{step_times[-1] * 1e3:.1f} ms/step", flush=True)
        if cfg.save_every and ((step + 1) % cfg.save_every == 0 or step == cfg.steps - 1):
            checkpoint.save_numbered(engine, cfg.save_dir, cfg.keep_last)
        bar.set_postfix(rank0_loss=f"{step_loss:.4f}", refresh=False)
        bar.update()
    bar.close()
    if meter:
        meter.close()
    if cfg.save_dir and not cfg.save_every:
        engine.save(cfg.save_dir)
    result = {
        "rank": rank,
        "backend": comm.backend(),               # where it ran: gloo on the CPU, NCCL on its GPU
        "device": device.type,
        "losses": losses,
        "loss_scales": loss_scales,
        "loss_scale": engine.loss_scale,        # S now (fp16; 1.0 otherwise), and the steps skipped
        "skipped_steps": engine.skipped_steps,
        "memory": memory,
        "comm_bytes_per_step": comm_per_step[-1] if comm_per_step else {},    # modelled
        "wire_bytes_per_step": wire_per_step[-1] if wire_per_step else None,  # measured
        "wire_unavailable": wire.unavailable(),         # why wire_bytes_per_step is None, or None
        "step_times": step_times,
        "phase_times": phase_times,                 # per step: seconds of forward, backward, step
        "num_params": model_num_params(engine),
        "num_frozen": sum(p.numel() for p in engine.frozen),
        "peak": engine.memory()["peak"],
        "construction_peak": construction_peak,     # parameter bytes held while the model was built
    }
    if device.type == "cuda":
        result["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    if cfg.return_state:
        result["state_dict"] = engine.full_state_dict()
    if cfg.measure_peak:                  # every rank at once, at the run's dtype: MFU's peak
        result["gemm_flops_per_s"] = peak_worker(cfg.dtype)
    return result


def train_several(cfgs: list[TrainConfig]) -> list[dict]:
    """Worker: several training runs one after another in one process group (one launch,
    many runs)."""
    return [train_worker(cfg) for cfg in cfgs]


def model_num_params(engine) -> int:
    """Ψ: distinct parameters of the wrapped model (a tied weight once). Stage 3's parameters are
    views of freed buffers, but their shapes are kept, so p.numel() still counts them."""
    return sum(p.numel() for p in engine.module.parameters())
