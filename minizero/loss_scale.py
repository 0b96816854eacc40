"""Loss scaling for fp16 training: lift small gradients into fp16's range, and skip the steps whose
gradients overflowed, on every rank at once.

    # dynamic, DeepSpeed's defaults
    engine = minizero.wrap(model, 2, opt, dtype="fp16")
    engine = minizero.wrap(model, 2, opt, dtype="fp16", loss_scale=1024.0)      # static
    engine = minizero.wrap(model, 2, opt, dtype="fp16",
                           loss_scale={"initial_scale_power": 12, "hysteresis": 1})
    python -m minizero.run --dtype fp16 --world-size 4  # the table ends with the final scale, skips
    python -m pytest tests/test_loss_scale.py

Why (Micikevicius et al., "Mixed Precision Training", 2018): fp16 keeps 5 exponent bits. Values
below ~6e-8 become 0 and values above 65504 become inf; many gradients of a real model are
smaller than the former. Multiplying the loss by S multiplies every gradient by S (chain rule)
and lifts them out of underflow. The step divides them by S again in fp32 (engine.step: in fp16
the division would underflow the small ones again), before clipping and the optimizer, which both
see the true gradient.

Dynamic scaling picks S as large as the gradients allow (DeepSpeed's DynamicLossScaler; the defaults
are its "fp16" config's):
  * S starts at 2**initial_scale_power (2**16);
  * a step whose gradients hold an inf or a nan anywhere is skipped: no optimizer step (its state
    and its step count are untouched), the gradients are cleared. Hysteresis: the first
    `hysteresis` - 1 overflows only use up a credit; the next one, and every one after it until S
    grows again, halves S, never below `min_loss_scale` (an overflow at the minimum is an error, as
    in DeepSpeed: the gradients are broken);
  * a good step that follows `loss_scale_window` good steps since the last overflow doubles S and
    restores the credit (DeepSpeed 0.19.8's rule: the (window + 1)-th good step in a row, then every
    window-th good step).
A static scale (loss_scale=1024.0, DeepSpeed's "loss_scale": 1024) never changes; an overflowed step
is still skipped (DeepSpeed's ZeRO optimizers do the same).

[Note: global overflow] With sharded gradients (stages 1-3) each rank holds only its partition, and
an inf lands in the partition of one rank only (reduce-scatter does not spread it). A rank that
decided from its own partition would skip the step while the others take it: the ranks' parameters
and scales part ways for good, and at stages 1-2 the next all-gather mixes a skipped step with a
taken one (the classic bug of sharded loss scaling). So the flags are agreed first: one all-reduce
(max) of each rank's 0/1 flag, 4 bytes, and every rank takes the same decision. DeepSpeed does the
same, at every stage.

Two consequences of data parallelism worth knowing: the reduction adds N ranks' scaled fp16
gradients before it divides (gloo and NCCL both), so N ranks can overflow at a scale one process
survives (DeepSpeed's gradient_predivide_factor exists for this); and a skipped step at stages 1-2
sends no all-gather (the parameters did not change).
"""

from __future__ import annotations

import torch

from minizero import comm

# DeepSpeed's "fp16" config section: the options of dynamic scaling, and their defaults.
DYNAMIC_DEFAULTS = {
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}


def scaler_for(dtype: str, loss_scale: float | dict | LossScaler | None) -> LossScaler | None:
    """The engine's scaler: fp16 has one, fp32 and bf16 none (their range needs no scaling). The one
    check that loss_scale goes with fp16 (the engine and the CLI call it). A LossScaler given as
    loss_scale is used as it is: the extension point for a scaler of your own (a subclass; exercise
    8's grader)."""
    if dtype == "fp16":
        return loss_scale if isinstance(loss_scale, LossScaler) else LossScaler(loss_scale)
    if loss_scale is not None:
        raise ValueError(
            f"loss_scale is for dtype='fp16' (bf16 and fp32 need none), got dtype={dtype!r}"
        )
    return None


