"""Shared-memory cleanup against real segments in the real /dev/shm, held by real processes.
Names carry a per-test prefix, so nothing but the test's own segments is ever touched."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from ops_helpers import SHM, program


def shm(prefix: str, *args: str) -> tuple[int, dict]:
    done = subprocess.run(
        program("shm", "--patterns", f"{prefix}*", *args),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return done.returncode, json.loads(done.stdout)


HOLD = """
import mmap, sys
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), 4096)
{close}
print("holding", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("how", ["mapped", "open"])
def test_held_segments_are_never_removed(shm_prefix, how):
    held, free = SHM / f"{shm_prefix}psm_a", SHM / f"{shm_prefix}psm_b"
    for seg in (held, free):
        seg.write_bytes(b"\0" * 4096)
    # mapped: the file descriptor is closed, only the mapping holds it
    code = HOLD.format(close="f.close()" if how == "mapped" else "")
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(held)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == b"holding"
        rc, report = shm(shm_prefix, "--remove")
        assert rc == 1 and report["removed"] == []
        assert report["held"] == {str(held): [holder.pid]}
        assert held.exists() and free.exists(), "nothing is removed while any is held"
    finally:
        holder.stdin.close()
        holder.wait(10)
    rc, report = shm(shm_prefix, "--remove")
    assert rc == 0 and sorted(report["removed"]) == sorted([str(held), str(free)])
    assert report["bytes_freed"] == 8192
    assert not held.exists() and not free.exists()


def test_listing_removes_nothing(shm_prefix):
    seg = SHM / f"{shm_prefix}x"
    seg.write_bytes(b"1")
    rc, report = shm(shm_prefix)
    assert rc == 0 and report["segments"] == [{"path": str(seg), "bytes": 1}]
    assert seg.exists() and report["removed"] == []
