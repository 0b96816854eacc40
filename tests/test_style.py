"""The project's style, checked: lines of at most 100 characters and no unused import or name
(ruff's E501 and pyflakes, set in pyproject.toml).

    python -m pytest tests/test_style.py        # or: ruff check
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_ruff_finds_no_long_line_and_no_dead_name():
    command = [sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
