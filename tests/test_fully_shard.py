"""minizero.fully_shard against PyTorch's own fully_shard and one process on the global batch.

    python -m pytest tests/test_fully_shard.py

One launch per world size (N = 2 and 3) runs every case in one process group, each with
minizero's fully_shard and with PyTorch's, on the same data, in a user's loop (tests/_fsdp2.py:
AdamW over model.parameters(), loss.backward(), optimizer.step(), zero_grad()). Models: the small
GPT, the awkward GPT (tied head, frozen parameters, an unused one, dims 0 of 17 and 14) and Wide (a
one-row parameter that rank 1 of 2 holds nothing of, a frozen Linear between trainable ones).
Checked: parameters within 1e-5 of one process (fp32) and equal to PyTorch's (16-bit: within 5e-3);
a zero_grad() of any kind changes nothing; the module's parameters are dim-0 DTensor shards, padded
as FSDP2 pads them; each rank's memory is the per-parameter formula exactly (padding counted), for
PyTorch's too; the collectives are on minizero's event stream and tally; what cannot apply is
refused in one line.
"""

from __future__ import annotations

import copy
import functools

import _fsdp2 as H
import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

import minizero
from minizero import comm
from minizero.lab.reference import max_abs_diff
from minizero.memory import measure
from minizero.pytorch import FSDPModule, MixedPrecisionPolicy, fully_shard

WORLD_SIZES = (2, 3)
STEPS, LR = 3, 3e-3
LOOPS = {       # how the user's loop clears gradients before each step
    "optimizer.zero_grad()": lambda model, opt: opt.zero_grad(),
    "optimizer.zero_grad(set_to_none=False)": lambda model, opt: opt.zero_grad(set_to_none=False),
    "model.zero_grad()": lambda model, opt: model.zero_grad(),
}
MODELS = {      # name -> (build the model, the units fully_shard is applied to before the root)
    "gpt": (H.gpt, lambda m: m.blocks),
    "awkward gpt": (functools.partial(H.gpt, awkward=True), lambda m: m.blocks),
    "wide": (H.wide, lambda m: [m.first, m.last]),
}
BF16 = {"bf16, fp32 reduce": torch.float32, "bf16": None}     # param_dtype bf16, reduce_dtype


def _layout(model) -> list[tuple[tuple[int, ...], bool]]:
    """Each distinct parameter's shape and whether it got a gradient (a tied weight once)."""
    return [(tuple(p.shape), p.grad is not None) for p in model.parameters()]


def _memory(model, optimizer) -> dict[str, int]:
    local = [p.to_local() for p in model.parameters()]
    return measure({"params": local,
                    "grads": [p.grad.to_local() for p in model.parameters() if p.grad is not None],
                    "optimizer": [v.to_local() if isinstance(v, DTensor) else v
                                  for s in optimizer.state.values() for v in s.values()]})


SGD = dict(optimizer=torch.optim.SGD, lr=0.5)   # linear in the gradient: catches a wrong scale,
                                                  # which AdamW's normalisation hides


def _run(impl: str, model_name: str, loop: str, train=None, **kwargs) -> dict:
    build, units = MODELS[model_name]
    model = build()
    H.shard(impl, model, units=units(model), **kwargs)
    out = H.train(model, steps=STEPS, zero_grad=LOOPS[loop], keep=True,
                  **(train or dict(lr=LR)))
    model, optimizer = out.pop("model"), out.pop("optimizer")
    out["memory"], out["layout"] = _memory(model, optimizer), _layout(model)
    return out


def _registration() -> dict:
    """What the sharded GPT holds before any forward, and after one step."""
    model = H.shard("minizero", H.gpt(awkward=True))
    fresh = H.gpt(awkward=True)
    params = dict(model.named_parameters())
    return {
        "class": type(model).__name__, "fsdp": isinstance(model, FSDPModule),
        "block class": type(model.blocks[0]).__name__,
        "dtensor": all(isinstance(p, DTensor) and p.placements == (Shard(0),)
                       for p in params.values()),
        "local rows": {k: p.to_local().shape[0] for k, p in params.items()},
        "full == initial": max((p.full_tensor() - fresh.get_parameter(k)).abs().max().item()
                               for k, p in params.items()),
        "tied": model.head.weight is model.tok_emb.weight,
        "names": sorted(params) == sorted(dict(fresh.named_parameters())),
    }


