"""Grader for exercise 17 (FSDP2's dim-0 shards):  pytest exercises -k ex17

(1) In this process: your shard for many shapes, every rank, N = 1 to 4, against FSDP2's rule
(minizero/pytorch/fsdp_param.py's arithmetic). (2)-(4) One launch of three ranks on a small model
whose dims 0 are 5, 7 and 1, each function graded on its own: your all_gather_param on FSDP2's own
shards, your reduce_scatter_grad on each rank's true gradient, then three SGD steps with all three
of yours; each compared with one process training on the whole batch, and the bytes each sent
(minizero's tally) with one collective's.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import _grading as g
from minizero import comm
from minizero.pytorch.fsdp_param import padded_rows, shard_rows

# The answer's own PyTorch: a DTensor's Shard(0) or FSDP would shard for you.
REFUSED = ("torch.distributed.tensor", "torch.distributed._tensor", "torch.distributed.fsdp",
           "torch.distributed._composable")
N, STEPS, LR, ROWS = 3, 3, 0.5, 12
# dims 0 that N = 1..4 divide and do not, one row (most ranks hold padding only), a bias (1-D)
SHAPES = [(6, 2), (5, 4), (7,), (1, 3), (2, 3), (4, 1, 2)]


def numbered(shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor whose row i holds i + (its column) / 100: a row tells which row it is."""
    rows = torch.arange(shape[0], dtype=torch.float32).view(-1, *[1] * (len(shape) - 1))
    return rows + torch.arange(int(torch.Size(shape[1:]).numel())).view(shape[1:] or ()) / 100


