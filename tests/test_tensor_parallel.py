"""minizero/tensor_parallel.py: Megatron's column- and row-parallel layers, the vocab-parallel
embedding and cross-entropy, on minizero's GPT, against the same GPT on one process."""

from __future__ import annotations

import copy
import types

import pytest
import torch

import minizero
from minizero import comm, tensor_parallel
from minizero.lab.data import global_batch
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.train import IGNORE, loss_fn


def _train_side_by_side(m: int, steps: int = 3) -> dict:
    """One tensor-parallel group of m ranks and, on the same ranks, the whole GPT: the same batch,
    the same SGD steps (SGD: a gradient off by a factor shows; Adam would normalize it away)."""
    group = comm.row_group(m)
    cfg = GPTConfig()
    whole = make_model(cfg, seed=0)
    split = tensor_parallel.parallelize_gpt(make_model(cfg, seed=0), group)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.5) for model in (whole, split)]
    out = {"logits": 0.0, "loss": 0.0, "params": 0.0}
    for step in range(steps):
        x, y = global_batch(step, 8, cfg.block_size)
        logits, mine = whole(x), split(x)                          # [B, T, V], [B, T, V/M]
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
    expected = dict(tensor_parallel.parallelize_gpt(copy.deepcopy(whole), group).named_parameters())
    for name, p in split.named_parameters():
        out["params"] = max(out["params"], (p - expected[name]).abs().max().item())
    out["split_numel"] = sum(p.numel() for p in split.parameters())
    out["whole_numel"] = sum(p.numel() for p in whole.parameters())
    return out


def _both_group_sizes() -> dict:
    return {m: _train_side_by_side(m) for m in (2, 4)}


@pytest.fixture(scope="module")
def runs():
    return minizero.launch(_both_group_sizes, 4)


@pytest.mark.parametrize("m", [2, 4])
def test_a_split_gpt_trains_to_the_whole_gpts_parameters(runs, m):
    for rank, result in enumerate(runs):
        r = result[m]
        assert r["logits"] < 1e-5 and r["loss"] < 1e-5, (rank, r)
        assert r["params"] < 1e-5, f"rank {rank}, M = {m}: parameters off by {r['params']:.2e}"


def test_each_rank_holds_its_share_of_the_blocks(runs):
    """Blocks' matmul weights and the vocabulary are split; LayerNorms, position embeddings and
    row-parallel biases are replicated: more than Ψ/M, less than Ψ."""
    r2, r4 = runs[0][2], runs[0][4]
    assert r4["split_numel"] < r2["split_numel"] < r2["whole_numel"]
    h, layers, vocab = 64, 4, 12
    matmuls = layers * (4 + 2 * 4) * h * h + layers * (3 * h + 4 * h)    # weights + split biases
    assert r2["whole_numel"] - r2["split_numel"] == (matmuls + vocab * h) // 2


def test_a_size_the_group_does_not_divide_is_one_clear_error():
    three = types.SimpleNamespace(size=3, index=0)
    with pytest.raises(ValueError, match=r"over 3 ranks: the number of heads = 4 is not divisible"):
        tensor_parallel.check_divides("the number of heads", 4, three)
