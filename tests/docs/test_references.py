"""The facts are in the repository: every pointer into docs/ resolves, every citation of source
lines in README.md and docs/*.md holds for the claim it supports.

- A `docs/<file>.md` or `docs/<file>.md#<section>` anywhere in the checkout, and every relative
  link of a Markdown file, names a file that exists and, with a section of a Markdown file, one
  of its headings (GitHub's anchor of the heading).
- No file points to notes kept outside the repository.
- Every citation is read. A citation is `path:N`, `path:N-M` or a list (`path:189 and 227`,
  `path:1-5, 9-12`), backticked in a table's source cell or bare in prose; `line N` or
  `lines N-M` (or a list) cites the file its paragraph or row cited last. Anything else that
  looks like one (`file.py: 12` broken over two lines, `line 7` after no file, a bare `9-12`
  beside citations) fails the test: it would be checked by nothing.
- A path is a file of the checkout, else of the vLLM wheel of the release its page is about
  (RELEASE_OF: docs/vllm-0.33.md reads 0.33.0; every other page, docs/vllm-0.34.md included,
  the default patch profile's release, `wheel_cache.VLLM_VERSION`): under vllm/, relative to
  the `vllm` package (as docs/tensor-parallel.md writes them), or by a bare file name the wheel
  has once. The file has the cited lines.
- The cited lines hold the claim's own words. The claim is, in a table, the row's cells other
  than its citations; in prose, the words of the citation's sentence between the previous
  citation of that sentence (or its start) and this one, or the whole sentence where those
  words name no code. Its words are its backticked code (a dotted name by its last part, a flag
  also with underscores) and its quoted phrases; a claim with neither has its code-like bare
  words (snake_case, CamelCase, dotted names, flags, acronyms such as ETP or NVFP4). One of them
  must be in the cited lines as a whole word (an acronym also as a part of a snake_case name),
  or name a function or class whose body holds the first cited line (`GroupCoordinator.all_reduce`
  returns early: lines of all_reduce's body). A citation that drifted to other code names none
  of its claim's words there; a claim that names no code fails too: it cannot be checked.
"""

from __future__ import annotations

import re
import subprocess
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import wheel_cache

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"

DOC_REF = re.compile(r"(?<![\w./-])docs/([\w.-]+\.md)(?:#([\w-]+))?")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
# The team notes that once lived beside the checkout (written so this file does not match).
OUTSIDE_NOTES = re.compile(r"\b(?:FACTS|DESIGN|PERF|CI)[.]md\b|[.][.][/]shared\b")
BACKTICKED = re.compile(r"`([^`]+)`")
# The vLLM release whose wheel a page's citations are read against, where it is not the default
# patch profile's (`wheel_cache.VLLM_VERSION`): a page about one release cites that release.
RELEASE_OF = {"docs/vllm-0.33.md": "0.33.0"}


def release_of(page: str) -> str:
    """The vLLM release a page (its path in the checkout) cites."""
    return RELEASE_OF.get(page, wheel_cache.VLLM_VERSION)


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


# Citations of source lines and their claims (the module's docstring has the rule).
EXTENSIONS = r"(?:py|pyi|md|ya?ml|j2|sh|toml|cfg|txt|json|cu|cuh|cpp|c|h)"
RANGES = r"\d+(?:-\d+)?(?:(?:,\s*|\s+and\s+)\d+(?:-\d+)?)*"
FILE_CITATION = re.compile(
    rf"(?<![\w/.-])(?P<path>[\w.-]+(?:/[\w.-]+)*\.{EXTENSIONS}):(?P<ranges>{RANGES})(?!\w|\.\d)"
)
LINE_CITATION = re.compile(rf"\blines?\s+(?P<ranges>{RANGES})(?!\w|\.\d)")
# Anything that looks like a citation; each must lie inside one the two patterns above parse.
CITATION_LIKE = re.compile(rf"[\w/.-]+\.{EXTENSIONS}\s*:\s*\d|\blines?\s*\d|#L\d")
# A bare range of numbers beside citations (`file.py:1-5 for A, 9-12 for B`) looks like one too.
BARE_RANGE = re.compile(r"(?<![\w.:/-])\d+-\d+(?![\w-])")
LIST_ITEM = re.compile(r"\s*(?:[-*+]|\d+[.)])\s")
SENTENCE_END = re.compile(r"(?<=[.!?])\**\s+(?=[A-Z`*(\[])")
QUOTED = re.compile(r'"([^"]{3,})"')
DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
CODE_WORD = re.compile(
    r"--[a-z][\w-]*"  # a flag
    r"|(?<![\w.])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+"  # a dotted name
    r"|\b\w*_\w+\b"  # snake_case
    r"|\b[a-z]+[A-Z]\w*\b|\b[A-Z][a-z0-9]+[A-Z]\w*\b"  # camelCase, CamelCase
    r"|\b[A-Z][A-Z0-9]+\b"  # an acronym
)
DEFINITION = re.compile(r"\s*(?:async\s+)?(?:def|class)\s+(\w+)")
# Words of code too common to tell one place from another.
COMMON_CODE = {"self", "cls", "not", "and", "or", "in", "is", "if", "None", "True", "False"}


