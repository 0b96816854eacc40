"""One torch optimizer for the usual split: Muon for the hidden matrices, AdamW for the rest.

    python -m pytest tests/test_muon.py -k optimizer

What an optimizer home (optim.py) builds over this rank's views when the user's factory makes
torch.optim.Muon: the user's parameter groups, in order, each either Muon's (use_muon, the default)
or AdamW's (use_muon=False: embeddings, the head, norms, biases; Keller Jordan's MuonWithAuxAdam
and DeepSpeed's convention). One optimizer, so that a scheduler, get_lr and checkpoints see every
group, as they would with any other optimizer.

A Muon group's parameters are *pieces*: a view of this rank's elements of one matrix (pieces.py).
step() runs torch.optim.Muon's algorithm (update.py) in its three parts: the momentum on each
piece, here; Newton-Schulz on whole matrices, by the design (straddle.py, round_robin.py: they may
communicate, so every rank calls step() together, as engine.step does); the update on each piece,
here. AdamW's groups are stepped by torch.optim.AdamW itself, which shares this optimizer's group
dicts and state (a scheduler that sets a group's lr sets it for both).
"""

from __future__ import annotations

import torch

from minizero.beyond.muon.pieces import Piece
from minizero.beyond.muon.update import adjusted_lr, apply_update, momentum_and_nesterov


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon's step on the pieces of the groups with use_muon (default True),
    torch.optim.AdamW's on the others. muon / adamw: each optimizer's settings (the user's Muon
    factory's, AdamW's defaults), which a group's own keys override. design: orthogonalizes
    [(piece, U, settings)]. locate() tells it which piece each view is, once the views exist."""

    def __init__(self, params, *, muon: dict, adamw: dict, design):
        groups = list(params)
        if not groups or not isinstance(groups[0], dict):
            groups = [{"params": groups}]                     # no groups: one, all Muon's
        groups = [{**(muon if g.get("use_muon", True) else adamw), "use_muon": True, **g}
                  for g in groups]
        super().__init__(groups, {})
        self.design = design
        self.pieces: dict[int, Piece] = {}       # {id(view): the piece of a matrix it is}
        self.group_of: dict[int, int] = {}       # {id(matrix): its group}, every rank's matrices
        aux = [g for g in self.param_groups if not g["use_muon"]]
        self.adamw = torch.optim.AdamW(aux) if aux else None
        self._share()

    def _share(self) -> None:
        """AdamW steps this optimizer's own group dicts, with this optimizer's state."""
        if self.adamw is not None:
            self.adamw.param_groups = [g for g in self.param_groups if not g["use_muon"]]
            self.adamw.state = self.state

    def locate(self, pieces: dict[int, Piece], group_of: dict[int, int]) -> None:
        """Which piece each Muon view is, and each Muon matrix's group (pieces.Layout): a design
        may orthogonalize a matrix this rank holds no piece of (round_robin.py)."""
        self.pieces, self.group_of = pieces, group_of

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, then each view keeps only its own kind's state (a checkpoint joins a bucket's
        views, Muon's momentum and AdamW's moments side by side: optim.ShardOptimizer)."""
        super().load_state_dict(state_dict)                   # new group dicts, new state
        for group in self.param_groups:
            for view in group["params"]:
                state = self.state.get(view, {})
                for name in list(state):
                    if (name == "momentum_buffer") != group["use_muon"]:
                        del state[name]
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo, views = [], []                                  # (piece, U, settings), view
        for group in self.param_groups:
            for view in group["params"] if group["use_muon"] else ():
                if view.grad is None:
                    continue
                state = self.state[view]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(view.grad)
                u = momentum_and_nesterov(state["momentum_buffer"], view.grad, group["momentum"],
                                          group["nesterov"])
                todo.append((self.pieces[id(view)], u, group))
                views.append(view)
        orthogonal = self.design.orthogonalize(
            todo, lambda matrix: self.param_groups[self.group_of[id(matrix)]])
        for view, (piece, _, group), o in zip(views, todo, orthogonal):
            apply_update(view, o, group["lr"], group["weight_decay"],
                         adjusted_lr(group["lr"], group["adjust_lr_fn"], piece.param.shape))
        if self.adamw is not None:
            self.adamw.step()
        return loss
