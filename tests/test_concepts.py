"""The concept map points at code that exists, and docs/concepts.md is what the generator makes now."""

from minizero.concepts import CONCEPTS, DOC, concept_rows, resolve, to_markdown


def test_every_symbol_exists_and_its_line_names_it():
    for row in concept_rows():
        path = DOC.parent.parent / row["path"]
        line = path.read_text().splitlines()[row["line"] - 1]
        name = row["symbol"].rsplit(".", 1)[1]
        assert name in line, f"{row['symbol']}: line {row['line']} of {row['path']} is {line!r}"
    assert len({c[1] for c in CONCEPTS}) == len(CONCEPTS)
    assert callable(resolve("minizero.zero3.Zero3._gather"))


def test_docs_page_is_up_to_date():
    assert DOC.read_text() == to_markdown(), \
        "docs/concepts.md is stale: run `python -m minizero.concepts --write` and commit it"