class LossScaler:
    """S, its update rule, and the count of skipped steps. `loss_scale`: None (dynamic, defaults), a
    number (static S), or a dict of some DYNAMIC_DEFAULTS keys (dynamic)."""

    def __init__(self, loss_scale: float | dict | None = None):
        self.dynamic = not isinstance(loss_scale, (int, float)) or isinstance(loss_scale, bool)
        if not self.dynamic:
            if not loss_scale > 0:
                raise ValueError(f"loss_scale must be > 0, got {loss_scale!r}")
            self.scale = float(loss_scale)
        else:
            options = {**DYNAMIC_DEFAULTS, **self._check(loss_scale or {})}
            self.scale = 2.0 ** options["initial_scale_power"]
            self.window = options["loss_scale_window"]
            self.hysteresis = self.credit = options["hysteresis"]
            self.min_scale = float(options["min_loss_scale"])
        self.skipped_steps = 0
        self.iteration = 0                 # steps seen (DeepSpeed's cur_iter)
        self.last_overflow = -1            # the iteration of the last overflow

    @staticmethod
    def _check(options) -> dict:
        if not isinstance(options, dict):
            raise TypeError(
                f"loss_scale must be None, a number or a dict, got {type(options).__name__}"
            )
        unknown = sorted(set(options) - set(DYNAMIC_DEFAULTS))
        if unknown:
            raise ValueError(f"loss_scale: unknown option(s) {', '.join(unknown)} "
                             f"(it takes {', '.join(DYNAMIC_DEFAULTS)})")
        for key, value in options.items():
            low = 0 if key == "initial_scale_power" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"loss_scale: {key} must be an integer >= {low}, got {value!r}")
        return options

    # What a checkpoint keeps (checkpoint.py), DeepSpeed's cur_scale, cur_iter,
    # last_overflow_iter and cur_hysteresis: without them a resumed fp16 run starts again at
    # 2**16 and takes other steps.
    _STATE = ("scale", "credit", "iteration", "last_overflow", "skipped_steps")

    def state_dict(self) -> dict:
        return {
            "dynamic": self.dynamic,
            **{k: getattr(self, k) for k in self._STATE if hasattr(self, k)},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where a saved scaler stopped. A static scale stays the configured one; a dynamic
        scaler takes a static run's counters only."""
        keys = (
            self._STATE if self.dynamic and state.get("dynamic") else ("iteration", "skipped_steps")
        )
        for k in keys:
            setattr(self, k, state[k])

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale(self, grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The step's gradient parts divided by S, as fp32 copies (transient, 4 bytes per owned
        element on the device, as optim.py's bf16 upcast; with offload DeepSpeed unscales on the
        host instead); None if any rank's overflowed (then every rank skips the step). Then S
        moves (`update`)."""
        overflow = self.found_overflow(grads)
        unscaled = (
            None if overflow else [g.to(torch.float32, copy=True).div_(self.scale) for g in grads]
        )
        self.update(overflow)
        return unscaled

    def found_overflow(self, grads: list[torch.Tensor]) -> bool:
        """The overflow check unscale() calls (the module's found_overflow): the seam exercise 10
        grades through, a subclass may replace it."""
        return found_overflow(grads)

    def update(self, overflow: bool) -> None:
        """DeepSpeed's DynamicLossScaler.update_scale (consecutive_hysteresis off), step by step."""
        if overflow:
            self.skipped_steps += 1
            if self.dynamic:
                if self.credit > 1:
                    self.credit -= 1                      # hysteresis: tolerate this one
                elif self.scale == self.min_scale:
                    raise RuntimeError(
                        f"fp16 gradients overflow at the minimum loss scale {self.min_scale:g}: "
                        "they are inf/nan whatever the scale"
                    )
                else:
                    self.scale = max(self.scale / 2, self.min_scale)
                self.last_overflow = self.iteration
        elif self.dynamic:
            # good steps in a row before this one
            good_before = self.iteration - self.last_overflow - 1
            if good_before > 0 and good_before % self.window == 0:
                self.scale *= 2
                self.credit = self.hysteresis
        self.iteration += 1


def found_overflow(grads: list[torch.Tensor]) -> bool:
    """Whether any rank's gradients hold an inf or a nan: the same answer on every
    rank [Note: global overflow]."""
    local = any(not torch.isfinite(g).all() for g in grads)
    flag = torch.tensor(float(local), device=comm.device())
    # the essential line: one decision for all ranks (any rank's overflow skips every rank's step)
    comm.all_reduce(flag, op="max", tag="fp16 overflow")
    return bool(flag.item())
