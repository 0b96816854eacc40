"""Grader for exercise 15 (Megatron's column- and row-parallel layers):  pytest exercises -k ex15

Three ranks split a 2-layer MLP (6 -> 12 -> 6, GELU) with your shard_columns / shard_rows and run
your column_parallel -> GELU -> row_parallel on the batch the whole MLP runs on in this process.
Checked: each shard's shape and values; every rank's output; after backward, the input's gradient on
every rank and each shard's gradient; and the bytes: one all-reduce forward, one backward.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import _grading as g
from minizero import comm

N = 3
REFUSED = ("minizero.beyond.tensor_parallel", "minizero.beyond.tensor_parallel_hf",
           "torch.distributed.tensor")
SHARDS = ("first weight", "first bias", "second weight")


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """The batch [5, 6] and the output's gradient [5, 6] (uneven, so no sum hides an error)."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(5, 6, generator=gen), torch.randn(5, 6, generator=gen)


def expected_shards(whole: nn.Sequential, rank: int) -> list[torch.Tensor]:
    return [whole[0].weight.detach().chunk(N, 0)[rank], whole[0].bias.detach().chunk(N, 0)[rank],
            whole[2].weight.detach().chunk(N, 1)[rank]]


def worker(module_name: str) -> dict:
    answer, whole = g.learner(module_name), mlp()
    w1, b1 = g.call(answer.shard_columns, whole[0])
    w2 = g.call(answer.shard_rows, whole[2])
    out = {"rank": comm.rank(), "shards": [t.detach().clone() for t in (w1, b1, w2)]}
    if [tuple(t.shape) for t in out["shards"]] != [(4, 6), (4,), (6, 4)]:
        return out                                          # check_shards says what is wrong
    params = [nn.Parameter(t.detach().clone()) for t in (w1, b1, w2)]
    bias = nn.Parameter(whole[2].bias.detach().clone())
    x, grad_y = inputs()
    x.requires_grad_()
    comm.reset_tally()
    hidden = F.gelu(g.call(answer.column_parallel, x, params[0], params[1]))
    y = g.call(answer.row_parallel, hidden, params[2], bias)
    out["forward_bytes"] = comm.tally()["total"]
    y.backward(grad_y)
    out["backward_bytes"] = comm.tally()["total"] - out["forward_bytes"]
    out["y"], out["x_grad"] = y.detach(), x.grad
    out["grads"] = [p.grad for p in params]
    return out


def reference() -> dict:
    whole = mlp()
    x, grad_y = inputs()
    x.requires_grad_()
    y = whole(x)
    y.backward(grad_y)
    return {"whole": whole, "y": y.detach(), "x_grad": x.grad,
            "grads": [whole[0].weight.grad, whole[0].bias.grad, whole[2].weight.grad]}


def _close(a, b) -> bool:
    return a is not None and a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def check_shards(impl: str) -> None:
    __tracebackhide__ = True
    g.guard(impl, refused=REFUSED)
    ref = reference()
    for res in g.launch_once(worker, N, impl):
        rank = res["rank"]
        for name, got, want in zip(SHARDS, res["shards"], expected_shards(ref["whole"], rank)):
            if tuple(got.shape) != tuple(want.shape):
                split = ("the outputs, the weight's rows (dim 0)" if name != "second weight"
                         else "the inputs, the weight's columns (dim 1)")
                raise AssertionError(f"rank {rank}: the {name} shard is {list(got.shape)}, "
                                     f"expected {list(want.shape)}: a "
                                     f"{'row' if name == 'second weight' else 'column'}-parallel "
                                     f"layer splits {split}")
            if not torch.equal(got, want):
                raise AssertionError(f"rank {rank}: the {name} shard holds other values than "
                                     f"the whole layer's slice {rank} of {N}, in rank order")


def check_forward(impl: str) -> None:
    __tracebackhide__ = True
    check_shards(impl)
    ref = reference()
    all_reduce = comm.ring_bytes("all_reduce", ref["y"].numel() * 4, N)
    for res in g.launch_once(worker, N, impl):
        rank, y = res["rank"], res["y"]
        if not _close(y, ref["y"]):
            hint = ""
            bias = ref["whole"][2].bias.detach()
            if _close((y - bias) * N + bias, ref["y"]):                  # the sum's 1/N, + bias
                hint = (f": it is 1/{N} of it, g must sum the partial outputs over the ranks, "
                        "not average them")
            raise AssertionError(f"rank {rank}: the output differs from the whole MLP's by "
                                 f"{(y - ref['y']).abs().max().item():.3g}{hint}")
        if res["forward_bytes"] != all_reduce:
            raise AssertionError(f"rank {rank}: forward sent {res['forward_bytes']:g} bytes, "
                                 f"expected {all_reduce:g}: one all-reduce of the output [5, 6] "
                                 "(g), nothing before the column-parallel layer (f is the "
                                 "identity forward)")


def check_backward(impl: str) -> None:
    __tracebackhide__ = True
    check_forward(impl)
    ref = reference()
    all_reduce = comm.ring_bytes("all_reduce", ref["x_grad"].numel() * 4, N)
    for res in g.launch_once(worker, N, impl):
        rank = res["rank"]
        if not _close(res["x_grad"], ref["x_grad"]):
            raise AssertionError(f"rank {rank}: the input's gradient is not the whole MLP's: "
                                 "each rank's flowed back through its own out/M outputs only, "
                                 "a partial sum; f's backward must all-reduce (sum) it")
        wanted = expected_shards_of(ref["grads"], rank)
        for name, got, want in zip(SHARDS, res["grads"], wanted):
            if not _close(got, want):
                raise AssertionError(f"rank {rank}: the gradient of the {name} shard is not the "
                                     "whole layer's gradient, sliced: g's backward is the "
                                     "identity (the output's gradient is whole on every rank)")
        if res["backward_bytes"] != all_reduce:
            raise AssertionError(f"rank {rank}: backward sent {res['backward_bytes']:g} bytes, "
                                 f"expected {all_reduce:g}: one all-reduce of the input's "
                                 "gradient (f), none for g")


def expected_shards_of(grads: list[torch.Tensor], rank: int) -> list[torch.Tensor]:
    return [grads[0].chunk(N, 0)[rank], grads[1].chunk(N, 0)[rank], grads[2].chunk(N, 1)[rank]]


@pytest.mark.points(1)
def test_each_rank_holds_its_slice(impl):
    check_shards(impl)


@pytest.mark.points(2)
def test_every_rank_computes_the_whole_output(impl):
    check_forward(impl)


@pytest.mark.points(2)
def test_backward_gives_the_whole_gradients(impl):
    check_backward(impl)
