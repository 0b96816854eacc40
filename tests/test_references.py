"""Every pointer a learner follows from the prose to the code resolves, and to the right place.

    python -m pytest tests/test_references.py

A reader moves from reading to doing at "Then do exercise 6", and from an exercise to the code at
"Compare: minizero/zero3.py (Unit: gather, ...)". When exercises are renumbered or code moves
between files, those pointers rot silently; here they are checked:
  * an exercise named in a notebook is one the exercises' table lists for that notebook;
  * an exercise named in minizero's source is one whose statement or grader uses that file;
  * any other "exercise N" / "exNN" (READMEs, docs, slides) exists;
  * "minizero/X.py (Name, Class.method, Class: method, ...)" names what X.py defines;
  * each notebook's settings cell (tagged `parameters`) is its first code cell, as
    notebooks/README.md says.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXERCISE_TABLE_ROW = re.compile(r"^\| (\d+) \| `(ex\d\d_\w+)\.py` \|.*\| (.*) \|$", re.M)
# "exercise 7", "exercises 9 (the host step) and 10 (...)", "Exercise 04", "ex08"
EXERCISE_REF = re.compile(r"\b[Ee]xercises? (\d+)((?:(?: \([^)]*\))?(?:,| and) \d+)*)|\bex(\d\d)\b")
# "minizero/zero3.py (Unit: gather, free)", also across a line break and its comment marker
CODE_REF = re.compile(r"(?:minizero/)?([a-z_/0-9]+\.py)\s*(?:#\s*)?\(([^)]*)\)")
IDENTIFIER = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)?$")


def _exercises() -> dict[int, tuple[str, str]]:
    """number -> (statement file stem, the table's 'notebook to read first' cell)."""
    table = (ROOT / "exercises" / "README.md").read_text()
    rows = {int(n): (stem, notebooks) for n, stem, notebooks in EXERCISE_TABLE_ROW.findall(table)}
    assert sorted(rows) == list(range(1, len(rows) + 1)) and len(rows) >= 14, sorted(rows)
    return rows


def _exercise_refs(text: str) -> list[tuple[int, int]]:
    """(line, exercise number) for every exercise named in text; "-k exNN" is a command, skipped."""
    refs = []
    for match in EXERCISE_REF.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        if match.group(3):
            if text[max(0, match.start() - 3):match.start()] != "-k ":
                refs.append((line, int(match.group(3))))
            continue
        more = re.findall(r"(?:,| and) (\d+)", re.sub(r" \([^)]*\)", "", match.group(2)))
        refs += [(line, int(n)) for n in (match.group(1), *more)]
    return refs


def _sources(*patterns: str) -> list[Path]:
    return sorted(p for pattern in patterns for p in ROOT.glob(pattern))


def test_an_exercise_named_in_a_notebook_is_one_of_that_notebooks():
    exercises, wrong = _exercises(), []
    for path in _sources("notebooks/[0-9]*.py"):
        for line, n in _exercise_refs(path.read_text()):
            if n not in exercises or path.stem not in exercises[n][1]:
                wrong.append(f"notebooks/{path.name}:{line}: exercise {n}")
    assert not wrong, ("these exercises are not the notebook's own (exercises/README.md's table): "
                       + "; ".join(wrong))


def test_an_exercise_named_in_the_source_is_one_that_uses_that_file():
    exercises, wrong = _exercises(), []
    for path in _sources("minizero/**/*.py"):
        relative = path.relative_to(ROOT).as_posix()
        module = relative.removesuffix(".py").replace("/", ".")
        for line, n in _exercise_refs(path.read_text()):
            text = "" if n not in exercises else "".join(
                (ROOT / "exercises" / f"{prefix}{exercises[n][0]}.py").read_text()
                for prefix in ("", "test_"))               # the statement and its grader
            if f"{path.name}" not in text and module not in text:
                wrong.append(f"{relative}:{line}: exercise {n}")
    assert not wrong, ("of these exercises neither the statement nor the grader names the file "
                       "that cites them: " + "; ".join(wrong))


def test_every_other_exercise_named_exists():
    exercises = _exercises()
    wrong = [f"{path.relative_to(ROOT)}:{line}: exercise {n}"
             for path in _sources("*.md", "*/README.md", "docs/*.md", "slides/*.md",
                                  "examples/*.py", "scripts/*.py")
             for line, n in _exercise_refs(path.read_text()) if n not in exercises]
    assert not wrong, "no such exercise: " + "; ".join(wrong)


def _definitions(path: Path) -> tuple[set[str], dict[str, set[str]]]:
    """A module's top-level names, and each class's attributes (methods, class attributes)."""
    tree = ast.parse(path.read_text())
    top, members = set(), {}

    def names(body) -> set[str]:
        found = set()
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found |= {t.id for t in targets if isinstance(t, ast.Name)}
        return found

    top = names(tree.body)
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            members[node.name] = names(node.body)
    return top, members


def _code_refs() -> list[tuple[str, str, list[str]]]:
    """(where, minizero file, names) for every "minizero/X.py (Name, ...)" outside minizero/."""
    found = []
    for path in _sources("exercises/**/*.py", "notebooks/*.py", "*.md", "*/README.md", "docs/*.md",
                         "minizero/**/*.py"):
        text = path.read_text()
        for match in CODE_REF.finditer(text):
            target = ROOT / "minizero" / match.group(1)
            if not target.exists():
                continue
            head, _, methods = match.group(2).partition(":")
            names = [n.strip() for n in head.split(",")]
            if not all(IDENTIFIER.match(n) and not n.endswith(".py") for n in names):
                continue                                  # prose or files in parentheses
            methods = [m.strip() for m in methods.split(",") if IDENTIFIER.match(m.strip())]
            names += [f"{names[-1]}.{m}" for m in methods]
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{path.relative_to(ROOT)}:{line}", target, names))
    return found


def test_every_name_cited_with_its_file_is_defined_there():
    refs, wrong = _code_refs(), []
    assert len(refs) >= 15                                   # the exercises' "Compare:" lines
    for where, target, names in refs:
        top, members = _definitions(target)
        every_member = set().union(*members.values()) if members else set()
        for name in names:
            owner, _, member = name.partition(".")
            ok = (member in members.get(owner, ()) if member
                  else owner in top or owner in every_member)
            if not ok:
                wrong.append(f"{where}: {name} is not in minizero/{target.name}")
    assert not wrong, "; ".join(wrong)


def test_each_notebooks_settings_are_its_first_code_cell():
    for path in _sources("notebooks/[0-9]*.py"):
        cells = re.findall(r"^# %%(.*)$", path.read_text(), re.M)
        code = [header for header in cells if "[markdown]" not in header]
        assert code and 'tags=["parameters"]' in code[0], (
            f"{path.name}: the first code cell is not the settings cell (tagged parameters), "
            "where notebooks/README.md says the settings are")


def test_every_relative_link_in_the_docs_resolves():
    """README.md, docs/ and the folders' READMEs link to files by relative path: each must exist."""
    wrong = []
    for path in _sources("*.md", "*/README.md", "docs/*.md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" not in target and not (path.parent / target).exists():
                wrong.append(f"{path.relative_to(ROOT)}: {target}")
    assert not wrong, "links to nothing: " + "; ".join(wrong)


def test_the_readme_is_a_front_door():
    """What minizero is, the two set-up commands, the learning path, the three front ends and where
    everything else lives: at most 150 lines (topics have their pages under docs/)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150, "README.md: move a topic to its page under docs/"
    assert 'pip install torch==2.13.0 -e ".[dev]"' in readme and "\npython -m pytest\n" in readme
