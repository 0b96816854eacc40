"""minizero/beyond/tensor_parallel.py: Megatron's column- and row-parallel layers, the
vocab-parallel embedding and cross-entropy, on minizero's GPT and Hugging Face's GPT-2 and Llama,
against the same model whole on one process."""

from __future__ import annotations

import copy
import types

import pytest
import torch

import _hf as _hf_models
import minizero
from minizero import comm
from minizero.beyond import activations, mesh, tensor_parallel, tensor_parallel_hf
from minizero.lab.data import global_batch
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.train import IGNORE, loss_fn
from minizero.memory import activation_bytes
from minizero.memory.mesh import gpt_tensor_parallel_bytes, tensor_parallel_bytes
from minizero.units import default_units


def _gpt(seed: int = 0):
    return make_model(GPTConfig(), seed=seed)


def _hf(name: str):
    return lambda: _hf_models.build(_hf_models.Case(name, stage=0))


def _logits(model, x):
    return model(x) if hasattr(model, "blocks") else model(input_ids=x, use_cache=False).logits


def _train_side_by_side(build, split_fn, m: int, steps: int = 3) -> dict:
    """One tensor-parallel group of m ranks and, on the same ranks, the whole model: the same batch,
    the same SGD steps (SGD: a gradient off by a factor shows; Adam would normalize it away)."""
    group = mesh.row_group(m)
    whole, split = build(), split_fn(build(), group)             # the same seed: the same weights
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.5) for model in (whole, split)]
    out = {"logits": 0.0, "loss": 0.0, "params": 0.0}
    block_size = 8 if hasattr(whole, "config") else whole.cfg.block_size
    for step in range(steps):
        x, y = global_batch(step, 8, block_size)
        logits, mine = _logits(whole, x), _logits(split, x)         # [B, T, V], [B, T, V/M]
        per_rank = mine.shape[-1]
        expected = logits[..., group.index * per_rank:(group.index + 1) * per_rank]
        out["logits"] = max(out["logits"], (mine - expected).abs().max().item())
        losses = loss_fn(logits, y), tensor_parallel.cross_entropy(mine, y, group, IGNORE)
        out["loss"] = max(out["loss"], abs(losses[0].item() - losses[1].item()))
        for loss, optimizer in zip(losses, optimizers):
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    # the whole model after training, split the same way: what each rank should hold now
    expected = dict(split_fn(copy.deepcopy(whole), group).named_parameters())
    for name, p in split.named_parameters():
        out["params"] = max(out["params"], (p - expected[name]).abs().max().item())
    out["split_numel"] = sum(p.numel() for p in split.parameters())
    out["whole_numel"] = sum(p.numel() for p in whole.parameters())
    return out


def _every_case() -> dict:
    gpt = {("gpt", m): _train_side_by_side(_gpt, tensor_parallel.parallelize_gpt, m)
           for m in (2, 4)}
    hf = {(name, 2): _train_side_by_side(_hf(name), tensor_parallel_hf.parallelize, 2)
          for name in ("gpt2", "llama")}
    return gpt | hf


@pytest.fixture(scope="module")
def runs():
    return minizero.launch(_every_case, 4)


def _checkpoint_modes() -> dict:
    """The split GPT's forward and backward with each checkpointing mode: gradients and the peak
    bytes saved for backward (the activation meter)."""
    group, out = mesh.row_group(comm.world_size()), {}
    x, y = global_batch(0, 4, 16)
    for mode in (False, True, "partitioned", "partitioned+cpu"):
        model = tensor_parallel.parallelize_gpt(make_model(GPTConfig(), seed=0), group)
        meter = activations.SavedTensorMeter(lambda m=model: list(m.parameters()))
        if mode:
            activations.checkpoint(list(model.blocks), mode, meter,
                                   group if mode in activations.PARTITIONED else None)
        comm.reset_tally()
        with meter.recording():
            logits = model(x)
        kept = meter.alive                            # everything forward saved for backward
        tensor_parallel.cross_entropy(logits, y, group, IGNORE).backward()
        grads = [p.grad for p in model.parameters()]
        out[mode] = {"kept": kept, "peak": meter.peak, "grads": grads,
                     "all_reduce": comm.tally()["all_reduce"]}
    return out


@pytest.mark.parametrize("case", [("gpt", 2), ("gpt", 4), ("gpt2", 2), ("llama", 2)])
def test_a_split_model_trains_to_the_whole_models_parameters(runs, case):
    """minizero's GPT at M = 2 and 4; Hugging Face's GPT-2 (tied head, Conv1D) and Llama (untied
    head, rotary, RMSNorm, gated MLP) at M = 2."""
    for rank, result in enumerate(runs):
        r = result[case]
        assert r["logits"] < 1e-5 and r["loss"] < 1e-5, (rank, case, r)
        assert r["params"] < 1e-5, f"rank {rank}, {case}: parameters off by {r['params']:.2e}"


