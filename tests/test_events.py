"""minizero/events.py: one stream of what happens in a step, watched without patching anything.

    python -m pytest tests/test_events.py
"""

from __future__ import annotations

import functools
import gc

import torch

import minizero
from minizero import events
from minizero.lab.data import global_batch
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.train import loss_fn
from minizero.zero2 import Zero2

SGD = functools.partial(torch.optim.SGD, lr=0.1)


def one_step(engine) -> None:
    x, y = global_batch(0, 8, 32)
    engine.backward(loss_fn(engine(x), y))
    engine.step()


def test_a_stage_3_step_tells_its_story_in_order():
    model = make_model(GPTConfig())
    engine = minizero.wrap(model, 3, SGD)
    with events.recorded() as log:
        one_step(engine)
    names = [name for _, name, _ in log]
    blocks = len(model.blocks)
    # every block: gathered for forward and for backward, freed after each, its gradients reduced
    gathered = [f["unit"].name for _, name, f in log if name == "unit gathered"]
    assert all(gathered.count(f"blocks.{i}") == 2 for i in range(blocks)), gathered
    assert names.count("unit freed") >= names.count("unit gathered")
    assert names.count("bucket ready") == names.count("bucket launched") == len(engine.units)
    tags = [f["tag"] for _, name, f in log if name == "collective"]
    assert "unit 1 (blocks.2)" in tags and all(tags), tags          # every collective says what for
    assert names.index("backward done") < names.index("optimizer step") < names.index("step")
    assert [f["seq"] for _, name, f in log if name == "collective"] == \
        sorted(f["seq"] for _, name, f in log if name == "collective done")


def test_the_engine_events_carry_the_engine_and_nothing_is_kept_alive():
    engine = minizero.wrap(make_model(GPTConfig()), 2, SGD, bucket_size=100_000)
    with events.recorded("bucket launched", "bucket arrived", "staging") as log:
        one_step(engine)
    assert log and all(f["engine"] is engine for _, _, f in log)
    assert sum(f["nbytes"] for _, name, f in log if name == "staging") == 0   # all released
    assert all(not torch.is_tensor(v) for _, _, f in log for v in f.values())
    del log, engine
    gc.collect()
    assert not any(type(o) is Zero2 for o in gc.get_objects())


def test_a_subscriber_stops_when_its_block_ends():
    seen = []
    with events.subscribed(lambda name, fields: seen.append(name)):
        events.emit("x")
    events.emit("y")
    assert seen == ["x"]


def test_a_profiler_trace_shows_zero_s_phases():
    engine = minizero.wrap(make_model(GPTConfig()), 3, SGD)
    one_step(engine)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        one_step(engine)
    labels = {e.key for e in prof.key_averages()}
    assert {"minizero/unit gathered", "minizero/unit freed", "minizero/bucket launched",
            "minizero/collective", "minizero/step"} <= labels, sorted(labels)[:20]
