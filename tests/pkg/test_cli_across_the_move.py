"""`sparkple <command>` after the move (sparkple/ops/ and the pair's half of serving/ into rooms of
their own): every command and every flag the package had before it is still there, read from
the help of both packages (the old one: tests/package_before_the_move.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from package_before_the_move import unpack

pytestmark = pytest.mark.slow  # a help run per command and subcommand, on both packages

ROOT = Path(__file__).resolve().parents[2]


def helps(package: Path) -> dict[str, set[str]]:
    """command (and `command subcommand`) -> the flags its help lists."""

    def help_of(words: list[str]) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "sparkple.cli", *words, "--help"],
            capture_output=True, text=True, env={"PYTHONPATH": str(package)}, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, f"{words}: {done.stderr}"
        return done.stdout

    def subcommands(text: str) -> list[str]:
        """The names listed under a subparser's line ({a,b} or a metavar) of the positionals."""
        found = re.search(r"^positional arguments:\n  \S+\n((?:    .*\n|\s{6,}.*\n)+)", text, re.M)
        return re.findall(r"^    ([a-z][a-z0-9-]*)", found.group(1), re.M) if found else []

    found: dict[str, set[str]] = {}
    top = help_of([])
    for command in subcommands(top):
        text = help_of([command])
        found[command] = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
        for sub in subcommands(text):
            words = [command, sub]
            found[" ".join(words)] = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", help_of(words)))
    return found


def test_every_command_and_flag_from_before_the_move_is_kept(tmp_path: Path) -> None:
    before, now = helps(unpack(tmp_path)), helps(ROOT)
    assert len(before) > 20  # the commands and their subcommands were found
    assert set(before) <= set(now), sorted(set(before) - set(now))
    lost = {command: sorted(flags - now[command]) for command, flags in before.items()}
    assert not any(lost.values()), {c: f for c, f in lost.items() if f}
