"""The package's one architectural rule: the ZeRO implementation imports nothing from the tooling.

    python -m pytest tests/test_layout.py

minizero/ holds the implementation (comm, flat, reducer, optim, engine, the stages, wrap, launcher,
memory, checkpoint). minizero/lab/ (model, data, training loop, reference, peers, experiments) and
minizero/cli/ (the commands) sit beside it and may import it; the short entry modules (run.py, bench.py,
...) only give the commands their names. Imports are read from the source (every `import` anywhere in a
file, also inside functions), so a lazy import cannot hide a dependency.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "minizero"
TOOLING = ("minizero.lab", "minizero.cli")
ENTRY_POINTS = ("run", "bench", "scale", "consolidate", "grade", "memory.__main__")


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every module a file imports ('from minizero import comm' counts as minizero.comm)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import; minizero spells its imports out"
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def core_modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if name.startswith(TOOLING) or name.removeprefix("minizero.") in ENTRY_POINTS:
            continue
        out[name] = path
    return out


def tooling_imports(path: pathlib.Path) -> list[str]:
    forbidden = TOOLING + tuple(f"minizero.{e}" for e in ENTRY_POINTS)
    return sorted(m for m in imported_modules(path) if m.startswith(forbidden))


def test_the_implementation_is_what_we_expect():
    names = {n.removeprefix("minizero.") for n in core_modules()}
    assert names >= {"minizero", "comm", "flat", "reducer", "optim", "engine", "ddp", "zero1", "zero2", "zero3",
                     "offload", "wrap", "launcher", "memory", "checkpoint"}, names


@pytest.mark.parametrize("name", sorted(core_modules()))
def test_implementation_module_imports_no_tooling(name):
    bad = tooling_imports(core_modules()[name])
    assert not bad, f"{name} imports {bad}: the implementation must not depend on lab/ or cli/"


def test_the_rule_catches_a_lazy_tooling_import(tmp_path):
    # The check itself can fail: a core-looking module with an import hidden inside a function.
    fake = tmp_path / "engine.py"
    fake.write_text("import torch\n\ndef f():\n    from minizero.lab.train import TrainConfig\n"
                    "    from minizero import cli\n    return TrainConfig\n")
    assert tooling_imports(fake) == ["minizero.cli", "minizero.lab.train", "minizero.lab.train.TrainConfig"]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_entry_points_are_thin(entry):
    path = PACKAGE / (entry.replace(".", "/") + ".py")
    code = [line for line in path.read_text().splitlines() if line.strip()]
    assert len(code) <= 15, f"{path} has {len(code)} lines: an entry point only names a command"
