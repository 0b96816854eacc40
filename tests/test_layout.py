"""The package's one architectural rule: the ZeRO implementation imports nothing from the tooling.

    python -m pytest tests/test_layout.py

minizero/ holds the implementation (comm, flat, reducer, optim, engine, the stages, wrap, launcher,
memory, checkpoint). minizero/lab/ (model, data, training loop, reference, peers, experiments) and
minizero/cli/ (the commands) sit beside it and may import it; the short entry modules (run.py,
bench.py, ...) only give the commands their names. Imports are read from the source (every `import`
anywhere in a file, also inside functions), so a lazy import cannot hide a dependency.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import minizero

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "minizero"
TOOLING = ("minizero.lab", "minizero.cli")
ENTRY_POINTS = ("run", "bench", "scale", "consolidate", "grade", "memory.__main__", "__main__")


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
    assert names >= {
        "minizero", "comm", "flat", "reducer", "optim", "engine", "ddp", "zero1", "zero2", "zero3",
        "offload", "wrap", "launcher", "memory", "checkpoint",
    }, names


@pytest.mark.parametrize("name", sorted(core_modules()))
def test_implementation_module_imports_no_tooling(name):
    bad = tooling_imports(core_modules()[name])
    assert not bad, f"{name} imports {bad}: the implementation must not depend on lab/ or cli/"


def test_the_rule_catches_a_lazy_tooling_import(tmp_path):
    # The check itself can fail: a core-looking module with an import hidden inside a function.
    fake = tmp_path / "engine.py"
    fake.write_text("import torch\n\ndef f():\n    from minizero.lab.train import TrainConfig\n"
                    "    from minizero import cli\n    return TrainConfig\n")
    assert tooling_imports(fake) == [
        "minizero.cli",
        "minizero.lab.train",
        "minizero.lab.train.TrainConfig",
    ]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_entry_points_are_thin(entry):
    path = PACKAGE / (entry.replace(".", "/") + ".py")
    code = [line for line in path.read_text().splitlines() if line.strip()]
    assert len(code) <= 15, f"{path} has {len(code)} lines: an entry point only names a command"


# --------------------------------------------------------------------------------------------------
# Nothing outside the implementation changes it at run time: tooling, graders and notebooks observe
# it through its events (minizero/events.py) and documented extension points (options of wrap,
# subclasses).
# --------------------------------------------------------------------------------------------------

ROOT = PACKAGE.parent
OBSERVERS = ("minizero/lab", "exercises", "notebooks")
# Names that hold the implementation's objects wherever they appear
# (`engine.x = ...`, `e.reducer.y = ...`)
IMPLEMENTATION_OBJECTS = {"engine", "unit", "units", "reducer", "optimizer", "layout", "scaler",
                          "activations", "link"}


def implementation_modules(tree: ast.AST) -> set[str]:
    """Local names bound to an implementation module: `from minizero import comm`,
    `import minizero.comm as c`, `import minizero` (every minizero.<core> chain)."""
    core = {n.removeprefix("minizero.") for n in core_modules()} | {"minizero"}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "minizero":
            names.update(a.asname or a.name for a in node.names if a.name in core)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minizero."):
            names.update(a.asname or a.name for a in node.names
                         if f"{node.module}.{a.name}".removeprefix("minizero.") in core)
        elif isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names
                         if a.name.split(".")[0] == "minizero")
    return names


def _chain(node: ast.AST) -> list[str]:
    """`a.b.c` -> ["a", "b", "c"]; other bases (calls, subscripts) end the chain."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


def run_time_patches(source: str, objects_too: bool = True) -> list[str]:
    """Every assignment (=, augmented =, del, setattr, delattr) to an attribute of an implementation
    module or (objects_too) of an implementation object, as 'line: target'."""
    tree = ast.parse(source)
    modules, found = implementation_modules(tree), []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        attributes = [
            t
            for target in targets
            for t in ast.walk(target)
            if isinstance(t, ast.Attribute) and isinstance(t.ctx, (ast.Store, ast.Del))
        ]
        objects = [t.value for t in attributes]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("setattr", "delattr") and node.args:
            objects.append(node.args[0])
        for obj in objects:
            chain = _chain(obj)
            if chain and (
                chain[0] in modules or objects_too and IMPLEMENTATION_OBJECTS & set(chain)
            ):
                found.append(f"{node.lineno}: {ast.unparse(obj)}")
    return found


