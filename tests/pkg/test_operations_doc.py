"""docs/operations.md's picture of who may stop what names, for each transition, the tests and
molecule tasks that exercise it: every one of them exists (a renamed or deleted test fails here,
not silently in the doc)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "operations.md"
# the caption's short names for the two files it cites most
SHORT = {"sup": "tests/ops/test_ops_supervisor.py", "pair": "tests/ops/test_ops_pair.py"}


def caption() -> list[str]:
    """The caption's bullets: one per transition, each naming its tests."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## Who may stop what") :]
    section = section[section.index("Tests per transition") :]
    return [line for line in section.splitlines() if line.startswith("- T")]


def named(bullet: str) -> list[tuple[str, str]]:
    """(file, test function or molecule task name) for each name in a bullet, in order: a
    `file::test` or `sup::test`, a `::test` of the file named before it, and a molecule file
    followed by its task names in quotes."""
    found, current = [], ""
    for code, quoted in re.findall(r"`([^`]+)`|\"([^\"]+)\"", bullet):
        if quoted:
            assert current.startswith("molecule/"), f"a task name without its file: {quoted!r}"
            found.append((current, quoted))
        elif "::" in code:
            where, _, test = code.partition("::")
            current = SHORT.get(where, where) or current
            found.append((current, test))
        elif code.startswith("molecule/"):
            current = code
    return found


def test_every_transition_names_its_tests() -> None:
    bullets = caption()
    assert len(bullets) >= 15
    for bullet in bullets:
        assert named(bullet), f"no test named: {bullet}"


def test_every_test_and_task_the_picture_names_exists() -> None:
    missing = []
    for bullet in caption():
        for where, name in named(bullet):
            source = (ROOT / where).read_text(encoding="utf-8")
            if where.endswith(".py"):
                ok = re.search(rf"^def {re.escape(name)}\(", source, re.MULTILINE)
            else:
                ok = re.search(rf"^\s*- name: {re.escape(name)}\s*$", source, re.MULTILINE)
            if not ok:
                missing.append(f"{where}: {name}")
    assert not missing, missing
