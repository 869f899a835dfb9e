"""Helpers for the operations tests: they run the real host-side programs (PROGRAMS) as
subprocesses against real processes (the lab server, lab/lab_server.py, as the service), real
HTTP servers and the real /proc."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from lab_service import alive, children  # noqa: F401 - the tests' /proc helpers

from sparkple.meminfo import read_meminfo

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "lab"  # the lab stand-in for vLLM (never shipped to a Spark)
SHM = Path("/dev/shm")  # POSIX shared memory, where --ipc host engines leave segments
# The lab server managed as a service (start, stop, is-active), as systemd manages the unit.
LAB_SERVICE = Path(__file__).with_name("lab_service.py")
# The programs run from this checkout's package, as a host runs them from the installed copy
# (PYTHONPATH=<package dir> python3 -m sparkple.supervise.watchdog, ...).
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def meminfo_mib(field: str) -> int:
    return read_meminfo()[field] // (1024 * 1024)


# The host programs by the names the tests use: the module each one runs as.
PROGRAMS = {
    "metrics": "sparkple.metrics.collect",
    "pair-supervisor": "sparkple.pair.supervisor_cli",
    "probe": "sparkple.supervise.probe",
    "shm": "sparkple.supervise.shm",
    "supervisor": "sparkple.supervise.supervisor_cli",
    "sysctl": "sparkple.provision.sysctl",
    "watchdog": "sparkple.supervise.watchdog",
}


def program(name: str, *args: object) -> list[str]:
    """The command line of host program `name` (PROGRAMS)."""
    return [sys.executable, "-m", PROGRAMS[name], *map(str, args)]


def above_real_memory() -> int:
    """A MemAvailable floor (MiB) no machine meets: the watchdog counts every sample as bad."""
    return 2 * meminfo_mib("MemTotal")


def watchdog_cmd(state: Path, *args: object, interval_s: float) -> list[str]:
    """The watchdog with its state in `state` and the archived logs beside it."""
    return program(
        "watchdog",
        "--state-dir", state,
        "--log-dir", state.parent / "logs",
        "--interval-s", interval_s,
        *args,
    )  # fmt: skip


def service_cmd(command: str, directory: Path, *extra: object) -> str:
    """A command line (as the programs' --*-cmd flags take it) for the lab service manager."""
    words = [sys.executable, "-S", str(LAB_SERVICE), command, str(directory), *map(str, extra)]
    return " ".join(f"'{w}'" for w in words)


T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def output(p: subprocess.Popen) -> str:
    """What a program started by the `procs` fixture has printed so far."""
    return Path(p.log_path).read_text()  # type: ignore[attr-defined]


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def markers(state_dir: Path, kind: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((state_dir / "markers").glob(f"{kind}-*"))]


class LabService:
    """The lab server as the service the host programs watch, through its manager's commands.

    `files` are the lab data (a snapshot, its table, a patch manifest and the `vllm` package it
    names); the server's argv and environment go into <directory>/service.json."""

    def __init__(self, directory: Path, port: int, files: dict) -> None:
        self.dir = directory
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        directory.mkdir(parents=True)
        spec = {
            "argv": [sys.executable, str(LAB / "lab_server.py"), "--model", str(files["snap"]),
                     "--port", str(port)],
            "env": {"PYTHONPATH": f"{ROOT}{os.pathsep}{files['site']}",
                    "SPARKPLE_PLE_TABLE_DIR": str(files["table"]),
                    "SPARKPLE_PATCH_DIR": str(files["patches"])},
            "url": self.url,
        }  # fmt: skip
        (directory / "service.json").write_text(json.dumps(spec))

    def start(self, *extra: str) -> None:
        cmd = [sys.executable, str(LAB_SERVICE), "start", str(self.dir)]
        subprocess.run([*cmd, *extra], check=True, timeout=90)

    def active(self) -> bool:
        cmd = [sys.executable, str(LAB_SERVICE), "is-active", str(self.dir)]
        return subprocess.run(cmd, timeout=20).returncode == 0

    def pid(self, which: str) -> int:
        return int((self.dir / f"{which}.pid").read_text())

    def cmd(self, command: str) -> str:
        return service_cmd(command, self.dir)

    def watchdog_args(self) -> list[str]:
        """The watchdog's service commands (is it running, its log, stop it) for this server."""
        return [
            "--running-cmd", self.cmd("is-active"),
            "--logs-cmd", f"cat {self.dir / 'server.log'}",
            "--stop-cmd", self.cmd("stop"),
        ]  # fmt: skip

    def kill_all(self) -> None:
        for which in ("engine", "front"):
            try:
                pid = self.pid(which)
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except (OSError, ValueError):
                pass
