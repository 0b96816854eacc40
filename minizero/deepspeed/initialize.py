"""`minizero.initialize`: DeepSpeed's front end, over minizero's engines.

    engine, optimizer, _, lr_scheduler = minizero.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")
    for x, y in micro_batches:              # every micro-batch, as a DeepSpeed script does
        loss = loss_fn(engine(x), y)
        engine.backward(loss)               # the loss / gradient_accumulation_steps
        engine.step()                       # the optimizer and the schedule: at the boundary only

    torchrun --nproc_per_node 2 examples/deepspeed_style.py   # the same script runs DeepSpeed

The config is read by minizero/deepspeed/config.py, the reader `python -m minizero.run --config`
uses: its zero_optimization, bf16/fp16, gradient_clipping (1.0 when absent, DeepSpeed's default),
batch sizes, optimizer and scheduler sections. "auto" is resolved where the batch rule or the
model's hidden size decides it, and is an error elsewhere (config.load_deepspeed_config,
flags=False).

Two front ends, one engine: `minizero.wrap(model, stage, optimizer_factory)` is the engine itself.
initialize builds exactly that engine (wrap) from the config, and adds what DeepSpeed's own engine
adds on top: gradient accumulation counted by the engine, not by the script. DeepSpeed users call
backward() and step() after every micro-batch; the engine scales each loss by 1/K (K =
gradient_accumulation_steps), and only the K-th step() is an optimizer step
(is_gradient_accumulation_boundary()). In between, stages 0-1 accumulate locally (no_sync(): their
gradients are whole on every rank anyway) and stages 2-3 reduce-scatter every micro-batch into the
gradient shard (Ψ/N of gradient memory, DeepSpeed's way). The optimizer is built by minizero over
this rank's partition: an optimizer object passed in gives its class, settings and parameter groups
(which parameters each holds), never its tensors (it was built over the whole model). Parameter
groups (model_parameters as dicts, or the object's) keep their own lr, weight_decay, betas...:
optim.py [Note: parameter groups].

DeepSpeed's AutoTP key, tensor_parallel.autotp_size = M > 1: the model (minizero's GPT, GPT-2,
Llama: beyond/tensor_parallel_hf.py) is split over rows of M ranks, ZeRO along the columns of N/M
(wrap's tensor_parallel=M), and its head all-gathers the logits, so the script's loss on whole
logits is the one it computes without. The M ranks of a row must be given the same micro-batch (the
training_data loader does, as DeepSpeed's AutoTP checks).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from minizero import comm
from minizero.deepspeed import deepspeed_checkpoint, muon
from minizero.beyond import tensor_parallel_hf
from minizero.deepspeed.config import (
    OPTIMIZERS,
    ConfigError,
    build_scheduler,
    load_deepspeed_config,
)
from minizero.engine import Engine
from minizero.units import apply_leaf_module_config
from minizero.wrap import check_options, wrap

# What the config reader gives (TrainConfig's names) that wrap takes as options.
ENGINE_OPTIONS = ("dtype", "loss_scale", "reduce_dtype", "clip_grad_norm", "bucket_size",
                  "prefetch", "quantized_weights", "quantized_gradients", "shard_group_size",
                  "hpz_group_size")
# Sizes a DeepSpeed config sets at every stage (the reader warns where they mean nothing): left out
# where the stage takes no such option, as DeepSpeed ignores them there.
SIZE_OPTIONS = ("bucket_size", "prefetch")


class DeepSpeedStyleEngine:
    """DeepSpeed's engine interface over a minizero engine (`self.engine`, what wrap builds).

    Anything else (memory(), full_state_dict(), gathered(), save(), load(), skipped_steps,
    loss_scale) is the minizero engine's."""

    def __init__(self, engine: Engine, gradient_accumulation_steps: int, micro_batch: int | None,
                 lr_scheduler=None):
        self.engine = engine
        self.module = engine.module
        self.optimizer = engine.optimizer.optimizer      # torch's, over this rank's masters
        self.lr_scheduler = lr_scheduler
        self._accumulation, self._micro_batch = gradient_accumulation_steps, micro_batch
        self.micro_steps = 0            # backward/step pairs so far
        self._micro_in_step = 0         # ... since the last optimizer step (a resume may change K)
        self.global_steps = 0           # optimizer steps so far (skipped fp16 ones too: DeepSpeed)
        self._step_applied = False      # whether the last step() updated the parameters
        self._in_backward = False       # inside backward(): a plain loss.backward() is not

    def __call__(self, *inputs, **kwargs):
        output = self.engine(*inputs, **kwargs)
        if self._accumulation > 1 and torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(self._refuse_plain_backward)
        return output

    def _refuse_plain_backward(self, grad):
        """A loss.backward() that did not come through backward() misses the loss's 1/K: with
        K > 1 it would step on K times the mean gradient. DeepSpeed's scripts call
        engine.backward(loss); a plain one is refused in one line rather than trained wrong."""
        if not self._in_backward:
            raise RuntimeError(f"gradient_accumulation_steps is {self._accumulation}: call "
                               "engine.backward(loss), which divides the loss by it, not "
                               "loss.backward()")

    forward = __call__

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def gradient_accumulation_steps(self) -> int:
        return self._accumulation

    def train_micro_batch_size_per_gpu(self) -> int | None:
        return self._micro_batch

    def train_batch_size(self) -> int | None:
        if self._micro_batch is None:
            return None
        return self._micro_batch * self._accumulation * comm.world_size()

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch is the last of an optimizer step."""
        return self._micro_in_step + 1 == self._accumulation

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward of loss / K; gradients accumulate over the step's micro-batches. Returns the
        scaled loss."""
        loss = loss / self._accumulation                      # the step's gradient: the mean over K
        local = self.engine.stage <= 1 and not self.is_gradient_accumulation_boundary()
        self._in_backward = True
        try:
            with self.engine.no_sync() if local else contextlib.nullcontext():
                self.engine.backward(loss)
        finally:
            self._in_backward = False
        return loss

    def step(self) -> None:
        """At the boundary: the optimizer step (clipping, fp16 overflow check) and the schedule's
        step (not after a skipped fp16 step, as DeepSpeed). Between boundaries: nothing but
        counting."""
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            skipped = self.engine.skipped_steps
            self.engine.step()
            self._step_applied = self.engine.skipped_steps == skipped
            if self.lr_scheduler is not None and self._step_applied:
                self.lr_scheduler.step()
            self.global_steps += 1
        self.micro_steps += 1
        self._micro_in_step = 0 if boundary else self._micro_in_step + 1

    # --- checkpoints: tags, `latest`, client_state (deepspeed/deepspeed_checkpoint.py)
    # --------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Collective, between steps: save_dir/tag (default global_step{global_steps}), then
        save_dir/latest. exclude_frozen_parameters: an error (the checkpoint's frozen parameters
        are what a resumed run needs: minizero saves them once, in replicated.pt)."""
        if exclude_frozen_parameters:
            raise ValueError("save_checkpoint: exclude_frozen_parameters=True is not supported "
                             "(minizero saves the frozen parameters once, from rank 0)")
        return deepspeed_checkpoint.save_checkpoint(self, save_dir, tag, client_state,
                                                    save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        """Collective, between steps: (path, client_state), or (None, None) without a tag and
        without load_dir/latest (one warning), as DeepSpeed."""
        return deepspeed_checkpoint.load_checkpoint(
            self, load_dir, tag, load_module_strict, load_optimizer_states,
            load_lr_scheduler_states, load_module_only, custom_load_fn)

    # --- what DeepSpeed scripts ask their engine -------------------------------------------------
    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_mom(self) -> list:
        """Each group's betas (Adam) or momentum (SGD), as DeepSpeed's get_mom."""
        return [group["betas"] if "betas" in group else group.get("momentum")
                for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer step: computed for clipping, so None
        with gradient_clipping 0 (DeepSpeed computes it at every step)."""
        return self.engine.last_grad_norm

    def was_step_applied(self) -> bool:
        """Whether the last step() updated the parameters (False between boundaries and on a
        skipped fp16 step)."""
        return self._step_applied

    def zero_grad(self) -> None:
        """DeepSpeed's: every parameter's .grad = None (the engine's own gradient buffers are
        zeroed by step())."""
        for p in self.module.parameters():
            p.grad = None

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def empty_partition_cache(self) -> None:
        """DeepSpeed's (stage 3 frees the parameters it kept gathered): minizero's units are freed
        after every use, so nothing is held between steps."""

    def destroy(self) -> None:
        """DeepSpeed's (removes its hooks): minizero's engine needs no teardown; the model keeps
        its hooks, as the engine is the model's for good."""

    def zero_optimization_stage(self) -> int:
        return self.engine.stage

    def zero_optimization(self) -> bool:
        return self.engine.stage > 0

    def fp16_enabled(self) -> bool:
        return self.engine.dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        return self.engine.dtype == torch.bfloat16

    def gradient_clipping(self) -> float:
        return self.engine.clip_grad_norm or 0.0

    @property
    def global_samples(self) -> int | None:
        batch = self.train_batch_size()
        return None if batch is None else self.global_steps * batch

    @property
    def global_rank(self) -> int:
        return comm.rank()

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", comm.rank()))   # launch: one node, rank = local

    @property
    def world_size(self) -> int:
        return comm.world_size()


