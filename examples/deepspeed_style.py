"""A training script written the way a DeepSpeed user writes one; minizero runs it unchanged.

    torchrun --nproc_per_node 2 examples/deepspeed_style.py                  # minizero
    torchrun --nproc_per_node 2 examples/deepspeed_style.py --stage 3
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/deepspeed_style.py --deepspeed

The only line that differs is the import (`import deepspeed` or `import minizero as deepspeed`);
reading the final parameters differs too, since stage 3 keeps them partitioned and the two libraries
gather them by different names. tests/test_initialize.py runs `train` with both, at stages 1, 2, 3
and 2 + offload, and checks they end within 1e-6. (Standalone, DeepSpeed 0.19.8 first JIT-compiles
an inference-only op for ~70 s; minizero/lab/deepspeed_peer.py says why the test avoids that.)
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from minizero.lab.data import global_batch, local_batch
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.train import loss_fn

STEPS = 4


def ds_config(stage: int, offload: bool = False) -> dict:
    """A DeepSpeed config: AdamW and a log warm-up from the config, 2 micro-batches per step."""
    zero = {"stage": stage,
            "stage3_param_persistence_threshold": 0,      # DeepSpeed: shard even small parameters
            "memory_efficient_linear": False}             # DeepSpeed: keep torch's own linear
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.0,                     # off (left out, DeepSpeed clips at 1.0)
            "optimizer": {"type": "AdamW",
                          "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR",
                          "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                     "warmup_num_steps": 3}},
            "zero_allow_untested_optimizer": True,        # DeepSpeed: torch's AdamW, not FusedAdam
            "zero_force_ds_cpu_optimizer": False,         # ... nor its CPUAdam when offloaded
            "zero_optimization": zero}


def train(deepspeed, config: dict, steps: int = STEPS) -> tuple[list[float], dict]:
    """Train the small GPT (tied embedding/head, odd sizes) with `deepspeed` (either module); return
    rank's losses and the final full parameters."""
    cfg = GPTConfig.named("tiny", n_embd=15)
    model = make_model(cfg, seed=0)
    # (engine, optimizer, training_dataloader, lr_scheduler): the engine steps the last two itself
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    accumulation = engine.gradient_accumulation_steps()
    rows = engine.train_micro_batch_size_per_gpu() * accumulation * world
    losses = []
    for step in range(steps):
        x, y = global_batch(step, rows, cfg.block_size, seed=0)
        for micro in range(accumulation):       # DeepSpeed: backward and step every micro-batch
            xm, ym = local_batch(x, y, rank, world, micro, accumulation)
            loss = loss_fn(engine(xm), ym)
            engine.backward(loss)
            engine.step()                                   # an optimizer step at the boundary only
            losses.append(loss.item())
    return losses, full_parameters(deepspeed, engine)


def full_parameters(deepspeed, engine) -> dict[str, torch.Tensor]:
    if hasattr(deepspeed, "zero"):                          # DeepSpeed: gather stage 3's partitions
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    return engine.full_state_dict()              # minizero: collective, every rank gets it


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--deepspeed", action="store_true", help="DeepSpeed instead of minizero")
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--offload", action="store_true", help="optimizer state on the host")
    args = p.parse_args()
    if args.deepspeed:
        import deepspeed
    else:
        import minizero as deepspeed
    losses, params = train(deepspeed, ds_config(args.stage, args.offload))
    if dist.get_rank() == 0:
        print(f"losses {' '.join(f'{v:.4f}' for v in losses)}")
        total = sum(v.double().sum().item() for v in params.values())
        print(f"sum of the final parameters {total:.8f}")


if __name__ == "__main__":
    main()
