"""Grader for exercise 16 (Muon's Newton-Schulz over ZeRO's partitions):  pytest exercises -k ex16

Three ranks train a small model whose matrices straddle the partitions at N = 3 (plus a tied
embedding, a frozen matrix, biases and a norm) with minizero.wrap at stages 1 and 3: torch's Muon
for its matrices, AdamW for the rest, your function in place of minizero's design (an adapter: a
minizero.beyond.muon Design that calls it once per bucket). At every step your O is compared with
minizero's own on every rank, piece by piece; after three steps every rank must end where one
process running torch.optim.Muon and torch.optim.AdamW ends. And what each design sends: (a) no
byte for a bucket without a straddling matrix, at most an fp32 all-gather of N x the longest piece
per straddler; (c) Newton-Schulz exactly once per matrix, on rank k mod N of each bucket's list.
"""

import functools

import pytest
import torch
from torch import nn

import _grading as g
import minizero
from minizero import comm
from minizero.beyond.muon.pieces import Design
from minizero.beyond.muon.straddle import GatherStraddlers

N = 3
STEPS = 3
ROWS, VOCAB = 12, 11
LR, ADAMW_LR = 0.02, 3e-3
STAGES = (1, 3)
FUNCTIONS = {"straddlers": "orthogonalize_straddlers", "round robin": "orthogonalize_round_robin"}


class Net(nn.Module):
    """Matrices 6x9, 9x9 x3, 9x6 (Muon), a frozen 9x9, a tied embedding, biases, a norm."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 6)
        self.up = nn.Linear(6, 9)
        self.blocks = nn.ModuleList(nn.Linear(9, 9, bias=False) for _ in range(3))
        self.frozen = nn.Linear(9, 9, bias=False)
        self.frozen.requires_grad_(False)
        self.down = nn.Linear(9, 6)
        self.norm = nn.LayerNorm(6)
        self.lm_head = nn.Linear(6, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, idx):
        x = torch.tanh(self.up(self.embed(idx)))
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.lm_head(self.norm(self.down(self.frozen(x))))


def split(model: Net) -> tuple[list, list]:
    hidden = [model.up.weight, *(b.weight for b in model.blocks), model.down.weight]
    rest = [p for p in model.parameters() if p.requires_grad and all(p is not h for h in hidden)]
    return hidden, rest


def loss_of(model, step: int, rows=lambda t: t) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    x, y = (torch.randint(0, VOCAB, (ROWS, 5), generator=gen) for _ in range(2))
    return nn.functional.cross_entropy(model(rows(x)).reshape(-1, VOCAB), rows(y).reshape(-1))


def reference() -> dict:
    model = Net()
    hidden, rest = split(model)
    muon, adamw = torch.optim.Muon(hidden, lr=LR), torch.optim.AdamW(rest, lr=ADAMW_LR)
    for step in range(STEPS):
        loss_of(model, step).backward()
        muon.step()
        adamw.step()
        model.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def adapter(answer, record: dict):
    """A minizero design that calls the learner's function once per bucket holding Muon matrices,
    and checks its O against minizero's own (GatherStraddlers) on the same U."""

    class Learners(Design):
        def orthogonalize(self, todo, settings_of):
            expected = GatherStraddlers(self.layout).orthogonalize(todo, settings_of)
            names = {id(p): name for name, p in record["model"].named_parameters()}
            got = {}
            for i, bucket in enumerate(self.layout.placement.buckets):
                matrices = [m for m in self.layout.matrices if m.bucket == i]
                if not matrices:
                    continue
                u_part = torch.zeros(bucket.shard_numel)
                for piece, u, _ in todo:
                    if piece.part == i:
                        u_part[piece.at:piece.at + piece.numel] = u
                calls = [0]

                def newton_schulz(u, settings=settings_of(matrices[0].param)):
                    calls[0] += 1
                    return self.kernel(u, settings)
                before = comm.tally()["total"]
                o_part = g.call(answer, [(m.offset, tuple(m.param.shape)) for m in matrices],
                                u_part.clone(), newton_schulz)
                record["buckets"].append({"sent": comm.tally()["total"] - before,
                                          "calls": calls[0], "matrices": len(matrices),
                                          "straddlers": [self.longest(m) for m in matrices
                                                         if m.straddles]})
                for piece, _, _ in todo:
                    if piece.part == i:
                        got[id(piece)] = o_part[piece.at:piece.at + piece.numel].float()
            for (piece, _, _), want in zip(todo, expected):
                mine = got[id(piece)]
                if not torch.equal(mine, want.float()) and record["first wrong"] is None:
                    record["first wrong"] = (names[id(piece.param)], piece.numel,
                                             int((mine == 0).sum()), int((want == 0).sum()),
                                             (mine.double().norm() / want.double().norm()).item())
            return [got[id(piece)] for piece, _, _ in todo]

        longest = staticmethod(GatherStraddlers.longest)

    return Learners


