"""DeepSpeed's ZeRO as a peer: the same model, data, optimizer and loop as minizero.lab.train,
inside a minizero.launch process group (no torchrun, no deepspeed launcher).

    pip install -e ".[peers]"                           # deepspeed, pure Python (DS_BUILD_OPS=0)
    results = minizero.launch(deepspeed_worker, 2, TrainConfig(stage=2, offload=True))

DeepSpeed stage s <-> minizero stage s (0 = its DDP-like engine; offload=True: "offload_optimizer"
cpu). Stage 3 fetches module by module; `set_z3_leaf_modules(model, [Block])` makes each GPT block
one fetch, the granularity of minizero's units (wrap's default: the blocks) and of the FSDP2 peer
(fully_shard per block), so the three stage-3 implementations gather the same units.

Running inside minizero.launch (what `join` does, and why):
  * DeepSpeed picks its accelerator once, at first use: DS_ACCELERATOR=cpu on a machine without
    CUDA (its CPU accelerator falls back to gloo when oneCCL is absent, the backend our group
    already uses).
  * deepspeed.initialize asserts that LOCAL_RANK is set (torchrun sets it); we set LOCAL_RANK, RANK
    and WORLD_SIZE from the group we are in. The group itself exists already, so
    `dist_init_required=False` makes DeepSpeed wrap it (deepspeed.comm's TorchBackend) instead of
    reading env:// and creating one.
  * That TorchBackend JIT-compiles a shared-memory all-reduce (ShareMemCommBuilder, ~70 s of g++
    on 2 cores, cached afterwards) whenever deepspeed.ops says the op is compatible. It is used only
    by inference_all_reduce (DeepSpeed's tensor-parallel inference); ZeRO training never calls it,
    even on the CPU. Initializing torch.distributed first does not avoid it (TorchBackend is built
    either way), so we mark the op incompatible in deepspeed.ops.__compatible_ops__, the dict
    DeepSpeed probes once per process and keeps for exactly such edits. deepspeed.comm then runs
    every collective on gloo.

Fairness: fp32 on both sides; at stages 1-2 DeepSpeed keeps a separate fp32 master copy even in fp32
(minizero steps its fp32 parameters in place), which counts in its optimizer bytes (at stage 3 its
master is the fp32 partition itself, at stage 0 the parameters); `gradient_clipping` is written
explicitly (DeepSpeed clips at 1.0 when the key is absent, minizero clips only when asked).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings

import torch

from minizero import comm
from minizero.lab.model import Block, make_model
from minizero.lab.train import TrainConfig, clock, forward_backward, timed_step
from minizero.memory import measure

PEER = "deepspeed"


def available() -> bool:
    """Whether DeepSpeed is installed (the optional extra `pip install -e ".[peers]"`)."""
    return importlib.util.find_spec("deepspeed") is not None


def ds_config(cfg: TrainConfig) -> dict:
    """The DeepSpeed config that trains as minizero trains `cfg` (fp32, one micro-batch per step).
    minizero.deepspeed.config reads it back into the same TrainConfig fields
    (tests/test_deepspeed.py)."""
    if cfg.dtype != "fp32" or cfg.grad_accum != 1 or cfg.optimizer not in ("adam", "adamw",
                                                                           "muon"):
        raise ValueError("the DeepSpeed peer is compared in fp32, with Adam(W) or Muon and one "
                         "micro-batch per step")
    zero = {"stage": cfg.stage,
            "reduce_bucket_size": int(cfg.bucket_size // 4),  # bytes -> fp32 elements
            "stage3_param_persistence_threshold": 0,          # shard every parameter, however small
            # Stage 3's default replaces torch.nn.functional.linear, process-wide and for good, with
            # its own autograd function (it rounds differently: 8.5e-5 apart after 6 steps of the 1M
            # GPT), so every later run in the process, minizero's and PyTorch's too, would compute
            # with DeepSpeed's linear.
            "memory_efficient_linear": False}
    if cfg.offload:
        if cfg.offload not in (True, "optimizer"):
            raise ValueError(
                f"the DeepSpeed peer offloads the optimizer only, got offload={cfg.offload!r}"
            )
        zero["offload_optimizer"] = {"device": "cpu"}
    muon = {}
    if cfg.optimizer == "muon":             # its own section (deepspeed/muon.py reads it alike)
        muon = {"optimizer": {"type": "Muon", "params": {"lr": cfg.lr, **cfg.optimizer_params,
                                                         "torch_adam": True}}}
        zero["reduce_scatter"] = cfg.stage != 3      # DeepSpeed's stage 3 refuses Muon with it
    return {**muon, "train_micro_batch_size_per_gpu": cfg.batch_size // cfg.world_size,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": cfg.clip_grad_norm or 0.0,         # absent would mean 1.0
            "zero_allow_untested_optimizer": True,         # torch.optim.AdamW, not FusedAdam
            "zero_force_ds_cpu_optimizer": False,          # ... nor DeepSpeedCPUAdam when offloaded
            "zero_optimization": zero}


def join():
    """Import DeepSpeed inside this rank's existing process group (see the module docstring);
    returns the deepspeed module."""
    if comm.device().type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in {
        "LOCAL_RANK": comm.rank(),
        "RANK": comm.rank(),
        "WORLD_SIZE": comm.world_size(),
    }.items():
        os.environ.setdefault(key, str(value))
    import deepspeed
    import deepspeed.ops
    # no 70 s JIT for an inference-only op
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # DeepSpeed 0.19 still calls torch.distributed's reduce_scatter_tensor / all_gather_into_tensor,
    # which torch 2.13 deprecates with a FutureWarning per call: pages of them in the bench's
    # output. Only those are silenced.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )
    return deepspeed


def build(cfg: TrainConfig):
    """A DeepSpeed engine for `cfg`: same initial weights (seed), same optimizer, blocks as
    stage-3 units."""
    deepspeed = join()
    model = make_model(cfg.model_config(), seed=cfg.seed).to(comm.device())
    if cfg.stage == 3:
        from deepspeed.utils import set_z3_leaf_modules
        set_z3_leaf_modules(model, [Block])
    if cfg.optimizer == "muon":
        # DeepSpeed's Muon kernels are torch.compile'd: on a CPU ~45 s of g++ per shape (measured),
        # so they run eagerly here, as minizero's do
        torch._dynamo.config.disable = True
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(cfg), dist_init_required=False)
        return engine
    optimizer = cfg.optimizer_factory()([p for p in model.parameters() if p.requires_grad])
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(cfg),
                                      dist_init_required=False)
    return engine


def deepspeed_worker(cfg: TrainConfig) -> dict:
    """The loop of minizero.lab.train.train_worker with a DeepSpeed engine: losses, step times,
    memory (as held at the end of the last backward), Adam's moment bytes, and the full state
    if asked."""
    engine = build(cfg)
    losses, step_times, phase_times, memory = [], [], [], None
    for step in range(cfg.steps):
        start, phases = clock(), {}
        # one micro-batch per step (ds_config), so no_sync is never entered; DeepSpeed's own refuses
        # stage 2-3
        losses.append(forward_backward(cfg, step, engine, engine.backward, engine.no_sync, phases))
        if step == cfg.steps - 1:
            memory = _memory(engine, cfg)
        timed_step(engine.step, phases)
        step_times.append(clock() - start)
        phase_times.append(phases)
    result = {
        "rank": comm.rank(),
        "losses": losses,
        "step_times": step_times,
        "phase_times": phase_times,
        "memory": memory,
        "adam_moment_bytes": adam_moment_bytes(_inner_optimizer(engine)),
    }
    if cfg.return_state:
        result["state_dict"] = full_state_dict(engine)
    engine.destroy()
    _release(engine)
    return result


def full_state_dict(engine) -> dict[str, torch.Tensor]:
    """Plain CPU tensors with the model's keys; stage 3's partitioned parameters gathered first."""
    import deepspeed
    params = list(engine.module.parameters())
    with (
        deepspeed.zero.GatheredParameters(params)
        if engine.zero_optimization_stage() == 3
        else contextlib.nullcontext()
    ):
        return {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}


def adam_moment_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of Adam's exp_avg and exp_avg_sq held by this rank's torch optimizer (the 8Ψ(/N)
    of K)."""
    return sum(s[k].numel() * s[k].element_size() for s in optimizer.state.values()
               for k in ("exp_avg", "exp_avg_sq") if k in s)


