"""A read fault under the published table while serving: the process that hits it dies, fast.

The table is served through a FUSE file system (tests/runtime/faulty_fs.py) whose reads fail
with EIO in a byte range of the data file, as a disk's unreadable sectors do; this machine's
kernel has no device-mapper, so no `error` target over a loop device. Through the read-only
mmap the failed page-in is SIGBUS in the thread that touched the row: the gather's process
dies at once (it never hangs), and the lab server's engine dying of it makes the front exit 1,
which is what the supervisor relaunches (with its backoff, then the hold).
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from lab_inputs import free_port, patched_site

from sparkple.runtime.tablemeta import read_meta

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LAB = ROOT / "lab" / "lab_server.py"


def mounted(path: Path) -> bool:
    return any(
        line.split()[1] == str(path) for line in Path("/proc/mounts").read_text().splitlines()
    )


@pytest.fixture
def faulty_table(built_table, tmp_path: Path) -> Iterator[tuple[Path, int, int]]:
    """The table mounted with reads of its data file failing from its second page on:
    (mounted table dir, first bad row, row count)."""
    meta = read_meta(built_table.table_dir)
    bad_start = mmap.PAGESIZE
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    fs = subprocess.Popen(
        [sys.executable, str(HERE / "faulty_fs.py"), str(built_table.table_dir), str(mnt),
         meta.data_file, str(bad_start), str(meta.data_bytes)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert fs.stdout is not None
    deadline = time.monotonic() + 20
    while not mounted(mnt):
        assert fs.poll() is None, f"the FUSE file system did not start: {fs.stdout.read()}"
        assert time.monotonic() < deadline, "the FUSE file system did not mount in 20 s"
        time.sleep(0.05)
    try:
        yield mnt, -(-bad_start // meta.row_width), meta.total_rows
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=30)
        try:
            fs.wait(10)
        except subprocess.TimeoutExpired:
            fs.kill()
            fs.wait()


GATHER = """
import sys
import numpy as np
from sparkple.runtime.gather import gather_rows
from sparkple.runtime.table import open_table

table = open_table(sys.argv[1])
staging = np.empty((1, 1, table.row_width), dtype=np.uint8)
gather_rows(table.rows, np.array([[0]]), staging)  # the first page reads fine
print("first row ok", flush=True)
gather_rows(table.rows, np.array([[int(sys.argv[2])]]), staging)  # a row in the bad range
print("read a row under the fault: the fault did not fire", flush=True)
"""


def test_a_read_fault_kills_the_gathering_process_at_once(faulty_table) -> None:
    mnt, bad_row, _ = faulty_table
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", GATHER, str(mnt), str(bad_row + 7)],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    took = time.monotonic() - started
    assert proc.stdout.splitlines() == ["first row ok"], proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stderr[-2000:])
    print(f"the gather died of SIGBUS {took:.2f} s after it started")


def test_the_lab_server_exits_nonzero_when_its_engine_hits_the_fault(
    built_table, faulty_table, tmp_path: Path
) -> None:
    """The engine gathers from the faulty table: it dies of SIGBUS, the request in flight gets
    an error answer (not a hang), and the front exits 1 for the supervisor to see."""
    mnt, _, _ = faulty_table
    site, patches = patched_site(tmp_path)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{site}",
           "SPARKPLE_PLE_TABLE_DIR": str(mnt), "SPARKPLE_PATCH_DIR": str(patches),
           "SPARKPLE_LAB_ENGINE_TIMEOUT_S": "5"}  # fmt: skip
    log = tmp_path / "lab.log"
    with open(log, "wb") as out:
        front = subprocess.Popen(
            [sys.executable, str(LAB), str(built_table.snapshot), "--port", str(port)],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:  # /health 200: the table opened (its metadata and first page read fine)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (OSError, urllib.error.HTTPError):
                pass
            assert front.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        body = json.dumps({"prompt": "hello spark", "max_tokens": 32}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body,
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        started = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(req, timeout=30)
        answered = time.monotonic() - started
        assert failed.value.code in (500, 503), failed.value.code
        assert front.wait(15) == 1, log.read_text()
    finally:
        if front.poll() is None:
            front.kill()
            front.wait()
    text = log.read_text()
    assert f"the engine exited with code {-signal.SIGBUS}" in text, text
    print(
        f"the request was answered {failed.value.code} after {answered:.2f} s; the front exited 1"
    )
