""".ci/role_docs.py: the Variables tables, and what goes into them.

Runs the script's own functions on a defaults file written here, and its --check on the
checkout's roles (every README's table is the one its defaults give).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".ci" / "role_docs.py"


def load_role_docs():
    spec = importlib.util.spec_from_file_location("role_docs", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_section_comments_stay_out_of_the_table(tmp_path: Path) -> None:
    defaults = tmp_path / "main.yml"
    defaults.write_text(
        "---\n"
        "# Image to run.\n"
        "demo_image: img\n"
        "\n"
        "# --- the recipe (each becomes one argument) -----------------\n"
        "# Longest context in tokens.\n"
        "demo_max_len: 4096\n"
        "# --- a section right above a knob\n"
        "# Concurrent sequences.\n"
        "demo_seqs: 4\n"
    )
    rows = load_role_docs().documented_defaults(defaults)
    assert rows == [
        ("demo_image", "img", "Image to run."),
        ("demo_max_len", "4096", "Longest context in tokens."),
        ("demo_seqs", "4", "Concurrent sequences."),
    ]


def test_a_knob_with_only_a_section_comment_has_none(tmp_path: Path) -> None:
    defaults = tmp_path / "main.yml"
    defaults.write_text("---\n# --- the recipe ---\ndemo_max_len: 4096\n")
    try:
        load_role_docs().documented_defaults(defaults)
    except SystemExit as exc:
        assert "demo_max_len has no comment line above it" in str(exc)
    else:
        raise AssertionError("a knob documented by a section comment alone was accepted")


def test_the_checkouts_tables_match_their_defaults() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for readme in sorted(ROOT.glob("roles/*/README.md")):
        table = readme.read_text().split("## Variables", 1)[1]
        assert "| --- " not in table, readme  # a section comment copied into a meaning cell
