"""Muon under ZeRO (minizero/beyond/muon/): every stage, offload and design ends where ONE process
running torch.optim.Muon (hidden matrices) plus torch.optim.AdamW (the rest) ends, fp32 within
1e-5, on an awkward model at N = 3 (matrices that straddle a partition boundary, a tied embedding,
a frozen matrix, three matrices of one shape for design (b)); orthogonalizing a partition's slice
instead is far off; each design sends the bytes and keeps the momentum its formula says; a Muon
checkpoint resumes bit-exact; what Muon cannot take is refused in one line. One launch.
Run: python -m pytest tests/test_muon.py -q"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import minizero
from minizero import comm, events
from minizero.beyond.muon import update
from minizero.beyond.muon.pieces import Design, matrices_of
from minizero.flat import FlatLayout

N = 3
STEPS = 3
ROWS = 12                                   # the global batch: N equal shares
VOCAB = 11
MUON_LR, ADAMW_LR = 0.02, 3e-3
TOLERANCE = 1e-5                            # fp32 (the bar)


class Net(nn.Module):
    """A tied embedding/head (AdamW), hidden matrices of odd shapes (Muon: 6x9 -> 9x9 x3 -> 9x6),
    a frozen 9x9 matrix, biases and a LayerNorm (AdamW). 554 parameters, 473 trained."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 6)
        self.up = nn.Linear(6, 9)
        self.blocks = nn.ModuleList(nn.Linear(9, 9, bias=False) for _ in range(3))
        self.frozen = nn.Linear(9, 9, bias=False)
        self.frozen.requires_grad_(False)
        self.down = nn.Linear(9, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, VOCAB, bias=False)
        self.head.weight = self.emb.weight                    # tied

    def forward(self, idx):
        x = torch.tanh(self.up(self.emb(idx)))
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(self.norm(self.down(self.frozen(x))))

    def hidden(self) -> list[nn.Parameter]:
        return [self.up.weight, *(b.weight for b in self.blocks), self.down.weight]


def groups(model: Net) -> list[dict]:
    """The usual split, as users write it: Muon for the hidden matrices, AdamW for the rest."""
    hidden = model.hidden()
    rest = [p for p in model.parameters() if p.requires_grad and all(p is not h for h in hidden)]
    return [{"params": hidden, "lr": MUON_LR},
            {"params": rest, "use_muon": False, "lr": ADAMW_LR, "betas": (0.9, 0.95)}]


def flagged(model: Net) -> Net:
    """DeepSpeed's convention instead of groups: each parameter says p.use_muon."""
    hidden = {id(p) for p in model.hidden()}
    for p in model.parameters():
        p.use_muon = id(p) in hidden
    return model


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, VOCAB, (ROWS, 5), generator=g),
            torch.randint(0, VOCAB, (ROWS, 5), generator=g))


def loss_of(model, step: int, rows=lambda t: t) -> torch.Tensor:
    x, y = data(step)
    return nn.functional.cross_entropy(model(rows(x)).reshape(-1, VOCAB), rows(y).reshape(-1))


def my_rows(t: torch.Tensor) -> torch.Tensor:
    return t.chunk(comm.world_size())[comm.rank()]


def reference(adamw_settings: bool = True) -> dict[str, torch.Tensor]:
    """One process, the global batch: torch.optim.Muon and torch.optim.AdamW, as torch's docs
    pair them (AdamW with the groups' settings, or its defaults: what use_muon flags give)."""
    model = Net()
    muon_group, adamw_group = groups(model)
    muon = torch.optim.Muon(muon_group["params"], lr=MUON_LR)
    adamw = torch.optim.AdamW(adamw_group["params"], **(
        {"lr": ADAMW_LR, "betas": adamw_group["betas"]} if adamw_settings else {}))
    for step in range(STEPS):
        loss_of(model, step).backward()
        muon.step()
        adamw.step()
        model.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class EachSliceAlone(Design):
    """The bug DeepSpeed once shipped: Newton-Schulz on what the partition holds of a matrix
    (here a piece as the row vector it is in the flat buffer), not on the whole matrix."""

    def orthogonalize(self, todo, settings_of):
        return [self.kernel(u.view(1, -1), group).reshape(-1) for _, u, group in todo]

    def sent_bytes(self) -> int:
        return 0


