"""minizero/events.py: one stream of what happens in a step, watched without patching anything.

    python -m pytest tests/test_events.py
"""

from __future__ import annotations

import functools
import gc

import torch

import minizero
from minizero import events
from minizero.lab.record import recorded
from minizero.lab.data import global_batch
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.train import loss_fn
from minizero.assembled import Zero2

SGD = functools.partial(torch.optim.SGD, lr=0.1)


def one_step(engine) -> None:
    x, y = global_batch(0, 8, 32)
    engine.backward(loss_fn(engine(x), y))
    engine.step()


def test_a_stage_3_step_tells_its_story_in_order():
    model = make_model(GPTConfig())
    engine = minizero.wrap(model, 3, SGD)
    with recorded() as log:
        one_step(engine)
    names = [name for _, name, _ in log]
    blocks = len(model.blocks)
    # every block: gathered for forward and for backward, freed after each, its gradients reduced
    gathered = [f["unit"].name for _, name, f in log if name == "unit gathered"]
    assert all(gathered.count(f"blocks.{i}") == 2 for i in range(blocks)), gathered
    assert names.count("unit freed") >= names.count("unit gathered")
    assert names.count("bucket ready") == names.count("bucket launched") == len(engine.units)
    tags = [f["tag"] for _, name, f in log if name == "collective"]
    assert "unit 3 (blocks.2)" in tags and all(tags), tags          # every collective says what for
    assert names.index("backward done") < names.index("optimizer step") < names.index("step")
    assert [f["seq"] for _, name, f in log if name == "collective"] == \
        sorted(f["seq"] for _, name, f in log if name == "collective done")


def test_the_engine_events_carry_the_engine_and_nothing_is_kept_alive():
    engine = minizero.wrap(make_model(GPTConfig()), 2, SGD, bucket_size=100_000)
    with recorded("bucket launched", "bucket arrived", "staging") as log:
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


def _emitted() -> dict[str, set[str]]:
    """Every events.emit in minizero/: its name and the fields it passes (read from the source)."""
    import ast
    from pathlib import Path
    found: dict[str, set[str]] = {}
    for path in Path(events.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "emit" and node.args
                    and isinstance(node.args[0], ast.Constant)):
                found.setdefault(node.args[0].value, set()).update(
                    k.arg for k in node.keywords if k.arg)
    return found


def _catalogue() -> dict[str, str]:
    """events.py's docstring (the core's events) and assembled.py's (what the pieces around it
    emit): each event's name and the text that describes it."""
    import re

    from minizero import assembled
    entries, name = {}, None
    for line in (events.__doc__ + assembled.__doc__).splitlines():
        head = re.match(r"    (\S.{0,17}?)\s{1,}(\S+\.py\b.*)$", line)
        if head and not line.startswith("     "):
            name = head.group(1).strip()
            entries[name] = head.group(2)
        elif name and line.startswith(" " * 22):
            entries[name] += " " + line.strip()
        else:
            name = None
    return entries


def test_every_event_emitted_is_in_the_catalogue_with_its_fields():
    """events.py's list (and assembled.py's) is the stream's documentation: every name minizero
    emits is there, nothing else is, and each field an emit passes is named in its entry (engine,
    unit and bucket: in the sentence after the list)."""
    emitted, catalogue = _emitted(), _catalogue()
    assert set(emitted) == set(catalogue), set(emitted) ^ set(catalogue)
    for name, fields in emitted.items():
        missing = {f for f in fields - {"engine", "unit", "bucket"} if f not in catalogue[name]}
        assert not missing, f"{name!r}: the catalogue does not name {sorted(missing)}"
