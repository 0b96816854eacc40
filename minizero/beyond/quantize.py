"""Block-quantized communication (ZeRO++, Wang et al. 2023): send int8 values and one scale
per block.

    engine = minizero.wrap(model, 3, optimizer, quantized_weights=True, quantized_gradients=True)
    python -m minizero.run --stage 3 --quantized-weights --quantized-gradients
    python -m pytest tests/test_quantize.py

On a slow network the bytes of a step are the time of a step (stage 3 moves 3Ψ). ZeRO++ shrinks two
of the three Ψ by sending fewer bits of what travels; what is stored (the shard, the fp32 masters,
the optimizer states) is never quantized:
  * qwZ, quantized weights: stage 3's *forward* all-gather sends each rank's parameter partition in
    int8 (zero3.Unit.gather, by the route units.ModelUnit.route_for picks). Backward's all-gather
    stays in full precision: the gradients are computed with exact weights, as in ZeRO++
    (DeepSpeed's zero_quantized_weights).
  * qgZ, quantized gradients: the gradient reduce-scatter of stages 2-3
    (zero2.GradientShard.reduce, by the route Int8GradientShard sets) becomes an all-to-all of
    int8 chunks: each rank quantizes chunk j of its bucket for rank j, and each rank dequantizes the
    N chunks it receives and averages them in fp32 (DeepSpeed's zero_quantized_gradients). ZeRO++'s
    real qgZ is hierarchical: a 2-hop all-to-all (inside the node, then across nodes) of int4
    values, which also keeps the number of quantize/dequantize rounds at two whatever N is.
    minizero builds the one-hop int8 form: one quantization per gradient, same idea.

Symmetric block quantization. A flat tensor is cut into blocks of B elements (the last one may be
shorter; it is padded with zeros, which change no absmax). Per block:

    scale = absmax / 127   (fp32)     q = round(x / scale), clamped to [-127, 127]   (int8)
    dequantize: x' = q * scale        error |x - x'| <= scale / 2 = absmax / 254     (rounding to
                                                                                     nearest)

127, not 128: the range stays symmetric, so -absmax and +absmax are both exact. A block of zeros
gets scale 0 and q 0. Bytes on the wire for n elements: n (int8) + 4·⌈n/B⌉ (scales) instead of n·e
(e = 4 for fp32, 2 for bf16): with B = 256, 1.016 bytes an element, 3.9x less than fp32, 1.97x
less than bf16. Smaller blocks: a tighter error (each block's absmax is more local), more bytes
for scales.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minizero import comm
from minizero.zero2 import GradientShard

BLOCK = 256          # B, elements per scale: 4/B = 1.6% extra bytes for the scales
SCALE_BYTES = 4      # each block's scale travels as fp32
LEVELS = 127         # q in [-127, 127]


def wire_bytes(numel: int, block: int = BLOCK) -> int:
    """Bytes that `numel` elements take once quantized: numel int8 values + one fp32 scale per
    block. For Ψ elements in blocks of B: Ψ + 4Ψ/B (the one formula; memory.comm_volume uses it)."""
    return numel + SCALE_BYTES * -(-numel // block)


def quantize(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] (any float dtype) -> q [..., n] int8, scales [..., ⌈n/B⌉] fp32; blocks run along
    the last dimension, so each row (a chunk for one rank) has blocks of its own."""
    n = x.shape[-1]
    blocks = -(-n // block)
    padded = torch.zeros(*x.shape[:-1], blocks * block, dtype=torch.float32, device=x.device)
    padded[..., :n] = x                                           # the tail padded with zeros
    padded = padded.view(*x.shape[:-1], blocks, block)            # [..., blocks, B]
    scales = padded.abs().amax(dim=-1) / LEVELS                   # [..., blocks]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))   # a block of zeros: q = 0
    q = (padded / safe.unsqueeze(-1)).round().clamp(-LEVELS, LEVELS).to(torch.int8)
    return q.flatten(-2)[..., :n].contiguous(), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """q [..., n] int8, scales [..., ⌈n/B⌉] -> x' [..., n] fp32 = q * its block's scale."""
    n = q.shape[-1]
    blocks = scales.shape[-1]
    padded = torch.zeros(*q.shape[:-1], blocks * block, dtype=torch.float32, device=q.device)
    padded[..., :n] = q
    return (padded.view(*q.shape[:-1], blocks, block) * scales.unsqueeze(-1)).flatten(-2)[..., :n]


def error_bound(scales: torch.Tensor, n: int, block: int = BLOCK) -> torch.Tensor:
    """Per element of a quantized [..., n]: the most |x - dequantize(quantize(x))| can be,
    scale / 2 of its block, plus the fp32 rounding of x / scale and q * scale (a few ulps
    of absmax = 127 * scale)."""
    half = scales * (0.5 + LEVELS * 2.0 ** -20)
    return half.repeat_interleave(block, dim=-1)[..., :n]


# --------------------------------------------------------------------------------------------------
# The two collectives ZeRO++ quantizes. Both return a handle whose wait() also dequantizes into
# `output`.
# --------------------------------------------------------------------------------------------------

class Int8Blocks:
    """A route for ZeRO++: comm's all_gather (qwZ) and reduce_scatter (qgZ), with the same
    arguments, sending int8 blocks of `block` elements. Each returns a handle whose wait() also
    dequantizes into `output` (in fp32, cast to the output's dtype). The extension point for another
    quantizer: a subclass with other `quantize` / `dequantize`, given to an engine as its
    `int8_codec` (assembled.py; exercise 13's grader does this)."""
    quantize = staticmethod(quantize)
    dequantize = staticmethod(dequantize)

    def __init__(self, block: int = BLOCK):
        self.block = block

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                   group: comm.Group | None = None, tag: str = ""):
        """comm.all_gather with int8 on the wire (qwZ): input [n] from every rank -> output [N * n],
        rank r's (dequantized) input at output[r*n:(r+1)*n]. This rank's own part is dequantized
        too, so every rank computes with the same weights. Sends (N-1)/N · N·wire_bytes(n) instead
        of (N-1)/N · N·n·e."""
        n, block = comm.group_size(group), self.block
        q, scales = self.quantize(input, block)                               # [n], [⌈n/B⌉]
        q_all = torch.empty(n * q.numel(), dtype=q.dtype, device=q.device)    # [N * n] int8
        scales_all = torch.empty(n * scales.numel(), dtype=torch.float32, device=q.device)
        handles = [comm.all_gather(q_all, q, async_op=True, group=group, tag=tag),
                   comm.all_gather(scales_all, scales, async_op=True, group=group,
                                   tag=f"{tag} scales")]

        def finish():
            values = self.dequantize(q_all.view(n, q.numel()), scales_all.view(n, scales.numel()),
                                     block)
            output.copy_(values.reshape(-1))
        return _waited(comm.Joined(handles, finish), async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "avg",
                       async_op: bool = False, group: comm.Group | None = None, tag: str = ""):
        """comm.reduce_scatter(op="avg") with int8 on the wire (qgZ): input [N * n] -> output [n],
        the average over ranks of chunk r. An all-to-all moves the int8 chunks (chunk j to rank j),
        then each rank dequantizes the N chunks it received and averages them in fp32: int8 values
        are never summed (they would overflow, and each chunk has scales of its own). `output` may
        be a view of `input` (stage 2's in-place partition): input is quantized before anything is
        written. Sends (N-1)/N · N·wire_bytes(n)."""
        n, block = comm.group_size(group), self.block
        q, scales = self.quantize(input.view(n, input.numel() // n), block)   # [N, n]: row j for j
        q_in, scales_in = torch.empty_like(q), torch.empty_like(scales)       # row j from rank j
        handles = [all_to_all(q_in, q, async_op=True, group=group, tag=tag),
                   all_to_all(scales_in, scales, async_op=True, group=group, tag=f"{tag} scales")]

        def finish():
            output.copy_(self.dequantize(q_in, scales_in, block).mean(dim=0))
        assert op == "avg", "qgZ averages"
        return _waited(comm.Joined(handles, finish), async_op)


def all_to_all(output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
               group: comm.Group | None = None, tag: str = ""):
    """input [N * n] -> output [N * n]: chunk j of rank r's input lands as chunk r of rank j's
    output (each rank keeps one chunk and sends N-1), through comm.issue like every collective."""
    assert output.numel() == input.numel() and input.numel() % comm.group_size(group) == 0, \
        "all_to_all: input and output must be the same N x n"
    pg = None if group is None else group.process_group
    return comm.issue("all_to_all", input, group, tag, async_op,
                      lambda: dist.all_to_all_single(output, input, async_op=True, group=pg),
                      lambda: output.copy_(input))


def _waited(handle, async_op: bool):
    """As comm's collectives: the handle when async_op, else done (None)."""
    if async_op:
        return handle
    handle.wait()
    return None


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    block: int = BLOCK,
    async_op: bool = False,
    group: comm.Group | None = None,
    tag: str = "",
):
    """Int8Blocks(block).all_gather, as a function of the comm kind (qwZ)."""
    return Int8Blocks(block).all_gather(output, input, async_op, group, tag)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    block: int = BLOCK,
    async_op: bool = False,
    group: comm.Group | None = None,
    tag: str = "",
):
    """Int8Blocks(block).reduce_scatter, as a function of the comm kind (qgZ)."""
    return Int8Blocks(block).reduce_scatter(output, input, "avg", async_op, group, tag)


class Int8GradientShard(GradientShard):
    """zero2.GradientShard whose reduce-scatter sends int8 blocks, with quantized_gradients=True
    (qgZ): the engine's int8_codec is its route."""

    def __init__(self, engine, layout, options):
        super().__init__(engine, layout, options)
        if options.quantized_gradients:
            self.route = engine.int8_codec(options.quantization_block)
