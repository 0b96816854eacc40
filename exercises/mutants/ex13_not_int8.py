"""Mutant: the rounded values are never cast to int8: exact enough, but each one still travels as 4
bytes of fp32, and the scales on top: more bytes than no quantization at all."""

from solutions.ex13_block_quantize import dequantize  # noqa: F401
from solutions.ex13_block_quantize import quantize as _quantize


def quantize(x, block):
    q, scales = _quantize(x, block)
    return q.float(), scales
