"""Exercise 13, answer: symmetric int8 block quantization (minizero/beyond/quantize.py, quantize,
dequantize)."""

import torch

LEVELS = 127                                      # int8 holds -127..127 symmetric around 0


def _blocks(x, block):
    """x [..., n] zero-padded to whole blocks, fp32, viewed [..., blocks, block]."""
    n = x.shape[-1]
    blocks = -(-n // block)
    padded = torch.zeros(*x.shape[:-1], blocks * block, dtype=torch.float32, device=x.device)
    padded[..., :n] = x                           # zeros change no absmax
    return padded.view(*x.shape[:-1], blocks, block)


def quantize(x, block):
    padded = _blocks(x, block)
    scales = padded.abs().amax(dim=-1) / LEVELS                        # [..., blocks] fp32
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))    # a block of zeros: q = 0
    q = (padded / safe.unsqueeze(-1)).round().clamp(-LEVELS, LEVELS).to(torch.int8)
    return q.flatten(-2)[..., : x.shape[-1]].contiguous(), scales


def dequantize(q, scales, block):
    return (_blocks(q, block) * scales.unsqueeze(-1)).flatten(-2)[..., : q.shape[-1]]
