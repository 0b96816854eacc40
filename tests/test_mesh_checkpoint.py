"""Checkpoints across meshes (minizero/checkpoint.py with tensor_parallel.merge and part): saved
at one (N_m, N_d), loaded at another, the run goes on as the uninterrupted one; and
`python -m minizero.consolidate` merges the tensor-parallel parts into the plain model's state_dict.
AdamW, whose exp_avg and exp_avg_sq are merged and cut like the weights; fp32; minizero's GPT (a
fused qkv, a tied vocab-parallel head) and Hugging Face's GPT-2 (Conv1D weights, [in, out]).

    python -m pytest tests/test_mesh_checkpoint.py
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import types

import pytest
import torch

import _hf
import minizero
from minizero import comm
from minizero.beyond import tensor_parallel, tensor_parallel_hf
from minizero.checkpoint import CheckpointError, consolidate
from minizero.cli.consolidate import main as consolidate_main
from minizero.lab.data import global_batch, local_batch
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.train import IGNORE, loss_fn

STEPS, ROWS, LR, EPS = 3, 8, 1e-3, 1e-6   # saved after STEPS - 1 steps, resumed for the last


def _gpt() -> torch.nn.Module:
    return make_model(GPTConfig(), seed=0)


def _gpt2() -> torch.nn.Module:
    return _hf.build(_hf.Case("gpt2", stage=0))


def _logits(model, x, call=None):
    """model's logits for x (call: its engine, which runs it)."""
    call = call or model
    return call(x) if hasattr(model, "blocks") else call(input_ids=x, use_cache=False).logits


def _train(build, stage: int, m: int, save: str | None = None, load: str | None = None) -> dict:
    """This rank's model (full_state_dict) after STEPS AdamW steps on the (m, N/m) mesh; save:
    saved after STEPS - 1; load: loaded from there and only the last step taken."""
    model = build()
    engine = minizero.wrap(model, stage, functools.partial(torch.optim.AdamW, lr=LR, eps=EPS),
                           tensor_parallel=m)
    if load:
        engine.load(load)
    row, n_d = comm.rank() // m, comm.world_size() // m          # this rank's data-parallel index
    for step in range(STEPS - 1 if load else 0, STEPS):
        if step == STEPS - 1 and save:
            engine.save(save)
        x, y = local_batch(*global_batch(step, ROWS, 8), row, n_d)
        logits = _logits(model, x, engine)
        loss = (loss_fn(logits, y) if m == 1 else
                tensor_parallel.cross_entropy(logits, y, engine.tensor_group, IGNORE))
        engine.backward(loss)
        engine.step()
    return engine.full_state_dict()


