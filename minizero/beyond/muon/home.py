"""Muon at every stage: the optimizer home that steps matrices, and the engine that holds it.

    engine = minizero.wrap(model, 2, functools.partial(torch.optim.Muon, lr=0.02),
                           param_groups=[{"params": hidden_matrices},
                                         {"params": the_rest, "use_muon": False, "lr": 3e-4}])
    python -m pytest tests/test_muon.py

wrap (minizero/wrap.py) asks muon_settings(factory) whether the user's factory makes
torch.optim.Muon; if so it builds the stage's engine with one cell of its row replaced (stages.py's
table; fairscale/fsdp_engine.py does the same for FSDP): `optimizer`, the optimizer home. The home
is optim.ShardOptimizer (offload.HostShardOptimizer with offload=True), unchanged but for
homes.py's checkpointable state (DeviceHome, HostHome), with two things handed in:

  * cut: its views are cut at the edges of the matrices' pieces (pieces.Layout), so that each view
    of a Muon group is one rank's piece of one matrix; AdamW's runs keep their cache-sized views;
  * the optimizer it builds is optimizer.MuonWithAdamW: the user's Muon settings on the groups with
    use_muon (the default), torch.optim.AdamW on those with use_muon=False, and the design that
    brings each matrix's U together for Newton-Schulz:

        "straddle"     (a) straddle.py: gather only the matrices that straddle (the default)
        "whole"        (b) whole.py: the bucket rule makes every full set of N same-shape
                       matrices whole on its ranks (stages 1-2; the table's `buckets` cell too)
        "round_robin"  (c) round_robin.py: gather every matrix, orthogonalize round-robin

Stage 0 (DDP) holds every matrix whole: its home is the same, and nothing straddles. Why "straddle"
is the default: docs/muon.md measures the three at N = 2, 3, 4. The DeepSpeed convention, a
`use_muon` attribute on each parameter (deepspeed.initialize sets it), becomes the two groups when
no param_groups are given (groups_from_flags).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
from torch import nn

from minizero import comm
from minizero.beyond.muon.optimizer import MuonWithAdamW
from minizero.beyond.muon.pieces import Layout
from minizero.beyond.muon.round_robin import RoundRobin
from minizero.beyond.muon.straddle import GatherStraddlers
from minizero.beyond.muon.whole import whole_matrix_buckets
from minizero.homes import DeviceHome, HostHome
from minizero.optim import Placement, ShardOptimizer
from minizero.param_groups import Grouping, group_runs

DESIGNS = {"straddle": GatherStraddlers, "whole": GatherStraddlers, "round_robin": RoundRobin}
DEFAULT_DESIGN = "straddle"
ADAMW = dict(torch.optim.AdamW([nn.Parameter(torch.zeros(1))]).defaults)  # torch's own defaults


def muon_settings(factory) -> dict | None:
    """The Muon settings of an optimizer factory (lr, momentum, ns_steps, ... with torch's defaults
    filled in), or None if it does not make a torch.optim.Muon. Asked once, on a 1x1 probe."""
    try:
        probe = factory([nn.Parameter(torch.zeros(1, 1))])
    except Exception:                        # not ours to judge: the engine builds it, and raises
        return None
    return dict(probe.defaults) if isinstance(probe, torch.optim.Muon) else None


def groups_from_flags(model: nn.Module) -> list[dict] | None:
    """DeepSpeed's convention as parameter groups: the trainable parameters with p.use_muon True,
    then those with False (AdamW); None if no parameter carries the flag."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not any(hasattr(p, "use_muon") for p in trainable):
        return None
    muon = [p for p in trainable if getattr(p, "use_muon", True)]
    rest = [p for p in trainable if not getattr(p, "use_muon", True)]
    return [{"params": muon}, {"params": rest, "use_muon": False}]