def initialize(args=None, model: nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, config=None, config_params=None,
               dist_init_required: bool | None = None, units: list[nn.Module] | None = None):
    """(engine, optimizer, training_dataloader, lr_scheduler), as deepspeed.initialize returns them.

    config (or config_params, or args.deepspeed_config): a DeepSpeed JSON path or dict.
    optimizer: None (the config's optimizer section), a torch.optim.Optimizer (its class, and its
        parameter groups with their settings) or a factory params -> Optimizer. model_parameters:
        None (every trainable parameter), parameters (frozen ones among them are not trained, as
        in DeepSpeed) or torch's group dicts [{"params": [...], "weight_decay": 0.0}, ...]
        ([Note: parameter groups] in optim.py); trainable parameters in none are not trained, and
        groups with no parameters are dropped, as DeepSpeed does both.
    lr_scheduler: None (the config's scheduler section) or a factory optimizer -> scheduler.
    units: minizero's own (wrap's units=), stage 3's units, e.g. list(model.blocks). Leaf modules
        (units.py's [Note: leaf modules]) are flagged as deepspeed.initialize flags them: the
        config's zero_optimization.leaf_module, else DeepSpeed's default MoE block classes, and
        any set_z3_leaf_modules() the script called before.
    training_data: a torch Dataset: each rank gets a DataLoader of its share (DistributedSampler) in
        micro-batches. The process group is joined from torchrun's environment unless it exists
        (dist_init_required=False: never). Bad values: ValueError / TypeError / ConfigError, one
        line."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    source = config if config is not None else config_params
    if source is None:
        source = getattr(args, "deepspeed_config", None)
    if source is None:
        raise ValueError("no config: pass config= (a DeepSpeed JSON path or dict)")
    if dist_init_required is not False and not dist.is_initialized() and "RANK" in os.environ:
        comm.init()                        # torchrun's env://, as deepspeed.init_distributed
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)   # Hugging Face models
    settings, notes = load_deepspeed_config(source, comm.world_size(), flags=False,
                                            hidden_size=hidden,
                                            client_optimizer=optimizer is not None)
    if comm.rank() == 0:
        for note in notes:
            warnings.warn(note, stacklevel=2)
    factory, groups = _optimizer_factory(optimizer, settings,
                                         _check_parameters(model, model_parameters), model)
    stage = settings.get("stage", 0)                       # DeepSpeed's default: no ZeRO
    options = {name: settings[name] for name in ENGINE_OPTIONS if name in settings}
    for name in SIZE_OPTIONS:
        if name in options:
            try:
                check_options(stage, {name})
            except TypeError:
                del options[name]
    apply_leaf_module_config(model, **settings.get("leaf_module", {}))
    if units is not None:
        options["units"] = units
    m = settings.get("tensor_parallel", 1)               # tensor_parallel.autotp_size
    if m > 1:
        if not tensor_parallel_hf.knows(model):
            raise ConfigError(f"tensor_parallel.autotp_size {m}: minizero splits its GPT, GPT-2 "
                              f"and Llama, not a {type(model).__name__} (DeepSpeed's AutoTP finds "
                              "the linear layers of any model)")
        options["tensor_parallel"] = m
    engine = wrap(model, stage, factory, offload=settings.get("offload", False),
                  activation_checkpointing=settings.get("activation_checkpointing", False),
                  param_groups=groups, **options)
    if m > 1:
        tensor_parallel_hf.gather_logits(model)     # the script's loss takes whole logits (AutoTP)
    schedule = _scheduler(engine.optimizer.optimizer, lr_scheduler, settings.get("scheduler"))
    accumulation = settings.get("grad_accum", 1)
    micro = None
    if "batch_size" in settings:
        micro = settings["batch_size"] // (accumulation * comm.world_size())
    outer = DeepSpeedStyleEngine(engine, accumulation, micro, schedule)
    loader = None if training_data is None else _loader(training_data, micro or 1, m)
    return outer, outer.optimizer, loader, schedule


def _check_parameters(model: nn.Module, model_parameters) -> list[dict] | None:
    """model_parameters as wrap's param_groups: None when they are every trainable parameter (one
    group, the factory's settings), else torch's group dicts (wrap checks them against the
    model). Frozen parameters given are not trained, as DeepSpeed's ZeRO filters them out."""
    if model_parameters is None:
        return None
    if isinstance(model_parameters, (torch.Tensor, dict)):
        model_parameters = [model_parameters]
    given = list(model_parameters)
    if all(isinstance(g, dict) for g in given) and given:
        return [_listed(g) for g in given]
    if not all(isinstance(p, torch.Tensor) for p in given):
        raise TypeError("model_parameters must be parameters or parameter-group dicts "
                        "{'params': [...], ...}, not a mix")
    if {id(p) for p in given if p.requires_grad} == {
            id(p) for p in model.parameters() if p.requires_grad}:
        return None
    return [{"params": given}]


