"""A real browser: every notebook opens in JupyterLab with its markdown rendered as prose, two run
with their widgets; the slide deck navigates by keyboard.

    python -m pytest tests/test_browser.py -q    # needs /usr/bin/chromium, chromedriver, selenium

Debian's `chromium` and `chromium-driver` packages (`.ci/run` installs them) and the pip package
selenium; the test skips, saying which is missing, without them. Selenium is handed the system
chromedriver and chromium explicitly, so Selenium Manager never downloads a browser or a driver.

What a learner does, in headless Chromium: `jupyter lab` serves a temporary copy of notebooks/ (the
repo is never modified). Every notebook is opened: no error dialog, every markdown cell rendered,
and no markdown cell rendered as a code block (no `<pre>` in the rendered markdown: a paragraph
indented by four spaces becomes one, as the step-through's introduction once did). Then NOTEBOOK and
STAGE_NOTEBOOK, with the small settings of tests/test_notebooks.py (TINY) after their parameters
cell, are run: *Run → Run All Cells* is clicked, and once no cell is running every code cell has its
execution count, no output shows a traceback, every cell whose source uses ipywidgets shows a
rendered control (not "Error displaying widget"), and changing that control changes what the kernel
computes and shows. A small notebook whose widget callback raises, with a widget whose model class
the front end does not know, and one whose markdown is indented, must fail the same checks (a check
that cannot fail checks nothing). The deck is built the way slides/build.py builds it and stepped
through with the keys it documents (→, space, PageDown, End, Home): the counter advances and every
figure of every slide is decoded and laid out. The figures are placeholder PNGs here:
tests/test_slides.py checks the measured ones, which take ~40 s to draw.

On a failure the screenshots and the page's HTML (and JupyterLab's log) are written to a temporary
folder whose path is printed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pathlib
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Debian's, never a downloaded one
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
NOTEBOOK = "06_compare"         # fast with the small settings (~15 s), a control that recomputes
STAGE_NOTEBOOK = "02_zero1"     # a stage notebook: its worker cell, the launch, the in-process cell
NOTEBOOK_NAMES = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
RUN_TIMEOUT_S = 240
WIDGET_CONTROLS = (".widget-slider, .widget-dropdown, .widget-play, .widget-toggle-buttons, "
                   ".widget-radio, .widget-select, .widget-button, .widget-checkbox, .widget-text")
ERROR_LINE = re.compile(
    r"Traceback \(most recent call last\)|^\s*\w*(Error|Exception|Interrupt)\b", re.MULTILINE
)


def _missing() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} not found (apt-get install chromium chromium-driver)"
    if importlib.util.find_spec("selenium") is None:
        return "selenium not installed (pip install -e '.[dev]')"
    if importlib.util.find_spec("jupyterlab") is None:
        return "jupyterlab not installed (pip install -e '.[dev]')"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=f"no real browser: {_missing()}")

if _missing() is None:
    import nbformat
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select
    from test_notebooks import with_tiny_settings


# --------------------------------------------------------------------------------------------------
# the browser, JupyterLab, and evidence on failure
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def evidence_dir():
    """Created on the first failure only; kept after the run so its screenshots can be looked at."""
    return {}


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@contextlib.contextmanager
def screenshots_on_failure(driver, name: str, evidence: dict, extra: dict | None = None):
    """Any exception inside: a screenshot, the page's HTML and `extra` files go to a
    temporary folder."""
    try:
        yield
    except BaseException as e:
        folder = evidence.setdefault("dir", tempfile.mkdtemp(prefix="minizero-browser-"))
        with contextlib.suppress(Exception):
            driver.save_screenshot(os.path.join(folder, f"{name}.png"))
            pathlib.Path(folder, f"{name}.html").write_text(driver.page_source)
        for filename, source in (extra or {}).items():
            with contextlib.suppress(OSError):
                shutil.copy(source, os.path.join(folder, filename))
        print(f"\nbrowser evidence for {name}: {folder}", file=sys.stderr)
        if hasattr(e, "add_note"):
            e.add_note(f"screenshot and HTML in {folder}")
        raise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc; empty elsewhere)."""
    found = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """`jupyter lab` on a free port serving a copy of notebooks/; the kernel imports this
    checkout's minizero."""
    base = tmp_path_factory.mktemp("lab")
    root = base / "notebooks"
    # the .ipynb files without their jupytext twins (NN_name.py), which jupytext's contents manager
    # would otherwise read the cells from: what is checked here is what the .ipynb holds
    shutil.copytree(ROOT / "notebooks", root,
                    ignore=shutil.ignore_patterns("*.py[co]", "__pycache__", "[0-9][0-9]_*.py"))
    for name in (NOTEBOOK, STAGE_NOTEBOOK):       # run here: the small settings of test_notebooks
        path = root / f"{name}.ipynb"
        nbformat.write(with_tiny_settings(nbformat.read(path, as_version=4), name), path)
    settings = base / "settings" / "@jupyterlab"
    # no news pop-up
    # every cell in the DOM
    for extension, values in (("notebook-extension/tracker", {"windowingMode": "none"}),
                              ("apputils-extension/notification", {"fetchNews": "false"})):
        (settings / extension).parent.mkdir(parents=True, exist_ok=True)
        (settings / f"{extension}.jupyterlab-settings").write_text(json.dumps(values))
    token, port = secrets.token_hex(16), free_port()
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "JUPYTER_CONFIG_DIR": str(base / "config"), "JUPYTER_DATA_DIR": str(base / "data"),
           "JUPYTER_RUNTIME_DIR": str(base / "runtime")}
    log = base / "jupyterlab.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
             f"--port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
             f"--ServerApp.root_dir={root}", f"--LabApp.user_settings_dir={base / 'settings'}",
             f"--LabApp.workspaces_dir={base / 'workspaces'}"],
            cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"jupyter lab exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"jupyter lab did not answer within 60 s: {log.read_text()[-2000:]}"
                    )
                time.sleep(0.3)
        yield {"url": url, "token": token, "root": root, "log": log}
    finally:
        # Killed, not stopped: a polite stop waits ~5 s on kernels that are about to die anyway.
        # Each kernel leads its own process group (with any ranks it launched), so it is killed by
        # its own id.
        kernels = children(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for pid in kernels:
            with contextlib.suppress(OSError):
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------------------------------
# a notebook in JupyterLab
# --------------------------------------------------------------------------------------------------

def wait_for(condition, timeout: float, what: str, poll: float = 0.3):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def kernel_idle(driver) -> bool:
    return any(
        re.search(r"\|\s*Idle\b", e.text)
        for e in driver.find_elements(By.CSS_SELECTOR, ".jp-StatusBar-Widget")
    )


def open_notebook(driver, lab: dict, name: str) -> None:
    """Open `name`.ipynb in a fresh workspace; wait for its cells and for its kernel to idle."""
    driver.get(f"{lab['url']}/lab/tree/{name}.ipynb?token={lab['token']}&reset")
    wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel .jp-Cell"), 60,
             "the notebook")
    wait_for(lambda: kernel_idle(driver), 60, "the kernel to start")


