"""What per-parameter sharding lets a user do that the flat layout does not, measured on both.

    from minizero.lab.layout_features import what_it_buys, format_features
    found = what_it_buys(world_size=2)             # one launch: both designs, every claim
    print(format_features(found))

Notebook 12 puts each claim next to its measurement; lab/layouts.py measures what it costs. The
designs are lab/layouts.py's "flat" (minizero.wrap's stage 3) and "per-parameter"
(minizero.fully_shard, the root resharded after forward as wrap's is), on the tiny GPT, SGD, one
process on the whole batch as the yardstick. Each rank measures, for each design:

  mixed       block 0 holds frozen weights (its qkv and first MLP weight) beside trainable ones,
              as LoRA or BitFit fine-tuning has them: the collectives of one step by kind and the
              bytes its reduce-scatters carry (comm's tally);
  unfreeze    after that step, the user unfreezes the qkv weight (requires_grad_(True), and hands
              it to the optimizer where it can) and steps again: how far the weight moved, and
              how far from one process doing the same;
  state dict  a state dict by parameter name between steps: model.state_dict() (flat: the
              model's own parameters are placeholders, engine.full_state_dict() is its named
              state): the collectives it issues (minizero's events and, by torch's CommDebugMode,
              torch's own), the bytes on the wire, what a rank holds of each parameter; and how
              many parameters the flat partitions cut inside a row;
  clip        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5) as a PyTorch user writes it:
              the norm it returns and the clipped gradients, against one process's; the flat
              engine's own clipping (wrap(..., clip_grad_norm=0.5)) beside it;
  optimizer   the tensors the optimizer steps (their shapes), and torch.optim.Muon, which needs
              2-D matrices, built over them: refused on the flat views; on the shards one step,
              its collectives (DTensor's own, outside minizero's comm) and its distance from one
              process's Muon step.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from minizero import comm, events
from minizero.lab.data import global_batch, local_batch
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.train import loss_fn
from minizero.launcher import launch
from minizero.memory import wire
from minizero.pytorch import fully_shard
from minizero.wrap import wrap

DESIGNS = ("flat", "per-parameter")
FROZEN = ("blocks.0.attn.qkv.weight", "blocks.0.mlp.0.weight")      # frozen beside trainable
UNFROZEN = FROZEN[0]                                                  # unfrozen after a step
LR, MAX_NORM, MUON_LR, ROWS = 0.1, 0.5, 0.02, 12


def _config(frozen=FROZEN) -> GPTConfig:
    return GPTConfig.named("tiny", frozen=frozen)


def _batch(step: int, whole: bool = False):
    x, y = global_batch(step, ROWS, _config().block_size)
    return (x, y) if whole else local_batch(x, y, comm.rank(), comm.world_size())


def build(design: str, frozen=FROZEN, **options):
    """(module to call, backward, the model, the optimizer's step) for one design, SGD."""
    model = make_model(_config(frozen), seed=0)
    if design == "flat":
        engine = wrap(model, 3, functools.partial(torch.optim.SGD, lr=LR), **options)
        return engine, engine.backward, model, engine
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model, reshard_after_forward=True)          # lab/layouts.py's per-parameter
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    return model, torch.Tensor.backward, model, optimizer


@functools.cache
def reference() -> dict:
    """One process on the whole batch: step 0 with FROZEN frozen (its gradient norm, and its
    gradients clipped to MAX_NORM, noted on the way), then UNFROZEN unfrozen for step 1; and one
    Muon step of the model without frozen weights."""
    model = make_model(_config(), seed=0)
    params = dict(model.named_parameters())
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    loss_fn(model(_batch(0, True)[0]), _batch(0, True)[1]).backward()
    grads = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
    clipped = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
    for n, g in grads.items():                       # the step itself is not clipped
        params[n].grad.copy_(g)
    optimizer.step()
    optimizer.zero_grad()
    params[UNFROZEN].requires_grad_(True)
    optimizer.add_param_group({"params": [params[UNFROZEN]]})
    loss_fn(model(_batch(1, True)[0]), _batch(1, True)[1]).backward()
    optimizer.step()
    muon_model = make_model(_config(()), seed=0)
    loss_fn(muon_model(_batch(0, True)[0]), _batch(0, True)[1]).backward()
    torch.optim.Muon(_matrices(muon_model), lr=MUON_LR).step()
    return {"unfrozen": params[UNFROZEN].detach().clone(), "norm": norm, "clipped": clipped,
            "muon": {n: p.detach().clone() for n, p in muon_model.named_parameters()}}


