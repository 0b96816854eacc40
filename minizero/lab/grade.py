"""Score the exercises: run their graders (pytest) and print points per exercise.

    python -m minizero.grade                       # grade your answers in exercises/exNN_*.py
    python -m minizero.grade -k ex03               # one exercise
    python -m minizero.grade --solutions           # grade exercises/solutions/ (full marks due)
    python -m minizero.grade --json score.json     # also write the table as JSON
    python -m minizero.grade --expect-zero         # CI: exit 1 unless every exercise scores zero
    python -m minizero.grade --solutions --expect-full   # CI: exit 1 unless every test passes

Each grader is a pytest file, exercises/test_exNN_*.py; a test's points come from its
`@pytest.mark.points(n)` marker (1 when it has none), and an exercise scores the points of the tests
it passes. The exit status is 0 whatever the score (unless an --expect flag says otherwise), 2 when
the graders could not run at all. See exercises/README.md.

`call_in` is the one helper the graders import from here: graders run the learner's code on several
ranks with minizero.launch, whose children must import the worker function by name. Launching
`call_in(directory, module, function, ...)` instead puts the exercises' folder on the child's
sys.path first, so workers can live next to the exercises whatever sys.path the launcher's server
started with.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections import defaultdict
from pathlib import Path

from minizero.cli import OneLineParser, UsageError, fail

EXERCISES = Path(__file__).resolve().parents[2] / "exercises"


def call_in(directory: str, module: str, function: str, *args):
    """Import `module` with `directory` first on sys.path and return module.function(*args)."""
    if directory not in sys.path:
        sys.path.insert(0, directory)
    return getattr(importlib.import_module(module), function)(*args)


class _Collector:
    """A pytest plugin: the points and the outcome of every selected test."""

    def __init__(self):
        self.tests: dict[str, dict] = {}

    def pytest_collection_finish(self, session):
        for item in session.items:                        # after -k: only what will run
            marker = item.get_closest_marker("points")
            self.tests[item.nodeid] = {"exercise": item.path.stem.removeprefix("test_"),
                                       "test": item.name, "points": marker.args[0] if marker else 1,
                                       "passed": False}

    def pytest_runtest_logreport(self, report):
        test = self.tests.get(report.nodeid)
        if test is None:
            return
        if report.when == "call":
            test["passed"] = report.passed
        # a setup or teardown error fails the test too
        if report.failed:
            test["passed"] = False
            crash = getattr(report.longrepr, "reprcrash", None)
            lines = str(report.longrepr).splitlines() or [""]
            test.setdefault("message", crash.message if crash else lines[-1])


def score(tests: dict[str, dict]) -> list[dict]:
    """One row per exercise, in exercise order: points earned and possible, tests passed and run."""
    rows: dict[str, dict] = defaultdict(lambda: {"points": 0, "max_points": 0, "passed": 0,
                                                 "tests": 0})
    for test in tests.values():
        row = rows[test["exercise"]]
        row["max_points"] += test["points"]
        row["tests"] += 1
        if test["passed"]:
            row["points"] += test["points"]
            row["passed"] += 1
    return [{"exercise": name, **rows[name]} for name in sorted(rows)]


def format_table(rows: list[dict]) -> str:
    """exercise | points earned/possible | tests passed/run, and the total."""
    width = max([len("exercise")] + [len(r["exercise"]) for r in rows])
    lines = [f"{'exercise':<{width}}  {'points':>7}  {'tests passed':>12}"]
    for r in rows:
        lines.append(f"{r['exercise']:<{width}}  {r['points']:>3}/{r['max_points']:<3}  "
                     f"{r['passed']:>8}/{r['tests']}")
    total, most = sum(r["points"] for r in rows), sum(r["max_points"] for r in rows)
    lines.append(f"{'total':<{width}}  {total:>3}/{most}")
    return "\n".join(lines)


def verdict(rows: list[dict], *, expect_zero: bool = False,
            expect_full: bool = False) -> tuple[int, str]:
    """(exit code, reason): 1 when an --expect flag is not met, else 0."""
    if expect_zero and any(r["points"] for r in rows):
        return 1, ("expected every exercise to score zero: "
                   + ", ".join(r["exercise"] for r in rows if r["points"]) + " scored")
    if expect_full and any(r["passed"] < r["tests"] for r in rows):
        failed = ", ".join(r["exercise"] for r in rows if r["passed"] < r["tests"])
        return 1, f"expected every test to pass: {failed} did not"
    return 0, ""


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m minizero.grade", description=__doc__.splitlines()[0])
    parser.add_argument("--solutions", action="store_true",
                        help="grade exercises/solutions/ instead")
    parser.add_argument("-k", dest="keyword",
                        help="only exercises/tests matching this pytest -k expression")
    parser.add_argument("--json", metavar="PATH", help="also write the score table to PATH as JSON")
    parser.add_argument("--exercises", metavar="DIR", default=str(EXERCISES),
                        help="the exercises folder")
    expect = parser.add_mutually_exclusive_group()
    expect.add_argument("--expect-zero", action="store_true",
                        help="exit 1 unless every exercise scores 0")
    expect.add_argument("--expect-full", action="store_true",
                        help="exit 1 unless every test passes")
    try:
        args = parser.parse_args(argv)
        if not Path(args.exercises, "conftest.py").is_file():
            raise UsageError(f"no graders in {args.exercises} (it has no conftest.py)")
        try:
            import pytest
        except ImportError:
            raise UsageError("grading needs pytest: pip install -e '.[dev]'") from None
    except UsageError as exc:
        return fail(parser.prog, str(exc))

    pytest_args = [args.exercises, "-q", "--tb=short", "-p", "no:cacheprovider"]
    pytest_args += ["--solutions"] if args.solutions else []
    pytest_args += ["-k", args.keyword] if args.keyword else []
    collector = _Collector()
    code = pytest.main(pytest_args, plugins=[collector])
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) or not collector.tests:
        return fail(parser.prog, f"the graders did not run (pytest exit code {int(code)})")

    rows = score(collector.tests)
    heading = "solutions in exercises/solutions/\n" if args.solutions else ""
    print("\n" + heading + format_table(rows))
    if args.json:
        total = {"points": sum(r["points"] for r in rows),
                 "max_points": sum(r["max_points"] for r in rows)}
        report = {"solutions": args.solutions, "exercises": rows, **total,
                  "tests": list(collector.tests.values())}
        try:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        except OSError as exc:
            return fail(parser.prog, f"cannot write {args.json}: {exc.strerror}")
    code, reason = verdict(rows, expect_zero=args.expect_zero, expect_full=args.expect_full)
    if reason:
        print(reason, file=sys.stderr)
    return code
