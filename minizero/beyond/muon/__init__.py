"""Muon under ZeRO: an optimizer that needs whole matrices, at every stage.

    engine = minizero.wrap(model, 2, functools.partial(torch.optim.Muon, lr=0.02))
    python -m pytest tests/test_muon.py          # notebooks/11_muon, docs/muon.md

update.py (Muon's step in three parts: which need the whole matrix), pieces.py (which pieces of
which matrices a partition holds), the three designs: straddle.py (a), whole.py (b),
round_robin.py (c), optimizer.py (MuonWithAdamW: the usual split, one torch optimizer), home.py
(how wrap builds a Muon engine from a stage's row).
"""
