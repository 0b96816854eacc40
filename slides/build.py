"""Build slides/deck.md into one self-contained HTML file: open it in any browser, no
network needed.

    python slides/make_figures.py          # measure and draw -> slides/build/figures/*.png
    python slides/build.py                 # -> slides/build/deck.html (figures inlined as base64)
    python slides/build.py --figures DIR --out FILE

Keys: -> / space / PageDown next, <- / PageUp previous, Home / End, the URL's #N is the slide shown.
Printing (or "save as PDF") puts one slide on each page.

The deck's Markdown is a small subset, converted here so the deck needs nothing but Python: slides
are separated by a line `---`; `#`/`##` headings, paragraphs, `-` lists (indent two spaces to
nest), fenced code blocks, `| a | b |` tables, images `![caption](figures/NAME.png)`, and inline
**bold**, *italic* and `code`. Everything else is text (HTML-escaped): the deck cannot load
anything from outside.
"""

from __future__ import annotations

import argparse
import base64
import html
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
IMAGE = re.compile(r"^!\[(?P<alt>[^\]]*)\]\((?P<src>[^)\s]+)\)$")

CSS = """
html, body { margin: 0; height: 100%; background: #222; font-family: system-ui, sans-serif; }
.slide { display: none; box-sizing: border-box; width: 100vw; height: 100vh; padding: 4vh 6vw;
         background: #fdfdfb; color: #1d1d1d; font-size: 2.6vh; line-height: 1.4; overflow: hidden; }
.slide.current { display: flex; flex-direction: column; }
.slide h1 { font-size: 6vh; margin: auto 0 1vh; color: #173f5f; }
.slide h2 { font-size: 4.4vh; margin: 0 0 2vh; color: #173f5f; border-bottom: 0.3vh solid #3caea3; }
.slide ul { margin: 0.5vh 0; } .slide li { margin: 0.6vh 0; }
.slide code { font-family: ui-monospace, monospace; background: #eef; padding: 0 0.3em; border-radius: 3px; }
.slide pre { background: #f1f1f8; padding: 1.2vh 1.5vw; font-size: 2.1vh; overflow: hidden; }
.slide pre code { background: none; padding: 0; }
.slide table { border-collapse: collapse; margin: 1vh 0; } .slide td, .slide th { border: 1px solid #bbb;
         padding: 0.6vh 1vw; } .slide th { background: #e8f1f4; }
.slide figure { margin: 0.5vh auto; text-align: center; flex: 1; min-height: 0; display: flex;
         flex-direction: column; align-items: center; }
.slide figure img { max-width: 100%; max-height: 100%; min-height: 0; object-fit: contain; flex: 1; }
.slide figcaption { font-size: 1.9vh; color: #555; }
.number { position: fixed; right: 2vw; bottom: 1.5vh; font-size: 1.8vh; color: #888; }
@media print {
  .slide, .slide.current { display: flex; flex-direction: column; page-break-after: always; }
  .number { display: none; }
}
"""

JS = """
const slides = document.querySelectorAll('.slide');
const number = document.querySelector('.number');
let current = 0;
function show(i) {
  current = Math.max(0, Math.min(slides.length - 1, i));
  slides.forEach((s, j) => s.classList.toggle('current', j === current));
  number.textContent = (current + 1) + ' / ' + slides.length;
  history.replaceState(null, '', '#' + (current + 1));
}
document.addEventListener('keydown', (e) => {
  if (['ArrowRight', 'ArrowDown', 'PageDown', ' '].includes(e.key)) { show(current + 1); e.preventDefault(); }
  if (['ArrowLeft', 'ArrowUp', 'PageUp'].includes(e.key)) { show(current - 1); e.preventDefault(); }
  if (e.key === 'Home') show(0);
  if (e.key === 'End') show(slides.length - 1);
});
document.addEventListener('click', (e) => show(current + (e.clientX > window.innerWidth / 3 ? 1 : -1)));
show((parseInt(location.hash.slice(1)) || 1) - 1);
"""


class DeckError(Exception):
    """A missing figure or malformed deck: reported in one line."""


def inline(text: str) -> str:
    """Escape, then `code`, **bold**, *italic* (code first, so its contents stay literal)."""
    parts = re.split(r"(`[^`]+`)", text)
    out = []
    for part in parts:
        if part.startswith("`") and part.endswith("`") and len(part) > 1:
            out.append(f"<code>{html.escape(part[1:-1])}</code>")
            continue
        s = html.escape(part)
        s = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", s)
        s = re.sub(r"(?<![\w*])\*(?!\s)(.+?)(?<!\s)\*(?![\w*])", r"<em>\1</em>", s)
        out.append(s)
    return "".join(out)


