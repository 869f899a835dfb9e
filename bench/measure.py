"""What every benchmark reads of its own process: progress on stderr, and the bytes it made the
disk read (/proc/self/io `read_bytes`, the PERF conventions' disk-bytes source); and the two
statistics they report samples by."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence

import numpy as np


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes")


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def pct(values: list[float] | np.ndarray, q: float) -> float:
    return float(np.percentile(np.asarray(values), q))