def worker(module_name: str) -> dict:
    answer, out = g.learner(module_name), {"rank": comm.rank()}
    for design, function in FUNCTIONS.items():
        for stage in STAGES:
            model = Net()
            hidden, rest = split(model)
            record = {"model": model, "buckets": [], "first wrong": None}
            engine = minizero.wrap(
                model, stage, functools.partial(torch.optim.Muon, lr=LR),
                param_groups=[{"params": hidden},
                              {"params": rest, "use_muon": False, "lr": ADAMW_LR}],
                muon_design=adapter(getattr(answer, function), record))
            for step in range(STEPS):
                engine.backward(loss_of(engine, step, lambda t: t.chunk(N)[comm.rank()]))
                engine.step()
            record.pop("model")
            out[(design, stage)] = {**record, "state": engine.full_state_dict()}
    return out


def check(impl: str, design: str) -> None:
    """Every rank's O first (the most precise message), then the bytes or the Newton-Schulz calls,
    then the trained parameters."""
    __tracebackhide__ = True
    g.guard(impl)
    runs = [(res["rank"], stage, res[(design, stage)])
            for stage in STAGES for res in g.launch_once(worker, N, impl)]
    for rank, stage, run in runs:
        if run["first wrong"] is not None:
            name, numel, zeros, want_zeros, scale = run["first wrong"]
            if zeros > want_zeros:
                hint = ("a matrix that begins in another rank's partition straddles into yours: "
                        "its piece here needs O too" if design == "straddlers" else
                        "the owner's O never reached this rank: every rank must get the O of its "
                        "own elements (reduce-scatter with op='sum')")
            elif abs(scale - N) < 0.5:
                hint = (f"it is {scale:.2f} x minizero's: more than the owner wrote O into the "
                        "buffer summed over the ranks")
            else:
                hint = ("Newton-Schulz of a piece is not the piece of Newton-Schulz: gather the "
                        "whole matrix first")
            raise AssertionError(f"rank {rank}, stage {stage}: your O of {name} differs from "
                                 f"minizero's on this rank's {numel} elements of it ({zeros} zeros "
                                 f"where minizero's has {want_zeros}): {hint}")
    for rank, stage, run in runs:
        for bucket in run["buckets"]:
            where = f"rank {rank}, stage {stage}"
            if design == "straddlers":
                allowed = sum(comm.ring_bytes("all_gather", N * longest * 4, N)
                              for longest in bucket["straddlers"])
                if bucket["sent"] > allowed:
                    raise AssertionError(
                        f"{where}: a bucket with {len(bucket['straddlers'])} straddling matrices "
                        f"of {bucket['matrices']} sent {bucket['sent']:g} bytes, at most "
                        f"{allowed:g}: only a matrix that straddles travels, padded to its "
                        "longest piece")
            else:
                owned = len(range(rank, bucket["matrices"], N))
                if bucket["calls"] != owned:
                    raise AssertionError(
                        f"{where}: Newton-Schulz ran {bucket['calls']} times for a bucket of "
                        f"{bucket['matrices']} matrices, expected {owned}: matrix k is "
                        "orthogonalized by rank k mod N alone")
    expected = reference()
    for rank, stage, run in runs:
        worst = max((run["state"][k] - v).abs().max().item() for k, v in expected.items())
        if worst > 1e-5:
            raise AssertionError(f"rank {rank}, stage {stage}: after {STEPS} steps the parameters "
                                 f"differ from one process's torch.optim.Muon + AdamW by "
                                 f"{worst:.3g}")


def check_straddlers(impl: str) -> None:
    __tracebackhide__ = True
    check(impl, "straddlers")


def check_round_robin(impl: str) -> None:
    __tracebackhide__ = True
    check(impl, "round robin")


@pytest.mark.points(3)
def test_straddling_matrices_are_gathered_and_nothing_else(impl):
    check_straddlers(impl)


@pytest.mark.points(2)
def test_round_robin_orthogonalizes_each_matrix_once(impl):
    check_round_robin(impl)
