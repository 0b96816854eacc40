"""The oracle: plain single-process training on the global batch. Every stage must end where
this does.

    from minizero.lab.reference import reference_train
    ref = reference_train(TrainConfig(steps=5))    # {"losses": [...], "state_dict": {...}}

No minizero machinery at all: the model, torch.optim, torch.nn.utils.clip_grad_norm_, one process.
The global batch is all micro-batches of all ranks; its mean loss equals the mean of their means
(equal sizes), so its gradient is what data parallelism must reproduce.

fp16 is compared step for step (the same overflows, skips and loss scales), so its reference
computes in fp16 too, on fp32 master weights, and scales the loss with minizero.loss_scale's rule
(tested on its own in tests/test_loss_scale.py): what a distributed run must match is one process
taking the same decisions.
"""

from __future__ import annotations

import torch

from minizero.lab.data import global_batch
from minizero.lab.model import make_model
from minizero.lab.train import TrainConfig, loss_fn
from minizero.loss_scale import LossScaler


def reference_train(cfg: TrainConfig) -> dict:
    mcfg = cfg.model_config()
    model = make_model(mcfg, seed=cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    scaler = LossScaler(cfg.loss_scale) if cfg.dtype == "fp16" else None
    stepped = params
    if scaler:                                   # fp16 model, fp32 masters that the optimizer steps
        model.half()
        stepped = [torch.nn.Parameter(p.detach().float()) for p in params]
    optimizer = cfg.optimizer_factory()(stepped)
    losses, loss_scales = [], []
    for step in range(cfg.steps):
        x, y = global_batch(step, cfg.batch_size, mcfg.block_size, seed=cfg.seed)
        loss = loss_fn(model(x), y)
        (scaler.scale_loss(loss) if scaler else loss).backward()
        losses.append(loss.item())
        if scaler:
            grads = scaler.unscale(
                [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            )
            for p in params:
                p.grad = None
            loss_scales.append(scaler.scale)
            if grads is None:                    # overflow: skip the step
                continue
            for master, g in zip(stepped, grads):
                master.grad = g
        if cfg.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(stepped, cfg.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scaler:
            with torch.no_grad():
                for p, master in zip(params, stepped):
                    p.copy_(master)         # fp32 master -> fp16 parameter (rounds)
    if scaler:                              # the result is the masters, as engine.full_state_dict()
        model.float()
        with torch.no_grad():
            for p, master in zip(params, stepped):
                p.copy_(master)
    return {
        "losses": losses,
        "loss_scales": loss_scales,
        "skipped_steps": scaler.skipped_steps if scaler else 0,
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def tolerance(dtype: str) -> float:
    """How far from its reference a correct run may end: the one statement of it. fp32: rounding
    only (Adam divides by the gradient's own size, which amplifies it to ~1e-5 for near-zero
    gradients); bf16 (against the fp32 reference): the model computes with 8-bit mantissas, only the
    fp32 masters stay close; fp16 (against the fp16 reference, same skips and scales): each rank
    rounds its own rows' fp16 gradients, and Adam amplifies that to a fair part of lr per step for
    near-zero gradients (2-3e-2 after 7 steps at lr 1e-2; SGD ends 5e-5 apart)."""
    return 1e-4 if dtype == "fp32" else 5e-2


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest |a - b| over every entry of two state dicts with the same keys."""
    if a.keys() != b.keys():
        raise ValueError(f"state dict keys differ: {sorted(a.keys() ^ b.keys())}")
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].numel())
