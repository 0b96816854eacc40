"""What every `python -m minizero.*` command shares: bad input is one line on stderr and exit
code 2."""

from __future__ import annotations

import argparse
import os
import sys


class UsageError(Exception):
    """Bad input from the command line."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error raises UsageError instead of printing the usage block and exiting."""

    def error(self, message):
        raise UsageError(message)


def fail(prog: str, message: str) -> int:
    """Report bad input the one way all minizero commands do; returns the exit code (2)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def add_json_flag(parser: argparse.ArgumentParser, what: str) -> None:
    """--json PATH, checked as the command line is read: a typo in the path is a usage error before
    the work starts, not a traceback after it (and the results lost)."""
    parser.add_argument("--json", default=None, metavar="PATH", type=_writable_file,
                        help=f"also write {what} as JSON")


def _writable_file(path: str) -> str:
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} is a directory")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"no directory {folder} to write {os.path.basename(path)} "
                                         "in")
    existed = os.path.exists(path)
    try:                           # tried rather than os.access, which root's permissions fool
        open(path, "a").close()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {path} ({e.strerror})") from None
    if not existed:
        os.remove(path)
    return path


def emit(text: str, data: dict, json_path: str | None) -> None:
    """Print a command's human-readable result, and write its machine-readable one if
    asked (--json)."""
    import json
    print(text)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(data, f, indent=1)
        print(f"wrote {json_path}")


def mode_of(argv: list[str], modes: dict) -> tuple:
    """A command's other measurements, chosen by a flag (`bench --peak`): (the chosen one's
    main or None, the arguments left for it). argparse finds the flag; the rest are the mode's
    own options."""
    parser = OneLineParser(add_help=False)
    group = parser.add_mutually_exclusive_group()
    for flag in modes:
        group.add_argument(flag, action="store_true")
    chosen, rest = parser.parse_known_args(list(argv))
    for flag, main in modes.items():
        if getattr(chosen, flag.lstrip("-").replace("-", "_")):
            return main, rest
    return None, rest
