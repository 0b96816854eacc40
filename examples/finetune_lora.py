"""Fine-tune a Hugging Face GPT-2 with LoRA, activation checkpointing and ZeRO stage 3 on
N processes.

    python examples/finetune_lora.py                           # 2 ranks, 40 steps, ~15 s on 2 cores
    python examples/finetune_lora.py --world-size 4 --steps 100 --no-checkpointing

The model is a small GPT-2 built from its config, so nothing is downloaded; for a real checkpoint
replace `GPT2LMHeadModel(config)` with `GPT2LMHeadModel.from_pretrained(name)`. The task is
minizero's digit sorting (minizero.lab.data). peft freezes the base and adds rank-8 adapters to
every attention's c_attn; HF recomputes each decoder layer's activations in backward instead of
keeping them; minizero.sharded_init builds the model already partitioned over the ranks (no rank
ever holds all of it), and minizero.wrap trains it at stage 3, the decoder layers as units: the
frozen base is sharded like the adapters. It prints the loss of the global batch and, at the end,
each rank's model-state bytes next to the ZeRO paper's formula.
"""

import argparse
import functools

import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel

import minizero
from minizero import comm
from minizero.lab.data import VOCAB_SIZE, global_batch, local_batch
from minizero.lab.train import loss_fn
from minizero.memory import estimate_breakdown, within_padding

BLOCK = 16                # tokens per row: 8 digits, the separator, 7 of the sorted digits
BATCH = 32                # rows per step, all ranks together: each rank trains on BATCH / N of them


def build_model(checkpointing: bool) -> torch.nn.Module:
    torch.manual_seed(0)              # the same model on every rank (wrap also broadcasts rank 0's)
    # GPT-2's 50256 is not in this vocabulary
    config = GPT2Config(vocab_size=VOCAB_SIZE, n_positions=BLOCK, n_embd=64, n_layer=4, n_head=4,
                        bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(config)
    if checkpointing:                     # non-reentrant: the variant that works with module hooks
        # transformers 5's name (the old one warns)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        else:                                                        # transformers 4.x
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    # GPT-2's c_attn is a Conv1D, whose weight is stored [in, out]: fan_in_fan_out says so
    return get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True)
    )


def worker(steps: int, checkpointing: bool, lr: float) -> dict:
    """One rank's training; at module level, so that minizero.launch's processes can import it."""
    with minizero.sharded_init() as init:                      # each rank keeps 1/N of every weight
        model = build_model(checkpointing)
    units = list(model.get_base_model().transformer.h)        # gathered one decoder layer at a time
    engine = minizero.wrap(model, 3, functools.partial(torch.optim.AdamW, lr=lr), units=units)
    # device: cpu or this rank's GPU
    rank, n, device = comm.rank(), comm.world_size(), comm.device()
    for step in range(steps):
        x, y = local_batch(*global_batch(step, BATCH, BLOCK), rank, n)     # this rank's rows
        x, y = x.to(device), y.to(device)
        loss = loss_fn(engine(input_ids=x, use_cache=False).logits, y)    # HF returns a ModelOutput
        engine.backward(loss)
        if step == steps - 1:
            # after backward, before the step: gradients and optimizer state
            memory = engine.memory()
        engine.step()
        loss = loss.detach()
        # the global batch's loss: the mean of the ranks' equal-sized means
        comm.all_reduce(loss, op="avg")
        if rank == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"step {step + 1:>3}/{steps}  loss {loss.item():.4f}", flush=True)
    counts = [
        sum(p.numel() for p in model.parameters() if p.requires_grad == t) for t in (True, False)
    ]
    return {
        "memory": memory,
        "trainable": counts[0],
        "frozen": counts[1],
        "construction": init.peak_bytes,
    }


def report(results: list[dict], world_size: int) -> None:
    """Measured bytes per rank next to ZeRO-3's (2 + 2 + K)Ψ/N, here fp32 (4 + 4) and
    AdamW (K = 8)."""
    trainable, frozen = results[0]["trainable"], results[0]["frozen"]
    # Parameters: (Ψ + Ψ_f)·4/N, frozen ones sharded too; gradients and optimizer state: trained
    # ones only.
    theory = estimate_breakdown(
        trainable, world_size, 3, param_bytes=4, grad_bytes=4, k=8, frozen=frozen
    )
    print(f"\nLoRA: {trainable:,} trained parameters, {frozen:,} frozen; bytes per rank "
          f"(formula: ZeRO-3, fp32, AdamW, N = {world_size})")
    print(f"{'rank':>7}" + "".join(f"{k:>12}" for k in ("params", "grads", "optimizer", "peak")))
    for rank, res in enumerate(results):
        m = res["memory"]
        print(
            f"{rank:>7}" + "".join(f"{m[k]:>12,}" for k in ("params", "grads", "optimizer", "peak"))
        )
    print(
        f"{'formula':>7}"
        + "".join(f"{theory[k]:>12,.0f}" for k in ("params", "grads", "optimizer"))
    )
    whole = 4 * (trainable + frozen)
    print(
        f"the whole model is {whole:,} bytes; building it held "
        f"at most {results[0]['construction']:,} on a rank"
    )
    for rank, res in enumerate(results):
        if not within_padding(res["memory"]["params"], theory["params"], world_size):
            print(f"rank {rank}: parameters differ from the formula by more than padding")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True,
                        help="HF activation checkpointing of each decoder layer (default: on)")
    args = parser.parse_args()
    if BATCH % args.world_size:
        parser.error(f"--world-size must divide the batch of {BATCH} rows")
    results = minizero.launch(worker, args.world_size, args.steps, args.checkpointing, args.lr)
    report(results, args.world_size)


if __name__ == "__main__":    # the launcher's processes import this file: nothing may run on import
    main()