def image(alt: str, src: str, figures: str) -> str:
    """An <img> with the PNG inlined as a data: URL; figures/NAME.png is looked up in `figures`."""
    if re.match(r"^[a-z]+:", src):
        raise DeckError(f"image {src!r}: only local figures/NAME.png files, nothing from a URL")
    path = os.path.join(figures, os.path.basename(src))
    if not os.path.exists(path):
        raise DeckError(f"figure {path} is missing: run python slides/make_figures.py first")
    with open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode("ascii")
    caption = f"<figcaption>{inline(alt)}</figcaption>" if alt else ""
    return (
        f'<figure><img alt="{html.escape(alt)}" data-src="{html.escape(os.path.basename(src))}" '
        f'src="data:image/png;base64,{data}">{caption}</figure>'
    )


def slide_html(markdown: str, figures: str) -> str:
    lines, out, i = markdown.strip("\n").split("\n"), [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):                         # fenced code block, verbatim
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                raise DeckError(f"unclosed ``` block: {line!r}")
            out.append("<pre><code>" + html.escape("\n".join(lines[i + 1:end])) + "</code></pre>")
            i = end + 1
        elif m := re.match(r"^(#{1,2}) (.*)$", line):
            level = len(m.group(1))
            out.append(f"<h{level}>{inline(m.group(2))}</h{level}>")
            i += 1
        elif m := IMAGE.match(line.strip()):
            out.append(image(m.group("alt"), m.group("src"), figures))
            i += 1
        elif line.lstrip().startswith("- "):
            block = []
            while i < len(lines) and lines[i].lstrip().startswith("- "):
                block.append(lines[i])
                i += 1
            out.append(bullets(block))
        elif line.startswith("|"):
            block = []
            while i < len(lines) and lines[i].startswith("|"):
                block.append(lines[i])
                i += 1
            out.append(table(block))
        elif not line.strip():
            i += 1
        else:                                              # a paragraph: consecutive plain lines
            block = []
            while (
                i < len(lines)
                and lines[i].strip()
                and not re.match(r"^(#|- |\||```|!\[)", lines[i].lstrip())
            ):
                block.append(lines[i].strip())
                i += 1
            out.append(f"<p>{inline(' '.join(block))}</p>")
    return "\n".join(out)


def bullets(block: list[str]) -> str:
    """Nested lists from two-space indentation."""
    out, depth = [], -1
    for line in block:
        level = (len(line) - len(line.lstrip())) // 2
        while depth < level:
            out.append("<ul>")
            depth += 1
        while depth > level:
            out.append("</ul>")
            depth -= 1
        out.append(f"<li>{inline(line.lstrip()[2:])}</li>")
    out += ["</ul>"] * (depth + 1)
    return "".join(out)


def table(block: list[str]) -> str:
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in block]
    rows = [r for r in rows if not all(re.fullmatch(r":?-{3,}:?", c) for c in r)]   # the |---| line
    head, body = rows[0], rows[1:]
    cells = lambda r, tag: "".join(f"<{tag}>{inline(c)}</{tag}>" for c in r)    # noqa: E731
    return ("<table><tr>" + cells(head, "th") + "</tr>"
            + "".join("<tr>" + cells(r, "td") + "</tr>" for r in body) + "</table>")


def build(deck_path: str, figures: str, out_path: str) -> int:
    """Write the HTML deck; returns the number of slides."""
    with open(deck_path, encoding="utf-8") as f:
        text = f.read()
    sources = [s for s in re.split(r"^---\s*$", text, flags=re.M) if s.strip()]
    title = re.search(r"^# (.*)$", text, flags=re.M)
    body = "\n".join(f'<section class="slide" id="s{i + 1}">\n{slide_html(s, figures)}\n</section>'
                     for i, s in enumerate(sources))
    page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
            f"<title>{html.escape(title.group(1) if title else 'deck')}</title>\n"
            f"<style>{CSS}</style></head>\n<body>\n{body}\n<div class=\"number\"></div>\n"
            f"<script>{JS}</script>\n</body></html>\n")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(page)
    return len(sources)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deck", default=os.path.join(HERE, "deck.md"))
    ap.add_argument("--figures", default=os.path.join(HERE, "build", "figures"))
    ap.add_argument("--out", default=os.path.join(HERE, "build", "deck.html"))
    args = ap.parse_args(argv)
    try:
        n = build(args.deck, args.figures, args.out)
    except (DeckError, OSError) as e:
        print(f"slides/build.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({n} slides)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