def _inner_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer DeepSpeed steps (inside its ZeRO optimizer at stages 1-3)."""
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def _memory(engine, cfg: TrainConfig) -> dict[str, int]:
    """This rank's model-state bytes, counted like minizero's (each storage once, first category
    wins): params: the module's parameters (stage 3: each one's partition, ds_tensor); optimizer
    (offloaded when offload_optimizer is on): the fp32 masters the torch optimizer steps and its
    state; grads: every other tensor the ZeRO optimizer holds (gradient partitions, reduce buckets)
    and the parameters' .grad."""
    params = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    inner = _inner_optimizer(engine)
    stepped = [p for g in inner.param_groups for p in g["params"]]
    state = _state_tensors(inner)
    held = _tensors_held(engine.optimizer) + [
        p.grad for p in engine.module.parameters() if p.grad is not None
    ]
    optimizer_key = "offloaded" if cfg.offload else "optimizer"
    out = measure({"params": params, optimizer_key: stepped + state, "grads": held})
    return {"params": out["params"], "grads": out["grads"], "optimizer": out.get("optimizer", 0),
            "offloaded": out.get("offloaded", 0)}


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in a torch optimizer's state (Adam's moments, its step counters)."""
    return [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


def _release(engine) -> None:
    """Free the storage of every tensor a finished engine holds. DeepSpeed's stage-3 engine stays
    reachable after destroy(), even through gc.collect() (its hooks on the parameters close cycles
    that the collector cannot see: the trap minizero.reducer's weak hook avoids), so each stage-3
    run would keep its model states until the process ends; the bench runs dozens of engines in
    one process."""
    module_tensors = [
        t
        for p in engine.module.parameters()
        for t in (p, getattr(p, "ds_tensor", None), p.grad)
        if t is not None
    ]
    for t in (
        module_tensors + _state_tensors(_inner_optimizer(engine)) + _tensors_held(engine.optimizer)
    ):
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)


def _tensors_held(obj, depth: int = 3) -> list[torch.Tensor]:
    """Tensors an object's attributes hold directly or in lists/tuples/dicts, `depth`
    levels down."""
    found = []

    def visit(x, d):
        if torch.is_tensor(x):
            found.append(x)
        elif d > 0 and isinstance(x, (list, tuple)):
            for item in x:
                visit(item, d - 1)
        elif d > 0 and isinstance(x, dict):
            for item in x.values():
                visit(item, d - 1)

    for value in vars(obj).values():
        visit(value, depth)
    return found

