"""The README and docs/: every command in `gencli --help` has a page, every relative link and anchor
resolves, the README stays short and its quick start keeps its two commands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"

# Commands documented on another command's page; every other command has docs/<command>.md.
SHARED_PAGES = {
    "similarity": "zeroshot.md",
    "reconstruct": "sample.md",
    "encode": "latents.md",
    "decode": "latents.md",
    "img2img": "txt2img.md",
    "replay": "txt2img.md",
    "models": "info.md",
    "fill-mask": "embed.md",
    "ner": "classify-text.md",
}

README_MAX_LINES = 300

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+).*?\1")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def commands() -> list[str]:
    """The command names `gencli --help` lists: the typer app's registered commands and groups."""
    import typer.main

    import gencli.cli

    group = typer.main.get_command(gencli.cli.app)
    return sorted(name for name, cmd in group.commands.items() if not getattr(cmd, "hidden", False))


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of a Markdown file outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower-cased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for _, line in prose_lines(path):
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            k = counts.get(base, 0)
            found.add(base if k == 0 else f"{base}-{k}")
            counts[base] = k + 1
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of the Markdown links and images outside code."""
    return [(n, m.group(1)) for n, line in prose_lines(path) for m in LINK.finditer(CODE_SPAN.sub("", line))]


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def test_every_command_has_a_docs_page_that_names_it():
    names = commands()
    assert "generate" in names and "txt2img" in names, names  # the app was read, not an empty group
    assert set(SHARED_PAGES) <= set(names), f"SHARED_PAGES names commands that no longer exist: {set(SHARED_PAGES) - set(names)}"
    readme = README.read_text(encoding="utf-8")
    problems = []
    for name in names:
        page = DOCS / SHARED_PAGES.get(name, f"{name}.md")
        if not page.is_file():
            problems.append(f"`gencli {name}`: no page {page.relative_to(ROOT)}")
        elif f"gencli {name}" not in page.read_text(encoding="utf-8"):
            problems.append(f"{page.relative_to(ROOT)} does not mention `gencli {name}`")
        if f"(docs/{page.name})" not in readme:
            problems.append(f"README.md does not link docs/{page.name} (the page of `gencli {name}`)")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    problems = []
    for n, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{n}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not problems, "\n".join(problems)


def test_links_and_anchors_are_found():
    """The checks above see what they check: the README links into docs/ with anchors."""
    targets = [t for _, t in links(README)]
    assert any(t.startswith("docs/") and "#" in t for t in targets), targets
    assert "command-contract" in anchors(DOCS / "architecture.md")
    assert slug("`gencli txt2img`, `gencli img2img` and `gencli replay`") == "gencli-txt2img-gencli-img2img-and-gencli-replay"
    assert slug("Device, dtype and threads") == "device-dtype-and-threads"


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail into docs/"


def test_quick_start_has_exactly_two_bash_blocks():
    text = README.read_text(encoding="utf-8")
    assert "\n## Quick start\n" in text
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```bash\n(.*?)^```", section, re.M | re.S)
    assert len(blocks) == 2, blocks
    assert all(b.strip() for b in blocks), blocks
