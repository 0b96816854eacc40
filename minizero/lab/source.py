"""minizero's own lines, read from its files when they are shown: which line emitted an event, and
the function around it, highlighted.

    from minizero.lab import source
    source.show(minizero.zero2.GradientShard.reduce, mark="reduce_scatter(")      # highlighted
    source.show(("minizero/zero3.py", 170))                        # the function around a line
    where = source.origin()      # inside an event subscriber: the minizero line that emitted it
    source.stack()               # ... and every minizero line on the stack that led to it

Notebooks 00-05 show the implementation this way, never a copy that could drift from it; the
step-through (stepthrough.py) records `origin()` with every phase and plots.step_widget shows the
function with the line that produced the phase marked.

`origin` walks the call stack of the event a subscriber is being told about (events.emit calls
subscribers synchronously, in the emitting thread): the first frame inside minizero/ that is not
the event stream itself, the collectives' plumbing (comm.py, beyond/quantize.py: every collective
passes through them) or this lab. A collective's line is therefore the stage's call to it
(zero2.py's reduce-scatter of a bucket), not comm.py's.
"""

from __future__ import annotations

import ast
import functools
import html
import inspect
import pathlib
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent         # minizero/
ROOT = PACKAGE.parent
# frames that only carry an event or a call
PLUMBING = ("events.py", "comm.py", "beyond/quantize.py")


def relative(path: str | pathlib.Path) -> str:
    """'minizero/zero3.py' for a file of this repository (the path a learner opens); a file
    elsewhere keeps its absolute path."""
    path = pathlib.Path(path).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def origin(skip: tuple[str, ...] = PLUMBING, skip_functions: tuple[str, ...] = ()) -> dict | None:
    """{"file", "line", "function"} of the innermost frame in minizero/ outside lab/, the files
    `skip` and the functions `skip_functions` (qualified names); None when no such frame is on the
    stack (the event came from tooling)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = pathlib.Path(frame.f_code.co_filename).resolve()
        if (path.is_relative_to(PACKAGE) and not path.is_relative_to(PACKAGE / "lab")
                and path.name not in skip and frame.f_code.co_qualname not in skip_functions):
            return {"file": relative(path), "line": frame.f_lineno,
                    "function": frame.f_code.co_qualname}
        frame = frame.f_back
    return None


def stack(skip: tuple[str, ...] = PLUMBING) -> list[dict]:
    """Every frame of the call stack in minizero/ outside lab/ and the files `skip`, innermost
    first, as {"file", "line", "function"}: the line of each minizero function that led to the
    event a subscriber is being told about (origin() is the first of them)."""
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        path = pathlib.Path(frame.f_code.co_filename).resolve()
        if (path.is_relative_to(PACKAGE) and not path.is_relative_to(PACKAGE / "lab")
                and path.name not in skip):
            frames.append({"file": relative(path), "line": frame.f_lineno,
                           "function": frame.f_code.co_qualname})
        frame = frame.f_back
    return frames


def of(obj) -> dict:
    """{"file", "line", "function"} of a function or method of minizero: its `def` line."""
    obj = inspect.unwrap(obj)
    return {"file": relative(inspect.getsourcefile(obj)), "line": obj.__code__.co_firstlineno,
            "function": obj.__qualname__}


def _functions(file: str) -> list[tuple[int, int, str]]:
    """(first line with decorators, last line, qualified name) of every function in `file`, as the
    file is now (parsed again when it changed: a learner may edit it between two looks)."""
    return _parsed(file, (ROOT / file).stat().st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _parsed(file: str, mtime_ns: int) -> list[tuple[int, int, str]]:
    tree = ast.parse((ROOT / file).read_text())
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                out.append((first, child.end_lineno, prefix + child.name))
                visit(child, prefix + child.name + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
    visit(tree, "")
    return out


def function_at(file: str, line: int) -> tuple[str, int, list[str]]:
    """The innermost function of `file` (relative to the repository) containing `line`: its
    qualified name, its first line number and its lines, read from the file now."""
    spans = [f for f in _functions(file) if f[0] <= line <= f[1]]
    if not spans:
        raise ValueError(f"{file}:{line} is not inside a function")
    first, last, name = max(spans, key=lambda f: f[0])
    lines = (ROOT / file).read_text().splitlines()[first - 1: last]
    return name, first, lines


class Code:
    """The function of minizero around `line`, read from its file now, with `line` and `also`
    marked (not the `def` line) and every line containing one of `marks`; shown as highlighted
    HTML in a notebook and as numbered text elsewhere (print: ▶ marks)."""

    def __init__(self, file: str, line: int, title: str = "", marks: tuple[str, ...] = (),
                 also: tuple[int, ...] = ()):
        self.file, self.line = file, line
        self.function, self.first, self.lines = function_at(file, line)
        self.title = title or f"{file}:{line}, in {self.function}"
        self.marked = {self.first + i for i, text in enumerate(self.lines)
                       if any(m in text for m in marks)} | ({line, *also} - {self.first})

    def __str__(self) -> str:
        width = len(str(self.first + len(self.lines)))
        body = [f"{'▶' if self.first + i in self.marked else ' '} {self.first + i:>{width}}  "
                f"{text}" for i, text in enumerate(self.lines)]
        return "\n".join([f"# {self.title}", *body])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        try:
            from pygments import highlight
            from pygments.formatters import HtmlFormatter
            from pygments.lexers import PythonLexer
        except ImportError:                  # no pygments: the text, numbered and marked
            return f"<pre>{html.escape(str(self))}</pre>"
        marked = sorted(n - self.first + 1 for n in self.marked)
        formatter = HtmlFormatter(linenos="inline", linenostart=self.first, hl_lines=marked,
                                  noclasses=True, style="friendly")
        code = highlight("\n".join(self.lines), PythonLexer(), formatter)
        return f"<div><b><code>{html.escape(self.title)}</code></b>{code}</div>"


def show(*things, mark: str | tuple[str, ...] = ()) -> Listing | Code:
    """Each thing (a function or method of minizero, or a (file, line) pair: that line marked) as
    Code: the function around it, read from the file now, each line containing `mark` (a string or
    several) highlighted. (file, line) pairs in one function are one Code with each line marked.
    One function: its Code; several: a Listing, shown one below the other."""
    marks = (mark,) if isinstance(mark, str) else tuple(mark)
    functions: dict[tuple[str, int], list[int]] = {}        # (file, def line) -> lines to mark
    for thing in things:
        where = dict(zip(("file", "line"), thing)) if isinstance(thing, tuple) else of(thing)
        _, first, _ = function_at(where["file"], where["line"])
        functions.setdefault((where["file"], first), []).append(where["line"])
    codes = [Code(file, lines[0], marks=marks, also=tuple(lines[1:]))
             for (file, _), lines in functions.items()]
    return codes[0] if len(codes) == 1 else Listing(codes)


class Listing(list):
    """Several Code blocks, one below the other."""

    def __str__(self) -> str:
        return "\n\n".join(str(c) for c in self)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return "".join(c._repr_html_() for c in self)
