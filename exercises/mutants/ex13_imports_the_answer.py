"""Mutant: borrows minizero's block quantization."""

from minizero.quantize import dequantize, quantize  # noqa: F401
