"""ZeRO on a 2-D mesh ([Note: the 2-D mesh] in minizero/beyond/tensor_parallel.py):
wrap(..., tensor_parallel=M) splits the GPT over rows of M ranks and shards it with ZeRO along the
columns of N_d = N/M. Every stage at (N_m, N_d) = (2, 1), (2, 2), (1, 4) and (4, 1) against one
process training the whole GPT on the global batch."""

from __future__ import annotations

import copy
import functools
import types

import pytest
import torch

import minizero
from minizero import comm
from minizero.beyond import tensor_parallel
from minizero.lab.data import global_batch, local_batch
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.train import IGNORE, loss_fn
from minizero.memory import estimate_breakdown, within_padding

STEPS, ROWS, LR, CLIP = 3, 8, 0.5, 0.05
STAGES = (0, 1, 2, 3)


def _train(stage: int, m: int, clip: float | None = None, steps=range(STEPS),
           load: str | None = None, save: str | None = None, momentum: float = 0.0,
           **options) -> dict:
    """This rank's part of the GPT after STEPS SGD steps on the mesh, and its model-state bytes."""
    model = make_model(GPTConfig(), seed=0)
    options |= {} if clip is None else {"clip_grad_norm": clip}
    optimizer = functools.partial(torch.optim.SGD, lr=LR, momentum=momentum)
    engine = minizero.wrap(model, stage, optimizer, tensor_parallel=m, **options)
    if load:
        engine.load(load)
    row, n_d = comm.rank() // m, comm.world_size() // m          # this rank's data-parallel index
    for step in steps:
        if step == STEPS - 1 and save:
            engine.save(save)
        x, y = local_batch(*global_batch(step, ROWS, model.cfg.block_size), row, n_d)
        logits = engine(x)
        loss = (loss_fn(logits, y) if m == 1 else
                tensor_parallel.cross_entropy(logits, y, engine.tensor_group, IGNORE))
        engine.backward(loss)
        engine.step()
    psi = sum(p.numel() for p in model.parameters())             # this rank's part: Ψ_rank
    return {"state": engine.full_state_dict(), "memory": engine.memory(), "psi": psi,
            "norm": engine.last_grad_norm}


def _autotp() -> dict:
    """minizero.initialize with DeepSpeed's AutoTP key: the script is the one without it, its loss
    on whole logits (the head all-gathers them); and a model minizero cannot split."""
    config = {"train_micro_batch_size_per_gpu": ROWS // 2, "gradient_clipping": 0,
              "zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"lr": LR}},
              "tensor_parallel": {"autotp_size": 2}}
    model = make_model(GPTConfig(), seed=0)
    engine, *_ = minizero.initialize(model=model, config=config)
    row, n_d = comm.rank() // 2, comm.world_size() // 2
    for step in range(STEPS):
        x, y = local_batch(*global_batch(step, ROWS, model.cfg.block_size), row, n_d)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    try:
        minizero.initialize(model=torch.nn.Linear(4, 4), config=config)
    except ValueError as e:
        return {"state": engine.full_state_dict(), "another model": str(e)}
    return {"state": engine.full_state_dict()}


def _every_stage(meshes: tuple[int, ...], directory: str) -> dict:
    runs = {(m, stage): _train(stage, m) for m in meshes for stage in STAGES}
    if comm.world_size() == 4:
        runs[(2, "clip")] = _train(2, 2, clip=CLIP)              # the norm over rows and columns
        # a checkpoint on the 2 x 2 mesh, saved before the last step and resumed from
        momentum = {"stage": 3, "m": 2, "momentum": 0.9}
        runs["whole run"] = _train(**momentum, save=directory)
        runs["resumed"] = _train(**momentum, load=directory, steps=[STEPS - 1])
        runs["autotp"] = _autotp()
        runs["recompute"] = _train(2, 2, activation_checkpointing=True)    # plain, not P_a
    return runs


def _whole(clip: float | None = None) -> tuple[torch.nn.Module, float | None]:
    """One process, the whole GPT, the global batch: where every mesh must end."""
    model = make_model(GPTConfig(), seed=0)
    optimizer, norm = torch.optim.SGD(model.parameters(), lr=LR), None
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_fn(model(global_batch(step, ROWS, model.cfg.block_size)[0]),
                global_batch(step, ROWS, model.cfg.block_size)[1]).backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
        optimizer.step()
    return model, norm