RENDERED_MARKDOWN = """
const cells = Array.from(document.querySelectorAll('.jp-NotebookPanel .jp-MarkdownCell'));
return {cells: cells.length,
        rendered: cells.filter(c => c.querySelector('.jp-RenderedMarkdown')).length,
        pre: cells.flatMap(c => Array.from(c.querySelectorAll('.jp-RenderedMarkdown pre')))
                  .map(p => p.textContent.slice(0, 120)),
        dialogs: Array.from(document.querySelectorAll('.jp-Dialog'))
                      .map(d => d.textContent.slice(0, 300))};
"""


def check_markdown(driver, name: str, root: pathlib.Path) -> None:
    """The notebook opened without an error dialog; each of its markdown cells is rendered, and none
    holds a code block (no markdown here has a fenced one: a <pre> is prose indented by mistake)."""
    cells = json.loads((root / f"{name}.ipynb").read_text())["cells"]
    expected = sum(c["cell_type"] == "markdown" for c in cells)
    def rendered():
        state = driver.execute_script(RENDERED_MARKDOWN)
        return state["rendered"] == expected and state
    state = wait_for(rendered, 30, f"{name}'s {expected} markdown cells to render")
    assert not state["dialogs"], f"{name}: an error dialog: {state['dialogs']}"
    assert state["cells"] == expected, f"{name}: {state['cells']} markdown cells, {expected} in it"
    if state["pre"]:
        raise AssertionError(f"{name}: markdown rendered as a code block: {state['pre'][0]!r}")


