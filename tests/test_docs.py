"""The documentation stands alone: README.md stays a newcomer's first page (short, the two
commands and a first request on its first screen), and every relative link in README.md,
docs/*.md and benchmarks/results/*/README.md resolves to a file inside the repository."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 260
FIRST_SCREEN = 60

# [text](target) or ![alt](target "title"); the text may hold `code` or one level of [brackets].
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def doc_files() -> list[Path]:
    files = [README, *sorted((ROOT / "docs").glob("*.md"))]
    files += sorted((ROOT / "benchmarks" / "results").glob("*/README.md"))
    files += sorted((ROOT / "benchmarks" / "results").glob("*/JOURNAL.md"))
    return files


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.lstrip()
        marker = stripped[:3]
        if marker in ("```", "~~~"):
            if fence is None:
                fence = marker
            elif fence == marker:
                fence = None
            continue
        if fence is None:
            out.append((number, line))
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every markdown link in the file's prose."""
    found = []
    for number, line in prose_lines(path):
        found += [(number, m.group(1)) for m in LINK.finditer(line)]
    return found


def relative_links(path: Path) -> list[tuple[int, str, Path, str]]:
    """(line, target, resolved file, anchor) of links to files (no scheme, not a bare #anchor)."""
    out = []
    for number, target in links(path):
        if SCHEME.match(target) or target.startswith("#"):
            continue
        file_part, _, anchor = target.partition("#")
        file_part = file_part.split("?", 1)[0]
        base = ROOT if file_part.startswith("/") else path.parent
        resolved = (base / file_part.lstrip("/")).resolve()
        out.append((number, target, resolved, anchor))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    for _, line in prose_lines(path):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
    found = set()
    for base, count in seen.items():
        found.add(base)
        found.update(f"{base}-{i}" for i in range(1, count))
    return found


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


DOCS = doc_files()


def test_the_pages_are_there():
    assert README.exists()
    assert len(DOCS) > 1, "no docs/*.md or benchmarks/results/*/README.md found"


@pytest.mark.parametrize("path", DOCS, ids=rel)
def test_relative_links_resolve(path):
    broken = [
        f"{rel(path)}:{number}: {target}"
        for number, target, resolved, _ in relative_links(path)
        if not resolved.exists()
    ]
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


@pytest.mark.parametrize("path", DOCS, ids=rel)
def test_no_link_leaves_the_repository(path):
    outside = [
        f"{rel(path)}:{number}: {target}"
        for number, target, resolved, _ in relative_links(path)
        if not resolved.is_relative_to(ROOT)
    ]
    assert not outside, "links outside the repository:\n" + "\n".join(outside)


@pytest.mark.parametrize("path", DOCS, ids=rel)
def test_anchors_name_headings(path):
    """A link to a heading of a markdown page (path.md#anchor or #anchor) names one it has."""
    missing = []
    for number, target in links(path):
        if SCHEME.match(target) or "#" not in target:
            continue
        file_part, _, anchor = target.partition("#")
        page = path if not file_part else (path.parent / file_part).resolve()
        if page.suffix == ".md" and page.exists() and anchor not in anchors(page):
            missing.append(f"{rel(path)}:{number}: {target}")
    assert not missing, "anchors with no such heading:\n" + "\n".join(missing)


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move sections to docs/"
    )


def test_readme_first_screen_has_the_two_commands_and_a_request():
    first = "\n".join(README.read_text(encoding="utf-8").splitlines()[:FIRST_SCREEN])
    for needle in ("make serve", "make test", "curl "):
        assert needle in first, f"{needle!r} is not in the first {FIRST_SCREEN} lines of README.md"


def test_every_page_is_linked_from_the_readme():
    linked = {resolved for _, _, resolved, _ in relative_links(README)}
    unlinked = [rel(p) for p in DOCS[1:] if p.resolve() not in linked]
    assert not unlinked, "pages the README does not link:\n" + "\n".join(unlinked)