def _events() -> dict:
    """One step of the sharded GPT as the event stream and the tally see it."""
    model = H.shard("minizero", H.gpt())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = H.batch(0)
    comm.reset_tally()
    with H.recorded() as log:
        H.loss_of(model, x, y).backward()
        opt.step()
    units = {m._fsdp_unit.tag: m for m in model.modules() if isinstance(m, FSDPModule)}
    return {
        "stream": [(name, f.get("kind"), f.get("tag"), f.get("unit").tag if "unit" in f else None,
                    f.get("nbytes"), f.get("prefetch")) for name, f in log],
        "tally": comm.tally(),
        "units": {tag: [(tuple(sp.shape), sp.requires_grad) for sp in m._fsdp_unit.params]
                  for tag, m in units.items()},
        "states": {tag: m._fsdp_unit.state.name for tag, m in units.items()},
    }


def _refusals() -> dict[str, str]:
    """What fully_shard refuses, each a one-line error."""
    from torch.distributed.device_mesh import init_device_mesh
    cases = {
        "empty list": lambda: fully_shard([]),
        "group as root": lambda: _group_as_root(),
        "not a module": lambda: fully_shard("model"),
        "shard_placement_fn": lambda: fully_shard(H.gpt(), shard_placement_fn=lambda p: None),
        "mesh type": lambda: fully_shard(H.gpt(), mesh="cpu"),
        "3-D mesh": lambda: fully_shard(H.gpt(), mesh=init_device_mesh(
            "cpu", (1, 1, comm.world_size()))),
        "mp_policy": lambda: fully_shard(H.gpt(), mp_policy={"param_dtype": torch.bfloat16}),
        "policy field": lambda: MixedPrecisionPolicy(param_dtype="bf16"),
        "offload_policy": lambda: fully_shard(H.gpt(), offload_policy="cpu"),
        "reshard_after_forward int": lambda: fully_shard(H.gpt(), reshard_after_forward=4),
        "reshard_after_forward type": lambda: fully_shard(H.gpt(), reshard_after_forward="yes"),
        "twice": lambda: fully_shard(fully_shard(H.gpt())),
        "tied apart": lambda: _tied_apart(),
        "scalar": lambda: _scalar(),
        "deepcopy": lambda: copy.deepcopy(fully_shard(H.gpt())),
        "second owner": lambda: minizero.wrap(H.shard("minizero", H.gpt()), 3,
                                              functools.partial(torch.optim.SGD, lr=0.1)),
        "owned before": lambda: _owned_before(),
    }
    out = {}
    for name, case in cases.items():
        try:
            case()
            out[name] = "accepted"
        except (TypeError, ValueError, RuntimeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _group_as_root():
    model = H.gpt()
    fully_shard([model.ln_f, model.head])
    model.ln_f(torch.randn(2, 14))


def _tied_apart():
    """Accepted by both calls (FSDP2's too), refused at the first forward, where FSDP2 finds it
    (its message: "already managed by another" unit)."""
    model = H.gpt()
    fully_shard(model.head)
    fully_shard(model)
    model(H.batch(0)[0])


def _scalar():
    model = torch.nn.Linear(3, 3)
    model.temperature = torch.nn.Parameter(torch.tensor(1.0))
    fully_shard(model)


def _owned_before():
    model = H.gpt()
    minizero.wrap(model, 0, functools.partial(torch.optim.SGD, lr=0.1))
    fully_shard(model)


def worker() -> dict:
    out = {}
    for impl in H.IMPLEMENTATIONS:
        for model_name in MODELS:
            for loop in LOOPS:
                out[impl, model_name, loop] = _run(impl, model_name, loop)
        for name, reduce_dtype in BF16.items():
            mp = H.policy(impl, "MixedPrecisionPolicy", param_dtype=torch.bfloat16,
                          reduce_dtype=reduce_dtype)
            out[impl, name] = _run(impl, "gpt", "optimizer.zero_grad()", mp_policy=mp)
        out[impl, "sgd"] = _run(impl, "awkward gpt", "optimizer.zero_grad()", train=SGD)
    out["registration"], out["events"], out["refusals"] = _registration(), _events(), _refusals()
    return out


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"N={n}")
def runs(request):
    return request.param, minizero.launch(worker, request.param, backend="gloo")


@pytest.fixture(scope="module")
def references() -> dict:
    out = {}
    for name, (build, _) in MODELS.items():
        out[name] = H.reference(build(), steps=STEPS, lr=LR)
    out["sgd"] = H.reference(MODELS["awkward gpt"][0](), steps=STEPS, **SGD)
    return out


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("model_name", MODELS)
def test_fully_shard_ends_where_one_process_and_pytorch_end(runs, references, model_name, loop):
    n, ranks = runs
    for rank in ranks:
        ours, theirs = rank["minizero", model_name, loop], rank["torch", model_name, loop]
        assert max_abs_diff(ours["params"], references[model_name]["params"]) <= 1e-5
        assert max_abs_diff(ours["params"], theirs["params"]) <= 1e-6
        assert ours["losses"] == pytest.approx(theirs["losses"], abs=1e-6)


