"""The facts are in the repository: every pointer into docs/ resolves, every vLLM citation holds.

- A `docs/<file>.md` or `docs/<file>.md#<section>` anywhere in the checkout, and every relative
  link of a Markdown file, names a file that exists and, with a section of a Markdown file, one
  of its headings (GitHub's anchor of the heading).
- No file points to notes kept outside the repository.
- Every `vllm/<path>.py:<first>-<last>` cited in docs/ is a file of the vLLM 0.33.0 wheel that
  has those lines, and the lines hold an identifier the same table row names in backticks.
"""

from __future__ import annotations

import re
import subprocess
import zipfile
from collections import Counter
from pathlib import Path

import pytest

from harness.wheel_cache import vllm_wheel

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"

DOC_REF = re.compile(r"(?<![\w./-])docs/([\w.-]+\.md)(?:#([\w-]+))?")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
# The team notes that once lived beside the checkout (written so this file does not match).
OUTSIDE_NOTES = re.compile(r"\b(?:FACTS|DESIGN|PERF|CI)[.]md\b|[.][.][/]shared\b")
CITATION = re.compile(r"`(vllm/[\w/.-]+\.py):(\d+)(?:-(\d+))?`")
BACKTICKED = re.compile(r"`([^`]+)`")
IDENTIFIER = re.compile(r"[A-Za-z_][\w.]*(?:\(\))?")


def repo_files() -> list[Path]:
    """Tracked files and new ones git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    paths = (REPO / name for name in out.decode().split("\0") if name)
    return sorted(p for p in paths if p.is_file())


def text_of(path: Path) -> str | None:
    data = path.read_bytes()
    return None if b"\0" in data else data.decode("utf-8", errors="replace")


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    found: set[str] = set()
    seen: Counter[str] = Counter()
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = anchor(match.group(1))
            found.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
            seen[slug] += 1
    return found


def references(path: Path, text: str) -> list[tuple[int, Path, str | None]]:
    """(line, target, section) of each pointer into docs/, and each relative Markdown link."""
    refs = []
    markdown = path.suffix == ".md"
    for number, line in enumerate(text.splitlines(), 1):
        for match in DOC_REF.finditer(line):
            refs.append((number, DOCS / match.group(1), match.group(2)))
        if not markdown:
            continue
        for match in MD_LINK.finditer(line):
            target = match.group(1)
            if "://" in target or target.startswith("mailto:"):
                continue
            name, _, section = target.partition("#")
            refs.append((number, (path.parent / name).resolve() if name else path, section or None))
    return refs


def unresolved(path: Path, text: str) -> list[str]:
    problems = []
    for number, target, section in references(path, text):
        where = f"{path.relative_to(REPO)}:{number}"
        if not target.is_relative_to(REPO):
            problems.append(f"{where}: {target} is outside the checkout")
        elif not target.exists():
            problems.append(f"{where}: {target.relative_to(REPO)} does not exist")
        elif section and target.suffix == ".md" and section not in anchors(target.read_text()):
            problems.append(
                f"{where}: {target.relative_to(REPO)} has no section #{section} "
                f"(its sections: {', '.join(sorted(anchors(target.read_text())))})"
            )
    return problems


@pytest.fixture(scope="module")
def texts() -> dict[Path, str]:
    found = {p: text_of(p) for p in repo_files()}
    return {p: t for p, t in found.items() if t is not None}


def test_every_pointer_resolves(texts):
    into_docs = [
        target
        for path, text in texts.items()
        if path.parent != DOCS
        for _, target, _ in references(path, text)
        if target.parent == DOCS
    ]
    assert len(into_docs) >= 10, f"only {len(into_docs)} pointers into docs/: were they lost?"
    problems = [p for path, text in texts.items() for p in unresolved(path, text)]
    assert not problems, "\n".join(problems)


def test_a_broken_pointer_is_found():
    d = "docs/"  # apart from the names, so this file holds no broken pointer itself
    text = f"see {d}model.md#row-ids and {d}model.md#no-such-section and {d}nothing.md\n"
    problems = unresolved(REPO / "roles" / "example.yml", text)
    assert len(problems) == 2
    assert "no section #no-such-section" in problems[0] and "nothing.md" in problems[1]


def test_anchors_follow_github():
    markdown = "# vLLM 0.33.0: the internals\n## The V2 model runner\n```\n# not a heading\n```\n"
    assert anchors(markdown + "## The V2 model runner\n") == {
        "vllm-0330-the-internals",
        "the-v2-model-runner",
        "the-v2-model-runner-1",
    }


def test_no_pointer_leaves_the_repository(texts):
    hits = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path, text in texts.items()
        for number, line in enumerate(text.splitlines(), 1)
        if OUTSIDE_NOTES.search(line)
    ]
    assert not hits, "notes outside the repository are cited; cite docs/ instead:\n" + "\n".join(
        hits
    )


def test_the_index_lists_every_doc():
    index = (DOCS / "README.md").read_text()
    linked = {DOCS / name for name in re.findall(r"\]\(([\w.-]+\.md)\)", index)}
    assert set(DOCS.glob("*.md")) - {DOCS / "README.md"} == linked


@pytest.fixture(scope="module")
def wheel() -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(vllm_wheel())
    except RuntimeError as exc:
        pytest.skip(f"the vllm==0.33.0 wheel is not available (no PyPI access?): {exc}")


def test_vllm_citations_hold_in_the_wheel(wheel):
    members = set(wheel.namelist())
    checked, problems = 0, []
    for doc in sorted(DOCS.glob("*.md")):
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            citations = list(CITATION.finditer(line))
            names = {
                token.removesuffix("()").rsplit(".", 1)[-1]
                for token in BACKTICKED.findall(line)
                if IDENTIFIER.fullmatch(token)
            }
            for cite in citations:
                where = f"{doc.relative_to(REPO)}:{number}: {cite.group(0)}"
                member, first = cite.group(1), int(cite.group(2))
                last = int(cite.group(3) or first)
                if member not in members:
                    problems.append(f"{where}: no such file in {Path(wheel.filename).name}")
                    continue
                lines = wheel.read(member).decode().splitlines()
                if not 1 <= first <= last <= len(lines):
                    problems.append(f"{where}: the file has {len(lines)} lines")
                    continue
                cited = "\n".join(lines[first - 1 : last])
                if not any(re.search(rf"\b{re.escape(n)}\b", cited) for n in names):
                    problems.append(f"{where}: none of {sorted(names)} is in those lines")
                checked += 1
    assert not problems, "\n".join(problems)
    assert checked >= 50, f"only {checked} citations checked: were they rewritten?"
