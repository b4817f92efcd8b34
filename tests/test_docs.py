"""The documentation holds together: the README stays a short front door that links every page of docs/, every
relative link resolves, every `make` target it names exists, and the project speaks only of itself (nothing of
how machines reach it, of tool calls or of transfer limits)."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_BYTES = 12_000
# the words the project must not use of itself; matched case-insensitively over raw bytes, as `grep -rniE` does
FORBIDDEN = re.compile(rb"lent|run\(carry|64 MiB", re.IGNORECASE)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
MAKE_TARGET = re.compile(r"\bmake\s+([A-Za-z0-9_*-]+)")
RULE = re.compile(r"^([A-Za-z0-9_-]+(?:[ \t]+[A-Za-z0-9_-]+)*)[ \t]*:(?!=)", re.MULTILINE)


def pages() -> list[Path]:
    """The Markdown pages under docs/ (top level), sorted."""
    return sorted(DOCS.glob("*.md"))


def relative_links(text: str) -> list[str]:
    """Link targets of Markdown links and images in `text` that point into the repository (no scheme, not a bare
    anchor), without their `#fragment`."""
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


def make_targets_named(text: str) -> set[str]:
    """Targets of `make <target>` inside code (fenced blocks and inline code spans) of a Markdown text."""
    spans = [m.group(0) for m in FENCE.finditer(text)] + INLINE_CODE.findall(FENCE.sub("", text))
    return {t for span in spans for t in MAKE_TARGET.findall(span)}


def makefile_targets() -> set[str]:
    """Rule names of the Makefile (`name:` or `a b:` at the start of a line; `VAR :=` assignments excluded)."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return {name for rule in RULE.findall(text) for name in rule.split()}


def test_readme_is_short() -> None:
    size = README.stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; the front door stays under {README_MAX_BYTES}"


def test_readme_keeps_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert "make demo" in text and "make test" in text


def test_readme_links_every_docs_page() -> None:
    linked = {(ROOT / t).resolve() for t in relative_links(README.read_text(encoding="utf-8"))}
    missing = [p.name for p in pages() if p.resolve() not in linked]
    assert pages(), "docs/ has no pages"
    assert not missing, f"README.md does not link {missing}"


@pytest.mark.parametrize("doc", [README, *pages()], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc: Path) -> None:
    broken = [t for t in relative_links(doc.read_text(encoding="utf-8")) if not (doc.parent / t).exists()]
    assert not broken, f"{doc.relative_to(ROOT)} links to missing files: {broken}"


def test_project_speaks_of_itself_only() -> None:
    files = [README] + [p for d in (DOCS, ROOT / "launch", ROOT / "checks") for p in sorted(d.rglob("*"))
                        if p.is_file() and "__pycache__" not in p.parts]
    hits = []
    for path in files:
        for n, line in enumerate(path.read_bytes().splitlines(), 1):
            if FORBIDDEN.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.decode('utf-8', 'replace').strip()[:100]}")
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("doc", [README, *pages()], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_make_targets_exist(doc: Path) -> None:
    targets = makefile_targets()
    named = make_targets_named(doc.read_text(encoding="utf-8"))
    unknown = sorted(t for t in named if not fnmatch.filter(targets, t))
    assert not unknown, f"{doc.relative_to(ROOT)} names make targets the Makefile lacks: {unknown}"


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """The helpers find what they are for: a broken link, an unknown target, a forbidden word."""
    doc = tmp_path / "page.md"
    doc.write_text("see [x](missing.md) and [web](https://example.org) and [top](#top)\n"
                   "```\nmake no-such-target\n```\nand `make demo`; we make progress\n", encoding="utf-8")
    assert relative_links(doc.read_text(encoding="utf-8")) == ["missing.md"]
    assert make_targets_named(doc.read_text(encoding="utf-8")) == {"no-such-target", "demo"}
    assert "demo" in makefile_targets() and "test" in makefile_targets() and "VENV" not in makefile_targets()
    assert FORBIDDEN.search(b"an Excellent result") and not FORBIDDEN.search(b"a quiet machine")


def _listed(index: Path, names: list[str]) -> list[str]:
    """The names that the package index's docstring (`index`, an __init__.py) does not mention."""
    text = index.read_text(encoding="utf-8")
    return [n for n in names if n not in text]


def test_bench_and_checks_indexes_list_every_module() -> None:
    """bench/__init__.py and checks/__init__.py name every module and folder beside them, and checks never import the
    benchmarks (a GPU node runs the checks from a checkout that needs nothing of bench/)."""
    bench = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem not in ("__init__", "common"))
    bench += sorted(p.name for p in (ROOT / "bench").iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert not _listed(ROOT / "bench" / "__init__.py", bench), "bench/__init__.py does not list them"
    checks = sorted(p.name for p in (ROOT / "checks").glob("*.py") if p.stem != "__init__")
    checks += sorted(p.name for p in (ROOT / "checks").iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert not _listed(ROOT / "checks" / "__init__.py", checks), "checks/__init__.py does not list them"
    importing = [p.relative_to(ROOT).as_posix() for p in (ROOT / "checks").rglob("*.py")
                 if re.search(r"^\s*(from|import) bench\b", p.read_text(encoding="utf-8"), re.M)]
    assert not importing, f"{importing} import bench/"
