"""No silent skips: tests/skip_guard.py under CI=true, and .ci/pytest_phase.py's counts.

Each case runs a real pytest in a subprocess on a small test file of its own, with the
project's plugin loaded as tests/conftest.py loads it; the cases for each way a test can pass
without checking anything run both with the project's pytest options and with the plugin alone
(it must hold whatever options a run is given).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from skip_guard import NO_CUDA

ROOT = Path(__file__).resolve().parents[2]
PHASE = ROOT / ".ci" / "pytest_phase.py"

SAMPLE = """
import pytest
from skip_guard import NO_CUDA

def test_runs():
    assert True

def test_needs_a_tool():
    pytest.skip("sometool not installed")

@pytest.mark.skipif(True, reason="no such part here")
def test_marked_skip():
    pass

@pytest.mark.gpu
def test_on_a_gpu():
    pytest.skip(NO_CUDA)

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
    """The plugin alone: a pytest.ini that only declares the gpu mark."""
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
    # the installed third-party plugins are not what is tested, and loading them (hypothesis's
    # above all) took most of each small run's 1.7 CPU-s
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
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
    assert "SKIPPED [1] test_sample.py" in out and NO_CUDA in out, out
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


# Each way a test passed under CI=true without checking anything, beside a test that passes
# (so a run that checks nothing else still exits 0 where the leak is open).
LEAKS = {
    "imperative_xfail": """
import pytest

def test_runs():
    assert True

def test_needs_a_tool():
    pytest.xfail("tool missing")
""",
    "xfail_that_passes": """
import pytest

def test_runs():
    assert True

@pytest.mark.xfail(reason="a bug fixed long ago")
def test_stale_mark():
    assert True
""",
    "gpu_skip_for_another_reason": """
import pytest

def test_runs():
    assert True

@pytest.mark.gpu
def test_on_a_gpu():
    pytest.skip("triton missing")
""",
    "class_with_init": """
def test_runs():
    assert True

class TestNeverCollected:
    def __init__(self):
        self.ready = True

    def test_never_runs(self):
        assert False
""",
}
# what the failure says, per leak
LEAK_MESSAGES = {
    "imperative_xfail": "test_leak.py::test_needs_a_tool called pytest.xfail under CI=true",
    "xfail_that_passes": "FAILED test_leak.py::test_stale_mark",
    "gpu_skip_for_another_reason": (
        f"test_leak.py::test_on_a_gpu is gpu-marked and was skipped under CI=true for another "
        f"reason than {NO_CUDA!r} (triton missing)"
    ),
    "class_with_init": "cannot collect test class 'TestNeverCollected'",
}
CONFIGS = {
    # the options the suite runs with (strict markers, xfail_strict, collection warnings)
    "project": lambda proj: ["-c", str(ROOT / "pyproject.toml"), "--rootdir", str(proj)],
    # the plugin alone, with the warnings pytest would otherwise only print turned off
    "guard_only": lambda proj: ["-W", "ignore::pytest.PytestCollectionWarning"],
}


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("leak", LEAKS)
def test_under_ci_a_test_that_checked_nothing_fails_the_run(
    tmp_path: Path, leak: str, config: str
) -> None:
    proj = project(tmp_path, {"test_leak.py": LEAKS[leak]})
    proc = run(pytest_cmd(*CONFIGS[config](proj), "test_leak.py"), proj, "true")
    out = proc.stdout + proc.stderr
    # 1: a test failed; 2: collection failed (the class pytest would not run)
    assert proc.returncode == (2 if leak == "class_with_init" else 1), out
    assert LEAK_MESSAGES[leak] in out, out


def test_under_ci_a_gpu_test_may_skip_only_for_want_of_a_cuda_device(tmp_path: Path) -> None:
    files = {
        "test_gpu_skips.py": """
import pytest
from skip_guard import NO_CUDA

@pytest.mark.gpu
def test_in_the_test():
    pytest.skip(NO_CUDA)

@pytest.mark.gpu
@pytest.mark.skipif(True, reason=NO_CUDA)
def test_as_a_mark():
    pass
""",
        "test_gpu_module.py": """
import pytest
from skip_guard import NO_CUDA

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(True, reason=NO_CUDA)]

def test_in_a_gpu_module():
    pass
""",
        "test_gpu_import.py": """
import pytest

@pytest.mark.gpu
def test_a_missing_part():
    pytest.importorskip("no_such_module_for_the_skip_guard")
""",
    }
    proj = project(tmp_path, files)
    allowed = run(pytest_cmd("test_gpu_skips.py", "test_gpu_module.py"), proj, "true")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert "3 skipped" in allowed.stdout and "failed" not in allowed.stdout, allowed.stdout
    # a part missing is not the one reason, even in a gpu test
    refused = run(pytest_cmd("test_gpu_import.py"), proj, "true")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "for another reason than 'no CUDA device'" in refused.stdout, refused.stdout
    # in the GPU check (a CUDA machine) not even that reason: the same tests fail
    env_before = os.environ.get("SPARKPLE_CUDA_REQUIRED")
    os.environ["SPARKPLE_CUDA_REQUIRED"] = "1"
    try:
        on_gpu = run(pytest_cmd("test_gpu_skips.py", "test_gpu_module.py"), proj, "true")
    finally:
        if env_before is None:
            del os.environ["SPARKPLE_CUDA_REQUIRED"]
        else:
            os.environ["SPARKPLE_CUDA_REQUIRED"] = env_before
    assert on_gpu.returncode == 1, on_gpu.stdout + on_gpu.stderr
    assert "was skipped in the GPU check (no CUDA device)" in on_gpu.stdout, on_gpu.stdout
    assert "3 skipped" not in on_gpu.stdout and "passed" not in on_gpu.stdout, on_gpu.stdout


def test_an_unknown_mark_fails_with_the_project_options(tmp_path: Path) -> None:
    # --strict-markers: a typo in a mark name is not a test quietly left unselected
    proj = project(
        tmp_path, {"test_typo.py": "import pytest\n\n@pytest.mark.gpuu\ndef test_x():\n    pass\n"}
    )
    proc = run(pytest_cmd(*CONFIGS["project"](proj), "test_typo.py"), proj, None)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "'gpuu' not found in `markers`" in proc.stdout + proc.stderr


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