def test_each_rank_holds_its_share_of_the_blocks(runs):
    """Blocks' matmul weights and the vocabulary are split; LayerNorms, position embeddings and
    row-parallel biases are replicated: more than Ψ/M, less than Ψ."""
    r2, r4 = runs[0][("gpt", 2)], runs[0][("gpt", 4)]
    assert r4["split_numel"] < r2["split_numel"] < r2["whole_numel"]
    h, layers, vocab = 64, 4, 12
    matmuls = layers * (4 + 2 * 4) * h * h + layers * (3 * h + 4 * h)    # weights + split biases
    assert r2["whole_numel"] - r2["split_numel"] == (matmuls + vocab * h) // 2


def test_a_size_the_group_does_not_divide_is_one_clear_error():
    three = types.SimpleNamespace(size=3, index=0)
    with pytest.raises(ValueError, match=r"over 3 ranks: the number of heads = 4 is not divisible"):
        tensor_parallel.check_divides("the number of heads", 4, three)


def test_stage_3_refuses_units_that_part_the_tied_head_from_its_embedding():
    """A one-block GPT's default units (by size) put tok_emb in a unit of its own: stage 3 would
    free its weight before the tied head reads it, and the loss would be NaN. One line instead;
    the blocks as units (the model keeps both) pass."""
    row = types.SimpleNamespace(size=2, index=0)
    model = tensor_parallel.parallelize_gpt(make_model(GPTConfig(n_layer=1), seed=0), row)
    with pytest.raises(ValueError, match=r"the tied head \(head\) reads the weight of tok_emb, "
                                         r"which is in another unit"):
        tensor_parallel.check_tied_heads(model, default_units(model))
    tensor_parallel.check_tied_heads(model, list(model.blocks))


def test_partitioned_checkpoints_keep_one_mth_of_each_blocks_input():
    """P_a: the M ranks of a tensor-parallel group hold the same block inputs; each keeps 1/M of
    them and all-gathers them before the recompute. Same gradients; what forward keeps falls by
    exactly (1 - 1/M) of the L inputs [B, T, C] fp32, and P_a+cpu keeps none of them on the
    device. (The peak falls by less: the recompute holds one whole input again.)"""
    m, layers, inputs = 2, 4, 4 * 16 * 64 * 4                   # L; one input's bytes, B T C e
    for rank, modes in enumerate(minizero.launch(_checkpoint_modes, m)):
        for mode in (True, "partitioned", "partitioned+cpu"):
            for got, want in zip(modes[mode]["grads"], modes[False]["grads"]):
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), (rank, mode)
        saved = modes[True]["kept"] - modes["partitioned"]["kept"]
        assert saved == layers * inputs * (1 - 1 / m), (rank, saved)
        on_host = modes["partitioned"]["kept"] - modes["partitioned+cpu"]["kept"]
        assert on_host == layers * inputs / m, (rank, on_host)
        assert modes["partitioned"]["peak"] < modes[True]["peak"] < modes[False]["peak"]


def test_partitioned_checkpoints_need_a_tensor_parallel_group():
    with pytest.raises(ValueError, match="P_a partitions the checkpoints that the ranks of a "
                                         "tensor-parallel group replicate"):
        activations.checkpoint([], "partitioned", None)


def test_what_tensor_parallelism_sends_is_the_formula():
    """Per step, 4 all-reduces of [b, s, h] per block (6 when checkpointing recomputes it), the
    embedding's g and the head's f, and the loss's three all-reduces of [b·s] numbers."""
    m, layers, (b, s, h) = 2, 4, (4, 16, 64)
    outside = 2 * comm.ring_bytes("all_reduce", 4 * b * s * h, m)          # embedding g, head f
    loss = 3 * comm.ring_bytes("all_reduce", 4 * b * s, m)
    modes = minizero.launch(_checkpoint_modes, m)[0]
    for mode, recompute in ((False, False), (True, True)):
        blocks = tensor_parallel_bytes(b, s, h, m, layers=layers, recompute=recompute)
        assert modes[mode]["all_reduce"] == blocks + outside + loss, mode
        assert gpt_tensor_parallel_bytes(b, s, h, m, layers=layers, recompute=recompute) == (
            blocks + outside + loss)


def test_activations_of_a_split_gpt_are_the_estimate_with_m():
    """The activation meter on one rank of the split GPT (b = 4 rows, s = 16) equals
    memory.activation_bytes(..., tensor_parallel=2) for every checkpointing mode: the blocks'
    column- and row-parallel tensors and scores 1/M, LayerNorm inputs whole, P_a's inputs 1/M."""
    modes = minizero.launch(_checkpoint_modes, 2)[0]
    for mode in (False, True, "partitioned", "partitioned+cpu"):
        estimate = activation_bytes(4, 64, 4, 16, 4, checkpointing=mode, tensor_parallel=2)
        assert modes[mode]["peak"] == estimate, (mode, modes[mode]["peak"], estimate)