def _matrices(model) -> list:
    """The 2-D weights Muon steps (the embeddings, tied to the head, are AdamW's in practice)."""
    return [p for n, p in model.named_parameters() if p.ndim == 2 and "emb" not in n]


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def counted(fn, dtensor: bool = True):
    """fn()'s result, and the collectives it issued: minizero's (its event stream), DTensor's own
    (torch's CommDebugMode: its functional collectives, which do not pass through minizero's comm)
    and this rank's bytes on the wire (memory/wire.py: all of them, minizero's or not; None where
    it cannot measure). dtensor=False: not DTensor's (CommDebugMode hooks every module's
    backward, which a forward and backward should not see)."""
    seen = []
    meter = None if wire.unavailable() else wire.WireMeter().start()
    with events.subscribed(lambda name, f: seen.append(f["kind"]) if name == "collective"
                           else None), CommDebugMode() if dtensor else contextlib.nullcontext() \
            as torch_side:
        out = fn()
    on_wire = None
    if meter:
        got = meter.bytes()
        on_wire = got["total"] + got["outside"]
        meter.close()
    found = {"minizero": _kinds(seen), "wire": on_wire}
    if dtensor:                                        # (minizero's own go through c10d.*)
        found["DTensor"] = {str(k).rsplit(".", 1)[-1]: v for k, v in
                            torch_side.get_comm_counts().items() if "c10d_functional" in str(k)}
    return out, found


def _kinds(seen: list[str]) -> dict[str, int]:
    return {kind: seen.count(kind) for kind in sorted(set(seen))}


def _step(design, module, backward, stepper, step: int) -> None:
    """One training step on this rank's rows (stepper: the flat engine, or the user's optimizer)."""
    x, y = _batch(step)
    backward(loss_fn(module(x), y))
    stepper.step()
    if design == "per-parameter":
        stepper.zero_grad()


def mixed_and_unfreeze(design: str) -> dict:
    """"mixed" and "unfreeze" above: one step with FROZEN frozen, then UNFROZEN unfrozen."""
    module, backward, model, stepper = build(design)
    before = comm.tally()
    _, collectives = counted(lambda: _step(design, module, backward, stepper, 0), dtensor=False)
    trainable = sum(p.numel() for n, p in make_model(_config(), seed=0).named_parameters()
                    if p.requires_grad)
    sent = {k: v - before.get(k, 0) for k, v in comm.tally().items()}
    weight = dict(model.named_parameters())[UNFROZEN]
    weight.requires_grad_(True)                             # the user unfreezes it
    if design == "per-parameter":
        stepper.add_param_group({"params": [weight]})       # and hands it to the optimizer
    start = _value(design, module, model)
    _step(design, module, backward, stepper, 1)
    now = _value(design, module, model)
    return {"collectives": collectives, "trainable": trainable,
            "reduce_scatter_bytes": sent.get("reduce_scatter", 0.0),
            "moved": (now - start).abs().max().item(),
            "vs_one_process": (now - reference()["unfrozen"]).abs().max().item()}


def _value(design: str, module, model) -> torch.Tensor:
    if design == "flat":
        return module.full_state_dict()[UNFROZEN]
    return _whole(dict(model.named_parameters())[UNFROZEN]).detach().clone()


def state_dict(design: str) -> dict:
    """"state dict" above, after one step."""
    module, backward, model, stepper = build(design)
    _step(design, module, backward, stepper, 0)
    own, own_counts = counted(model.state_dict)
    entry = own["blocks.0.attn.proj.weight"]
    local = entry.to_local() if isinstance(entry, DTensor) else entry
    out = {"model.state_dict()": own_counts,
           "entry": {"shape": list(entry.shape), "local": list(local.shape),
                     "storage_bytes": local.untyped_storage().nbytes(),
                     "nan": bool(torch.isnan(local).any())}}
    if design == "flat":
        _, out["engine.full_state_dict()"] = counted(module.full_state_dict)
        out["cut_inside_a_row"] = _cut_inside_a_row(module)
    return out


