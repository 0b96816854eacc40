"""Who owns a parameter: one engine or front end per parameter, refused in one line otherwise.

    python -m pytest tests/test_users_loop.py

Every minizero engine and front end takes over the parameters it is given: it makes them views of
its flat buffers, hooks their gradients, or replaces them by shards. A second one over the same
parameters would do it again beside the first (two reductions of every gradient, two optimizers
stepping one weight), and train to something that is neither: measured, a stage-0 engine for the
gradients plus a stage-1 engine as a sharded optimizer ended 0.518 away from one process, silently.
So each takes its parameters with `claim`, which refuses what another already holds, naming both.

The one exception is a pair whose originals compose: torch's DistributedDataParallel averages the
gradients and its ZeroRedundancyOptimizer steps them (`composes_with`: each names the kinds of
owner it works beside).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Owner:
    kind: str                          # what it is, as the user wrote it: "minizero.wrap (stage 1)"
    composes_with: tuple[str, ...] = ()   # kinds of owner it works beside on the same parameters


# id(parameter) -> (a weak reference to it, its owners). Weak: a model nobody holds any more
# leaves no claim behind (ids are reused, so a dead reference's entry is dropped when seen).
_claims: dict[int, tuple[weakref.ref, list[Owner]]] = {}


def owners(p: torch.Tensor) -> list[Owner]:
    entry = _claims.get(id(p))
    if entry is None or entry[0]() is not p:
        _claims.pop(id(p), None)
        return []
    return entry[1]


def claim(params, owner: Owner, names: dict[int, str] | None = None) -> None:
    """Make `owner` an owner of every tensor in `params`, or raise ValueError (one line, nothing
    claimed) if one is held by an owner that does not compose with it. names: {id: name} for the
    message."""
    params = list({id(p): p for p in params}.values())
    for p in params:
        for other in owners(p):
            if owner.kind not in other.composes_with or other.kind not in owner.composes_with:
                name = (names or {}).get(id(p), f"a parameter of shape {tuple(p.shape)}")
                raise ValueError(
                    f"{name} is already owned by {other.kind}; {owner.kind} cannot take it too "
                    "(both would reduce and step it): build the model again, or use one of them")
    for p in params:
        held = owners(p)
        _claims[id(p)] = (weakref.ref(p), held + [owner])


def release(params, owner: Owner) -> None:
    """`owner` hands its parameters back (an FSDP instance retired into an outer one)."""
    for p in params:
        held = [o for o in owners(p) if o is not owner]
        if held:
            _claims[id(p)] = (weakref.ref(p), held)
        else:
            _claims.pop(id(p), None)
