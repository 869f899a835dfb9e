"""tests/process_guard.py: a test that leaves a process running fails, naming it, and the process
is killed; one whose processes end in time passes. A real pytest in a subprocess on a small test
file, with the plugin loaded as tests/conftest.py loads it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SAMPLE = """
import subprocess, sys, time

def test_leaves_an_orphan(tmp_path):
    # the shell exits at once; its background job is reparented (to the subreaper) and runs on
    subprocess.run(["bash", "-c", "exec -a leaked-by-a-test sleep 300 & echo $! > pid"],
                   cwd=tmp_path, check=True)
    (tmp_path.parent.parent / "leaked.pid").write_text((tmp_path / "pid").read_text())

def test_a_server_it_stops_in_time():
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    server.terminate()
    assert server.wait(10) != 0

def test_nothing_started():
    assert True
"""


def test_a_leaked_process_fails_its_test_and_is_killed(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["process_guard"]\n')
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-p", "no:xdist",
         f"--basetemp={tmp_path / 'base'}", "test_sample.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 1, out
    assert "3 passed, 1 error" in out, out
    assert "ERROR at teardown of test_leaves_an_orphan" in out, out
    assert "the test left 1 process(es) running (killed now)" in out, out
    assert "leaked-by-a-test 300" in out, out
    pid = int((tmp_path / "leaked.pid").read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
        if state == "Z":
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists() or state == "Z", "the leaked process was killed"