def _cut_inside_a_row(engine) -> list[str]:
    """The parameters whose piece on some rank of the flat partition begins or ends inside one of
    their rows: no tensor of whole rows can name that piece."""
    names, cut = {id(p): n for n, p in engine.module.named_parameters()}, []
    for b in engine.layout.buckets:
        for p, off in zip(b.params, b.offsets):
            row = p[0].numel() if p.dim() > 1 else 1
            edges = [q * b.shard_numel - off for q in range(1, b.world_size)]
            if any(0 < e < p.numel() and e % row for e in edges):
                cut.append(names[id(p)])
    return cut


def clip(design: str) -> dict:
    """"clip" above, after one backward."""
    module, backward, model, _ = build(design)
    x, y = _batch(0)
    backward(loss_fn(module(x), y))
    norm, collectives = counted(
        lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    ref = reference()
    grads = {n: _whole(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    out = {"norm": _whole(norm).item(), "one_process_norm": ref["norm"],
           "collectives": collectives, "grads": len(grads),
           "clipped_vs_one_process": max(((g - ref["clipped"][n]).abs().max().item()
                                          for n, g in grads.items()), default=None)}
    if design == "flat":                                  # the engine's own clipping
        engine, backward, _, _ = build(design, clip_grad_norm=MAX_NORM)
        backward(loss_fn(engine(x), y))
        engine.step()
        out["engine_clip_norm"] = engine.last_grad_norm
    return out


def optimizer(design: str) -> dict:
    """"optimizer" above, on the tiny GPT with nothing frozen."""
    module, backward, model, stepper = build(design, frozen=())
    tensors = (stepper.optimizer.optimizer.param_groups[0]["params"] if design == "flat"
               else _matrices(model))
    out = {"shapes": [list(t.shape) for t in tensors],
           "local": [list(t.to_local().shape) for t in tensors if isinstance(t, DTensor)]}
    try:
        muon = torch.optim.Muon(tensors, lr=MUON_LR)
    except ValueError as exc:
        return {**out, "muon": f"ValueError: {exc}"}
    x, y = _batch(0)
    backward(loss_fn(module(x), y))
    _, out["collectives"] = counted(muon.step)
    want = reference()["muon"]
    out["muon"] = "stepped"
    out["vs_one_process"] = max((_whole(p) - want[n]).abs().max().item()
                                for n, p in model.named_parameters() if p.ndim == 2
                                and "emb" not in n)
    return out


def step_cost(model_name: str = "default", repeats: int = 10) -> dict[str, float]:
    """What one optimizer step costs the per-parameter layout on a CPU, median ms of `repeats`
    AdamW steps: over the shards as DTensors (what the user's optimizer is given, after a real
    backward), over plain tensors of the same local shapes, and over plain tensors of the flat
    design's shapes (its optimizer's views of the shard: a few long 1-D tensors)."""
    model = make_model(GPTConfig.named(model_name), seed=0)
    engine = wrap(make_model(GPTConfig.named(model_name), seed=0), 3,
                  functools.partial(torch.optim.AdamW, lr=1e-3))
    flat_shapes = [t.shape for g in engine.optimizer.optimizer.param_groups for t in g["params"]]
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    x, y = global_batch(0, ROWS, GPTConfig.named(model_name).block_size)
    x, y = local_batch(x, y, comm.rank(), comm.world_size())
    loss_fn(model(x), y).backward()
    shards = list(model.parameters())
    plain = [torch.nn.Parameter(p.to_local().detach().clone()) for p in shards]
    flat = [torch.nn.Parameter(torch.zeros(shape)) for shape in flat_shapes]
    for p, shard in zip(plain, shards):
        p.grad = shard.grad.to_local().clone()
    for p in flat:
        p.grad = torch.randn_like(p)
    out = {}
    for name, params in (("DTensor shards", shards), ("plain, the same shapes", plain),
                         ("plain, the flat shapes", flat)):
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        optimizer.step()                                  # its state made
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times) * 1e3
    out["tensors"] = {"per-parameter": len(shards), "flat": len(flat)}
    return out


def features_worker() -> dict:
    """Every measurement above, for both designs, on this rank."""
    torch.set_num_threads(1)
    return {"rank": comm.rank(), "step cost": step_cost(),
            **{design: {"mixed": mixed_and_unfreeze(design), "state dict": state_dict(design),
                        "clip": clip(design), "optimizer": optimizer(design)}
               for design in DESIGNS}}


def what_it_buys(world_size: int = 2) -> list[dict]:
    """One launch; every rank's measurements."""
    return launch(features_worker, world_size, backend="gloo")


def format_features(found: list[dict]) -> str:
    """Rank 0's measurements, claim by claim: what the flat design did, what the per-parameter
    one did."""
    flat, per, cost = found[0]["flat"], found[0]["per-parameter"], found[0]["step cost"]

    def said(counts: dict) -> str:
        parts = [f"{n} {kind.replace('_', '-')}" for kind, n in counts["minizero"].items()]
        parts += [f"{n} DTensor {kind.replace('_', '-')}" for kind, n in
                  counts.get("DTensor", {}).items()]
        wire_bytes = "" if counts["wire"] is None else f", {counts['wire']:,} B on the wire"
        return (", ".join(parts) or "no collective") + wire_bytes

    def entry(e: dict) -> str:
        held = "NaN placeholder" if e["nan"] else f"rows {e['local']} of {e['shape']}"
        return f"{held}, {e['storage_bytes']} B of storage"

    mixed = [m["mixed"] for m in (flat, per)]
    rows = [
        ("frozen beside trainable in a unit: one step", *(said(m["collectives"]) for m in mixed)),
        ("  its reduce-scatters' bytes (ring)",
         *(f"{m['reduce_scatter_bytes']:,.0f} (trainable: {m['trainable']:,} elements)"
           for m in mixed)),
        (f"unfreeze {UNFROZEN}, step: it moved",
         *(f"{m['moved']:.1e} ({m['vs_one_process']:.1e} from one process)" for m in mixed)),
        ("model.state_dict() between steps", *(said(d["state dict"]["model.state_dict()"])
                                                for d in (flat, per))),
        ("  blocks.0.attn.proj.weight in it", *(entry(d["state dict"]["entry"])
                                                 for d in (flat, per))),
        ("  flat: engine.full_state_dict()",
         said(flat["state dict"]["engine.full_state_dict()"]), "(not needed)"),
        ("  parameters a flat partition cuts inside a row",
         ", ".join(flat["state dict"]["cut_inside_a_row"]) or "none", "none: whole rows"),
        (f"clip_grad_norm_(model.parameters(), {MAX_NORM})",
         f"returns {flat['clip']['norm']:.4f}, {flat['clip']['grads']} gradients clipped "
         f"(the engine's clip_grad_norm= option: {flat['clip']['engine_clip_norm']:.4f})",
         f"returns {per['clip']['norm']:.4f}, {per['clip']['grads']} gradients clipped, "
         f"{per['clip']['clipped_vs_one_process']:.1e} from one process; "
         f"{said(per['clip']['collectives'])}"),
        ("  one process's norm", f"{flat['clip']['one_process_norm']:.4f}",
         f"{per['clip']['one_process_norm']:.4f}"),
        ("the tensors Muon is given (flat: the optimizer's views; per-parameter: the matrices)",
         *(f"{len(d['optimizer']['shapes'])}: {d['optimizer']['shapes'][:3]}"
           + (f", local {d['optimizer']['local'][:3]}" if d["optimizer"]["local"] else "")
           + ("..." if len(d["optimizer"]["shapes"]) > 3 else "") for d in (flat, per))),
        ("torch.optim.Muon over them", flat["optimizer"]["muon"],
         f"{per['optimizer']['muon']}, {per['optimizer']['vs_one_process']:.1e} from one "
         f"process's Muon; {said(per['optimizer']['collectives'])}"),
        (f"AdamW step, small GPT ({cost['tensors']['per-parameter']} parameters, "
         f"{cost['tensors']['flat']} flat views)",
         f"plain tensors of the flat shapes: {cost['plain, the flat shapes']:.2f} ms",
         f"DTensor shards: {cost['DTensor shards']:.2f} ms; plain tensors of the same "
         f"shapes: {cost['plain, the same shapes']:.2f} ms"),
    ]
    lines = [f"N = {len(found)}, tiny GPT, SGD; rank 0"]
    for claim, on_flat, on_per in rows:
        lines += [claim, f"    flat:          {on_flat}", f"    per-parameter: {on_per}"]
    return "\n".join(lines)