def _runs(directory: str) -> dict:
    def at(name: str) -> str:
        return os.path.join(directory, name)

    return {
        "(2, 2)": _train(_gpt, 1, 2, save=at("2x2")),
        "(2, 2) -> (1, 4)": _train(_gpt, 3, 1, load=at("2x2")),
        "(2, 2) again": _train(_gpt, 1, 2, load=at("2x2")),
        "(4, 1)": _train(_gpt, 2, 4, save=at("4x1")),
        "(4, 1) -> (2, 2)": _train(_gpt, 0, 2, load=at("4x1")),
        "gpt2 (2, 2)": _train(_gpt2, 3, 2, save=at("gpt2")),
        "gpt2 (2, 2) -> (1, 4)": _train(_gpt2, 1, 1, load=at("gpt2")),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mesh_checkpoint")
    return {"ranks": minizero.launch(_runs, 4, str(directory)), "directory": directory}


def _one_process(build, steps: int) -> torch.nn.Module:
    """The whole model trained on one process on the global batch: where every mesh ends."""
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    for step in range(steps):
        x, y = global_batch(step, ROWS, 8)
        optimizer.zero_grad()
        loss_fn(_logits(model, x), y).backward()
        optimizer.step()
    return model


def _split(build, m: int, index: int) -> torch.nn.Module:
    return tensor_parallel_hf.parallelize(build(), types.SimpleNamespace(size=m, index=index))


def _whole(build, m: int, parts: list[dict]) -> dict:
    """The whole model's state_dict from a row's m parts (rank order)."""
    entries = tensor_parallel.whole_entries(_split(build, m, 0))
    return {e["key"]: tensor_parallel.merge([p[e["part"]] for p in parts], e["split"])
            for e in entries}


def _off_by(got: dict, want: dict) -> tuple[float, str]:
    assert list(got) == list(want)
    return max(((got[k].float() - want[k].float()).abs().max().item(), k) for k in want)


@pytest.mark.parametrize("build, m", [(_gpt, 2), (_gpt, 4), (_gpt2, 2)],
                         ids=["gpt-2", "gpt-4", "gpt2-2"])
def test_merge_is_parts_inverse(build, m):
    """Splitting a whole model (the layers' own cut) and merging its parts gives it back bitwise,
    with the whole model's keys in its order (a tied head's included); part cuts them again."""
    whole = build().state_dict()
    parts = [_split(build, m, i) for i in range(m)]
    states = [p.state_dict() for p in parts]
    entries = tensor_parallel.whole_entries(parts[0])
    assert [e["key"] for e in entries] == list(whole)
    for e in entries:
        merged = tensor_parallel.merge([s[e["part"]] for s in states], e["split"])
        assert torch.equal(merged, whole[e["key"]]) and list(merged.shape) == e["shape"], e["key"]
        for i, s in enumerate(states):
            assert torch.equal(tensor_parallel.part(merged, e["split"], m, i), s[e["part"]])


@pytest.mark.parametrize("saved, resumed, m_saved", [("(2, 2)", "(2, 2) -> (1, 4)", 2),
                                                     ("(4, 1)", "(4, 1) -> (2, 2)", 4)])
def test_a_run_resharded_to_another_mesh_goes_on_as_the_uninterrupted_one(runs, saved, resumed,
                                                                           m_saved):
    """Saved at (2, 2), resumed at (1, 4); saved at (4, 1), resumed at (2, 2): after the last step
    the whole model is the uninterrupted run's within 1e-5 (fp32, AdamW: the moments were merged
    and cut too, or the step would differ far more)."""
    ranks = runs["ranks"]
    want = _whole(_gpt, m_saved, [r[saved] for r in ranks[:m_saved]])
    m_resumed = int(resumed[-5])
    got = (ranks[0][resumed] if m_resumed == 1 else
           _whole(_gpt, m_resumed, [r[resumed] for r in ranks[:m_resumed]]))
    diff, key = _off_by(got, want)
    assert diff < 1e-5, f"{resumed}: {key} off by {diff:.2e}"


def test_the_same_mesh_resumes_bit_exactly(runs):
    for rank, r in enumerate(runs["ranks"]):
        assert all(torch.equal(r["(2, 2) again"][k], v) for k, v in r["(2, 2)"].items()), rank


def test_gpt2_saved_on_a_mesh_resumes_whole(runs):
    """GPT-2's Conv1D weights are merged back to [in, out] and cut again; the resumed whole model
    is the one-process run's."""
    diff, key = _off_by(runs["ranks"][0]["gpt2 (2, 2) -> (1, 4)"], _one_process(_gpt2, STEPS)
                        .state_dict())
    assert diff < 1e-5, f"{key} off by {diff:.2e}"


@pytest.mark.parametrize("build, name", [(_gpt, "2x2"), (_gpt2, "gpt2")], ids=["gpt", "gpt2"])
def test_consolidate_merges_the_parts_into_the_plain_model(runs, tmp_path, build, name):
    """`python -m minizero.consolidate` on a tensor-parallel checkpoint: one state_dict that loads
    strictly into the model built without tensor parallelism, equal to one process's after the
    same STEPS - 1 steps."""
    out = tmp_path / "model.pt"
    assert consolidate_main([str(runs["directory"] / name), str(out)]) == 0
    state = torch.load(out, weights_only=True)
    plain = build()
    plain.load_state_dict(state, strict=True)
    diff, key = _off_by(state, _one_process(build, STEPS - 1).state_dict())
    assert diff < 1e-5, f"{key} off by {diff:.2e}"


def test_a_mesh_checkpoint_that_does_not_say_how_it_was_split_is_one_line(runs, tmp_path):
    """A manifest without whole_state_dict (saved on a mesh before checkpoints were resharded):
    merging would take part 0 for the whole of every split parameter; refused instead."""
    old = tmp_path / "old"
    shutil.copytree(runs["directory"] / "2x2", old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["whole_state_dict"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="before manifests recorded how the parts are split"):
        consolidate(old)