def _optimizer_factory(optimizer, settings: dict, groups: list[dict] | None, model: nn.Module):
    """(params -> torch optimizer, parameter groups for wrap): from the object or factory given,
    else from the config's section. An optimizer object gives its class, its defaults and its own
    groups (settings and parameters; model_parameters then only chose what it was built over, as
    in DeepSpeed). Muon's section tags the model's parameters and splits the groups in two
    (deepspeed/muon.py)."""
    if optimizer is not None and "optimizer" in settings:
        raise ConfigError("the config has an optimizer section and optimizer= was passed too: "
                          "choose one")
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = [dict(g) for g in optimizer.param_groups]       # params and every setting
        # its defaults that its constructor takes (AdamW's decoupled_weight_decay it sets itself)
        accepted = inspect.signature(type(optimizer)).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        factory = functools.partial(type(optimizer), **defaults)
    elif optimizer is not None:
        if not callable(optimizer):
            raise TypeError("optimizer must be a torch.optim.Optimizer or a factory params -> "
                            f"Optimizer, got {type(optimizer).__name__}")
        factory = optimizer
    elif "optimizer" not in settings:
        raise ConfigError("no optimizer: give the config an optimizer section or pass optimizer=")
    else:
        lr = {"lr": settings["lr"]} if "lr" in settings else {}
        params = settings.get("optimizer_params", {})
        if settings["optimizer"] == "muon":
            return muon.factory_and_groups(model, {**lr, **params}, _nonempty(groups))
        factory = functools.partial(OPTIMIZERS[settings["optimizer"]], **lr, **params)
    return factory, _nonempty(groups)