def observer_sources() -> dict[str, str]:
    """Every Python source of the observers, notebooks' code cells included (magics left out)."""
    import json
    out = {}
    for folder in OBSERVERS:
        for path in sorted((ROOT / folder).rglob("*")):
            rel = str(path.relative_to(ROOT))
            if path.suffix == ".py":
                out[rel] = path.read_text()
            elif path.suffix == ".ipynb":
                cells = json.loads(path.read_text())["cells"]
                out[rel] = "\n".join("\n".join(line for line in "".join(c["source"]).splitlines()
                                               if not line.lstrip().startswith(("%", "!")))
                                     for c in cells if c["cell_type"] == "code")
    return out


def learner_code(path: str) -> bool:
    """An exercise's skeleton, solution or mutant: the learner's own wrapper, whose units and
    optimizers are not minizero's (only minizero's modules are off limits there)."""
    return path.startswith(("exercises/solutions/", "exercises/mutants/", "exercises/ex"))


@pytest.mark.parametrize("path", sorted(observer_sources()))
def test_nothing_patches_the_implementation_at_run_time(path):
    patches = run_time_patches(observer_sources()[path], objects_too=not learner_code(path))
    assert not patches, (
        f"{path} assigns attributes of minizero's implementation at run time "
        f"({'; '.join(patches)}): subscribe to minizero.events or use an extension point"
    )


def test_the_rule_catches_each_kind_of_patch():
    # The check itself can fail: each line below patches the implementation; none of the last
    # four does.
    patches = run_time_patches(
        "from minizero import comm\nimport minizero\nfrom minizero.lab import stepthrough\n"
        "comm.all_gather = None\nminizero.comm.GLOO = False\nengine.timeline = []\n"
        "setattr(comm, 'reduce_scatter', f)\ndel unit.free\ne.reducer.max_in_flight += 1\n"
        "stepthrough.x = 1\nself.y = 2\np.grad = None\nslider.value = 3\n")
    assert sorted(int(p.split(":")[0]) for p in patches) == [4, 5, 6, 7, 8, 9], patches


def test_the_reading_orders_line_counts_are_the_files():
    """minizero/__init__.py tells a reader how long each file of the reading order is, and the
    total: those numbers are the files' (wc -l), so they cannot go stale unseen."""
    package = pathlib.Path(minizero.__file__).parent
    doc = minizero.__doc__
    order = doc[doc.index("read in this order"):doc.index("Then ")]
    counts = {name: int(n) for name, n in re.findall(r"(\w+\.py) \((\d+)", order)}
    counts |= {name: int(n) for name, n in re.findall(r"(\w+\.py) (\d+)", order)}
    actual = {name: len((package / name).read_text().splitlines()) for name in counts}
    assert counts == actual
    total = int(re.search(r"\(([\d,]+) lines", order).group(1).replace(",", ""))
    assert total == sum(actual.values())


def test_the_readme_reads_the_code_in_the_same_order():
    """README.md's "read in this order" lists the files minizero/__init__.py counts, in its order
    (units.py comes with zero3.py there, so it is not a step of its own)."""
    doc = minizero.__doc__
    order = doc[doc.index("read in this order"):doc.index("Then ")]
    package_order = re.findall(r"(\w+\.py) \(", order)
    readme = (PACKAGE.parent / "README.md").read_text()
    readme = readme[readme.index("read in this order"):]
    readme_order = re.findall(r"`(\w+\.py)`", readme[:readme.index("Every")])
    assert readme_order == package_order


# --------------------------------------------------------------------------------------------------
# The reading path (issue 46): the files minizero/__init__.py names, in its order, with every
# minizero module they import at module level, transitively. A learner reads it top to bottom
# without opening a file off it, so it must be short, import nothing off it, and hold the paper:
# what came after it (beyond/) gets at most a one-line pointer in each file.
# --------------------------------------------------------------------------------------------------

