"""ZeRO stage 3 (P_os+g+p): reference, memory (2+2+K)Ψ/N, traffic 3Ψ, and only units in
flight gathered."""

import functools

import torch
from _checks import StageSuite, assert_matches_reference
from _workers import zero3_with_tied_units

import minizero
from minizero import events
from minizero.lab.data import global_batch
from minizero.lab.demo import zero3_timeline_worker
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.train import TrainConfig, loss_fn, train_several


class TestZero3(StageSuite):
    stage = 3


def test_without_prefetch_and_peak_parameters_stay_below_the_model():
    base = dict(
        stage=3,
        world_size=4,
        steps=3,
        batch_size=8,
        model="default",
        optimizer="sgd",
        lr=0.5,
        return_state=True,
    )
    cfgs = [TrainConfig(**base, prefetch=False), TrainConfig(**base, prefetch=True)]
    no_prefetch, prefetch = minizero.launch(train_several, 4, cfgs)[0]
    assert_matches_reference(cfgs[0], [no_prefetch], atol=1e-6)
    assert_matches_reference(cfgs[1], [prefetch], atol=1e-6)
    model_bytes = no_prefetch["num_params"] * 4
    block_bytes = model_bytes / 4                      # the 4 blocks are ~98% of this GPT
    shard_bytes = model_bytes / 4                      # Ψ/N with N = 4
    # 5 units (4 blocks + a small root): the shard plus the root and one block in flight (two with
    # prefetch), never the whole model gathered at once
    assert no_prefetch["memory"]["peak_params"] < shard_bytes + 1.1 * block_bytes
    assert prefetch["memory"]["peak_params"] < shard_bytes + 2.1 * block_bytes < model_bytes
    assert no_prefetch["memory"]["peak_params"] < prefetch["memory"]["peak_params"]


def test_each_unit_is_gathered_for_forward_and_backward_then_freed():
    cfg = TrainConfig(stage=3, world_size=2, batch_size=4, optimizer="sgd", lr=0.1)
    record = minizero.launch(zero3_timeline_worker, 2, [cfg])[0][0]  # one step after a warm-up step
    names, step = record["unit_names"], [(e, b) for _, e, b in record["events"]]
    for b in range(len(names)):
        gathers = [e for e, u in step if u == b and e in ("gather", "prefetch")]
        frees = [e for e, u in step if u == b and e == "free"]
        assert len(gathers) == 2 and len(frees) == 2, f"unit {names[b]}: {gathers} {frees}"


def test_tied_weight_split_across_units_trains_like_the_reference():
    results = minizero.launch(zero3_with_tied_units, 3, 3)
    cfg = TrainConfig(
        stage=3, world_size=3, steps=3, batch_size=12, model="tiny", optimizer="sgd", lr=0.5
    )
    # the root owns the tied weight; the head unit owns nothing of its own and is not a unit at all
    assert "head" not in results[0]["unit_names"] and "<root>" in results[0]["unit_names"]
    assert_matches_reference(cfg, results, atol=1e-6)


def test_the_peak_is_counted_at_each_gather_not_measured_again(monkeypatch):
    """memory/meter.py [Note: counted peaks]: a step measures every storage twice (end of backward,
    step), not at every unit gathered and bucket launched; what it counts there equals a
    measurement."""
    model = make_model(GPTConfig())
    engine = minizero.wrap(
        model, 3, functools.partial(torch.optim.SGD, lr=0.1), units=list(model.blocks)
    )
    meter = engine.meter
    measure = meter.now
    measured, counted = [], []
    monkeypatch.setattr(meter, "now", lambda: measured.append(1) or measure())

    def compare(name, fields):                  # after the meter's own subscriber has counted
        if name in ("unit gathered", "bucket ready") and fields["engine"] is engine and meter._now:
            counted.append((dict(meter._now), measure()))
    x, y = global_batch(0, 8, 32)
    with events.subscribed(compare):
        for _ in range(3):
            engine.backward(loss_fn(engine(x), y))
            engine.step()
    assert len(measured) <= 1 + 2 * 3, f"{len(measured)} measurements in 3 steps"
    assert len(counted) >= 3 * 3 * len(model.blocks)       # each block: 2 gathers + 1 bucket a step
    assert all(now[k] == real[k] for now, real in counted for k in ("params", "grads", "optimizer"))
