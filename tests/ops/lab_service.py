"""A tiny service manager for the lab server (lab/lab_server.py), standing in for systemd in the
operations tests: the host programs get its commands as they get systemctl's on a Spark.

  lab_service.py start DIR [--api-key K]   start the server detached, wait until /health is 200
  lab_service.py stop DIR                  SIGTERM, wait for the exit (a graceful stop)
  lab_service.py is-active DIR             exit 0 while the server's front process runs

DIR/service.json (written by the tests) holds the server's argv and environment; DIR gets
front.pid, engine.pid (once healthy) and server.log. While DIR/health-fail exists the server's
/health answers 503 (SPARKPLE_LAB_HEALTH_FAIL_FILE), as vLLM's does once its engine core died.
"""

from __future__ import annotations

import os
import sys

# `is-active` runs several times a second in the tests: it is answered before the heavier
# imports below.
if __name__ == "__main__" and sys.argv[1:2] == ["is-active"]:
    try:
        with (
            open(os.path.join(sys.argv[2], "front.pid")) as _f,
            open(f"/proc/{int(_f.read())}/stat") as _s,
        ):
            sys.exit(0 if _s.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X") else 3)
    except (OSError, ValueError):
        sys.exit(3)

import argparse  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import urllib.error  # noqa: E402
import urllib.request  # noqa: E402
from pathlib import Path  # noqa: E402

SPEC = "service.json"
START_TIMEOUT_S = 60.0  # a loaded CI machine: python, numpy and the table's first open
STOP_TIMEOUT_S = 15.0


def alive(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            found.append(int(stat.parent.name))
    return found


def health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return None


def start(directory: Path, api_key: str) -> int:
    spec = json.loads((directory / SPEC).read_text())
    env = {
        **os.environ,
        **spec["env"],
        "SPARKPLE_LAB_HEALTH_FAIL_FILE": str(directory / "health-fail"),
    }
    if api_key:
        env["VLLM_API_KEY"] = api_key
    with open(directory / "server.log", "ab") as log:
        front = subprocess.Popen(
            spec["argv"], env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    (directory / "front.pid").write_text(f"{front.pid}\n")
    (directory / "engine.pid").unlink(missing_ok=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and front.poll() is None:
        if health(spec["url"]) == 200:
            (directory / "engine.pid").write_text(f"{children(front.pid)[0]}\n")
            return 0
        time.sleep(0.02)
    print(f"the lab server did not become healthy; see {directory / 'server.log'}", file=sys.stderr)
    return 1


def stop(directory: Path) -> int:
    pid = read_pid(directory / "front.pid")
    if pid is None or not alive(pid):
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return 0 if not alive(pid) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["start", "stop", "is-active"])
    p.add_argument("dir", type=Path)
    p.add_argument("--api-key", default="")
    a = p.parse_args()
    if a.command == "start":
        return start(a.dir, a.api_key)
    if a.command == "stop":
        return stop(a.dir)
    pid = read_pid(a.dir / "front.pid")
    return 0 if pid is not None and alive(pid) else 3


if __name__ == "__main__":
    sys.exit(main())
