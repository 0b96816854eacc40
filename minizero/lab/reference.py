"""The oracle: plain single-process training on the global batch. Every stage must end where this does.

    from minizero.lab.reference import reference_train
    ref = reference_train(TrainConfig(steps=5))    # {"losses": [...], "state_dict": {...}}

No minizero machinery at all: the model, torch.optim, torch.nn.utils.clip_grad_norm_, one process. The
global batch is all micro-batches of all ranks; its mean loss equals the mean of their means (equal
sizes), so its gradient is what data parallelism must reproduce.
"""

from __future__ import annotations

import torch

from minizero.lab.data import global_batch
from minizero.lab.model import make_model
from minizero.lab.train import TrainConfig, loss_fn


def reference_train(cfg: TrainConfig) -> dict:
    mcfg = cfg.model_config()
    model = make_model(mcfg, seed=cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = cfg.optimizer_factory()(params)
    losses = []
    for step in range(cfg.steps):
        x, y = global_batch(step, cfg.batch_size, mcfg.block_size, seed=cfg.seed)
        loss = loss_fn(model(x), y)
        loss.backward()
        if cfg.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, cfg.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def tolerance(dtype: str) -> float:
    """How far from this fp32 reference a correct run may end: the one statement of it. fp32: rounding
    only (Adam divides by the gradient's own size, which amplifies it to ~1e-5 for near-zero gradients);
    bf16: the model computes with 8-bit mantissas, only the fp32 masters stay close."""
    return 1e-4 if dtype == "fp32" else 5e-2


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest |a - b| over every entry of two state dicts with the same keys."""
    if a.keys() != b.keys():
        raise ValueError(f"state dict keys differ: {sorted(a.keys() ^ b.keys())}")
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].numel())
