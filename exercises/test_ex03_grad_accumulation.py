"""Grader for exercise 3 (gradient accumulation, communicating once a step):  pytest exercises -k
ex03

Two ranks train a small MLP for 3 SGD steps with your train_step, K = 2 micro-batches each; the
result is compared with one process training on the whole global batch, and each step's bytes
(comm.tally) with one all-reduce of every gradient.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import _grading as g
from minizero import comm

N, K, STEPS, ROWS, LR = 2, 2, 3, 3, 0.5              # ROWS per rank and micro-batch: 12 rows a step
REFUSED = ("torch.nn.parallel",)                     # PyTorch's DDP has no_sync() too


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))     # Ψ = 42 + 24 = 66


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch, [K][N][ROWS] rows: micro-batch k of rank r is
    batch(step)[.][k][r]."""
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(K, N, ROWS, 5, generator=gen), torch.randint(
        0, 3, (K, N, ROWS), generator=gen
    )


def worker(module_name: str) -> dict:
    answer, model = g.learner(module_name), make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    sent = []
    for step in range(STEPS):
        x, y = batch(step)
        comm.reset_tally()
        g.call(
            answer.train_step,
            model,
            optimizer,
            [(x[k, comm.rank()], y[k, comm.rank()]) for k in range(K)],
            F.cross_entropy,
        )
        sent.append(comm.tally()["total"])
    return {
        "rank": comm.rank(),
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "sent": sent,
    }


def reference() -> tuple[dict, dict]:
    """(initial, trained) parameters of one process on the whole global batch, K micro-batches a
    step."""
    model = make_model()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = batch(step)
        for k in range(K):
            (F.cross_entropy(model(x[k].flatten(0, 1)), y[k].flatten()) / K).backward()
        optimizer.step()
        optimizer.zero_grad()
    return start, model.state_dict()


def check_training(impl: str) -> None:
    __tracebackhide__ = True
    g.guard(impl, REFUSED)
    results = g.launch_once(worker, N, impl)
    start, expected = reference()
    for res in results:
        for name, want in expected.items():
            got, diff = res["state"][name], (res["state"][name] - want).abs()
            if diff.max() > 1e-6:
                update = want - start[name]
                ratio = ((got - start[name]) * update).sum() / update.pow(2).sum()
                raise AssertionError(f"rank {res['rank']}, {name} after {STEPS} SGD steps of K = "
                                     f"{K} micro-batches on N = {N} ranks: differs from one "
                                     f"process by up to {diff.max().item():.3g}; your total update "
                                     f"is {ratio.item():.3g} x the reference's. Is the loss "
                                     "divided by K once, and the gradient averaged over the ranks "
                                     "once?")


def check_bytes(impl: str) -> None:
    __tracebackhide__ = True
    g.guard(impl, REFUSED)
    numel = sum(p.numel() for p in make_model().parameters())
    want = comm.ring_bytes("all_reduce", 4 * numel, N)
    for res in g.launch_once(worker, N, impl):
        for step, sent in enumerate(res["sent"]):
            if sent != want:
                raise AssertionError(
                    f"rank {res['rank']}, step {step}: sent {sent:g} bytes, expected {want:g}, one "
                    f"all-reduce of the Ψ = {numel} fp32 gradients (2(N-1)/N · 4Ψ)"
                    + (f": {sent / want:.3g} x that, did you all-reduce after every micro-batch? "
                       "Inside the accumulation only add locally" if sent > want else ""))


@pytest.mark.points(2)
def test_accumulated_steps_train_like_one_process(impl):
    check_training(impl)


@pytest.mark.points(1)
def test_one_all_reduce_per_step(impl):
    check_bytes(impl)