def _expected(whole: torch.nn.Module, m: int, index: int) -> dict:
    """The whole model split as rank `index` of a row of m holds it."""
    if m == 1:
        return whole.state_dict()
    row = types.SimpleNamespace(size=m, index=index)           # splitting needs no collective
    return tensor_parallel.parallelize_gpt(copy.deepcopy(whole), row).state_dict()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("mesh") / "checkpoint")
    return {2: minizero.launch(_every_stage, 2, (2,), directory),
            4: minizero.launch(_every_stage, 4, (2, 1, 4), directory), "directory": directory}


@pytest.mark.parametrize("n, m", [(2, 2), (4, 2), (4, 1), (4, 4)])
def test_every_stage_on_the_mesh_trains_like_one_process(runs, n, m):
    whole, _ = _whole()
    for rank, result in enumerate(runs[n]):
        want = _expected(whole, m, rank % m)
        for stage in STAGES:
            got = result[(m, stage)]["state"]
            for name, value in got.items():
                diff = (value.float() - want[name].float()).abs().max().item()
                assert diff < 1e-5, f"(N_m, N_d) = ({m}, {n // m}), stage {stage}, rank {rank}: " \
                                    f"{name} off by {diff:.2e}"


@pytest.mark.parametrize("n, m", [(2, 2), (4, 2), (4, 4)])
def test_memory_per_rank_is_the_formula_with_m(runs, n, m):
    """Each rank's model is Ψ_rank (Ψ/M of the split weights, all of the replicated ones), sharded
    over the N_d ranks of its column: estimate_breakdown(Ψ_rank, N_d) (fp32, SGD: K = 0)."""
    for rank, result in enumerate(runs[n]):
        for stage in STAGES:
            r = result[(m, stage)]
            formula = estimate_breakdown(r["psi"], n // m, stage, param_bytes=4, grad_bytes=4, k=0)
            for category in ("params", "grads", "optimizer"):
                assert within_padding(r["memory"][category], formula[category], n // m), (
                    rank, stage, category, r["memory"][category], formula[category])


def test_clipping_takes_the_norm_of_the_whole_model(runs):
    """A split parameter's squares summed over the row, a replicated one counted once: the norm of
    the whole model's gradient, as torch's clip_grad_norm_ computes it on one process."""
    whole, norm = _whole(clip=CLIP)
    for rank, result in enumerate(runs[4]):
        r = result[(2, "clip")]
        assert r["norm"] == pytest.approx(norm, rel=1e-5), rank
        want = _expected(whole, 2, rank % 2)
        for name, value in r["state"].items():
            assert torch.allclose(value.float(), want[name].float(), atol=1e-5), (rank, name)


def test_a_checkpoint_on_the_mesh_resumes_bit_exactly(runs):
    """Each tensor-parallel part keeps its own column of shard files (tp{i}-rank{r}.pt): a run
    resumed on the same mesh ends bit-identical to the uninterrupted one (stage 3, SGD with
    momentum). Another mesh, and consolidate: tests/test_mesh_checkpoint.py."""
    for rank, result in enumerate(runs[4]):
        whole, resumed = result["whole run"]["state"], result["resumed"]["state"]
        assert all(torch.equal(whole[k], resumed[k]) for k in whole), rank


def test_plain_activation_checkpointing_runs_on_the_mesh(runs):
    """activation_checkpointing=True on a mesh recomputes each block (no P_a group needed: only
    'partitioned' takes one); recomputing changes no value."""
    for rank in range(4):
        recomputed, stored = runs[4][rank]["recompute"]["state"], runs[4][rank][(2, 2)]["state"]
        assert recomputed.keys() == stored.keys()
        for name, value in recomputed.items():
            assert torch.equal(value, stored[name]), (rank, name)


def test_a_world_size_the_mesh_does_not_fit_is_one_line():
    with pytest.raises(ValueError, match="tensor_parallel=3 must divide the world size 1"):
        minizero.wrap(make_model(GPTConfig()), 0, functools.partial(torch.optim.SGD, lr=0.1),
                      tensor_parallel=3)


def test_initialize_applies_deepspeeds_autotp_size(runs):
    """tensor_parallel.autotp_size 2 at N = 4: the GPT split over rows of 2, stage 2 along the
    columns, the script's loss on whole logits as without it: one process's parameters (1e-5). A
    model minizero cannot split: one line."""
    whole, _ = _whole()
    for rank, result in enumerate(runs[4]):
        want = _expected(whole, 2, rank % 2)
        for name, value in result["autotp"]["state"].items():
            assert torch.allclose(value.float(), want[name].float(), atol=1e-5), (rank, name)
        assert result["autotp"]["another model"] == (
            "tensor_parallel.autotp_size 2: minizero splits its GPT, GPT-2 and Llama, not a Linear "
            "(DeepSpeed's AutoTP finds the linear layers of any model)")