READING_PATH_LIMIT = 1600
# What lies beyond the paper's ZeRO-DP, as the path would name it (case-insensitive patterns).
BEYOND_THE_PAPER = (r"\bhpz\b", r"quantiz", r"tensor[ _-]parallel", r"\bmesh", r"\bdisk\b",
                    r"\bnetwork", r"desync", r"\bmics\b", r"\bhsdp\b", r"shard[ _]group",
                    r"replicate[ _]group", r"zero\+\+", r"\bq[wg]z\b", r"\bint8\b", r"secondar",
                    r"ranks_per_node", r"(inter|intra)[_-]node", r"\bmulti-node\b")


def reading_order() -> list[str]:
    """The files of the reading order in minizero/__init__.py's docstring, in its order."""
    doc = minizero.__doc__
    order = doc[doc.index("read in this order"):doc.index("Then ")]
    return re.findall(r"(\w+\.py) \(", order)


def module_level_imports(path: pathlib.Path) -> set[str]:
    """The minizero modules a file imports when it is imported: its module body's imports (inside
    `if` and `try` too), not those inside functions. `from minizero import comm` is minizero.comm;
    the package minizero itself is the front door, not a file of the path."""
    def body_imports(body) -> set[str]:
        found = set()
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                found |= body_imports(node.body + node.orelse)
        return found
    modules = core_modules()
    return {name for name in body_imports(ast.parse(path.read_text()).body)
            if name in modules and name != "minizero"}


def reading_closure() -> dict[str, int]:
    """{module: its lines} for the reading path and everything it imports at module level."""
    modules, seen = core_modules(), {}
    todo = [f"minizero.{name.removesuffix('.py')}" for name in reading_order()]
    while todo:
        name = todo.pop(0)
        if name not in seen:
            seen[name] = len(modules[name].read_text().splitlines())
            todo += sorted(module_level_imports(modules[name]))
    return seen


def test_the_reading_path_with_what_it_imports_is_short():
    closure = reading_closure()
    assert sum(closure.values()) <= READING_PATH_LIMIT, (
        f"the reading path and its imports are {sum(closure.values())} lines "
        f"(> {READING_PATH_LIMIT}): {closure}")


def test_the_reading_path_imports_nothing_off_it():
    path = {f"minizero.{name.removesuffix('.py')}" for name in reading_order()}
    off = sorted(set(reading_closure()) - path)
    assert not off, f"the reading path imports {off} at module level: a learner would open them"


def beyond_lines(source: str) -> list[str]:
    """The lines of a source that name something beyond the paper (BEYOND_THE_PAPER)."""
    return [line.strip() for line in source.splitlines()
            if any(re.search(word, line, re.IGNORECASE) for word in BEYOND_THE_PAPER)]


@pytest.mark.parametrize("name", reading_order())
def test_a_file_on_the_path_points_beyond_the_paper_in_one_line_at_most(name):
    lines = beyond_lines((PACKAGE / name).read_text())
    assert len(lines) <= 1, (f"{name} names what lies beyond the paper in {len(lines)} lines "
                             f"(one pointer at most): {lines}")


def test_the_beyond_rule_can_fail():
    source = ("# stage 3 gathers a unit\nhpz_group = None  # ZeRO++'s hpZ\n"
              "codec = Int8Blocks()  # quantized weights\nmesh = comm.mesh(2)\n"
              "replicated = True  # DDP replicates everything: the paper's word\n")
    assert len(beyond_lines(source)) == 3


def test_the_paths_length_is_stated_truly():
    """minizero/__init__.py, README.md ("the code") and pyproject.toml state the path's length
    (with what it imports) and a reading time of about 200 lines an hour: both measured here."""
    total = sum(reading_closure().values())
    hours = round(total / 200)
    readme = (ROOT / "README.md").read_text()
    texts = {"minizero/__init__.py": minizero.__doc__,
             "README.md": readme[readme.index("**The code**"):readme.index("**Slides**")],
             "pyproject.toml": (ROOT / "pyproject.toml").read_text()}
    for where, text in texts.items():
        assert f"{total:,} lines" in text, f"{where} does not state the path's {total:,} lines"
        assert f"about {hours} hours" in text, f"{where} does not say 'about {hours} hours'"
        assert "afternoon" not in text, f"{where} still promises an afternoon"


def test_docs_architecture_reads_the_code_in_the_same_order():
    text = (ROOT / "docs" / "architecture.md").read_text()
    order = text[text.index("Reading order:"):]
    assert re.findall(r"`(\w+\.py)`", order[:order.index(")")]) == reading_order()
