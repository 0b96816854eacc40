"""Mutant: scale = absmax / 255, as if int8 were unsigned: q = round(x / scale) reaches 255 and is
clamped to 127, so every element above absmax / 2 comes back as about absmax / 2."""

import torch

from solutions.ex13_block_quantize import dequantize  # noqa: F401


def quantize(x, block):
    n = x.shape[-1]
    blocks = -(-n // block)
    padded = torch.zeros(*x.shape[:-1], blocks * block, dtype=torch.float32)
    padded[..., :n] = x
    padded = padded.view(*x.shape[:-1], blocks, block)
    scales = padded.abs().amax(dim=-1) / 255
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = (padded / safe.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return q.flatten(-2)[..., :n].contiguous(), scales
