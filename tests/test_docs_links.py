"""The README and the guide in docs/ stay true to the tree: no page can point at something
that is not there.

Every Markdown page (README.md and docs/**/*.md; the raw outputs in docs/bench/ are text,
not pages) is read as GitHub renders it:
- every link ``[text](target)``, image, reference definition ``[ref]: target`` and HTML
  ``href``/``src`` with a relative target must name a file or folder that exists, relative
  to the linking page; a ``#anchor`` must be a heading of the target page (GitHub's slugs);
  http(s) and mailto links are left alone (no network);
- every repository path a page names (``recovery/runtime/steps.py``, a backticked
  ``recovery/transport/`` or ``docs/bench/*.txt``) must exist;
- every ``[Note: ...]`` a page names must be in the code, and in the file the page says it
  is in (``[Note: x] in `path```);
- every backticked dotted name under our packages (``recovery.integrity.fingerprint.digest``)
  must import, and so must every ``from recovery import ...`` of the pages' Python blocks.
Pure file reading and imports: no Ray, no processes.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOTS = (
    "recovery",
    "parallelism",
    "simulations",
    "scripts",
    "tests",
    "examples",
    "configs",
    "docs",
)
PACKAGES = ("recovery", "parallelism", "simulations")

_FENCE = re.compile(r"^([ \t]*)(```|~~~)[^\n]*\n.*?^\1\2[ \t]*$", re.MULTILINE | re.DOTALL)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
_HTML_REF = re.compile(r"\b(?:href|src)=\"([^\"]+)\"")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
_REPO_PATH = re.compile(
    rf"(?<![\w/.-])((?:{'|'.join(ROOTS)})/[\w/.-]+\.(?:py|md|toml|sh|txt|json))(?![\w/])"
)
_BACKTICKED_PATH = re.compile(rf"`((?:{'|'.join(ROOTS)})/[^`\s]*)`")
_DOTTED = re.compile(rf"`((?:{'|'.join(PACKAGES)})(?:\.\w+)+)")
_NOTE = re.compile(r"\[Note: ([^\]]+)\]")
_NOTE_IN = re.compile(r"\[Note: ([^\]]+)\] in `([^`]+)`")
_EXTERNAL = ("http://", "https://", "mailto:")
_LINE_ANCHOR = re.compile(r"L\d+(-L\d+)?")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


PAGES = _pages()


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _blank(match: re.Match[str]) -> str:
    """A match replaced by spaces, its newlines kept, so offsets and line numbers hold."""
    return re.sub(r"[^\n]", " ", match.group(0))


def _prose(text: str) -> str:
    """The page with its code (fenced blocks and inline spans) blanked out."""
    return _INLINE_CODE.sub(_blank, _FENCE.sub(_blank, text))


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _flat(text: str) -> str:
    """Whitespace (and comment markers at line starts) collapsed: a note's name may be
    broken over lines of a paragraph or of a comment."""
    return re.sub(r"\s+", " ", re.sub(r"\n[ \t]*(?:#+|\*|//)?[ \t]*", " ", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (links reduced to their text, emphasis
    markers dropped), lowercased, punctuation dropped except '-' and '_', spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@functools.cache
def anchors(page: Path) -> frozenset[str]:
    """Every anchor a page has: its headings' slugs (a repeated one numbered -1, -2, ...,
    as GitHub does) and explicit HTML anchors."""
    text = page.read_text(encoding="utf-8")
    found: set[str] = set(_HTML_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for line in _FENCE.sub(_blank, text).splitlines():
        heading = _HEADING.match(line)
        if heading is None:
            continue
        base = slug(heading.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


@dataclass(frozen=True)
class Link:
    page: Path
    line: int
    target: str


def links(page: Path) -> list[Link]:
    """Every link target on a page, outside code."""
    text = page.read_text(encoding="utf-8")
    prose = _prose(text)
    found = [
        Link(page, _line(prose, m.start()), m.group(1))
        for pattern in (_LINK, _REF_DEF, _HTML_REF)
        for m in pattern.finditer(prose)
    ]
    return sorted(found, key=lambda link: link.line)


def link_problem(link: Link) -> str | None:
    """What is wrong with one link, or None."""
    target = link.target
    if not target:
        return "an empty link target"
    if target.startswith(_EXTERNAL):
        return None
    path, _, anchor = target.partition("#")
    resolved = (link.page.parent / path).resolve() if path else link.page
    if path.startswith("/") or not resolved.is_relative_to(ROOT):
        return f"{target}: outside the repository (use a path relative to the page)"
    if not resolved.exists():
        return f"{target}: no such file or folder ({resolved.relative_to(ROOT).as_posix()})"
    if not anchor:
        return None
    if resolved.suffix == ".md":
        if anchor not in anchors(resolved):
            return f"{target}: no heading with the anchor #{anchor} in {_name(resolved)}"
        return None
    if resolved.is_file() and _LINE_ANCHOR.fullmatch(anchor):
        return None
    return f"{target}: an anchor into a file that is not a Markdown page"


def _where(page: Path, text: str, offset: int) -> str:
    return f"{_name(page)}:{_line(text, offset)}"


def test_slug_follows_github() -> None:
    """The slugs GitHub gives the kinds of headings these pages have."""
    assert slug("Quick start") == "quick-start"
    assert slug("ZeRO-1") == "zero-1"
    assert slug("Beside torchrun + DDP and torchft") == "beside-torchrun--ddp-and-torchft"
    assert slug("Chaos from outside: `scripts/chaos.py`") == "chaos-from-outside-scriptschaospy"
    assert (
        slug("When there is no room: `timeouts.replace`") == "when-there-is-no-room-timeoutsreplace"
    )
    assert slug("Elastic: train on while a replacement is not there (`elastic=True`)") == (
        "elastic-train-on-while-a-replacement-is-not-there-elastictrue"
    )
    assert slug("[Linked](x.md) and **bold**") == "linked-and-bold"


def test_the_checker_catches_broken_links(tmp_path: Path) -> None:
    """A missing file, a missing anchor and a path out of the tree are each reported; a
    link inside code is not a link; external links are not followed."""
    page = ROOT / "docs" / "README.md"
    assert link_problem(Link(page, 1, "no-such-page.md")) is not None
    assert link_problem(Link(page, 1, "DESIGN.md#no-such-heading")) is not None
    assert link_problem(Link(page, 1, "../../etc/passwd")) is not None
    assert link_problem(Link(page, 1, "DESIGN.md#recovery-hierarchy")) is None
    assert link_problem(Link(page, 1, "https://example.invalid/x.md#y")) is None
    fake = tmp_path / "page.md"
    fake.write_text("```\n[a](missing.md)\n```\nand `[b](missing.md)`; [c](there.md#top)\n")
    assert [link.target for link in links(fake)] == ["there.md#top"]


def test_every_page_is_found() -> None:
    names = {_name(page) for page in PAGES}
    assert {"README.md", "docs/README.md", "docs/DESIGN.md", "docs/timeouts.md"} <= names
    assert not any(name.startswith("docs/bench/") for name in names)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_link_resolves(page: Path) -> None:
    problems = [
        f"{_name(link.page)}:{link.line}: {problem}"
        for link in links(page)
        if (problem := link_problem(link)) is not None
    ]
    assert not problems, "broken links:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_repository_path_exists(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    problems: dict[str, None] = {}  # in order, each once
    for m in _REPO_PATH.finditer(text):
        if not (ROOT / m.group(1)).is_file():
            problems[f"{_where(page, text, m.start())}: {m.group(1)} does not exist"] = None
    for m in _BACKTICKED_PATH.finditer(text):
        path = m.group(1).rstrip(".,;:")
        if "<" in path or "..." in path or _REPO_PATH.fullmatch(path):
            continue  # a placeholder (a run folder), or a file the loop above checked
        exists = any(ROOT.glob(path.rstrip("/"))) if "*" in path else (ROOT / path).exists()
        if not exists:
            problems[f"{_where(page, text, m.start())}: {path} does not exist"] = None
    assert not problems, "paths that are not in the tree:\n" + "\n".join(problems)


@functools.cache
def _code() -> dict[str, str]:
    """Every Python and shell file of the tree, flattened (see `_flat`)."""
    files = [
        p for root in ROOTS[:-1] for p in (ROOT / root).rglob("*") if p.suffix in (".py", ".sh")
    ]
    return {p.relative_to(ROOT).as_posix(): _flat(p.read_text(encoding="utf-8")) for p in files}


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_note_is_in_the_code(page: Path) -> None:
    """A `[Note: ...]` named by a page is a design note written in the code; where the page
    says which file holds it, that file does."""
    text = _flat(page.read_text(encoding="utf-8"))
    code = _code()
    everywhere = " ".join(code.values())
    problems = [
        f"{_name(page)}: [Note: {name}] is in no file of the tree"
        for name in sorted(set(_NOTE.findall(text)))
        if f"[Note: {name}]" not in everywhere
    ]
    problems += [
        f"{_name(page)}: [Note: {name}] is not in {path}"
        for name, path in sorted(set(_NOTE_IN.findall(text)))
        if f"[Note: {name}]" not in code.get(path, "")
    ]
    assert not problems, "\n".join(problems)


def _resolves(dotted: str) -> bool:
    """Whether ``a.b.c.D.e`` names a module or an attribute reached from one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_dotted_name_imports(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    problems = [
        f"{_where(page, text, m.start())}: {m.group(1)} does not import"
        for m in _DOTTED.finditer(text)
        if not _resolves(m.group(1))
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_import_of_the_examples_works(page: Path) -> None:
    """The pages' Python blocks parse, and what they import from our packages exists."""
    text = page.read_text(encoding="utf-8")
    problems = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        where = _where(page, text, m.start())
        try:
            tree = ast.parse(m.group(1))
        except SyntaxError as error:
            problems.append(f"{where}: the block does not parse: {error}")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.split(".")[0] not in PACKAGES:
                    continue
                problems += [
                    f"{where}: from {node.module} import {alias.name}: no such name"
                    for alias in node.names
                    if not _resolves(f"{node.module}.{alias.name}")
                ]
            elif isinstance(node, ast.Import):
                problems += [
                    f"{where}: import {alias.name}: no such module"
                    for alias in node.names
                    if alias.name.split(".")[0] in PACKAGES and not _resolves(alias.name)
                ]
    assert not problems, "\n".join(problems)
