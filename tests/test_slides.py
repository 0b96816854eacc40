"""slides/: the figures are measured and drawn, the deck builds offline into one HTML file with
every figure inlined and nothing loaded from a URL. Run: python -m pytest tests/test_slides.py -q"""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest

SLIDES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "slides")


def _load(name):
    spec = importlib.util.spec_from_file_location(
        f"slides_{name}", os.path.join(SLIDES, f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build, make_figures = _load("build"), _load("make_figures")


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    out = tmp_path_factory.mktemp("figures")
    assert make_figures.main(["--small", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def deck(figures, tmp_path_factory):
    path = tmp_path_factory.mktemp("deck") / "deck.html"
    n = build.build(os.path.join(SLIDES, "deck.md"), str(figures), str(path))
    return n, path.read_text()


def referenced_figures():
    with open(os.path.join(SLIDES, "deck.md")) as f:
        return re.findall(r"!\[[^\]]*\]\(figures/([^)]+)\)", f.read())


def test_every_figure_is_drawn(figures):
    for name in make_figures.FIGURES:
        with open(figures / f"{name}.png", "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name


def test_measurements_show_zero(figures):
    data = json.loads((figures / "measurements.json").read_text())
    ddp, stage3 = (
        {n: p for n, ps in data["probes"].items() for p in ps if p["variant"] == v}
        for v in ("DDP", "stage 3")
    )
    assert stage3["2"]["memory"]["params"] < ddp["2"]["memory"]["params"]       # parameters sharded
    ratio = data["scale"]["stage3_over_ddp"]
    assert ratio["2"] > 1.2 * ratio["1"]                   # stage 3 fits more with every rank added


def test_bench_pairs_every_stage_with_a_peer(figures):
    pairs = json.loads((figures / "measurements.json").read_text())["bench"]["pairs"]
    assert {p["variant"] for p in pairs} >= {"0", "1", "2", "3"}
    assert all(p["ratio"] > 0 and p["max_param_diff"] < 1e-5 for p in pairs)


def test_deck_is_self_contained(deck):
    n, html = deck
    assert 15 <= n <= 25
    names = referenced_figures()
    assert set(names) <= {f"{f}.png" for f in make_figures.FIGURES} and len(names) >= 6
    for name in names:
        assert re.search(
            rf'data-src="{re.escape(name)}" src="data:image/png;base64,[A-Za-z0-9+/=]{{100,}}"',
            html,
        )
    assert "http://" not in html and "https://" not in html
    assert not re.search(r"""\s(src|href)=["'](?!data:|#)""", html)        # nothing external at all
    assert "<script>" in html and "keydown" in html


def test_missing_figure_is_an_error(tmp_path):
    with pytest.raises(build.DeckError, match="missing"):
        build.build(os.path.join(SLIDES, "deck.md"), str(tmp_path), str(tmp_path / "deck.html"))


def test_markdown_subset():
    html = build.slide_html(
        "## T\n- a *b* **c** `<d>`\n  - nested\n\n| x | y |\n|---|---|\n| 1 | 2 |", "."
    )
    assert "<h2>T</h2>" in html and "<em>b</em>" in html and "<strong>c</strong>" in html
    assert "<code>&lt;d&gt;</code>" in html and html.count("<ul>") == 2 and "<td>2</td>" in html
