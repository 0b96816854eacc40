"""The experiments behind notebooks/11_muon: Muon's designs rank by rank, against one process.

    from minizero.lab import muon_demo
    runs = minizero.launch(muon_demo.designs_worker, 3, "tiny", 3, 12)   # every (stage, design)
    expected = muon_demo.reference("tiny", 3, 12)      # one process: torch's Muon + AdamW

The GPT of `size` (minizero/lab/model.py) with the usual split (lab/muon_costs.usual_split: Muon
for the blocks' matrices, AdamW for the embeddings, the tied head, norms, biases), minizero's data
(lab/data.py). Each rank records, per (stage, design): which pieces of which matrices it holds, the
Muon collectives of the first step (with the minizero line that issued each: lab/source.py), its
momentum bytes and Newton-Schulz calls, and the parameters at the end. SliceAlone is the bug the
designs avoid: Newton-Schulz on whatever piece of a matrix the partition holds.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from minizero import comm, events
from minizero.beyond.muon.pieces import Design
from minizero.lab import source
from minizero.lab.data import global_batch, local_batch
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.muon_costs import ADAMW_LR, LR, STAGE_DESIGNS, usual_split
from minizero.lab.train import loss_fn
from minizero.wrap import wrap


class SliceAlone(Design):
    """The wrong design: each piece orthogonalized as the row of numbers the partition holds."""

    def orthogonalize(self, todo, settings_of):
        return [self.kernel(u.view(1, -1), group).reshape(-1) for _, u, group in todo]

    def sent_bytes(self) -> int:
        return 0

    def newton_schulz_calls(self) -> int:
        return sum(len(pieces) for pieces in self.layout.pieces)


CASES = {**{(stage, design): design for stage, designs in STAGE_DESIGNS.items()
            for design in designs}, (0, "straddle"): "straddle", (1, "slice alone"): SliceAlone}


def _batch(step: int, batch: int, block_size: int, whole: bool = False):
    x, y = global_batch(step, batch, block_size)
    return (x, y) if whole else local_batch(x, y, comm.rank(), comm.world_size())


def reference(size: str, steps: int, batch: int) -> dict[str, torch.Tensor]:
    """One process, the global batch: torch.optim.Muon on the Muon group, torch.optim.AdamW on the
    rest (the full state dict after `steps`)."""
    model = make_model(GPTConfig.named(size), seed=0)
    muon_group, adamw_group = usual_split(model)
    muon = torch.optim.Muon(muon_group["params"], lr=LR)
    adamw = torch.optim.AdamW(adamw_group["params"], lr=ADAMW_LR)
    for step in range(steps):
        x, y = _batch(step, batch, model.cfg.block_size, whole=True)
        loss_fn(model(x), y).backward()
        muon.step()
        adamw.step()
        model.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run(size: str, stage: int, design, steps: int, batch: int) -> dict:
    model = make_model(GPTConfig.named(size), seed=0)
    names = {id(p): name for name, p in model.named_parameters()}
    engine = wrap(model, stage, functools.partial(torch.optim.Muon, lr=LR),
                  param_groups=usual_split(model), muon_design=design)
    collectives = []

    def record(name, fields):
        if name == "collective" and fields["tag"].startswith("Muon"):
            collectives.append({"kind": fields["kind"], "tag": fields["tag"],
                                "numel": fields["numel"], "dtype": str(fields["dtype"]),
                                "sent": fields["sent"], "source": source.origin()})
    for step in range(steps):
        x, y = _batch(step, batch, model.cfg.block_size)
        engine.backward(loss_fn(engine(x), y))
        with events.subscribed(record) if step == 0 else contextlib.nullcontext():
            engine.step()
    orthogonalize = engine.optimizer.optimizer.design
    layout = orthogonalize.layout
    return {"pieces": [(names[id(p.param)], tuple(p.param.shape), p.begin, p.end, p.whole)
                       for pieces in layout.pieces for p in pieces],
            "straddlers": [names[id(m.param)] for m in layout.matrices if m.straddles],
            "collectives": collectives, "sent_formula": orthogonalize.sent_bytes(),
            "newton_schulz_calls": orthogonalize.newton_schulz_calls(),
            "momentum": sum(s["momentum_buffer"].numel() * 4
                            for s in engine.optimizer.optimizer.state.values()
                            if "momentum_buffer" in s),
            "state": engine.full_state_dict()}


def designs_worker(size: str, steps: int, batch: int) -> dict:
    """Every case of CASES on this rank: {(stage, design name): _run's record}."""
    return {(stage, name): _run(size, stage, design, steps, batch)
            for (stage, name), design in CASES.items()}
