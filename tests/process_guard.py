"""No test leaves a process behind: each test's new descendants must have ended by the time its
teardown ends (after a grace for what is already exiting), or the test fails naming them, and
they are killed.

The pytest process (each xdist worker) is made a child subreaper (prctl PR_SET_CHILD_SUBREAPER):
a process that a test's child started and then left (a daemon, `setsid`, a shell's background
job) is reparented to it instead of init, so it is still seen, and it is reaped here once it
exits, it only stays a zombie (never reaped here: a test's own Popen may still wait for its
child). Linux only; elsewhere the guard does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterator

import pytest

from harness.procs import PROC, process_stats

PR_SET_CHILD_SUBREAPER = 36
# what a process that is already exiting (a server told to stop) may take
GRACE_S = 10.0


def parents() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process /proc shows."""
    return {pid: (stat.ppid, stat.state) for pid, stat in process_stats().items()}


def command_line(pid: int) -> str:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip() or "?"


def descendants(root: int) -> dict[int, str]:
    """The live (not zombie) processes under `root`, with their command lines."""
    table = parents()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        if table[pid][1] == "Z":
            continue
        found[pid] = command_line(pid)
    return found


def pytest_configure(config: pytest.Config) -> None:
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    if sys.platform != "linux":
        yield
        return
    me = os.getpid()
    before = set(descendants(me))
    yield
    deadline = time.monotonic() + GRACE_S
    left = {pid: cmd for pid, cmd in descendants(me).items() if pid not in before}
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = {pid: cmd for pid, cmd in descendants(me).items() if pid not in before}
    if left:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        named = "; ".join(f"{pid}: {cmd[:200]}" for pid, cmd in sorted(left.items()))
        pytest.fail(f"the test left {len(left)} process(es) running (killed now): {named}")
