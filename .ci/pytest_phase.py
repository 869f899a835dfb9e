"""The pytest phase of .ci/test: run pytest, then count its tests from the JUnit report.

Usage: pytest_phase.py COUNTS_FILE [PYTEST_ARGS...]

Prints every skipped test with its reason and the line `pytest: N passed, N failed, N skipped`,
and writes `passed failed skipped` (then one `skipped: ...` line per skip) to COUNTS_FILE for
.ci/test's closing line. Exit status is
pytest's, except that pytest's 5 (no test collected) is a failure (1): a run that checked
nothing must not pass. Under CI=true tests/skip_guard.py already turns a skipped test that is
not `gpu`-marked into a failure; the skips left here are the gpu ones.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

NO_TESTS_COLLECTED = 5


def counts(junit: Path) -> tuple[int, int, list[str]]:
    """(passed, failed, ["nodeid: reason" for each skip]) from pytest's JUnit XML."""
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return 0, 0, []
    passed, failed, skipped = 0, 0, []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("skipped") is not None:
            reason = case.find("skipped").get("message", "")  # type: ignore[union-attr]
            skipped.append(f"{name}: {reason}")
        elif case.find("failure") is not None or case.find("error") is not None:
            failed += 1
        else:
            passed += 1
    return passed, failed, skipped


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    counts_file, pytest_args = Path(argv[0]), argv[1:]
    with tempfile.TemporaryDirectory(prefix="pytest-phase-") as tmp:
        junit = Path(tmp) / "pytest.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
        rc = subprocess.run([*cmd, f"--junitxml={junit}", *pytest_args]).returncode
        passed, failed, skipped = counts(junit)
    if rc == NO_TESTS_COLLECTED:
        print("pytest: no tests collected: that is a failure (the run checked nothing)")
        rc = 1
    elif rc != 0 and failed == 0:
        failed = 1  # a collection error or an internal error: no failing test, still a failure
    for line in skipped:
        print(f"skipped: {line}")
    print(f"pytest: {passed} passed, {failed} failed, {len(skipped)} skipped")
    counts_file.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"{passed} {failed} {len(skipped)}", *(f"skipped: {line}" for line in skipped)]
    counts_file.write_text("\n".join(lines) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
