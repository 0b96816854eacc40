"""minizero.sharded_init: a model built partitioned equals the normally built one, bit for bit, and
no rank ever holds it whole (peak ≈ Ψ/N + the largest module under construction)."""

import pytest

import minizero
from _workers import build_sharded


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_minizero_gpt_built_sharded_is_bitwise_the_normal_one(n):
    for r in minizero.launch(build_sharded, n, "gpt"):
        assert r["differ"] == [] and r["unpartitioned"] == [] and r["absent_after"]
        assert r["held_after"] == 4                  # the absent value every parameter reads
        # chunks are ⌈numel/N⌉ per parameter: Ψ/N up to < N elements of padding each
        assert r["model_bytes"] / n <= r["shard"] < r["model_bytes"] / n + 4 * n * len(r["names"])
        # while building: its chunks plus the largest submodule (a block's MLP is built before it
        # is attached)
        assert r["peak"] <= r["shard"] + r["largest_child"]
        if n > 1:
            assert r["peak"] < r["model_bytes"]


def test_hugging_face_gpt2_built_sharded_is_bitwise_the_normal_one():
    pytest.importorskip("transformers")
    for r in minizero.launch(build_sharded, 2, "hf_gpt2"):
        # GPT-2's post_init re-initialises every weight after construction: gathered,
        # written, re-partitioned
        assert r["differ"] == [] and r["unpartitioned"] == [] and r["absent_after"]
        assert r["held_after"] == 4
        assert r["peak"] < r["model_bytes"]


def test_wrap_explains_what_to_do_with_a_meta_or_sharded_model():
    import functools

    import torch
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    with torch.device("meta"):
        meta = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="meta device .* minizero.sharded_init"):
        minizero.wrap(meta, 3, sgd)
    with minizero.sharded_init():                       # one process: N = 1, still partitioned
        model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    with pytest.raises(
        ValueError, match="sharded_init, which partitions parameters for stage 3; stage 2"
    ):
        minizero.wrap(model, 2, sgd)


@pytest.mark.parametrize("n", [2, 3])
def test_a_model_built_sharded_trains_at_stage_3_like_one_process(n):
    from _checks import assert_matches_reference
    from minizero.lab.reference import tolerance
    from minizero.lab.train import TrainConfig, train_several
    base = dict(
        stage=3,
        world_size=n,
        steps=3,
        batch_size=12,
        model="tiny",
        optimizer="sgd",
        lr=0.5,
        return_state=True,
        model_overrides={"frozen": ("pos_emb.weight",)},
    )
    cfgs = [
        TrainConfig(**base, sharded_init=True),
        TrainConfig(**base, sharded_init=True, dtype="bf16", offload="params"),
    ]
    runs = minizero.launch(train_several, n, cfgs)
    sharded = [per_rank[0] for per_rank in runs]
    assert_matches_reference(cfgs[0], sharded, atol=1e-6)
    for r in sharded:
        model_bytes = r["num_params"] * 4
        assert r["construction_peak"] < model_bytes              # never the whole model on one rank
    bf16_offloaded = [per_rank[1] for per_rank in runs]
    assert_matches_reference(cfgs[1], bf16_offloaded, atol=tolerance("bf16"))
    assert all(r["memory"]["params"] == 0 and r["memory"]["offloaded"] > 0 for r in bf16_offloaded)
