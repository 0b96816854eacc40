"""Which modules are stage 3's units, and which parameters each one owns (the Unit itself: unit.py).

    engine = minizero.wrap(model, 3, optimizer)                    # default_units(model)
    engine = minizero.wrap(model, 3, optimizer, units=list(model.blocks))

Run its tests:  python -m pytest tests/test_zero3_units.py

A unit is the granularity of stage 3 (zero3.py): the largest unit, not the model, bounds the
parameter memory in flight. FSDP users choose units with a wrap policy (a transformer's blocks, or
by size); DeepSpeed fetches module by module.
"""

from __future__ import annotations

import warnings

from torch import nn

UNIT_SHARE = 1 / 8  # default units without transformer blocks hold at most Ψ/8 each (default_units)


def default_units(model: nn.Module) -> list[nn.Module]:
    """The units when none are given, so that no unit holds much of Ψ (the trainable parameters).

    1. A transformer: the blocks of the first nn.ModuleList holding most of Ψ, if none holds
       more than half: one unit per block, as FSDP users wrap; the model keeps the rest
       (embeddings, head), < Ψ/2.
    2. Any other model, by size (FSDP's size-based auto-wrap, turned to bound the largest unit):
       walking down from the model, a submodule holding at most UNIT_SHARE·Ψ is a unit; a bigger one
       is a unit of the parameters it holds directly, and its children are visited in turn. No unit
       exceeds Ψ/8 but the parameters one module holds directly (a single big weight, say) and a
       weight tied across units.
    Why Ψ/8: with prefetch two units are gathered at once, so parameters peak near Ψ/N + Ψ/4;
    smaller units save little more and each costs one more all-gather (and its latency) per use.
    """
    # frozen count: memory
    size = {id(m): sum(p.numel() for p in m.parameters()) for m in model.modules()}
    total = size[id(model)]
    for m in model.modules():
        if (
            isinstance(m, nn.ModuleList)
            and size[id(m)] > total / 2
            and all(size[id(b)] <= total / 2 for b in m)
        ):
            return list(m)
    units = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            units.append(child)
            if size[id(child)] > UNIT_SHARE * total:
                visit(child)
    visit(model)
    return units


def assign_units(model: nn.Module, units: list[nn.Module], chosen: bool = False
                 ) -> tuple[list[nn.Module], list[list[nn.Parameter]], list[list[nn.Parameter]]]:
    """(unit modules, the trainable and the frozen parameters each owns), in bucket order; the model
    is always a unit. chosen: the user chose the units (wrap's units=); warn if one holds most of Ψ.

    A parameter belongs to the innermost unit containing every module that holds it, so a weight
    tied across units (the GPT's embedding and head) is gathered whenever either use needs it. Units
    owning nothing are dropped. Bucket order is reverse registration order: the order in which
    backward completes units (the model last: the tied embedding's gradient is finished only at the
    very end)."""
    units = list({id(u): u for u in [model, *units]}.values())
    members = {id(u): {id(m) for m in u.modules()} for u in units}
    holders: dict[int, set[int]] = {}                   # parameter -> modules that hold it directly
    for m in model.modules():
        for p in m.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(id(m))
    owned: dict[int, list[nn.Parameter]] = {id(u): [] for u in units}
    for p in model.parameters():
        owner = min(
            (u for u in units if holders[id(p)] <= members[id(u)]),
            key=lambda u: len(members[id(u)]),
        )
        owned[id(owner)].append(p)
    kept = [u for u in reversed(units) if owned[id(u)]]
    sizes = {id(u): sum(p.numel() for p in owned[id(u)]) for u in kept}
    largest = max(kept, key=lambda u: sizes[id(u)])
    share = sizes[id(largest)] / sum(sizes.values())
    if chosen and share > 0.5:               # gathered whole, it is most of the model: little saved
        name = next(n for n, m in model.named_modules() if m is largest) or "<root>"
        warnings.warn(
            f"stage 3: unit {name!r} holds {share:.0%} of the parameters; pass units= with "
            "smaller submodules (e.g. each block)",
            stacklevel=4,
        )
    return (kept, [[p for p in owned[id(u)] if p.requires_grad] for u in kept],
            [[p for p in owned[id(u)] if not p.requires_grad] for u in kept])
