""".ci/structure.py: the drawing in docs/structure.md is the one the imports make, and a circle
between rooms is refused."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".ci" / "structure.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("structure", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_drawing_in_the_docs_is_the_imports() -> None:
    done = subprocess.run([sys.executable, SCRIPT, "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_rooms_and_their_arrows_are_read_from_the_code() -> None:
    rooms, arrows = load().graph()
    assert "PairLeader" not in str(rooms)  # modules, not classes
    assert {"supervise", "pair", "metrics", "measure", "provision"} <= set(rooms)
    assert rooms["pair"].count("leader") == 1 and "supervisor" in rooms["supervise"]
    assert arrows[("pair", "supervise")] > 0 and ("supervise", "pair") not in arrows


def test_a_circle_between_rooms_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    structure = load()
    for room, imports in (("low", "from ..high import b\n"), ("high", "from ..low import a\n")):
        (tmp_path / "sparkple" / room).mkdir(parents=True)
        (tmp_path / "sparkple" / room / "a.py").write_text(imports)
    monkeypatch.setattr(structure, "ROOT", tmp_path)
    monkeypatch.setattr(structure, "PACKAGE", tmp_path / "sparkple")
    with pytest.raises(SystemExit, match="circle"):
        structure.drawing()