def run_all_cells(driver, lab: dict, name: str) -> list:
    """Open `name`.ipynb, click Run → Run All Cells, wait until no cell is running; the code
    cells' elements."""
    open_notebook(driver, lab, name)
    menu = lambda selector, label: next(e for e in driver.find_elements(By.CSS_SELECTOR, selector)
                                        if e.text == label)
    menu(".lm-MenuBar-itemLabel", "Run").click()
    wait_for(lambda: [e for e in driver.find_elements(By.CSS_SELECTOR, ".lm-Menu-itemLabel")
                      if e.text == "Run All Cells"], 10, "the Run menu")
    menu(".lm-Menu-itemLabel", "Run All Cells").click()
    cells = driver.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel .jp-CodeCell")
    prompts = lambda: [c.find_element(By.CSS_SELECTOR, ".jp-InputPrompt").text for c in cells]
    # Run All stops at the first error: then some prompts stay "[ ]:" and the kernel goes idle
    wait_for(
        lambda: (
            "[*]:" not in prompts()
            and re.fullmatch(r"\[\d+\]:", prompts()[0])
            and kernel_idle(driver)
        ),
        RUN_TIMEOUT_S,
        f"{name} to run",
    )
    return cells


def widget_cells(name: str, root: pathlib.Path) -> list[int]:
    """Indices (among code cells) of the cells that build an ipywidgets control."""
    cells = [
        c
        for c in json.loads((root / f"{name}.ipynb").read_text())["cells"]
        if c["cell_type"] == "code"
    ]
    return [
        i
        for i, c in enumerate(cells)
        if re.search(
            r"\bipywidgets\b|\binteract(ive)?\(|\bplots\.\w+_widget\(", "".join(c["source"])
        )
    ]


def check_cells(cells: list, widgets: list[int]):
    """Every code cell ran without a traceback; each widget cell shows a rendered control."""
    prompts = [c.find_element(By.CSS_SELECTOR, ".jp-InputPrompt").text for c in cells]
    for i, cell in enumerate(cells):
        for out in cell.find_elements(
            By.CSS_SELECTOR, '[data-mime-type="application/vnd.jupyter.stderr"]'
        ):
            if ERROR_LINE.search(out.text):
                raise AssertionError(f"code cell {i} ({prompts[i]}) shows an error:\n{out.text}")
    if not all(re.fullmatch(r"\[\d+\]:", p) for p in prompts):
        raise AssertionError(f"cells left unexecuted: {prompts}")
    for i in widgets:
        outputs = cells[i].find_element(By.CSS_SELECTOR, ".jp-OutputArea")
        wait_for(
            lambda outputs=outputs: "Loading widget" not in outputs.text,
            20,
            f"code cell {i}'s widgets to load",
        )
        controls = [
            e for e in outputs.find_elements(By.CSS_SELECTOR, WIDGET_CONTROLS) if e.is_displayed()
        ]
        if "Error displaying widget" in outputs.text or not controls:
            raise AssertionError(
                f"code cell {i} builds a widget but shows no control: {outputs.text[:500]!r}"
            )


def change_a_control(driver, cell) -> str:
    """Pick another value in the cell's first dropdown (else nudge its first slider); the
    interactive output's new HTML, once it differs from before (it must be recomputed by the kernel,
    not only redrawn)."""
    view = lambda: cell.find_element(By.CSS_SELECTOR, ".widget-output").get_attribute("innerHTML")
    before = view()
    selects = cell.find_elements(By.CSS_SELECTOR, ".widget-dropdown select")
    if selects:
        choice = Select(selects[0])
        current = choice.first_selected_option.text
        choice.select_by_visible_text(next(o.text for o in choice.options if o.text != current))
    else:
        handle = cell.find_element(By.CSS_SELECTOR, ".widget-slider .noUi-handle")
        ActionChains(driver).click(handle).send_keys(Keys.ARROW_RIGHT).perform()
    return wait_for(lambda: view() != before and "jp-OutputArea-output" in view() and view(), 60,
                    "the widget's output to change")


