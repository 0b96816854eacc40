"""The optimizer steps cache-sized views of the masters (minizero/optim.py,
[Note: cache-sized views]): nothing changes but the speed. In the test process, one rank; VIEW_NUMEL
made small so the tiny GPT's masters are cut into many views."""

import functools

import pytest
import torch

import minizero
from minizero import optim
from minizero.lab.model import GPTConfig, make_model


def _train(view_numel, monkeypatch, steps=3, load=None, **options):
    monkeypatch.setattr(optim, "VIEW_NUMEL", view_numel)
    engine = minizero.wrap(
        make_model(GPTConfig.named("tiny")),
        1,
        functools.partial(torch.optim.AdamW, lr=1e-2),
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
