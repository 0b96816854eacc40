"""The concept map points at code that exists, and docs/concepts.md is what the generator
makes now."""

import pytest

from minizero.lab.concepts import (
    CONCEPTS, DOC, ROOT, concept_rows, main, resolve, to_markdown,
)

REGENERATE = "run `python -m minizero.lab.concepts --write` and commit docs/concepts.md"


@pytest.mark.parametrize("symbol", sorted({c[2] for c in CONCEPTS}))
def test_every_symbol_exists(symbol):
    try:
        resolve(symbol)
    except (ImportError, AttributeError) as e:
        pytest.fail(
            f"minizero/lab/concepts.py names {symbol}, which "
            f"no longer exists ({e}): point CONCEPTS at "
            f"its new name, then {REGENERATE}"
        )


def test_every_line_names_its_symbol():
    rows = concept_rows()
    assert len(rows) == len(CONCEPTS) == len({c[1] for c in CONCEPTS}), "each term appears once"
    assert {r["source"] for r in rows} == {"DeepSpeed", "FairScale", "PyTorch"}
    for row in rows:
        line = (ROOT / row["path"]).read_text().splitlines()[row["line"] - 1]
        name = row["symbol"].rsplit(".", 1)[1]
        assert name in line, f"{row['symbol']}: line {row['line']} of {row['path']} is {line!r}"
    zero2 = next(r for r in rows if r["symbol"] == "minizero.zero2.Zero2.reduce_scatter_grads")
    assert f"(../minizero/zero2.py#L{zero2['line']})" in to_markdown()


def test_docs_page_is_up_to_date():
    assert DOC.read_text() == to_markdown(), (
        f"docs/concepts.md is stale (code moved?): {REGENERATE}"
    )


def test_cli_prints_the_table_and_rejects_other_options(capsys):
    assert main([]) == 0 and capsys.readouterr().out == to_markdown()
    assert main(["--bogus"]) == 2 and capsys.readouterr().err.count("\n") == 1
