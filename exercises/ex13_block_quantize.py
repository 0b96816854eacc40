"""Exercise 13: ZeRO++'s block quantization, int8 values and one fp32 scale per block.

    Grade it:    pytest exercises -k ex13            (or: python -m minizero.grade -k ex13)
    Notebook:    notebooks/08_beyond.ipynb (its section on qwZ and qgZ)
    Compare:     minizero/beyond/quantize.py (quantize, dequantize, wire_bytes), and where it is
    used:
                 zero3.Unit.gather (qwZ) and zero2.GradientShard.reduce (qgZ)

Over a slow network the bytes of a step are the time of a step: stage 3 moves 3Ψ elements per step.
ZeRO++ sends two of those Ψ (forward's all-gather of the weights, the gradients' reduce-scatter) as
int8: one byte an element instead of 4 (fp32) or 2 (bf16), plus one fp32 scale per block of B
elements.

Write quantize(x, block) and dequantize(q, scales, block), symmetric block quantization:
  * x is a tensor [..., n] (float); blocks of `block` elements run along its LAST dimension, so each
    row has blocks of its own (the last block of a row may be shorter: n need not be a multiple of
    block).
  * per block: scale = absmax / 127 (fp32), q = round(x / scale) clamped to [-127, 127], as int8.
    A block of zeros has scale 0: its q must be 0, not nan.
  * quantize returns (q [..., n] int8, scales [..., ceil(n / block)] fp32);
    dequantize returns q * (its block's scale), [..., n], fp32.

Rounding to the nearest level makes the error of each element at most half a step: |x - x'| <= scale
/ 2 = absmax / 254 of its block. And what travels for n elements is n bytes of q + 4 * ceil(n /
block) bytes of scales.

What the grader checks: (1) on tensors with blocks of very different magnitudes, a partial last
block and a block of zeros, your dequantize(quantize(x)) is within absmax/254 of x, element by
element; (2) two ranks train a small GPT at stage 3 with ZeRO++'s qwZ and qgZ
(quantized_weights=True, quantized_gradients=True) calling your functions for everything they send:
the bytes sent per step (minizero's tally) must equal those of minizero's own quantization, (n + 4
ceil(n/B)) per chunk.

Hints:
  * pad the last dimension with zeros to a multiple of block (zeros change no absmax), view it as
    [..., blocks, block], take .abs().amax(dim=-1); slice the padding off again at the end.
  * where scale is 0, divide by 1 instead (torch.where). .round(), .clamp(), .to(torch.int8).
  * what is sent is what quantize returns: its dtype and its size are the bytes.
"""


def quantize(x, block):
    """x [..., n] -> (q [..., n] int8, scales [..., ceil(n / block)] fp32), blocks along the last
    dimension."""
    raise NotImplementedError("ex13: write quantize")


def dequantize(q, scales, block):
    """q [..., n] int8, scales [..., ceil(n / block)] -> q * its block's scale, [..., n] fp32."""
    raise NotImplementedError("ex13: write dequantize")
