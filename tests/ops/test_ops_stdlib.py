"""The host programs run on the host's system python3 with nothing installed: each one, and
every module it imports, comes from the standard library or the sparkple package. So does the
serving plan (`sparkple serving-plan`, `sparkple launch-gate`), which the role runs there too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from ops_helpers import ROOT

PROGRAMS = sorted(p.stem for p in (ROOT / "sparkple" / "ops").glob("*.py") if p.stem != "__init__")
HOST_MODULES = [f"sparkple.ops.{name}" for name in PROGRAMS] + ["sparkple.serving.cli"]


def test_every_program_is_found():
    expected = {"alert", "host", "metrics", "probe", "shm", "state", "supervisor", "sysctl"}
    assert expected | {"watchdog"} <= set(PROGRAMS)


@pytest.mark.parametrize("module", HOST_MODULES)
def test_imports_only_the_standard_library_and_sparkple(module):
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    # -S: no site-packages at all, so a third-party import fails instead of being found.
    done = subprocess.run(
        [sys.executable, "-S", "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT)},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    foreign = set(json.loads(done.stdout)) - sys.stdlib_module_names - {"sparkple", "__main__"}
    assert not foreign, f"{module} imports {sorted(foreign)}"


@pytest.mark.parametrize("name", ["metrics", "probe", "shm", "supervisor", "sysctl", "watchdog"])
def test_runs_as_a_module_without_site_packages(name):
    done = subprocess.run(
        [sys.executable, "-S", "-m", f"sparkple.ops.{name}", "--help"],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT)},
        timeout=60,
    )
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr
