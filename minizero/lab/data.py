"""The learning task: sort a sequence of digits. Generated, deterministic, nothing to download.

    from minizero.lab.data import global_batch, local_batch
    x, y = global_batch(step=0, batch_size=16, block_size=32)     # x, y: [16, 32] token ids

A sequence is k random digits, a separator, then the same digits sorted:   3 1 4 1 5 | 1 1 3 4 5
The model reads it left to right and is scored only on the sorted half (targets before the separator
are IGNORE), so the loss starts near ln(10) ≈ 2.3 and falls as the model learns to sort: a real task
for a tiny transformer, visible within a few hundred CPU steps.

Every rank generates the same *global* batch from (seed, step) and takes its own rows: the
data-parallel split is explicit and the single-process reference sees exactly the union of what the
ranks saw.
"""

from __future__ import annotations

import torch

SEPARATOR = 10
VOCAB_SIZE = 12          # 0-9, separator, one spare id
IGNORE = -100            # cross_entropy's ignore_index


def sequence_length(block_size: int) -> int:
    """Tokens per row of global_batch: 2k with k = block_size // 2 (k digits, the separator,
    k - 1 sorted)."""
    return 2 * (block_size // 2)


def global_batch(
    step: int, batch_size: int, block_size: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets [batch_size, sequence_length(block_size)]."""
    k = block_size // 2
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    digits = torch.randint(0, 10, (batch_size, k), generator=gen)
    sep = torch.full((batch_size, 1), SEPARATOR)
    seq = torch.cat([digits, sep, digits.sort(dim=1).values], dim=1)        # [B, 2k + 1]
    x, y = seq[:, :-1].clone(), seq[:, 1:].clone()                           # next-token prediction
    y[:, : k - 1] = IGNORE   # the unsorted digits are random: nothing to learn before the separator
    return x, y


def local_batch(x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int, micro_step: int = 0,
                accum_steps: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s rows for micro-batch `micro_step`: the global batch is
    [accum_steps][world_size][rows]."""
    chunks = accum_steps * world_size
    if x.shape[0] % chunks:
        raise ValueError(
            f"global batch size {x.shape[0]} is not divisible by world size x accumulation "
            f"steps = {world_size} x {accum_steps}"
        )
    rows = x.shape[0] // chunks
    start = (micro_step * world_size + rank) * rows
    return x[start: start + rows], y[start: start + rows]
