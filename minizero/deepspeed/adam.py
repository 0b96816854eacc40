"""Adam and AdamW as DeepSpeed configs name them: torch's, plus `bias_correction=False`.

    optimizer = minizero.deepspeed.adam.AdamW(params, lr=1e-3, bias_correction=False)
    {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "bias_correction": false}}}   # DeepSpeed
    python -m pytest tests/test_adam.py

Adam keeps running averages of the gradient m and of its square v, both started at zero, so for
the first steps they are biased towards zero; Adam divides them by (1 - β1^t) and (1 - β2^t) to
correct that (Kingma and Ba, section 3). DeepSpeed's Adam optimizers (FusedAdam, DeepSpeedCPUAdam)
can leave the correction out, and BERT's original recipe did (its configs say bias_correction
false): the first updates are then smaller, lr·m/(√v + ε) with the raw averages. torch.optim's Adam
always corrects, so with bias_correction=True these classes are torch's own, step for step; with
False they take the uncorrected step below (weight decay: L2 added to the gradient for Adam,
decoupled for AdamW, as torch and DeepSpeed both do). The state is torch's (step, exp_avg,
exp_avg_sq), so checkpoints move between the two.
"""

from __future__ import annotations

import torch


def _uncorrected_step(optimizer: torch.optim.Optimizer, decoupled: bool) -> None:
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            grad = p.grad
            if decay and decoupled:
                p.mul_(1 - lr * decay)                      # AdamW: decay the weight itself
            elif decay:
                grad = grad.add(p, alpha=decay)             # Adam: L2 on the gradient
            m, v = state["exp_avg"], state["exp_avg_sq"]
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            p.addcdiv_(m, v.sqrt().add_(eps), value=-lr)   # <- no 1/(1 - β^t): the raw averages


class _BiasCorrectionSwitch:
    """torch's Adam or AdamW (the class after this one), with bias_correction=False taking the
    uncorrected step."""
    decoupled: bool

    def __init__(self, params, *args, bias_correction: bool = True, **kwargs):
        super().__init__(params, *args, **kwargs)
        self.bias_correction = bias_correction

    @torch.no_grad()
    def step(self, closure=None):
        if self.bias_correction:
            return super().step(closure)
        loss = None if closure is None else closure()
        _uncorrected_step(self, self.decoupled)
        return loss


class Adam(_BiasCorrectionSwitch, torch.optim.Adam):
    decoupled = False


class AdamW(_BiasCorrectionSwitch, torch.optim.AdamW):
    decoupled = True
