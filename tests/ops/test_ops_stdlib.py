"""The host programs run on the host's system python3 with nothing installed: each one, and
every module it imports, comes from the standard library or the sparkple package. So does the
serving plan (`sparkple serving-plan`, `sparkple launch-gate`), which the role runs there too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from ops_helpers import PROGRAMS, ROOT

# The rooms the host's python3 imports from, every module in them; and the serving plan.
HOST_ROOMS = ("supervise", "pair", "metrics", "provision", "ops")
HOST_MODULES = [
    f"sparkple.{room}.{path.stem}"
    for room in HOST_ROOMS
    for path in sorted((ROOT / "sparkple" / room).glob("*.py"))
    if path.stem != "__init__"
] + ["sparkple.serving.cli"]
# The module paths units rendered before the move run (sparkple.ops, kept for one release).
OLD_PATHS = {
    "metrics": "sparkple.ops.metrics",
    "probe": "sparkple.ops.probe",
    "shm": "sparkple.ops.shm",
    "supervisor": "sparkple.ops.supervisor",
    "sysctl": "sparkple.ops.sysctl",
    "watchdog": "sparkple.ops.watchdog",
}


def test_every_program_is_found():
    assert set(PROGRAMS.values()) <= set(HOST_MODULES)
    assert set(OLD_PATHS.values()) <= set(HOST_MODULES)


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


@pytest.mark.parametrize("module", sorted(PROGRAMS.values()) + sorted(OLD_PATHS.values()))
def test_runs_as_a_module_without_site_packages(module):
    done = subprocess.run(
        [sys.executable, "-S", "-m", module, "--help"],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT)},
        timeout=60,
    )
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr


@pytest.mark.parametrize("name", sorted(OLD_PATHS))
def test_an_old_module_path_runs_the_program_from_its_new_home(name):
    """A unit rendered before the move (`-m sparkple.ops.<program>`) runs the same program: the
    same help, flag for flag."""

    def usage(module: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", module, "--help"],
            capture_output=True, text=True, env={"PYTHONPATH": str(ROOT)}, timeout=60,
        )  # fmt: skip
        program = module.rsplit(".", 1)[1] + ".py"  # argparse's prog: the file's name
        return " ".join(done.stdout.replace(program, "PROGRAM").split())

    new = usage(PROGRAMS[name])
    assert new.startswith("usage: PROGRAM") and usage(OLD_PATHS[name]) == new