@pytest.mark.parametrize("name", NOTEBOOK_NAMES)
def test_notebook_opens_and_its_markdown_renders_as_prose(browser, lab, evidence_dir, name):
    with screenshots_on_failure(browser, name, evidence_dir, {"jupyterlab.log": lab["log"]}):
        open_notebook(browser, lab, name)
        check_markdown(browser, name, lab["root"])


def test_notebook_runs_in_jupyterlab_and_its_widgets_work(browser, lab, evidence_dir):
    widgets = widget_cells(NOTEBOOK, lab["root"])
    assert widgets, f"{NOTEBOOK} has no ipywidgets cell: choose another NOTEBOOK"
    with screenshots_on_failure(browser, NOTEBOOK, evidence_dir, {"jupyterlab.log": lab["log"]}):
        cells = run_all_cells(browser, lab, NOTEBOOK)
        check_cells(cells, widgets)
        interactive = [
            i for i in widgets if cells[i].find_elements(By.CSS_SELECTOR, ".widget-output")
        ]
        assert interactive, f"no widget cell of {NOTEBOOK} has an output its controls recompute"
        change_a_control(browser, cells[interactive[0]])
        check_cells(cells, widgets)                      # and the recomputed output is no traceback


def test_a_stage_notebook_runs_in_jupyterlab(browser, lab, evidence_dir):
    """Its worker, notebooks/ranks.py, is imported by the launched ranks from the folder
    JupyterLab serves."""
    log = {"jupyterlab.log": lab["log"]}
    with screenshots_on_failure(browser, STAGE_NOTEBOOK, evidence_dir, log):
        cells = run_all_cells(browser, lab, STAGE_NOTEBOOK)
        check_cells(cells, widget_cells(STAGE_NOTEBOOK, lab["root"]))
        launched = [c for c in cells
                    if "minizero.launch(" in c.find_element(By.CSS_SELECTOR, ".jp-InputArea").text]
        output = launched and launched[0].find_element(By.CSS_SELECTOR, ".jp-OutputArea").text
        assert "rank 1:" in output, f"the worker cell's launch printed no rank 1: {output!r}"


BROKEN = [
    "from ipywidgets import IntSlider, interact",
    "def view(x):\n    raise RuntimeError(f'broken widget "
    "callback at x = {x}')\ninteract(view, x=IntSlider(3));",
    ("import ipywidgets, traitlets\n"                    # a model class the front end does not know
     "class Unknown(ipywidgets.DOMWidget):\n"
     "    _model_name = traitlets.Unicode('NoSuchModel').tag(sync=True)\n"
     "    _model_module = traitlets.Unicode('no-such-module').tag(sync=True)\n"
     "Unknown()"),
]


