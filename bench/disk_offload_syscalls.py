"""Syscall counting for bench/disk_offload_compare.py: strace -c -f attached to this process
while a block runs, and which syscalls count as I/O or are left out of the total."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

IO_SYSCALLS = {
    "pread64": "read",
    "preadv": "read",
    "preadv2": "read",
    "fadvise64": "advice",
    "madvise": "advice",
    "process_madvise": "advice",
}
# not the host step's: the modelled device's busy time between steps (time.sleep), and the
# polling of torch.distributed's gloo thread, which runs whatever the step does
NOT_COUNTED = {"clock_nanosleep", "nanosleep", "epoll_wait"}


@contextmanager
def strace_counts(into: dict[str, int]) -> Iterator[None]:
    """Every syscall of this process (all threads) while the block runs: `strace -c -f -p`
    attached for its length, the block started only once each thread is traced."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "counts"
        proc = subprocess.Popen(
            ["strace", "-f", "-c", "-o", str(out), "-p", str(os.getpid())],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not all_traced():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("strace could not attach to this process")
            time.sleep(0.01)
        try:
            yield
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait()
            for line in out.read_text().splitlines():
                parts = line.split()
                if len(parts) >= 5 and parts[3].isdigit() and parts[-1] != "total":
                    into[parts[-1]] = into.get(parts[-1], 0) + int(parts[3])


def all_traced() -> bool:
    for status in glob.glob(f"/proc/{os.getpid()}/task/*/status"):
        try:
            text = Path(status).read_text()
        except OSError:
            continue  # a thread that ended meanwhile
        for line in text.splitlines():
            if line.startswith("TracerPid:") and line.split()[1] == "0":
                return False
    return True