CASES = {  # name: (stage, muon_design, options)
    "stage 0": (0, None, {}),
    "stage 1 (a)": (1, "straddle", {}),
    "stage 1 (b)": (1, "whole", {}),
    "stage 1 (c)": (1, "round_robin", {}),
    "stage 2 (a)": (2, "straddle", {"bucket_size": 600}),
    "stage 2 (b)": (2, "whole", {"bucket_size": 600}),
    "stage 3 (a)": (3, "straddle", {}),
    "stage 3 (c)": (3, "round_robin", {}),
    "stage 2 (a) + offload": (2, "straddle", {"offload": True}),
    "stage 3 (c) + offload params": (3, "round_robin", {"offload": "params"}),
    "stage 2, use_muon flags": (2, None, {}),
    "stage 1, each slice alone": (1, EachSliceAlone, {}),
}


def muon_bytes() -> tuple[dict, callable]:
    """Bytes this rank's Muon collectives send (comm.py's ring tally), from the event stream."""
    sent = {"bytes": 0}

    def count(name, fields):
        if name == "collective" and fields["tag"].startswith("Muon"):
            sent["bytes"] += fields["sent"]
    return sent, count


def run_case(name: str) -> dict:
    stage, design, options = CASES[name]
    model = Net()
    grouping = {} if "flags" in name else {"param_groups": groups(model)}
    engine = minizero.wrap(flagged(model) if "flags" in name else model, stage,
                           functools.partial(torch.optim.Muon, lr=MUON_LR),
                           muon_design=design, **grouping, **options)
    orthogonalize = engine.optimizer.optimizer.design
    sent, count = muon_bytes()
    with events.subscribed(count):
        for step in range(STEPS):
            engine.backward(loss_of(engine, step, my_rows))
            engine.step()
    momentum = sum(s["momentum_buffer"].numel() * 4
                   for s in engine.optimizer.optimizer.state.values() if "momentum_buffer" in s)
    layout = orthogonalize.layout
    return {"state": engine.full_state_dict(),
            "straddlers": sum(m.straddles for m in layout.matrices),
            "whole buckets": sum(all(p.ndim == 2 for p in b.params) for b in engine.layout.buckets),
            "sent per step": sent["bytes"] / STEPS,
            "formula": orthogonalize.sent_bytes(),
            "momentum": momentum,
            "momentum formula": 4 * sum(p.numel for pieces in layout.pieces for p in pieces)}


def resume(folder: str) -> dict:
    """Stage 2 (a): two steps, a checkpoint, a fresh engine loads it and takes the third."""
    def build():
        model = Net()
        return minizero.wrap(model, 2, functools.partial(torch.optim.Muon, lr=MUON_LR),
                             param_groups=groups(model), bucket_size=600)
    engine = build()
    for step in range(2):
        engine.backward(loss_of(engine, step, my_rows))
        engine.step()
    engine.save(folder)
    engine = build()
    engine.load(folder)
    engine.backward(loss_of(engine, 2, my_rows))
    engine.step()
    return engine.full_state_dict()


def worker(folder: str) -> dict:
    out = {name: run_case(name) for name in CASES}
    out["resumed"] = resume(folder)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("muon") / "ckpt")
    return minizero.launch(worker, N, folder)


def max_diff(state: dict, expected: dict) -> float:
    return max((state[k].float() - expected[k].float()).abs().max().item() for k in expected)


@pytest.fixture(scope="module")
def expected():
    return {"groups": reference(), "flags": reference(adamw_settings=False)}


@pytest.mark.parametrize("name", [n for n in CASES if "slice" not in n])
def test_every_stage_and_design_equals_torchs_muon_and_adamw(runs, expected, name):
    assert max_diff(runs[0][name]["state"], expected["flags" if "flags" in name else "groups"]) \
        < TOLERANCE
    for rank in range(1, N):                                     # and every rank holds the same
        assert max_diff(runs[rank][name]["state"], runs[0][name]["state"]) == 0


def test_the_model_is_awkward_where_it_matters(runs):
    """At N = 3 matrices straddle a boundary (stages 1 and 3: the case design (a) gathers), and
    design (b) makes the three 9x9 matrices one bucket, one whole matrix a rank."""
    for name in ("stage 1 (a)", "stage 3 (a)", "stage 3 (c)"):
        assert runs[0][name]["straddlers"] >= 1, name
    assert runs[0]["stage 1 (b)"]["whole buckets"] == 1
    assert runs[0]["stage 0"]["straddlers"] == 0                 # DDP: every matrix whole