def fsdp2_shard(param: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """FSDP2's padded shard, from minizero's arithmetic."""
    chunk, rows = padded_rows(param.shape[0], n), shard_rows(param.shape[0], n, rank)
    out = torch.zeros((chunk, *param.shape[1:]), dtype=param.dtype)
    out[:rows] = param[rank * chunk:rank * chunk + rows]
    return out


def _rows(shard: torch.Tensor, real: int) -> str:
    """Which rows of a numbered() parameter a shard holds, read off its values."""
    held = [int(r.reshape(-1)[0].floor()) for r in shard[:real]]
    return f"rows {held}" if held else "no row"


def check_shards(impl: str) -> None:
    __tracebackhide__ = True
    g.guard(impl, REFUSED)
    answer = g.learner(impl)
    for n in range(1, 5):
        for shape in SHAPES:
            param = numbered(shape)
            for rank in range(n):
                want = fsdp2_shard(param, rank, n)
                got = g.call(answer.shard, param.clone(), rank, n)
                chunk, rows = want.shape[0], shard_rows(shape[0], n, rank)
                where = f"rank {rank} of {n}, a parameter of shape {list(shape)}"
                if not torch.is_tensor(got) or tuple(got.shape) != tuple(want.shape):
                    got_shape = list(got.shape) if torch.is_tensor(got) else type(got).__name__
                    floor = (f" ({shape[0]} // {n} rows: floor, not ceil, and no padding?)"
                             if torch.is_tensor(got) and got.shape[0] == shape[0] // n else "")
                    raise AssertionError(
                        f"{where}: your shard is {got_shape}, expected {list(want.shape)}{floor}: "
                        f"ceil({shape[0]} / {n}) = {chunk} rows on every rank, the last ones zeros "
                        f"where {n} does not divide {shape[0]}, so that every rank sends the same "
                        "count to the all-gather")
                if torch.equal(got, want):
                    continue
                owner = next((q for q in range(n) if torch.equal(got, fsdp2_shard(param, q, n))),
                             None)
                if owner is not None:
                    raise AssertionError(
                        f"{where}: your shard holds {_rows(got, shard_rows(shape[0], n, owner))}, "
                        f"rank {owner}'s; expected {_rows(want, rows)}: rank r keeps rows "
                        f"r*{chunk} ... r*{chunk} + {chunk - 1}")
                if torch.equal(got[:rows], want[:rows]):
                    raise AssertionError(f"{where}: your padding rows are not zeros: the "
                                         "all-gather sends them, and FSDP2 pads with zeros")
                raise AssertionError(f"{where}: your shard holds {_rows(got, chunk)}, expected "
                                     f"{_rows(want, rows)} and {chunk - rows} rows of zeros")


class Net(nn.Module):
    """Dims 0 of 5, 7 and 1: at N = 3 each pads, and the last layer's one row leaves ranks 1 and 2
    with padding only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.out = nn.Linear(4, 5), nn.Linear(5, 7), nn.Linear(7, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.second(torch.tanh(self.first(x)))))


def batch(rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch, or rank's rows of it (ROWS / N each)."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(ROWS, 4, generator=gen), torch.randn(ROWS, 1, generator=gen)
    if rank is None:
        return x, y
    return x[rank * ROWS // N:(rank + 1) * ROWS // N], y[rank * ROWS // N:(rank + 1) * ROWS // N]


def gradients(model: Net, params: dict, rows) -> dict[str, torch.Tensor]:
    """The gradient of the loss on `rows` of the batch at `params` (whole tensors)."""
    leaves = {name: p.detach().clone().requires_grad_() for name, p in params.items()}
    x, y = rows
    loss = nn.functional.mse_loss(torch.func.functional_call(model, leaves, (x,)), y)
    loss.backward()
    return {name: p.grad for name, p in leaves.items()}


@functools.cache
def reference() -> dict:
    """One process on the whole batch: the first step's gradient, the parameters after STEPS SGD
    steps."""
    model = Net()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    first = gradients(model, params, batch())
    for _ in range(STEPS):
        grads = gradients(model, params, batch())
        params = {n: p - LR * grads[n] for n, p in params.items()}
    return {"grad": first, "trained": params}


KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "total")


def _sent(fn):
    """fn()'s result and the bytes it sent, by collective kind (minizero's tally)."""
    before = comm.tally()
    out = fn()
    return out, {k: v - before.get(k, 0) for k, v in comm.tally().items()
                 if k in KINDS and v != before.get(k, 0)}


def worker(module_name: str) -> dict:
    answer, rank = g.learner(module_name), comm.rank()
    model = Net()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = {"rank": rank, "gathered": {}, "reduced": {}, "trained": {}}
    for name, p in params.items():                # (2) from FSDP2's own shards
        out["gathered"][name] = _sent(lambda: g.call(answer.all_gather_param,
                                                     fsdp2_shard(p, rank, N), tuple(p.shape)))
    mine = gradients(model, params, batch(rank))  # (3) this rank's true gradient
    for name, grad in mine.items():
        out["reduced"][name] = _sent(lambda: g.call(answer.reduce_scatter_grad, grad.clone()))
    out["trained"] = train(answer, model, params, rank)                            # (4)
    return out


def train(answer, model: Net, params: dict, rank: int) -> dict:
    """STEPS SGD steps with the learner's three functions: each rank's shards after them, or why
    not. Every rank decides alike whether to start (every rank's shard shapes are computed here,
    shard needs no collective), so that none waits in a collective the others skip."""
    for q in range(N):
        for name, p in params.items():
            got = g.call(answer.shard, p.clone(), q, N)
            if not torch.is_tensor(got) or got.shape != fsdp2_shard(p, q, N).shape:
                return {"error": f"your shard of {name} on rank {q} has the wrong shape"}
    shards = {n: g.call(answer.shard, p.clone(), rank, N) for n, p in params.items()}
    try:
        for _ in range(STEPS):
            whole = {n: g.call(answer.all_gather_param, s, tuple(params[n].shape))
                     for n, s in shards.items()}
            grads = gradients(model, whole, batch(rank))
            shards = {n: s - LR * g.call(answer.reduce_scatter_grad, grads[n])
                      for n, s in shards.items()}
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:   # the same on every rank
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
    return shards


def _bytes(where: str, what: str, sent: dict, kind: str, numel: int) -> None:
    want = comm.ring_bytes(kind, 4 * numel, N)
    if sent != {kind: want, "total": want}:
        raise AssertionError(
            f"{where}: your {what} sent {sent.get('total', 0):g} bytes ("
            + ", ".join(f"{k} {v:g}" for k, v in sent.items() if k != "total")
            + f"), expected one {kind.replace('_', '-')} of the padded {numel} elements, "
            f"{want:g} bytes in a ring: "
            + ("an all-reduce sends twice what a reduce-scatter does" if "all_reduce" in sent
               else "through minizero.comm, one collective for the whole tensor"))


def check_gather(impl: str) -> None:
    __tracebackhide__ = True
    g.guard(impl, REFUSED)
    model = Net()
    for res in g.launch_once(worker, N, impl):
        for name, p in model.named_parameters():
            (got, sent), where = res["gathered"][name], f"rank {res['rank']}, {name}"
            if tuple(got.shape) != tuple(p.shape):
                extra = (f": drop the padding rows ({got.shape[0] - p.shape[0]} of zeros)"
                         if got.shape[0] > p.shape[0] and tuple(got.shape[1:]) == p.shape[1:]
                         else "")
                raise AssertionError(f"{where}: your all_gather_param returned "
                                     f"{list(got.shape)}, expected {list(p.shape)}{extra}")
            if not torch.equal(got, p.detach()):
                raise AssertionError(f"{where}: your all_gather_param differs from the parameter "
                                     f"by up to {(got - p).abs().max().item():.3g}: rank r's shard "
                                     "holds rows r*chunk ..., in rank order")
            _bytes(where, "all_gather_param", sent, "all_gather",
                   N * padded_rows(p.shape[0], N) * p[0].numel())


def check_reduce(impl: str) -> None:
    __tracebackhide__ = True
    g.guard(impl, REFUSED)
    want_grads = reference()["grad"]
    for res in g.launch_once(worker, N, impl):
        rank = res["rank"]
        for name, whole in want_grads.items():
            (got, sent), where = res["reduced"][name], f"rank {rank}, {name}'s gradient"
            want = fsdp2_shard(whole, rank, N)
            if tuple(got.shape) != tuple(want.shape):
                raise AssertionError(f"{where}: your reduce_scatter_grad returned "
                                     f"{list(got.shape)}, expected {list(want.shape)}: this "
                                     "rank's rows, padded like its shard")
            rows = shard_rows(whole.shape[0], N, rank)
            if got[rows:].abs().sum() > 0:
                raise AssertionError(f"{where}: the padding rows of your result are not zeros: pad "
                                     "the gradient with zeros")
            diff = (got - want).abs().max().item()
            if diff > 1e-6:
                ratio = ((got * want).sum() / want.pow(2).sum().clamp_min(1e-30)).item()
                why = (f"exactly N = {N}: a sum over the ranks where their average belongs "
                       "(op='avg')" if abs(ratio - N) < 0.01 * N else
                       "each rank must receive its own rows, rows r*chunk ..., of the average")
                raise AssertionError(f"{where}: your rows differ from the whole batch's gradient "
                                     f"by up to {diff:.3g}; they are {ratio:.3g} x it: {why}")
            _bytes(where, "reduce_scatter_grad", sent, "reduce_scatter",
                   N * padded_rows(whole.shape[0], N) * whole[0].numel())


def check_training(impl: str) -> None:
    __tracebackhide__ = True
    g.guard(impl, REFUSED)
    trained = reference()["trained"]
    for res in g.launch_once(worker, N, impl):
        if "error" in res["trained"]:
            raise AssertionError(f"rank {res['rank']}: training with your shard, "
                                 f"all_gather_param and reduce_scatter_grad stopped: "
                                 f"{res['trained']['error']}: pass the other tests first")
        for name, whole in trained.items():
            got, want = res["trained"][name], fsdp2_shard(whole, res["rank"], N)
            if tuple(got.shape) != tuple(want.shape) or (got - want).abs().max() > 1e-5:
                raise AssertionError(
                    f"rank {res['rank']}, {name}: after {STEPS} SGD steps with your shard, "
                    f"all_gather_param and reduce_scatter_grad the shard is "
                    + (f"{list(got.shape)}, expected {list(want.shape)}" if tuple(got.shape)
                       != tuple(want.shape) else
                       f"{(got - want).abs().max().item():.3g} away from one process's rows")
                    + ": pass the other tests first")


@pytest.mark.points(2)
def test_each_rank_keeps_its_rows_with_fsdp2_padding(impl):
    check_shards(impl)


@pytest.mark.points(1)
def test_the_all_gather_rebuilds_every_parameter(impl):
    check_gather(impl)


@pytest.mark.points(2)
def test_the_reduce_scatter_gives_each_rank_its_rows_of_the_average(impl):
    check_reduce(impl)


@pytest.mark.points(1)
def test_training_with_your_three_functions_matches_one_process(impl):
    check_training(impl)