def muon_engine(base: type, model: nn.Module, factory, param_groups: list[dict] | None,
                design: str | None, offload, options: dict) -> tuple[type, list[dict] | None]:
    """What wrap builds for `factory`: (base, param_groups) unchanged unless it makes
    torch.optim.Muon; then the Muon engine class and the groups (groups_from_flags without any).
    Raises ValueError (one line) for what Muon cannot take."""
    if muon_settings(factory) is None:
        if design is not None:
            raise ValueError("muon_design needs an optimizer factory that makes torch.optim.Muon")
        return base, param_groups
    design = DEFAULT_DESIGN if design is None else design
    if isinstance(design, str) and design not in DESIGNS:
        raise ValueError(f"muon_design must be one of {', '.join(DESIGNS)} or a pieces.Design "
                         f"class, got {design!r}")
    if offload == "disk":
        raise ValueError("offload='disk' with Muon: not supported (the disk tier streams the "
                         "optimizer state in pieces; Muon's U must be whole); use offload=True")
    if options.get("tensor_parallel", 1) > 1:
        raise ValueError("tensor_parallel with Muon: not supported (a tensor-parallel matrix is "
                         "split over its row, and Newton-Schulz needs it whole)")
    param_groups = groups_from_flags(model) if param_groups is None else param_groups
    muon = [p for g in param_groups or [{"params": model.parameters()}]
            if g.get("use_muon", True) for p in g["params"] if p.requires_grad]
    names = {id(p): name for name, p in model.named_parameters()}
    for p in muon:
        if p.ndim != 2:
            raise ValueError(f"Muon steps 2-D parameters only: {names.get(id(p), 'a parameter')} "
                             f"is {list(p.shape)}; give it a group with use_muon=False (AdamW)")
    n = options.get("shard_group_size") or comm.world_size()
    return engine_class(base, design, offload, {id(p) for p in muon}, n), param_groups


def engine_class(base: type, design, offload, muon_ids: set[int], n: int) -> type:
    """`base` (a stage's engine, stages.py) with its row's optimizer home replaced by Muon's, and
    with design "whole" its bucket rule too (muon_ids: the Muon matrices, n: ranks a partition
    group)."""
    row = base.row
    if design == "whole":
        if row.buckets is None:
            raise ValueError("muon_design='whole' needs a stage that chooses its buckets (1 or 2): "
                             "stage 3's buckets are its units; use 'straddle' or 'round_robin'")
        row = replace(row, buckets=whole_matrix_buckets(row.buckets, n, muon_ids))
    home = partial(muon_home, design=design, host=bool(offload))
    return type(f"{base.__name__}Muon", (base,), {"row": replace(row, optimizer=home)})


def muon_home(parts: list[torch.Tensor], factory, grouping: Grouping | None,
              placement: Placement, *, design, host: bool) -> ShardOptimizer:
    """The optimizer home of a Muon engine (homes.OptimizerHome): ShardOptimizer's (host memory's
    with host) over this rank's parts, its views cut at the matrices' pieces, stepping them with
    MuonWithAdamW and `design`."""
    sizes = [p.numel() for p in parts]
    grouping = grouping or _one_group(placement, sizes)
    layout = Layout(placement, sizes, grouping)
    partitioned = any(b.world_size > 1 for b in placement.buckets)        # DDP: every matrix whole
    design = design if partitioned else DEFAULT_DESIGN
    orthogonalize = (DESIGNS[design] if isinstance(design, str) else design)(layout)
    build = partial(MuonWithAdamW, muon=muon_settings(factory), adamw=ADAMW, design=orthogonalize)
    home = (HostHome if host else DeviceHome)(parts, build, grouping, placement, cut=layout.cut)
    pieces = {}                          # each Muon view is the next piece of its part, in order
    for views, groups, part_pieces in zip(home.views, home.view_groups, layout.pieces):
        muon_views = [v for v, g in zip(views, groups) if layout.muon_group(g)]
        pieces.update({id(v): piece for v, piece in zip(muon_views, part_pieces, strict=True)})
    home.optimizer.locate(pieces, {id(m.param): layout.group_index(m.param)
                                   for m in layout.matrices})
    return home


def _one_group(placement: Placement, sizes: list[int]) -> Grouping:
    """No param_groups: one group of every trainable parameter (padding in none)."""
    group_of = {id(p): 0 for b in placement.buckets for p in b.params}
    runs = [group_runs(b, start, start + size, group_of)
            for b, start, size in zip(placement.buckets, placement.starts, sizes)]
    return Grouping([{}], runs, group_of)

