"""pytest plumbing for the graders: the --solutions option, the points marker, the `impl` fixture.

    pytest exercises                 # grade your answers (exercises/exNN_*.py)
    pytest exercises --solutions     # grade the reference answers (exercises/solutions/)
"""

import os
import sys

import pytest

# The graders import the learner's module by name (`ex02_ddp_bucket`, `solutions.ex02_ddp_bucket`):
# this folder must be on sys.path, also under pytest's --import-mode=importlib.
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def pytest_addoption(parser):
    parser.addoption(
        "--solutions",
        action="store_true",
        default=False,
        help="grade exercises/solutions/ (the reference answers) instead of your files",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "points(n): what the test is worth; minizero.grade adds "
                                       "them up")


@pytest.fixture
def impl(request) -> str:
    """Module name of the answer under test: test_ex02_ddp_bucket.py grades ex02_ddp_bucket."""
    exercise = os.path.splitext(os.path.basename(request.module.__file__))[0].removeprefix("test_")
    return f"solutions.{exercise}" if request.config.getoption("--solutions") else exercise
