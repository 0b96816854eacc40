"""DeepSpeed's `"optimizer": {"type": "Muon"}` as minizero's: torch.optim.Muon plus AdamW groups.

    {"optimizer": {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95, "adam_lr": 3e-4}}}
    engine, optimizer, _, _ = minizero.initialize(model=model, config=config)
    python -m pytest tests/test_muon.py -k deepspeed

DeepSpeed 0.19.8 (deepspeed.initialize, then DeepSpeedEngine's Muon branch) does three things, and
minizero does the same three:
  1. tags every parameter `use_muon`: True for a matrix (2 or more dimensions) whose name holds
     neither "embed" nor "lm_head", False otherwise; whatever the script set before;
  2. splits each parameter group (model_parameters' dicts, or one group of everything) into a Muon
     half and an AdamW half. A half's settings: the config's shared lr / weight_decay (and
     momentum, or betas and eps), then muon_lr / adam_lr, then the group's own keys; what is
     still missing is DeepSpeed's default (Muon: lr 0.02, momentum 0.95, weight_decay 0; AdamW:
     lr 3e-4, betas (0.9, 0.95), eps 1e-10, weight_decay 0);
  3. steps the Muon halves with Muon (Nesterov, lr scaled by sqrt(max(1, rows/cols))) and the
     AdamW halves with AdamW (torch's with "torch_adam": true).
minizero's step is torch.optim.Muon's, with the partitioned designs of minizero/beyond/muon/.
Where the two differ (docs/muon.md measures it): DeepSpeed orthogonalizes with its own
Newton-Schulz ("ns_method": "gram" by default: a Gram iteration in fp16, or fp32 on a CPU without
fp16, as this one), minizero with torch's (the quintic iteration, in bf16), so the updates differ
by their rounding; a 4-D convolution weight DeepSpeed flattens to a matrix, minizero refuses
(tag it use_muon = False); DeepSpeed's inline Adam without torch_adam rounds its last digit
differently from torch's AdamW.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

# What each half takes from the config and from a group, and DeepSpeed's defaults for the rest.
MUON_KEYS, ADAMW_KEYS = ("lr", "momentum", "weight_decay"), ("lr", "betas", "eps", "weight_decay")
MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0}
ADAMW_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}


def tag(model: nn.Module) -> None:
    """DeepSpeed's rule: p.use_muon for the matrices that are neither embeddings nor the head."""
    for name, p in model.named_parameters():
        p.use_muon = p.ndim >= 2 and not any(word in name.lower() for word in ("embed", "lm_head"))


def factory_and_groups(model: nn.Module, params: dict, groups: list[dict] | None):
    """(torch.optim.Muon factory, parameter groups for wrap) from the config's optimizer params
    (lr, muon_lr, adam_lr, momentum, weight_decay, betas, eps) and model_parameters' groups (None:
    one group of every trainable parameter). The model's parameters are tagged (tag)."""
    tag(model)
    names = {id(p): name for name, p in model.named_parameters()}
    for p in model.parameters():
        if p.use_muon and p.ndim != 2:
            raise ValueError(f"Muon steps matrices: {names[id(p)]} is {list(p.shape)} (DeepSpeed "
                             "flattens a convolution's weight, minizero does not): set its "
                             "use_muon = False")
    halves = ((True, MUON_KEYS, MUON_DEFAULTS, "muon_lr"),
              (False, ADAMW_KEYS, ADAMW_DEFAULTS, "adam_lr"))
    groups = groups or [{"params": [p for p in model.parameters() if p.requires_grad]}]
    split = []
    for group in groups:
        own = {k: v for k, v in group.items() if k != "params"}
        trainable = [p for p in group["params"] if p.requires_grad]
        for use_muon, keys, defaults, lr_key in halves:
            half = [p for p in trainable if p.use_muon is use_muon]
            if not half:
                continue
            settings = {**defaults, **{k: params[k] for k in keys if k in params}}
            if lr_key in params:
                settings["lr"] = params[lr_key]
            settings.update({k: v for k, v in own.items() if k in keys})
            if "betas" in settings:
                settings["betas"] = tuple(settings["betas"])
            split.append({"params": half, "use_muon": use_muon, **settings})
    return functools.partial(torch.optim.Muon, **MUON_DEFAULTS), split
