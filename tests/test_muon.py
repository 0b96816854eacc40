"""Muon under ZeRO (minizero/beyond/muon/): every stage, offload and design ends where ONE process
running torch.optim.Muon (hidden matrices) plus torch.optim.AdamW (the rest) ends, fp32 within
1e-5, on an awkward model at N = 3 (matrices that straddle a partition boundary, a tied embedding,
a frozen matrix, three matrices of one shape for design (b)); orthogonalizing a partition's slice
instead is far off; each design sends the bytes and keeps the momentum its formula says; a Muon
checkpoint resumes bit-exact and reshards to another stage and N; what Muon cannot take is refused
in one line. Launches: N = 3 (every case), N = 2 (the resharded checkpoint; DeepSpeed's parity).
Run: python -m pytest tests/test_muon.py -q"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn

import minizero
from minizero import comm, events
from minizero.beyond.muon import update
from minizero.beyond.muon.pieces import Design, matrices_of
from minizero.flat import FlatLayout
from minizero.lab import deepspeed_peer

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
        self.embed = nn.Embedding(VOCAB, 6)
        self.up = nn.Linear(6, 9)
        self.blocks = nn.ModuleList(nn.Linear(9, 9, bias=False) for _ in range(3))
        self.frozen = nn.Linear(9, 9, bias=False)
        self.frozen.requires_grad_(False)
        self.down = nn.Linear(9, 6)
        self.norm = nn.LayerNorm(6)
        self.lm_head = nn.Linear(6, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight              # tied

    def forward(self, idx):
        x = torch.tanh(self.up(self.embed(idx)))
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.lm_head(self.norm(self.down(self.frozen(x))))

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


def reference(split=groups, adamw_defaults: bool = False) -> dict[str, torch.Tensor]:
    """One process, the global batch: torch.optim.Muon over split(model)'s use_muon groups and
    torch.optim.AdamW over the others, as torch's docs pair them (adamw_defaults: AdamW's own
    settings, what use_muon flags give)."""
    model = Net()
    kinds = {True: [], False: []}
    for group in split(model):
        settings = {k: v for k, v in group.items() if k != "use_muon"}
        use_muon = group.get("use_muon", True)
        kinds[use_muon].append(settings if use_muon or not adamw_defaults
                               else {"params": settings["params"]})
    muon, adamw = torch.optim.Muon(kinds[True]), torch.optim.AdamW(kinds[False])
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
            "momentum formula": 4 * sum(p.numel for pieces in layout.pieces for p in pieces),
            "optimizer memory": engine.memory()["offloaded" if "offload" in options
                                                else "optimizer"],
            "optimizer memory formula": optimizer_bytes(engine, layout, options.get("offload"))}


def optimizer_bytes(engine, layout, offload) -> int:
    """This rank's optimizer bytes by their formula: 4 per element of its Muon pieces (momentum),
    8 per element AdamW steps (two moments) and AdamW's 4-byte step per view; offloaded, the fp32
    masters and gradients on the host too (8 per element of its part), and with "params" stage
    3's parameter shard (4 more) and its partition of the frozen matrix (Ψ_f/N, one unit)."""
    home = engine.optimizer
    adamw = [v for views, kinds in zip(home.views, home.view_groups) for v, g in zip(views, kinds)
             if g is not None and not layout.muon_group(g)]
    muon = sum(p.numel for pieces in layout.pieces for p in pieces)
    part = sum(p.numel() for p in home.param_parts)
    frozen = sum(-(-p.numel() // N) for p in engine.frozen)
    host = {None: 0, True: 8 * part, "params": 12 * part + 4 * frozen}[offload]
    return 4 * muon + 8 * sum(v.numel() for v in adamw) + 4 * len(adamw) + host


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


def pytorch_front_ends() -> dict:
    """torch.optim.Muon as PyTorch's users pass it: to minizero.ZeroRedundancyOptimizer (whole
    matrices to each rank: Muon needs nothing more) over minizero.DistributedDataParallel, and over
    the shards of minizero.fully_shard (DTensors: torch's Muon orthogonalizes the full matrix)."""
    out = {}
    model = Net()
    ddp = minizero.DistributedDataParallel(model)
    hidden, rest = groups(model)
    optimizers = [minizero.ZeroRedundancyOptimizer(hidden["params"], torch.optim.Muon,
                                                   lr=MUON_LR),
                  minizero.ZeroRedundancyOptimizer(rest["params"], torch.optim.AdamW,
                                                   lr=ADAMW_LR, betas=rest["betas"])]
    for step in range(STEPS):
        loss_of(ddp, step, my_rows).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    out["ZeroRedundancyOptimizer(Muon) over DistributedDataParallel"] = {
        k: v.detach().clone() for k, v in model.state_dict().items()}
    from torch.distributed.fsdp import fully_shard as torchs_fully_shard
    for name, fully_shard in (("fully_shard + torch.optim.Muon", minizero.fully_shard),
                              ("torch's fully_shard + torch.optim.Muon", torchs_fully_shard)):
        model = Net()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        hidden, rest = groups(model)
        muon = torch.optim.Muon(hidden["params"], lr=MUON_LR)
        adamw = torch.optim.AdamW(rest["params"], lr=ADAMW_LR, betas=rest["betas"])
        for step in range(STEPS):
            loss_of(model, step, my_rows).backward()
            for optimizer in (muon, adamw):
                optimizer.step()
                optimizer.zero_grad()
        out[name] = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    return out


def worker(folder: str) -> dict:
    out = {name: run_case(name) for name in CASES}
    out["resumed"] = resume(folder)
    out["pytorch"] = pytorch_front_ends()
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("muon") / "ckpt")


@pytest.fixture(scope="module")
def runs(folder):
    return minizero.launch(worker, N, folder)


def resharded(folder: str) -> dict:
    """Stage 1 at N = 2 loads the stage-2 checkpoint saved at N = 3 and takes the third step."""
    model = Net()
    engine = minizero.wrap(model, 1, functools.partial(torch.optim.Muon, lr=MUON_LR),
                           param_groups=groups(model))
    engine.load(folder)
    engine.backward(loss_of(engine, 2, my_rows))
    engine.step()
    return engine.full_state_dict()


def max_diff(state: dict, expected: dict) -> float:
    return max((state[k].float() - expected[k].float()).abs().max().item() for k in expected)


@pytest.fixture(scope="module")
def expected():
    return {"groups": reference(), "flags": reference(adamw_defaults=True)}


@pytest.mark.parametrize("name", [n for n in CASES if "slice" not in n])
def test_every_stage_and_design_equals_torchs_muon_and_adamw(runs, expected, name):
    assert max_diff(runs[0][name]["state"], expected["flags" if "flags" in name else "groups"]) \
        < TOLERANCE
    for rank in range(1, N):                                     # and every rank holds the same
        assert max_diff(runs[rank][name]["state"], runs[0][name]["state"]) == 0


def test_pytorchs_front_ends_take_torchs_muon_as_their_users_pass_it(runs, expected):
    """ZeroRedundancyOptimizer hands each rank whole matrices: one process's result. Over
    fully_shard's DTensor shards torch's Muon orthogonalizes the whole matrix through DTensor's own
    collectives (not minizero's comm: they are not tallied), whose bf16 sums run in another order
    than one process's: Newton-Schulz amplifies that to bf16's ~4e-3, for torch's own fully_shard
    alike (measured here: 5.8e-3 from one process). So it is compared with torch's fully_shard."""
    for rank in range(N):
        got = runs[rank]["pytorch"]
        assert max_diff(got["ZeroRedundancyOptimizer(Muon) over DistributedDataParallel"],
                        expected["groups"]) < TOLERANCE, rank
        assert max_diff(got["fully_shard + torch.optim.Muon"],
                        got["torch's fully_shard + torch.optim.Muon"]) < TOLERANCE, rank
        assert max_diff(got["torch's fully_shard + torch.optim.Muon"], expected["groups"]) < 5e-2


def test_the_model_is_awkward_where_it_matters(runs):
    """At N = 3 matrices straddle a boundary (stages 1 and 3: the case design (a) gathers), and
    design (b) makes the three 9x9 matrices one bucket, one whole matrix a rank."""
    for name in ("stage 1 (a)", "stage 3 (a)", "stage 3 (c)"):
        assert runs[0][name]["straddlers"] >= 1, name
    assert runs[0]["stage 1 (b)"]["whole buckets"] == 1
    assert runs[0]["stage 0"]["straddlers"] == 0                 # DDP: every matrix whole


def test_orthogonalizing_a_slice_is_wrong(runs, expected):
    assert max_diff(runs[0]["stage 1, each slice alone"]["state"], expected["groups"]) > 1e-3


@pytest.mark.parametrize("name", list(CASES))
def test_each_design_sends_and_keeps_what_its_formula_says(runs, name):
    """Muon's bytes per step (the tally of its collectives), its momentum, and the engine's
    measured optimizer bytes (memory(): the optimizer's, or offloaded) on every rank."""
    for rank in range(N):
        run = runs[rank][name]
        assert run["sent per step"] == run["formula"], (rank, run["sent per step"], run["formula"])
        assert run["momentum"] == run["momentum formula"], rank
        assert run["optimizer memory"] == run["optimizer memory formula"], rank
    if "(b)" in name:            # the whole-matrix buckets need nothing: what is left straddles
        assert runs[0][name]["formula"] < runs[0][name.replace("(b)", "(a)")]["formula"]


def test_a_muon_checkpoint_resumes_bit_exact(runs):
    uninterrupted = runs[0]["stage 2 (a)"]["state"]
    assert max_diff(runs[0]["resumed"], uninterrupted) == 0


def test_a_muon_checkpoint_reshards_to_another_stage_and_n(runs, folder, expected):
    """Saved at stage 2 on N = 3, loaded at stage 1 on N = 2: each rank's momentum and AdamW's
    moments are cut again (a rank may hold only one kind: checkpoint.universal fills zeros)."""
    assert max_diff(minizero.launch(resharded, 2, folder)[0], expected["groups"]) < TOLERANCE


# --- DeepSpeed's "optimizer": {"type": "Muon"} (minizero/deepspeed/muon.py), N = 2 ---------------
DS_PARAMS = {"lr": 0.02, "adam_lr": 3e-3, "momentum": 0.9, "weight_decay": 0.01, "torch_adam": True}


def ds_config(stage: int) -> dict:
    """DeepSpeed's stage 3 refuses Muon with its reduce-scatter on: reduce_scatter false (minizero
    warns that it always reduce-scatters)."""
    return {"train_micro_batch_size_per_gpu": ROWS // 2, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "optimizer": {"type": "Muon", "params": DS_PARAMS},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  "reduce_scatter": stage != 3}}


def deepspeeds_split(model: Net) -> list[dict]:
    """What DeepSpeed 0.19.8 makes of DS_PARAMS, written out: Muon for the matrices named neither
    embed nor lm_head, AdamW for the rest, each half with its settings."""
    muon = [p for name, p in model.named_parameters() if p.requires_grad and p.ndim == 2
            and "embed" not in name and "lm_head" not in name]
    rest = [p for p in model.parameters() if p.requires_grad and all(p is not m for m in muon)]
    return [{"params": muon, "lr": 0.02, "momentum": 0.9, "weight_decay": 0.01},
            {"params": rest, "use_muon": False, "lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-10,
             "weight_decay": 0.01}]


def group_settings(optimizer: torch.optim.Optimizer) -> list[tuple]:
    """Each group's half and the settings DeepSpeed gives that half (torch's Muon has an eps too:
    Newton-Schulz's, not Adam's)."""
    keys = {True: ("lr", "momentum", "weight_decay"),
            False: ("lr", "betas", "eps", "weight_decay")}
    return [(g["use_muon"], *(tuple(g[k]) if k == "betas" else g[k] for k in keys[g["use_muon"]]))
            for g in optimizer.param_groups]


def deepspeed_worker(stages: tuple[int, ...]) -> dict:
    """Per stage: minizero.initialize (torch's Newton-Schulz), minizero with DeepSpeed's own
    Newton-Schulz plugged in as a design's kernel, and deepspeed.initialize, on the same data."""
    torch._dynamo.config.disable = True      # DeepSpeed compiles its Muon kernels: ~45 s of g++
    from deepspeed.runtime.zero.muon.original_muon import zeropower_via_gram_newtonschulz

    from minizero.beyond.muon.straddle import GatherStraddlers
    from minizero.deepspeed.muon import factory_and_groups
    from minizero.lab.deepspeed_peer import full_state_dict, join

    class DeepSpeedsKernel(GatherStraddlers):
        wire = torch.float32            # its Gram iteration normalizes in fp32: U must not round
        kernel = staticmethod(lambda u, group: zeropower_via_gram_newtonschulz(u, steps=5))

    def train(engine):
        for step in range(STEPS):
            engine.backward(loss_of(engine, step, my_rows))
            engine.step()

    deepspeed, out = join(), {}
    for stage in stages:
        with warnings.catch_warnings(record=True) as notes:             # rank 0 says them
            warnings.simplefilter("always")
            ours, optimizer, _, _ = minizero.initialize(model=Net(), config=ds_config(stage))
        train(ours)
        model = Net()
        factory, split = factory_and_groups(model, DS_PARAMS, None)
        kernel = minizero.wrap(model, stage, factory, param_groups=split,
                               muon_design=DeepSpeedsKernel)
        train(kernel)
        model = Net()
        theirs, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(stage), dist_init_required=False)
        train(theirs)
        out[stage] = {"initialize": ours.engine.full_state_dict(),
                      "notes": [str(note.message) for note in notes],
                      "groups": group_settings(optimizer),
                      "kernel": kernel.full_state_dict(), "deepspeed": full_state_dict(theirs),
                      "deepspeed groups": group_settings(theirs.optimizer.optimizer)}
        theirs.destroy()
    return out


@pytest.fixture(scope="module")
def deepspeed_runs():
    if not deepspeed_peer.available():
        pytest.skip("DeepSpeed is not installed (pip install -e '.[peers]')")
    return minizero.launch(deepspeed_worker, 2, (1, 2, 3))[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeeds_muon_config_is_read_as_deepspeed_reads_it(deepspeed_runs, stage):
    """The same two halves with the same settings (DeepSpeed's names and defaults), and minizero
    trains them as one process with torch's Muon and AdamW would."""
    run = deepspeed_runs[stage]
    assert run["groups"] == run["deepspeed groups"]
    assert max_diff(run["initialize"], reference(deepspeeds_split)) < TOLERANCE
    if stage == 3:                         # what DeepSpeed needs for Muon, and minizero ignores
        assert any("reduce_scatter" in note for note in run["notes"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_with_deepspeeds_newton_schulz_minizero_ends_where_deepspeed_ends(deepspeed_runs, stage):
    """Everything but the kernel is DeepSpeed's: 3.7e-9 apart (measured). With torch's kernel
    (initialize) the runs differ by the kernels' rounding, bf16 quintic against fp32 Gram."""
    run = deepspeed_runs[stage]
    assert max_diff(run["kernel"], run["deepspeed"]) < 1e-6
    assert 1e-5 < max_diff(run["initialize"], run["deepspeed"]) < 1e-2


@pytest.mark.parametrize("params, message", [
    ({"per_head_muon": True}, "per_head_muon is not implemented"),
    ({"adam_w_mode": False}, "adam_w_mode false"),
    ({"muon_lr": 0}, "muon_lr must be > 0"),
    ({"nesterov": True}, "not a parameter of Muon"),
])
def test_what_deepspeeds_muon_cannot_do_here_is_refused(params, message):
    from minizero.deepspeed.config import ConfigError, load_deepspeed_config
    config = {**ds_config(1), "optimizer": {"type": "Muon", "params": params}}
    with pytest.raises(ConfigError, match=message):
        load_deepspeed_config(config, 1, flags=False)


def test_ns_method_warns_that_it_has_no_effect():
    from minizero.deepspeed.config import load_deepspeed_config
    config = {**ds_config(1), "optimizer": {"type": "Muon", "params": {"ns_method": "gram"}}}
    _, notes = load_deepspeed_config(config, 1, flags=False)
    assert any("ns_method" in note for note in notes)


def test_a_convolution_deepspeed_would_flatten_is_refused():
    from minizero.deepspeed.muon import factory_and_groups
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"0.weight is \[3, 2, 3, 3\]"):
        factory_and_groups(model, {}, None)


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


def test_the_commands_refuse_what_they_cannot_run(tmp_path, capsys):
    """python -m minizero.bench --muon checks its options; python -m minizero.run refuses a Muon
    config in one line (exit 2) instead of running it with the wrong memory table."""
    import json

    from minizero.cli import muon as muon_command
    from minizero.cli.run import main as run
    assert muon_command.main(["--sizes", "3M"]) == 2
    assert muon_command.main(["--stages", "0"]) == 2
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(ds_config(1)))
    assert run(["--config", str(config), "--world-size", "2"]) == 2
    assert "Muon trains through minizero.initialize" in capsys.readouterr().err
