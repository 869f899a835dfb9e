"""No silent skips: tests/skip_guard.py under CI=true, and .ci/pytest_phase.py's counts.

Each case runs a real pytest in a subprocess on a small test file of its own, with the
project's plugin loaded as tests/conftest.py loads it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PHASE = ROOT / ".ci" / "pytest_phase.py"

SAMPLE = """
import pytest

def test_runs():
    assert True

def test_needs_a_tool():
    pytest.skip("sometool not installed")

@pytest.mark.skipif(True, reason="no such part here")
def test_marked_skip():
    pass

@pytest.mark.gpu
def test_on_a_gpu():
    pytest.skip("needs a CUDA GPU")

@pytest.mark.xfail(reason="a known bug", strict=True)
def test_known_bug():
    raise AssertionError
"""
MODULE_SKIP = """
import pytest
pytest.importorskip("no_such_module_for_the_skip_guard")

def test_never():
    pass
"""


def project(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n", encoding="utf-8"
    )
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["skip_guard"]\n', encoding="utf-8")
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    return tmp_path


def run(cmd: list[str], cwd: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = f"{ROOT / 'tests'}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def pytest_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *args]


def test_under_ci_a_skip_fails_naming_the_test_and_its_reason(tmp_path: Path) -> None:
    proj = project(tmp_path, {"test_sample.py": SAMPLE})
    proc = run(pytest_cmd(), proj, "true")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert (
        "test_sample.py::test_needs_a_tool was skipped under CI=true (sometool not installed)"
        in out
    )
    assert "test_sample.py::test_marked_skip was skipped under CI=true (no such part here)" in out
    # the gpu test may skip, an expected failure stays one, the plain test passes
    assert "SKIPPED [1] test_sample.py" in out and "needs a CUDA GPU" in out, out
    # a skip in the test fails it, a skip mark fails its set-up (an error)
    assert "1 failed, 1 passed, 1 skipped, 1 xfailed, 1 error" in out, out


def test_under_ci_a_module_skipped_at_import_fails(tmp_path: Path) -> None:
    proj = project(tmp_path, {"test_module_skip.py": MODULE_SKIP})
    proc = run(pytest_cmd(), proj, "true")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "test_module_skip.py was skipped under CI=true" in out, out
    assert "no_such_module_for_the_skip_guard" in out, out


@pytest.mark.parametrize("ci", [None, "false"])
def test_outside_ci_skips_stay_skips(tmp_path: Path, ci: str | None) -> None:
    proj = project(tmp_path, {"test_sample.py": SAMPLE, "test_module_skip.py": MODULE_SKIP})
    proc = run(pytest_cmd(), proj, ci)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "1 passed, 4 skipped, 1 xfailed" in out, out


def test_the_phase_prints_skips_in_its_closing_line(tmp_path: Path) -> None:
    proj = project(tmp_path, {"test_sample.py": SAMPLE})
    counts = tmp_path / "counts"
    proc = run([sys.executable, str(PHASE), str(counts)], proj, None)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    # the xfail is neither a pass nor a failure nor a skip the operator has to look at
    assert out.splitlines()[-1] == "pytest: 1 passed, 0 failed, 4 skipped", out
    assert "skipped: test_sample::test_needs_a_tool: sometool not installed" in out, out
    lines = counts.read_text().splitlines()
    assert lines[0] == "1 0 4" and len(lines) == 5, lines


def test_the_phase_fails_when_nothing_was_collected(tmp_path: Path) -> None:
    proj = project(tmp_path, {"test_empty.py": "# no tests here\n"})
    counts = tmp_path / "counts"
    proc = run([sys.executable, str(PHASE), str(counts)], proj, None)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no tests collected: that is a failure" in proc.stdout
    assert counts.read_text().splitlines()[0] == "0 0 0"


def test_the_phase_counts_a_failing_test(tmp_path: Path) -> None:
    proj = project(tmp_path, {"test_bad.py": "def test_bad():\n    assert 1 == 2\n"})
    counts = tmp_path / "counts"
    proc = run([sys.executable, str(PHASE), str(counts)], proj, "true")
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[-1] == "pytest: 0 passed, 1 failed, 0 skipped"
