"""The optimizer steps cache-sized views of the masters (minizero/optim.py,
[Note: cache-sized views]): nothing changes but the speed. In the test process, one rank; VIEW_NUMEL
made small so the tiny GPT's masters are cut into many views."""

import functools

import pytest
import torch

import minizero
from minizero import optim
from minizero.lab.model import GPTConfig, make_model


def _no_decay_groups(model) -> list[dict]:
    """Hugging Face's split: weight decay on the matrices, none on biases and LayerNorms (their own
    lr too)."""
    plain = [p for n, p in model.named_parameters() if "bias" in n or "ln" in n]
    return [{"params": [p for p in model.parameters() if all(p is not q for q in plain)]},
            {"params": plain, "weight_decay": 0.0, "lr": 3e-2}]


def _train(view_numel, monkeypatch, steps=3, load=None, grouped=False, **options):
    monkeypatch.setattr(optim, "VIEW_NUMEL", view_numel)
    model = make_model(GPTConfig.named("tiny"))
    engine = minizero.wrap(
        model,
        1,
        functools.partial(torch.optim.AdamW, lr=1e-2),
        param_groups=_no_decay_groups(model) if grouped else None,
        **options,
    )
    if load:
        engine.load(load)
    for step in range(engine.step_count, engine.step_count + steps):      # the data continues
        x = torch.randint(0, 12, (4, 17), generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    return engine


@pytest.mark.parametrize(
    "options", [{}, {"dtype": "bf16"}, {"offload": True}], ids=["fp32", "bf16", "offload"]
)
def test_views_step_bitwise_like_the_whole_master_and_checkpoint_per_bucket(
    options, monkeypatch, tmp_path
):
    whole = _train(1 << 40, monkeypatch, **options)
    viewed = _train(500, monkeypatch, **options)
    assert (
        [len(v) for v in viewed.optimizer.views] == [round(whole.layout.shard_numel / 500)] != [1]
    )
    assert all(
        v.untyped_storage().data_ptr() == viewed.optimizer.masters[0].untyped_storage().data_ptr()
        for v in viewed.optimizer.views[0]
    )  # views: the masters' own storage
    a, b = whole.full_state_dict(), viewed.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)                  # Adam is elementwise: same bits
    # the same bytes of state (Adam's step counter, 4 bytes, is per view)
    extra_views = len(viewed.optimizer.views[0]) - 1
    assert viewed.memory()["optimizer"] + viewed.memory()["offloaded"] == \
        whole.memory()["optimizer"] + whole.memory()["offloaded"] + 4 * extra_views
    # a checkpoint speaks in buckets: saved with views, resumed without (and back), bit-identical
    viewed.save(tmp_path / "viewed")
    assert viewed.optimizer.state_dict()["state"].keys() == {0}
    resumed = _train(1 << 40, monkeypatch, steps=2, load=tmp_path / "viewed", **options)
    resumed.save(tmp_path / "whole")
    again = _train(500, monkeypatch, steps=1, load=tmp_path / "whole", **options)
    reference = _train(1 << 40, monkeypatch, steps=6, **options)
    ref = reference.full_state_dict()
    assert all(torch.equal(ref[k], v) for k, v in again.full_state_dict().items())


def test_grouped_views_are_cut_at_group_boundaries_and_step_bitwise_like_whole_runs(
    monkeypatch, tmp_path
):
    """[Note: parameter groups]: with groups, each run of one group is cut into views; small views
    step exactly as one view per run, and a checkpoint crosses between the two bit-identically."""
    whole = _train(1 << 40, monkeypatch, grouped=True)
    viewed = _train(300, monkeypatch, grouped=True)
    runs = whole.optimizer.view_groups[0]
    assert len(runs) > 2 and len(viewed.optimizer.views[0]) > len(runs)
    assert [len(g["params"]) for g in whole.optimizer.optimizer.param_groups] == [
        runs.count(0), runs.count(1)]                     # one torch group per user group
    a, b = whole.full_state_dict(), viewed.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    viewed.save(tmp_path / "viewed")
    resumed = _train(1 << 40, monkeypatch, steps=2, load=tmp_path / "viewed", grouped=True)
    reference = _train(300, monkeypatch, steps=5, grouped=True).full_state_dict()
    assert all(torch.equal(reference[k], v) for k, v in resumed.full_state_dict().items())
