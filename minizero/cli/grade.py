"""Score the exercises (pytest underneath).

    python -m minizero.grade      (= python -m minizero grade; --help for the options)

The command's arguments and output are here; the experiment itself is minizero/lab/grade.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from minizero.cli import OneLineParser, UsageError, add_json_flag, fail
from minizero.lab.grade import EXERCISES, Collector, format_table, score, verdict


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m minizero.grade", description=__doc__.splitlines()[0])
    parser.add_argument("--solutions", action="store_true",
                        help="grade exercises/solutions/ instead")
    parser.add_argument("-k", dest="keyword",
                        help="only exercises/tests matching this pytest -k expression")
    add_json_flag(parser, "the score table")
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
    collector = Collector()
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