def test_orthogonalizing_a_slice_is_wrong(runs, expected):
    assert max_diff(runs[0]["stage 1, each slice alone"]["state"], expected["groups"]) > 1e-3


@pytest.mark.parametrize("name", [n for n in CASES if n != "stage 0"])
def test_each_design_sends_and_keeps_what_its_formula_says(runs, name):
    for rank in range(N):
        run = runs[rank][name]
        assert run["sent per step"] == run["formula"], (rank, run["sent per step"], run["formula"])
        assert run["momentum"] == run["momentum formula"], rank
    if "(b)" in name:            # the whole-matrix buckets need nothing: what is left straddles
        assert runs[0][name]["formula"] < runs[0][name.replace("(b)", "(a)")]["formula"]


def test_a_muon_checkpoint_resumes_bit_exact(runs):
    uninterrupted = runs[0]["stage 2 (a)"]["state"]
    assert max_diff(runs[0]["resumed"], uninterrupted) == 0


# --- one process ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(12, 8), (8, 12), (10, 10)])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_update_is_torchs_muon_bit_for_bit(shape, nesterov, adjust_lr_fn):
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(shape))
    mine, buffer = weight.detach().clone(), torch.zeros(shape)
    optimizer = torch.optim.Muon([weight], lr=0.02, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    group = optimizer.param_groups[0]
    for _ in range(3):
        weight.grad = torch.randn(shape)
        u = update.momentum_and_nesterov(buffer, weight.grad, group["momentum"], nesterov)
        update.apply_update(mine, update.orthogonalized(u, group), group["lr"],
                            group["weight_decay"],
                            update.adjusted_lr(group["lr"], adjust_lr_fn, shape))
        optimizer.step()
        assert torch.equal(mine, weight.detach())


def test_newton_schulz_of_the_slices_is_not_of_the_whole():
    """Two ranks each orthogonalize their half of U's rows: each half comes out orthogonal by
    itself, and the two stacked are not orthogonal at all (singular values up to ~sqrt 2)."""
    torch.manual_seed(0)
    u = torch.randn(16, 24)
    group = torch.optim.Muon([nn.Parameter(u)]).param_groups[0]
    whole = update.orthogonalized(u, group).float()
    stacked = torch.cat([update.orthogonalized(half, group) for half in u.chunk(2)]).float()
    assert (stacked - whole).norm() / whole.norm() > 0.3
    assert torch.linalg.matrix_norm(whole, 2) < 1.25 < torch.linalg.matrix_norm(stacked, 2)


def test_where_each_piece_of_a_matrix_is():
    """pieces.py's picture: W0 (6), W1 (9), W2 (5) at N = 3, partitions of 7."""
    w = [nn.Parameter(torch.zeros(shape)) for shape in ((2, 3), (3, 3), (1, 5))]
    bucket = FlatLayout.build([w], world_size=3, rank=0).buckets[0]
    holders = [m.holders for m in matrices_of(bucket, 0, lambda p: True)]
    assert holders == [((0, 0, 6),), ((0, 0, 1), (1, 1, 8), (2, 8, 9)), ((2, 0, 5),)]


@pytest.mark.parametrize("change, message", [
    (dict(param_groups="all"), "2-D parameters only: up.bias"),
    (dict(offload="disk", offload_path="."), "offload='disk' with Muon"),
    (dict(stage=3, muon_design="whole"), "needs a stage that chooses its buckets"),
    (dict(muon_design="diagonal"), "muon_design must be one of"),
    (dict(optimizer=functools.partial(torch.optim.AdamW), muon_design="whole"),
     "needs an optimizer factory that makes torch.optim.Muon"),
])
def test_what_muon_cannot_take_is_refused_in_one_line(change, message):
    model = Net()
    args = {"stage": 1, "optimizer": functools.partial(torch.optim.Muon),
            "param_groups": groups(model), **change}
    if args["param_groups"] == "all":
        args["param_groups"] = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    with pytest.raises(ValueError, match=message):
        minizero.wrap(model, **args)
