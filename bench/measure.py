"""What every benchmark reads of its own process: progress on stderr, and the bytes it made the
disk read (/proc/self/io `read_bytes`, the PERF conventions' disk-bytes source)."""

from __future__ import annotations

import sys


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes")