def test_broken_widget_cells_fail_the_checks(browser, lab, evidence_dir):
    """The same checks on a small notebook whose widget callback raises, and whose last widget's
    model class does not exist in the front end: each must fail them."""
    nb = {
        "cells": [
            {
                "cell_type": "code",
                "metadata": {},
                "source": s,
                "outputs": [],
                "execution_count": None,
            }
            for s in BROKEN
        ],
        "metadata": {
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (lab["root"] / "broken_widget.ipynb").write_text(json.dumps(nb))
    assert widget_cells("broken_widget", lab["root"]) == [0, 1, 2]
    with screenshots_on_failure(
        browser, "broken_widget", evidence_dir, {"jupyterlab.log": lab["log"]}
    ):
        cells = run_all_cells(browser, lab, "broken_widget")
        with pytest.raises(AssertionError, match="RuntimeError: broken widget callback at x = 3"):
            check_cells(cells[:2], [1])
        with pytest.raises(AssertionError, match="builds a widget but shows no control"):
            check_cells(cells[2:], [0])


def test_indented_markdown_fails_the_check(browser, lab, evidence_dir):
    """A markdown paragraph indented by 8 spaces (what dedent inside an indented f-string left)."""
    indented = "## One step\n\n        A model small enough to read every number: `Linear(2, 3)`."
    cells = [{"cell_type": "markdown", "metadata": {}, "source": "## A heading\n\nProse, as is."},
             {"cell_type": "markdown", "metadata": {}, "source": indented}]
    kernel = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb = {"cells": cells, "nbformat": 4, "nbformat_minor": 5, "metadata": {"kernelspec": kernel}}
    (lab["root"] / "indented_markdown.ipynb").write_text(json.dumps(nb))
    log = {"jupyterlab.log": lab["log"]}
    with screenshots_on_failure(browser, "indented_markdown", evidence_dir, log):
        open_notebook(browser, lab, "indented_markdown")
        with pytest.raises(AssertionError, match="a code block: ' *A model small enough"):
            check_markdown(browser, "indented_markdown", lab["root"])


# --------------------------------------------------------------------------------------------------
# the slide deck
# --------------------------------------------------------------------------------------------------

def _load_build():
    spec = importlib.util.spec_from_file_location("slides_build", ROOT / "slides" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def deck(tmp_path_factory) -> pathlib.Path:
    """slides/deck.md built by slides/build.py, with a placeholder PNG (a distinct size each)
    per figure."""
    import numpy as np
    from matplotlib.image import imsave

    figures = tmp_path_factory.mktemp("figures")
    names = re.findall(r"!\[[^\]]*\]\(figures/([^)]+)\)", (ROOT / "slides" / "deck.md").read_text())
    for k, name in enumerate(dict.fromkeys(names)):
        imsave(figures / name, np.full((60 + k, 120 + 2 * k, 3), 0.2 + 0.1 * (k % 8)))
    path = figures.parent / "deck.html"
    _load_build().build(str(ROOT / "slides" / "deck.md"), str(figures), str(path))
    return path


SLIDE_STATE = """
const current = document.querySelectorAll('.slide.current');
const slides = Array.from(document.querySelectorAll('.slide'));
return {current: slides.findIndex(s => s.classList.contains('current')),
        shown: current.length, number: document.querySelector('.number').textContent,
        images: current.length ? Array.from(current[0].querySelectorAll('img')).map(img => ({
            name: img.dataset.src, complete: img.complete, width: img.naturalWidth,
            shown: img.getBoundingClientRect().width > 0
                   && img.getBoundingClientRect().height > 0})) : []};
"""


def test_deck_navigates_with_the_keyboard_and_shows_every_figure(browser, deck, evidence_dir):
    with screenshots_on_failure(browser, "deck", evidence_dir):
        browser.get(deck.as_uri())
        n = browser.execute_script("return document.querySelectorAll('.slide').length")
        assert n >= 2
        keys, seen = [Keys.ARROW_RIGHT, Keys.SPACE, Keys.PAGE_DOWN], []
        for i in range(n):
            state = wait_for(
                lambda i=i: (s := browser.execute_script(SLIDE_STATE))["current"] == i and s,
                5,
                f"slide {i + 1}",
            )
            assert state["shown"] == 1 and state["number"] == f"{i + 1} / {n}", state
            for img in state["images"]:
                assert img["complete"] and img["width"] > 0 and img["shown"], (
                    f"slide {i + 1}: {img}"
                )
                seen.append(img["name"])
            ActionChains(browser).send_keys(keys[i % len(keys)]).perform()
        referenced = re.findall(
            r"!\[[^\]]*\]\(figures/([^)]+)\)", (ROOT / "slides" / "deck.md").read_text()
        )
        assert seen == referenced, "every figure of the deck, each on its slide, in order"
        # past the end: stays on the last
        assert browser.execute_script(SLIDE_STATE)["current"] == n - 1
        ActionChains(browser).send_keys(Keys.HOME).perform()
        assert wait_for(
            lambda: browser.execute_script(SLIDE_STATE)["number"] == f"1 / {n}", 5, "Home"
        )
        ActionChains(browser).send_keys(Keys.ARROW_LEFT).send_keys(Keys.END).perform()
        assert wait_for(
            lambda: browser.execute_script(SLIDE_STATE)["number"] == f"{n} / {n}", 5, "End"
        )
