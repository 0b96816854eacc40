"""Hugging Face models as minizero's clients: the worker and the oracle behind tests/test_hf.py.

    python -m pytest tests/test_hf.py

Models are built from configs with a fixed seed (never from_pretrained: nothing is downloaded):
GPT-2 (its head tied to the token embedding), Llama (untied, RMSNorm, rotary), and GPT-2 with a peft
LoRA adapter on c_attn (frozen base). They learn minizero's sorting task (minizero.lab.data) with
the same loss as the small GPT: HF forwards take keyword inputs and return a ModelOutput, so the
loss is computed from `.logits`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import minizero
from minizero import comm
from minizero.lab.data import global_batch, local_batch
from minizero.lab.train import OPTIMIZERS, loss_fn

BLOCK = 8                 # sequence length = n_positions: 4 digits, the separator, 3 sorted digits
VOCAB = 64                # > minizero.lab.data.VOCAB_SIZE (12): every task id is a token


@dataclass(frozen=True)
class Case:
    model: str                           # "gpt2" | "llama" | "lora" (GPT-2 + LoRA on c_attn)
    stage: int
    offload: bool = False
    units: bool = True               # stage 3: units= the decoder layers; False: minizero's default
    checkpointing: bool = False      # HF's gradient_checkpointing_enable, non-reentrant
    optimizer: str = "adamw"
    lr: float = 1e-3
    optimizer_params: tuple = ()  # (name, value) pairs, e.g. (("momentum", 0.9),): a Case is frozen
    world_size: int = 2
    steps: int = 3
    batch_size: int = 6                  # global rows per step: divisible by N = 2 and 3
    seed: int = 0

    def optimizer_factory(self):
        return functools.partial(
            OPTIMIZERS[self.optimizer], lr=self.lr, **dict(self.optimizer_params)
        )


def build(case: Case) -> torch.nn.Module:
    """The case's model, fp32, identical on every rank and in the reference (same seed)."""
    torch.manual_seed(case.seed)
    if case.model == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=2, num_attention_heads=2,
                                             num_key_value_heads=2, max_position_embeddings=BLOCK))
    else:
        # dropout off: each rank would draw other masks than the reference, and the ends could not
        # match 50256: not in VOCAB
        model = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=VOCAB,
                n_positions=BLOCK,
                n_embd=16,
                n_layer=3,
                n_head=2,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=None,
                eos_token_id=None,
            )
        )
    if case.checkpointing:
        # transformers 5 renamed it (the old name warns); 4.x has only the old one
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    if case.model == "lora":
        # GPT-2's c_attn is a Conv1D (weight stored [in, out]): fan_in_fan_out says so
        model = get_peft_model(
            model, LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)
        )
    return model.train()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The stage-3 units: GPT-2's transformer.h, Llama's model.layers (under peft:
    base_model.model)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(inner.transformer.h if hasattr(inner, "transformer") else inner.model.layers)


def lm_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return loss_fn(model(input_ids=x, use_cache=False).logits, y)      # training keeps no KV cache


def train_cases(cases: list[Case]) -> list[dict]:
    """Worker: every case in turn in this one process group (launches are the expensive part)."""
    return [train_case(case) for case in cases]


def train_case(case: Case) -> dict:
    rank, n = comm.rank(), comm.world_size()
    model = build(case)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    options = {"units": decoder_layers(model)} if case.stage == 3 and case.units else {}
    engine = minizero.wrap(
        model, case.stage, case.optimizer_factory(), offload=case.offload, **options
    )
    losses = []
    for step in range(case.steps):
        x, y = local_batch(*global_batch(step, case.batch_size, BLOCK, seed=case.seed), rank, n)
        x, y = x.to(comm.device()), y.to(comm.device())        # the model's device: cpu or this GPU
        loss = lm_loss(engine, x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {
        "rank": rank,
        "losses": losses,
        "state_dict": engine.full_state_dict(),
        "memory": engine.memory(),
        "model_bytes": model_bytes,
        "unit_names": getattr(engine, "unit_names", None),
        "trainable": sum(p.numel() for p in engine.trainable),
        "frozen": sum(p.numel() for p in engine.frozen),
    }


def reference_train(case: Case) -> dict:
    """The oracle: one process, the global batch (the union of the ranks' rows),
    plain torch.optim."""
    model = build(case)
    optimizer = case.optimizer_factory()([p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(case.steps):
        loss = lm_loss(model, *global_batch(step, case.batch_size, BLOCK, seed=case.seed))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {
        "losses": losses,
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }
