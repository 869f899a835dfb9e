"""Stand-ins for the serving units of a pair's two nodes in the supervisor's tests: each a real
HTTP server (python -m http.server) whose /health answers 200, managed as systemd manages a unit.

  pair_units.py start DIR       start it detached on the port in DIR/port, wait for /health 200,
                                then append DIR's name to DIR/../starts.log (the start order)
  pair_units.py stop DIR        SIGTERM, wait for the exit (when DIR/slow-stop exists, first
                                write DIR/stopping and sleep the seconds it holds: a node whose
                                stop takes a while)
  pair_units.py is-active DIR   exit 0 while it runs (when DIR/pause-once exists, first sleep
                                the seconds it holds and remove it: a slow first check)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from lab_service import alive, read_pid

TIMEOUT_S = 30.0


def start(directory: Path) -> int:
    port = (directory / "port").read_text().strip()
    www = directory / "www"
    www.mkdir(exist_ok=True)
    (www / "health").write_text("ok\n")
    with open(directory / "server.log", "ab") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "http.server", port, "--bind", "127.0.0.1", "--directory", www],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    (directory / "pid").write_text(f"{server.pid}\n")
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    with open(directory.parent / "starts.log", "a") as order:
                        order.write(f"{directory.name}\n")
                    return 0
        except OSError:
            time.sleep(0.02)
    print(f"the unit did not come up; see {directory / 'server.log'}", file=sys.stderr)
    return 1


def stop(directory: Path) -> int:
    slow = directory / "slow-stop"
    if slow.exists():
        (directory / "stopping").touch()
        time.sleep(float(slow.read_text()))
    pid = read_pid(directory / "pid")
    if pid is None or not alive(pid):
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + TIMEOUT_S
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return 0 if not alive(pid) else 1


def main() -> int:
    command, directory = sys.argv[1], Path(sys.argv[2])
    if command == "start":
        return start(directory)
    if command == "stop":
        return stop(directory)
    pause = directory / "pause-once"
    if pause.exists():
        seconds = float(pause.read_text())
        pause.unlink()
        time.sleep(seconds)
    pid = read_pid(directory / "pid")
    return 0 if pid is not None and alive(pid) else 3


if __name__ == "__main__":
    sys.exit(main())
