"""The concept map points at code that exists, and docs/concepts.md is what the generator
makes now."""

import functools
import inspect
import sys

import pytest
import torch
from torch import nn

import minizero
from minizero.lab.concepts import (
    CONCEPTS, DOC, ROOT, WALK, concept_rows, main, resolve, to_markdown, walk_rows,
)
from minizero.lab.data import global_batch
from minizero.lab.model import GPTConfig, make_model
from minizero.flat import Bucket
from minizero.lab.train import loss_fn
from minizero.zero3 import Unit

REGENERATE = "run `python -m minizero.lab.concepts --write` and commit docs/concepts.md"


@pytest.mark.parametrize("symbol", sorted({c[2] for c in CONCEPTS}))
def test_every_symbol_exists(symbol):
    try:
        resolve(symbol)
    except (ImportError, AttributeError) as e:
        pytest.fail(
            f"minizero/lab/concepts.py names {symbol}, which "
            f"no longer exists ({e}): point CONCEPTS at "
            f"its new name, then {REGENERATE}"
        )


def test_every_line_names_its_symbol():
    rows = concept_rows()
    assert len(rows) == len(CONCEPTS) == len({c[1] for c in CONCEPTS}), "each term appears once"
    assert {r["source"] for r in rows} == {"DeepSpeed", "FairScale", "PyTorch"}
    for row in rows:
        line = (ROOT / row["path"]).read_text().splitlines()[row["line"] - 1]
        name = row["symbol"].rsplit(".", 1)[1]
        assert name in line, f"{row['symbol']}: line {row['line']} of {row['path']} is {line!r}"
    zero2 = next(r for r in rows if r["symbol"] == "minizero.zero2.GradientShard.reduce")
    assert f"(../minizero/zero2.py#L{zero2['line']})" in to_markdown()


def test_docs_page_is_up_to_date():
    assert DOC.read_text() == to_markdown(), (
        f"docs/concepts.md is stale (code moved?): {REGENERATE}"
    )


def test_cli_prints_the_table_and_rejects_other_options(capsys):
    assert main([]) == 0 and capsys.readouterr().out == to_markdown()
    assert main(["--bogus"]) == 2 and capsys.readouterr().err.count("\n") == 1


def test_the_walk_through_stage_3_is_short():
    """docs/concepts.md's "one parameter through stage 3": at most 25 calls, 6 files (comm.py, the
    floor every walk ends on, not counted), each file entered at most twice per phase."""
    rows = walk_rows()
    assert len(rows) <= 25, f"{len(rows)} calls"
    assert len({r["path"] for r in rows}) <= 6, sorted({r["path"] for r in rows})
    for phase in dict.fromkeys(r["phase"] for r in rows):
        paths = [r["path"] for r in rows if r["phase"] == phase]
        entered = [p for i, p in enumerate(paths) if i == 0 or paths[i - 1] != p]
        twice = {p for p in entered if entered.count(p) > 2}
        assert not twice, f"{phase}: {sorted(twice)} entered more than twice"


def test_the_walk_is_the_order_a_step_runs():
    """Trace the calls of one stage-3 step (one process) and find the walk's calls in it, in its
    order: the walk cannot drift from the code."""
    wanted = [inspect.unwrap(resolve(symbol)).__code__ for _, symbol, _ in WALK]
    seen: list = []
    model = make_model(GPTConfig())
    p = model.blocks[0].attn.qkv.weight                            # the parameter walked

    def about_p(args: dict) -> bool:
        """A call about another unit, bucket or parameter is not p's way."""
        for value in args.values():
            params = value.params if isinstance(value, Bucket) else \
                getattr(value, "params", [p]) if isinstance(value, Unit) else [p]  # built yet?
            if all(q is not p for q in params):
                return False
            if isinstance(value, nn.Parameter) and value is not p:
                return False
        return True

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in wanted and about_p(frame.f_locals):
            seen.append(frame.f_code)
    sys.setprofile(profile)
    try:
        engine = minizero.wrap(model, 3, functools.partial(torch.optim.AdamW, lr=1e-3),
                               units=list(model.blocks))
        x, y = global_batch(0, 4, 32)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    finally:
        sys.setprofile(None)
    at = 0
    for code in seen:                          # the walk's calls, a subsequence of the trace
        if at < len(wanted) and code is wanted[at]:
            at += 1
    assert at == len(wanted), f"after {WALK[at - 1][1] if at else 'the start'}, {WALK[at][1]} " \
                              "was not called next: regenerate the walk from the code"