def _nonempty(groups: list[dict] | None) -> list[dict] | None:
    """DeepSpeed removes the groups with no parameters."""
    if groups is None:
        return None
    return [g for g in groups if not (isinstance(g, dict) and isinstance(g.get("params"), list)
                                      and not g["params"])]


def _listed(group):
    """A group dict with its "params" as a list (a generator is read once; one tensor is a group of
    one); anything else as it is, for wrap to say what is wrong with it."""
    if not isinstance(group, dict) or "params" not in group:
        return group
    params = group["params"]
    return {**group, "params": [params] if isinstance(params, torch.Tensor) else list(params)}


def _scheduler(optimizer: torch.optim.Optimizer, given, spec: dict | None):
    if given is not None and spec is not None:
        raise ConfigError("the config has a scheduler section and lr_scheduler= was passed too: "
                          "choose one")
    if given is not None:
        if not callable(given) or hasattr(given, "step"):
            raise TypeError("lr_scheduler must be a factory optimizer -> scheduler (minizero "
                            "builds the optimizer: a scheduler made over yours would step another)")
        return given(optimizer)
    return None if spec is None else build_scheduler(optimizer, spec)


def _loader(dataset, micro_batch: int, tensor_parallel: int = 1):
    """Each data-parallel rank its share; the M ranks of a tensor-parallel row the same one."""
    from torch.utils.data import DataLoader, DistributedSampler
    n = comm.world_size() // tensor_parallel
    sampler = DistributedSampler(dataset, n, comm.rank() // tensor_parallel) if n > 1 else None
    return DataLoader(dataset, batch_size=micro_batch, sampler=sampler)
