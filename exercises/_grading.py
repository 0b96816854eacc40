"""What every grader shares: run a learner's module on several ranks, train with it, compare,
explain.

The graders (test_exNN_*.py) call the learner's code only through thin adapters: a subclass of one
of minizero's engines that overrides the one method the exercise is about and calls the learner's
function there. Everything else (model, data, loop, the single-process oracle) is minizero's, so a
learner may organise helpers any way they like. Failures are AssertionErrors whose message names the
rank, the tensor, what was expected and what came back.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import os
import sys

import torch

import minizero
from minizero.lab.grade import call_in
from minizero.lab.reference import reference_train
from minizero.lab.train import TrainConfig, train_worker

HERE = os.path.dirname(os.path.abspath(__file__))
# a learner's rank waiting in a collective the others never call must not hang CI
LAUNCH_TIMEOUT_S = 90


# What a learner's file may use of minizero: its communication layer, the building block every
# exercise starts from. Each grader may widen this (minizero.memory for the predictions) and narrow
# it (the collective an exercise builds is refused): guard(impl, refused=..., allowed=...).
ALLOWED = ("minizero.comm",)


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The full dotted name an expression like `comm.all_reduce` stands for, through the
    imports."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return ".".join([aliases[node.id], *reversed(parts)])
    return None


def _uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted name) for everything a module imports and every attribute it reads through
    them."""
    aliases: dict[str, str] = {}
    used = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                # `import a.b` binds a; `as x` binds a.b
                top = a.name.partition(".")[0]
                aliases[a.asname or top] = a.name if a.asname else top
                used.append((node.lineno, a.name))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                name = node.module if a.name == "*" else f"{node.module}.{a.name}"
                aliases[a.asname or a.name] = name
                used.append((node.lineno, name + (".*" if a.name == "*" else "")))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            called = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if called in ("__import__", "import_module"):        # importlib.import_module("...")
                used.append((node.lineno, str(node.args[0].value)))
    # after every alias is known
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = _dotted(node, aliases)
            if name:
                used.append((node.lineno, name))
    return used


def guard(module_name: str, refused: tuple[str, ...] = (),
          allowed: tuple[str, ...] = ALLOWED) -> None:
    """Refuse an answer that borrows what its exercise asks to build: of minizero, a learner's file
    may use only `allowed` (minizero.comm), and nothing in `refused` (minizero's own version of the
    answer, or torch's). Read from the file's source (imports and attribute chains), before anything
    runs."""
    __tracebackhide__ = True
    path = importlib.util.find_spec(module_name).origin
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)

    def within(name, prefixes):
        return any(name == p or name.startswith(p + ".") for p in prefixes)

    for line, name in sorted(_uses(tree)):
        # `import minizero`: fine
        borrowed = name.startswith("minizero.") and not within(name, allowed)
        if borrowed or within(name, refused):
            raise AssertionError(f"{os.path.relpath(path, HERE)}, line {line}: uses {name}, which "
                                 "does what this exercise asks you to build: write it yourself, "
                                 "with torch and what the exercise allows of minizero ("
                                 f"{', '.join(allowed)})")


def learner(module_name: str):
    """The implementation under test: 'ex02_ddp_bucket', 'solutions.ex02_ddp_bucket',
    'mutants....'."""
    return importlib.import_module(module_name)


def call(fn, *args, **kwargs):
    """Call a learner's function in the grader's own process; NotImplementedError fails, it does not
    error."""
    # pytest: show the message, not this frame
    __tracebackhide__ = True
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as exc:
        raise AssertionError(f"{fn.__name__} is not implemented yet ({exc})") from None


def launch(worker, world_size: int, *args) -> list:
    """worker(*args) on `world_size` gloo ranks; a failing rank becomes a readable AssertionError.

    `worker` is a function of a grader file; the children import that file by name from this folder
    (minizero.lab.grade.call_in), however pytest imported it here."""
    __tracebackhide__ = True
    module = os.path.splitext(os.path.basename(sys.modules[worker.__module__].__file__))[0]
    try:
        return minizero.launch(call_in, world_size, HERE, module, worker.__name__, *args,
                               backend="gloo", timeout=LAUNCH_TIMEOUT_S)
    except RuntimeError as exc:
        first, _, trace = str(exc).partition("\n")
        if "timed out" in first:
            raise AssertionError(f"{first}. A rank is probably waiting in a collective that the "
                                 "others never called: every rank must issue the same collectives "
                                 "in the same order.") from None
        # a grader's check: it names the rank itself
        if "AssertionError: " in first:
            raise AssertionError(first.partition("AssertionError: ")[2]) from None
        if "NotImplementedError" in first:
            raise AssertionError(f"not implemented yet: {first}") from None
        # the learner's own bug: keep its traceback
        raise AssertionError(f"{first}\n{trace}") from None


_launched: dict[tuple, list | AssertionError] = {}


