"""A small GPT: the model every stage, test, notebook and benchmark trains.

    from minizero.lab.model import GPT, GPTConfig
    model = GPT(GPTConfig())   # ~0.2 M parameters, learns minizero.lab.data's sorting task on a CPU

Deliberately ordinary (nanoGPT-shaped) so that what is interesting is the parallelism, not the
model: token + position embeddings, pre-LayerNorm blocks of causal self-attention and an MLP, a
final LayerNorm, and an output head whose weight is *tied* to the token embedding (one
Parameter used twice: the case stage 3 must not get wrong). Attention uses an explicit
causal-mask buffer so every stage also has to carry a buffer. The blocks sit in `GPT.blocks`,
the natural units for stage 3.

Options that only tests need (to make the model awkward on purpose): `frozen` names parameters
that get
requires_grad=False, and `unused_param` adds a parameter that forward never touches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 12          # minizero.lab.data.VOCAB_SIZE: digits 0-9, separator, padding
    block_size: int = 32          # longest sequence
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    mlp_ratio: int = 4
    tie_weights: bool = True
    frozen: tuple[str, ...] = field(default_factory=tuple)   # parameter names to freeze
    unused_param: bool = False

    @classmethod
    def named(cls, name: str, **overrides) -> "GPTConfig":
        """One of MODEL_NAMES: 'default' (~0.2 M params) or 'tiny' (a few thousand, awkward odd
        sizes); or one of the benchmark's SIZES ('1M' ... '50M')."""
        shapes = {**PRESETS, **SIZES}
        if name not in shapes:
            raise ValueError(
                f"unknown model {name!r}; choose from {', '.join(MODEL_NAMES + tuple(SIZES))}"
            )
        return cls(**{**shapes[name], **overrides})


# The models every command accepts by name (--model): the one list of them.
PRESETS = {
    "default": {},
    "tiny": dict(n_layer=2, n_head=1, n_embd=14, block_size=17, mlp_ratio=3),
}
MODEL_NAMES = tuple(PRESETS)

# The sizes `python -m minizero.bench --sizes 1M,8M,50M` compares at: the default GPT made wider
# (and deeper), so that optimizer locality, overlap and copies matter as they do in real models. Ψ
# (count_params, which the bench prints) is within 1 % of each name. One place for them:
# GPTConfig.named accepts these too.
SIZES = {
    "1M": {"n_layer": 4, "n_head": 4, "n_embd": 144},     # Ψ = 1,009,440
    "2M": {"n_layer": 4, "n_head": 4, "n_embd": 204},     # Ψ = 2,017,560
    "8M": {"n_layer": 8, "n_head": 8, "n_embd": 288},     # Ψ = 8,005,824
    "20M": {"n_layer": 8, "n_head": 8, "n_embd": 456},    # Ψ = 20,030,256
    "50M": {"n_layer": 8, "n_head": 8, "n_embd": 720},    # Ψ = 49,874,400
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("causal_mask", mask)            # [T_max, T_max], a buffer, not a param

    def forward(self, x: torch.Tensor) -> torch.Tensor:          # x: [B, T, C]
        B, T, _ = x.shape
        # [B, T, C] each; C/M under tensor parallelism (n_head/M heads:
        # minizero/beyond/tensor_parallel.py)
        q, k, v = self.qkv(x).chunk(3, dim=2)
        head_size = q.shape[-1] // self.n_head
        q, k, v = (t.view(B, T, self.n_head, head_size).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(head_size)                  # [B, H, T, T]
        att = att.masked_fill(~self.causal_mask[:T, :T], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, -1)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd), nn.GELU(),
                                 nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight                # the tie: one Parameter, two uses
        if cfg.unused_param:
            self.unused = nn.Parameter(torch.randn(7))             # never touched by forward
        self.apply(self._init_weights)
        names = dict(self.named_parameters(remove_duplicate=False))
        for name in cfg.frozen:
            if name not in names:
                raise ValueError(f"frozen: no parameter named {name!r}")
            names[name].requires_grad_(False)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def num_params(self) -> int:
        """Ψ: distinct parameters (the tied weight once), trainable or not."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:       # idx: [B, T] token ids
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)                  # [B, T, C]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))                             # logits [B, T, vocab]


def count_params(cfg: GPTConfig) -> int:
    """Ψ of GPT(cfg), without building it (python -m minizero.memory --layers ... for a 1.5 B
    model): per block (4 + 2r)·h² weights (qkv 3h², proj h², the MLP 2r·h²) and (9 + r)·h biases and
    LayerNorm parameters; the embeddings (vocab + block_size)·h, the final LayerNorm 2h, an untied
    head vocab·h."""
    h, r = cfg.n_embd, cfg.mlp_ratio
    block = (4 + 2 * r) * h * h + (9 + r) * h
    head = 0 if cfg.tie_weights else cfg.vocab_size * h
    return (
        cfg.n_layer * block
        + (cfg.vocab_size + cfg.block_size) * h
        + 2 * h
        + head
        + 7 * cfg.unused_param
    )


def make_model(cfg: GPTConfig, seed: int = 0) -> GPT:
    """The same initial weights on every rank and in the reference, from one seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg)