def test_sgd_ends_where_one_process_and_pytorch_end(runs, references):
    n, ranks = runs
    for rank in ranks:
        ours, theirs = rank["minizero", "sgd"]["params"], rank["torch", "sgd"]["params"]
        assert max_abs_diff(ours, references["sgd"]["params"]) <= 1e-6
        assert max_abs_diff(ours, theirs) <= 1e-7


@pytest.mark.parametrize("model_name", MODELS)
def test_zero_grad_in_the_loop_changes_nothing(runs, model_name):
    n, ranks = runs
    for rank in ranks:
        runs_of = [rank["minizero", model_name, loop]["params"] for loop in LOOPS]
        assert all(max_abs_diff(runs_of[0], other) == 0.0 for other in runs_of[1:])


@pytest.mark.parametrize("name", BF16)
def test_bf16_mixed_precision_ends_where_pytorch_ends(runs, references, name):
    n, ranks = runs
    for rank in ranks:
        ours, theirs = rank["minizero", name]["params"], rank["torch", name]["params"]
        assert max_abs_diff(ours, theirs) <= 5e-3
        assert all(v.dtype == references["gpt"]["params"][k].dtype for k, v in ours.items())
        assert max_abs_diff(ours, references["gpt"]["params"]) <= 5e-2    # bf16 compute vs fp32