def launch_once(worker, world_size: int, impl: str) -> list:
    """launch(worker, world_size, impl), remembered: a grader whose tests share one run launches it
    once, and a failed run fails each of those tests with the same message."""
    __tracebackhide__ = True
    key = (worker.__module__, worker.__name__, world_size, impl)
    if key not in _launched:
        try:
            _launched[key] = launch(worker, world_size, impl)
        except AssertionError as exc:
            _launched[key] = exc
    if isinstance(_launched[key], AssertionError):
        raise _launched[key]
    return _launched[key]


def config(stage: int, world_size: int, **overrides) -> TrainConfig:
    """A run small enough to launch in about a second and awkward enough to catch the usual
    mistakes.

    SGD, not Adam: Adam is invariant to a constant gradient scale, so it cannot see a sum where an
    average belongs. Odd sizes (no parameter count divisible by 2 or 3), a frozen parameter, one
    that forward never uses, several buckets, two accumulated micro-batches. No clipping: it would
    also hide a wrong scale.
    """
    base = dict(stage=stage, world_size=world_size, steps=3, batch_size=12, grad_accum=2,
                model="tiny", model_overrides={"frozen": ("pos_emb.weight",), "unused_param": True},
                bucket_size=3000, optimizer="sgd", lr=0.5, return_state=True, backend="gloo")
    return TrainConfig(**{**base, **overrides})


def train_with(engine_factory, cfg: TrainConfig) -> dict:
    """minizero.lab.train.train_worker(cfg) with `engine_factory` (an engine class: the learner's
    subclass of one of minizero's engines) in place of minizero.wrap. Returns the trained state
    (from the optimizer's fp32 masters) and, for stages 0-2, the model's own parameters on this
    rank: what its next forward would use.
    """
    engines = []

    def build(model, stage, optimizer, **options):
        engines.append(engine_factory(model, optimizer, **options))
        return engines[-1]

    result = train_worker(cfg, make_engine=build)
    live = None
    if cfg.stage < 3:  # stage 3's full parameters are freed
        state = engines[-1].module.state_dict()
        live = {k: v.detach().float().cpu().clone() for k, v in state.items()}
    return {"rank": result["rank"], "state_dict": result["state_dict"], "live": live}


_references: dict[str, tuple[dict, dict]] = {}


def reference(cfg: TrainConfig) -> tuple[dict, dict]:
    """(initial, trained) state dicts of the single-process oracle for cfg."""
    key = repr(dataclasses.replace(cfg, world_size=1))
    if key not in _references:
        start = reference_train(dataclasses.replace(cfg, steps=0))["state_dict"]
        _references[key] = (start, reference_train(cfg)["state_dict"])
    return _references[key]


def update_ratio(start: torch.Tensor, expected: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """How far `got` moved from `start` along the reference's update (start -> expected), as a
    multiple of it: 1 is right, N a gradient summed over N ranks in one plain SGD step."""
    update = expected.double() - start.double()
    moved = ((got.double() - start.double()) * update).sum()
    return moved / update.pow(2).sum().clamp_min(1e-30)


def first_step_ratio(cfg: TrainConfig, results: list[dict]) -> float:
    """The update_ratio of one SGD step (cfg.steps == 1) farthest from 1, over ranks and tensors
    that moved: unlike a total over several steps, a gradient c times too large shows as c here."""
    start, expected = reference(cfg)
    moved = [name for name, t in expected.items()
             if t.is_floating_point() and not torch.equal(t, start[name])]
    ratios = [update_ratio(start[name], expected[name], res["state_dict"][name]).item()
              for res in results for name in moved]
    return max(ratios, key=lambda r: abs(r - 1))


def assert_matches_reference(cfg: TrainConfig, results: list[dict], atol: float = 1e-6,
                             hint: str = "") -> None:
    """Every rank ends where one process training on the whole batch ends: its optimizer's
    parameters (`state_dict`) and, where they exist, the model's own parameters (`live`)."""
    __tracebackhide__ = True
    start, expected_state = reference(cfg)
    for res in results:
        for what, state in (("parameters held by the optimizer", res["state_dict"]),
                            ("model's parameters (what the next forward uses)", res["live"])):
            if state is None:
                continue
            for name, expected in expected_state.items():
                got = state[name].double()
                diff = (got - expected.double()).abs()
                if diff.numel() == 0 or diff.max() <= atol:
                    continue
                i = int(diff.reshape(-1).argmax())
                ratio = update_ratio(start[name], expected, got)
                raise AssertionError(
                    f"rank {res['rank']}, {name} ({what}) after {cfg.steps} SGD steps on N="
                    f"{cfg.world_size} ranks: element {i} expected "
                    f"{expected.reshape(-1)[i].item():.6g}, got {got.reshape(-1)[i].item():.6g} "
                    f"(max |difference| {diff.max().item():.3g} > {atol:g}); your total update of "
                    f"this tensor is {ratio.item():.3g} x the reference's. {hint}".strip())