@dataclass(frozen=True)
class Block:
    """A table row, or a paragraph or list item joined into one line."""

    starts: tuple[tuple[int, int], ...]  # (offset in text, line of the page) of each line
    text: str
    row: bool

    def line_at(self, offset: int) -> int:
        return max(line for start, line in self.starts if start <= offset)


@dataclass(frozen=True)
class Citation:
    where: str  # page:line
    path: str
    first: int
    last: int
    terms: frozenset[str]  # the claim's words, any of which the cited lines must hold
    claim: str


def blocks(markdown: str) -> list[Block]:
    """The page's table rows, paragraphs and list items; headings and fenced code are left out."""
    found: list[Block] = []
    lines: list[tuple[int, str]] = []

    def close() -> None:
        if lines:
            offsets = [0]
            for _, text in lines[:-1]:
                offsets.append(offsets[-1] + len(text) + 1)
            starts = tuple((o, n) for o, (n, _) in zip(offsets, lines, strict=True))
            found.append(Block(starts, " ".join(text for _, text in lines), False))
            lines.clear()

    fenced = False
    for number, line in enumerate(markdown.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            close()
            fenced = not fenced
        elif fenced:
            continue
        elif stripped.startswith("|"):
            close()
            found.append(Block(((0, number),), stripped, True))
        elif not stripped or stripped.startswith("#"):
            close()
        else:
            if LIST_ITEM.match(line):
                close()
            lines.append((number, stripped))
    close()
    return found


def ranges(text: str) -> list[tuple[int, int]]:
    """`189 and 227`, `1-5, 9-12`: (first, last) of each."""
    found = []
    for part in re.split(r",\s*|\s+and\s+", text):
        first, _, last = part.partition("-")
        found.append((int(first), int(last or first)))
    return found


def terms_of(claim: str) -> frozenset[str]:
    """The words of a claim its cited lines must show one of (the rule above)."""
    found: set[str] = set(QUOTED.findall(claim))
    for code in BACKTICKED.findall(claim):
        if code.startswith("--"):
            flag = code.split("=")[0].split()[0][2:]
            found |= {flag, flag.replace("-", "_")}
        elif "/" not in code:  # a path is the citation's business, not the claim's
            found |= {name.rsplit(".", 1)[-1] for name in DOTTED_NAME.findall(code)}
    if not found:
        for word in CODE_WORD.findall(BACKTICKED.sub(" ", claim)):
            if word.startswith("--"):
                found |= {word[2:], word[2:].replace("-", "_")}
            else:
                found.add(word.rsplit(".", 1)[-1])
    return frozenset(w for w in found if len(w) > 1 and w not in COMMON_CODE)


def holds(term: str, text: str) -> bool:
    """`term` is in `text` as a whole word; an acronym also as a part of a snake_case name."""
    if re.fullmatch(r"[A-Z][A-Z0-9]+", term):
        return bool(re.search(rf"(?<![A-Za-z0-9]){term}(?![A-Za-z0-9])", text, re.I))
    return bool(re.search(rf"(?<!\w){re.escape(term)}(?!\w)", text))


def citations(page: str, markdown: str) -> tuple[list[Citation], list[str]]:
    """Every citation of the page with its claim's words, and what looks like a citation but
    was not parsed (page:line: the text)."""
    found: list[Citation] = []
    unparsed: list[str] = []
    for block in blocks(markdown):
        spans: list[tuple[int, int]] = []  # of the citations parsed
        last_path = None
        claim = ""
        parsed = sorted(
            [*FILE_CITATION.finditer(block.text), *LINE_CITATION.finditer(block.text)],
            key=lambda m: m.start(),
        )
        if block.row:
            cells = block.text.strip("|").split("|")
            claim = " ".join(c for c in cells if not FILE_CITATION.search(c))
        sentences = [(m.start(), m.end()) for m in SENTENCE_END.finditer(block.text)]
        for match in parsed:
            path = match.groupdict().get("path") or last_path
            where = f"{page}:{block.line_at(match.start())}"
            if path is None:
                unparsed.append(f"{where}: {match.group(0)!r} follows no file")
                continue
            last_path = path
            if not block.row:
                start = max([end for _, end in sentences if end <= match.start()], default=0)
                stop = min([s for s, _ in sentences if s >= match.end()], default=len(block.text))
                before = max([start, *(end for _, end in spans if end <= match.start())])
                claim = block.text[before : match.start()]
                if not terms_of(claim):
                    sentence = block.text[start:stop]
                    claim = FILE_CITATION.sub(" ", LINE_CITATION.sub(" ", sentence))
            spans.append((match.start(), match.end()))
            for first, last in ranges(match.group("ranges")):
                found.append(Citation(where, path, first, last, terms_of(claim), claim.strip()))
        looks_cited = [*CITATION_LIKE.finditer(block.text)]
        if spans:
            looks_cited += BARE_RANGE.finditer(block.text)
        for loose in looks_cited:
            if not any(start <= loose.start() < end for start, end in spans):
                context = block.text[max(0, loose.start() - 30) : loose.end() + 10]
                unparsed.append(f"{page}:{block.line_at(loose.start())}: {context!r}")
    return found, unparsed


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def enclosing(lines: list[str], first: int) -> set[str]:
    """The functions and classes of a Python file whose bodies hold line `first` (from 1)."""
    names: set[str] = set()
    body = next((line for line in lines[first - 1 :] if line.strip()), "")
    indent = len(body) - len(body.lstrip())
    for line in reversed(lines[: first - 1]):
        depth = len(line) - len(line.lstrip())
        if indent == 0:
            break
        # a signature's closing `) -> None:` is not outside the body it opens
        if line.strip() and depth < indent and not line.lstrip().startswith((")", "]", "}")):
            definition = DEFINITION.match(line)
            if definition:
                names.add(definition.group(1))
            indent = depth
    return names


def check(citation: Citation, read: Callable[[str], tuple[str, list[str]] | str]) -> str | None:
    """What is wrong with a citation (None: nothing): `read` gives a path's (name, lines), or
    why it cannot."""
    found = read(citation.path)
    where = f"{citation.where}: {citation.path}:{citation.first}-{citation.last}"
    if isinstance(found, str):
        return f"{where}: {found}"
    name, lines = found
    if not 1 <= citation.first <= citation.last <= len(lines):
        return f"{where}: {name} has {len(lines)} lines"
    if not citation.terms:
        return f"{where}: the claim names no code to look for: {citation.claim!r}"
    cited = "\n".join(lines[citation.first - 1 : citation.last])
    inside = enclosing(lines, citation.first) if name.endswith(".py") else set()
    if not any(holds(term, cited) or term in inside for term in citation.terms):
        return (
            f"{where}: none of the claim's {sorted(citation.terms)} is in {name}'s lines "
            f"(the claim: {citation.claim!r})"
        )
    return None


def source_reader(wheel: zipfile.ZipFile) -> Callable[[str], tuple[str, list[str]] | str]:
    """A file of the checkout, else of the wheel (under vllm/, or by its bare name)."""
    members = [n for n in wheel.namelist() if not n.endswith("/")]
    assert wheel.filename is not None, "the wheel is opened from a file"
    wheel_name = Path(wheel.filename).name

    def read(path: str) -> tuple[str, list[str]] | str:
        if (REPO / path).is_file():
            return path, (REPO / path).read_text().splitlines()
        named = [n for n in members if n in (path, f"vllm/{path}")]
        named = named or [n for n in members if n.endswith(f"/{path}")]
        if len(named) != 1:
            return f"{len(named)} files of {wheel_name} match: {named[:5]}"
        return named[0], wheel.read(named[0]).decode().splitlines()

    return read


def test_every_citation_is_parsed():
    found = {p: citations(str(p.relative_to(REPO)), p.read_text()) for p in pages()}
    unparsed = [u for _, missed in found.values() for u in missed]
    assert not unparsed, "written like a citation, but not one this test reads:\n" + "\n".join(
        unparsed
    )
    assert sum(len(cites) for cites, _ in found.values()) >= 150, "were the citations lost?"


def test_the_citation_check_reads_the_claim_not_the_row():
    source = ["class Pool:", "    def warm(self):", "        return cold()", "", "def cold(): ..."]
    read = {"pkg/m.py": ("pkg/m.py", source)}.get

    def problems(markdown: str) -> list[str | None]:
        cites, unparsed = citations("page.md", markdown)
        return [*unparsed, *(check(c, lambda p: read(p) or "no such file") for c in cites)]

    # a row: its claim cell's words, any of them
    assert problems("| `Pool.warm` calls `cold` | `pkg/m.py:2-3` |\n") == [None]
    # prose: the words before each citation in its sentence; `lines` cites the last file
    good = "- `warm` (pkg/m.py:2) returns `cold()` (line 3), defined at line 5.\n"
    assert problems(good) == [None, None, None]
    # the lines of a function's body hold its name
    assert problems("`Pool.warm` returns what it calls (pkg/m.py:3).\n") == [None]
    # the sentence names `cold`, which line 5 holds, but the words before this citation name
    # only `Pool`, which it does not: the claim's own words decide, not any name near it
    (wrong,) = problems("`warm` returns `cold()` (pkg/m.py:3); `Pool` holds it (pkg/m.py:5).\n")[1:]
    assert wrong and "none of the claim's ['Pool'] is in pkg/m.py's lines" in wrong
    # a citation broken over two lines of the page, or with no file before it, is not read
    assert problems("`warm` (pkg/m.py:\n  2-3).\n")[0] == "page.md:1: '`warm` (pkg/m.py: 2-3).'"
    assert "follows no file" in str(problems("`warm` (line 2).\n")[0])
    # a bare range beside a citation reads as one, but cites nothing
    beside = problems("`warm` (pkg/m.py:2 for one, 3-5 for another).\n")
    assert beside[0] == "page.md:1: '`warm` (pkg/m.py:2 for one, 3-5 for anoth'"
    assert "pkg/m.py has 5 lines" in str(problems("`warm` (pkg/m.py:2-9).\n")[0])


@pytest.fixture(scope="module")
def wheels() -> Iterator[Callable[[str], zipfile.ZipFile]]:
    """The wheel of a release, opened once."""
    opened: dict[str, zipfile.ZipFile] = {}

    def wheel(version: str) -> zipfile.ZipFile:
        if version not in opened:
            try:
                opened[version] = zipfile.ZipFile(wheel_cache.vllm_wheel(version))
            except RuntimeError as exc:
                pytest.skip(f"the vllm=={version} wheel is not available (no PyPI access?): {exc}")
        return opened[version]

    yield wheel
    for archive in opened.values():
        archive.close()


def test_a_page_about_a_release_reads_its_wheel():
    assert release_of("docs/vllm-0.33.md") == "0.33.0"
    assert release_of("README.md") == release_of("docs/model.md") == wheel_cache.VLLM_VERSION
    # every page about one release (vllm-X.Y.md under docs/) reads a wheel of that release
    for page in sorted(DOCS.glob("vllm-*.md")):
        release = release_of(str(page.relative_to(REPO)))
        assert release.startswith(page.stem.removeprefix("vllm-") + "."), (page.name, release)


def test_citations_hold_for_their_claims(wheels):
    readers: dict[str, Callable[[str], tuple[str, list[str]] | str]] = {}
    problems, checked = [], Counter[str]()
    for page in pages():
        name = str(page.relative_to(REPO))
        release = release_of(name)
        if release not in readers:
            readers[release] = source_reader(wheels(release))
        cites, _ = citations(name, page.read_text())
        problems += [p for p in (check(c, readers[release]) for c in cites) if p]
        checked[name] = len(cites)
    assert not problems, "\n".join(problems)
    for doc, least in {"docs/model.md": 30, "docs/tensor-parallel.md": 60}.items():
        assert checked[doc] >= least, f"{doc}: only {checked[doc]} citations checked"
    assert checked.total() >= 150, checked