def per_parameter_formula(layout, n: int, rank: int) -> dict[str, int]:
    """A rank's model-state bytes under dim-0 sharding (fp32, AdamW): every parameter's padded shard
    ceil(d0/N) rows; the gradient shard padded alike for each one that got a gradient; AdamW's two
    moments over the rank's own rows (unpadded) and its step count (a 4-byte tensor)."""
    params = grads = optimizer = 0
    for shape, got_grad in layout:
        row = torch.Size(shape[1:]).numel()
        chunk = -(-shape[0] // n)
        rows = max(0, min(chunk, shape[0] - rank * chunk))
        params += 4 * chunk * row
        if got_grad:
            grads += 4 * chunk * row
            optimizer += 2 * 4 * rows * row + 4
    return {"params": params, "grads": grads, "optimizer": optimizer}


@pytest.mark.parametrize("impl", H.IMPLEMENTATIONS)
@pytest.mark.parametrize("model_name", MODELS)
def test_memory_per_rank_is_the_per_parameter_formula(runs, impl, model_name):
    n, ranks = runs
    for r, rank in enumerate(ranks):
        result = rank[impl, model_name, "optimizer.zero_grad()"]
        assert result["memory"] == per_parameter_formula(result["layout"], n, r), (impl, r)


def test_the_module_holds_dim0_dtensor_shards_padded_as_fsdp2_pads(runs):
    n, ranks = runs
    fresh = dict(H.gpt(awkward=True).named_parameters())
    for r, rank in enumerate(ranks):
        reg = rank["registration"]
        assert (reg["class"], reg["block class"], reg["fsdp"]) == ("FSDPGPT", "FSDPBlock", True)
        assert reg["dtensor"] and reg["tied"] and reg["names"]
        assert reg["full == initial"] == 0.0
        for name, rows in reg["local rows"].items():
            d0 = fresh[name].shape[0]
            chunk = -(-d0 // n)
            assert rows == max(0, min(chunk, d0 - r * chunk)), name


def test_one_step_on_the_event_stream_and_the_tally(runs):
    """Forward gathers the root, then each block (prefetched from the second step on); backward
    gathers the blocks again (the root stays gathered: reshard_after_forward=None); one
    reduce-scatter per unit. Every collective is tagged with its unit, and the tally books their
    ring bytes: (N-1)/N of each all-gather's and reduce-scatter's padded size."""
    n, ranks = runs
    for rank in ranks:
        ev = rank["events"]
        kinds = [(kind, tag) for name, kind, tag, *_ in ev["stream"] if name == "collective"]
        assert kinds == [("all_gather", "unit 0 (<root>)"), ("all_gather", "unit 1 (blocks.0)"),
                         ("all_gather", "unit 2 (blocks.1)"), ("all_gather", "unit 2 (blocks.1)"),
                         ("all_gather", "unit 1 (blocks.0)"),
                         ("reduce_scatter", "unit 2 (blocks.1)"),
                         ("reduce_scatter", "unit 1 (blocks.0)"),
                         ("reduce_scatter", "unit 0 (<root>)")]
        padded = {tag: sum(4 * n * -(-shape[0] // n) * torch.Size(shape[1:]).numel()
                           for shape, _ in params) for tag, params in ev["units"].items()}
        gathered = [nbytes for name, _, _, unit, nbytes, _ in ev["stream"]
                    if name == "unit gather"]
        assert gathered == [padded["unit 0 (<root>)"], padded["unit 1 (blocks.0)"],
                            padded["unit 2 (blocks.1)"], padded["unit 2 (blocks.1)"],
                            padded["unit 1 (blocks.0)"]]
        moved = padded["unit 0 (<root>)"] * 2 + 3 * (padded["unit 1 (blocks.0)"]
                                                     + padded["unit 2 (blocks.1)"])
        assert ev["tally"]["total"] == pytest.approx(moved * (n - 1) / n)
        assert set(ev["states"].values()) == {"FREE"}


REFUSED = {   # case -> (exception, the start of its message)
    "empty list": ("ValueError", "fully_shard: an empty list of modules"),
    "group as root": ("RuntimeError", "fully_shard: a unit of several modules cannot be the root"),
    "not a module": ("TypeError", "fully_shard: module must be a torch.nn.Module or a list"),
    "shard_placement_fn": ("ValueError", "fully_shard: shard_placement_fn is not supported"),
    "mesh type": ("TypeError", "fully_shard: mesh must be a torch DeviceMesh"),
    "3-D mesh": ("ValueError", "fully_shard: mesh must be 1-D (FSDP) or 2-D"),
    "mp_policy": ("TypeError", "fully_shard: mp_policy must be a MixedPrecisionPolicy"),
    "policy field": ("TypeError", "MixedPrecisionPolicy: param_dtype must be"),
    "offload_policy": ("TypeError", "fully_shard: offload_policy must be an OffloadPolicy"),
    "reshard_after_forward int": ("ValueError", "fully_shard: reshard_after_forward=4 must"),
    "reshard_after_forward type": ("TypeError", "fully_shard: reshard_after_forward must be"),
    "twice": ("ValueError", "fully_shard: this FSDPGPT is sharded already"),
    "tied apart": ("ValueError", "fully_shard: tok_emb.weight is tied to a parameter already "
                   "managed by another unit, fully_shard(Linear)"),
    "scalar": ("ValueError", "fully_shard: temperature (of shape ()) cannot be sharded"),
    "deepcopy": ("TypeError", "fully_shard: a sharded module cannot be deep-copied"),
    "second owner": ("ValueError", "tok_emb.weight is already owned by minizero.fully_shard"),
    "owned before": ("ValueError", "tok_emb.weight is already owned by a minizero stage-0"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_cannot_apply_is_refused_in_one_line(runs, case):
    n, ranks = runs
    kind, start = REFUSED[case]
    message = ranks[0]["refusals"][case]
    assert message.startswith(f"{kind}: {start}"), message
    assert "\n" not in message


def test_the_bench_pairs_fully_shard_with_pytorchs():
    """python -m minizero.bench --stages fully_shard: minizero.fully_shard next to torch's, the
    same units, the same loop; the same parameters after, and minizero's tally as its comm."""
    from minizero.lab import bench
    report = bench.compare((2,), sizes=("tiny",), steps=2, repeats=1, variants=("fully_shard",),
                           peers=("torch",), meter=False)
    (pair,) = report["pairs"]
    assert (pair["variant"], pair["peer"]) == ("fully_shard", "fsdp2")
    assert pair["max_param_diff"] == 0.0
    assert pair["memory"]["minizero"] == pair["memory"]["peer"]
    assert 0 < pair["comm_bytes_per_step"]["minizero"] <= pair["comm_bytes_per_step"]["peer"]


def test_the_two_layouts_side_by_side():
    """minizero.lab.layouts: the flat layout (wrap's stage 3) and the per-parameter one
    (fully_shard) on the tiny GPT at N = 3, the same units: each rank's bytes are each design's
    formula exactly, the per-parameter layout pads more (whole rows per parameter against a few
    elements per unit) and its optimizer state differs between ranks; the same parameters after."""
    from minizero.lab.layouts import compare_layouts, format_layouts
    report = compare_layouts("tiny", 3, steps=2)
    for design in report["designs"].values():
        for measured, formula in zip(design["memory"], design["formula"]):
            assert measured == {k: formula[k] for k in measured}
    flat, per_param = report["designs"]["flat"], report["designs"]["per-parameter"]
    assert flat["formula"][0]["padding"] < per_param["formula"][0]["padding"]
    assert per_param["memory"][0]["optimizer"] != per_param["memory"][2]["optimizer"]
    assert flat["collectives"]["reduce_scatter"] == per_param["collectives"]["reduce_scatter"] == 3
    assert report["max_param_diff"] <= 1e-6
    assert "per-parameter" in format_layouts(report)
