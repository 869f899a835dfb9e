"""What every benchmark reads of its own process: progress on stderr, and the bytes it made the
disk read (/proc/self/io `read_bytes`, the PERF conventions' disk-bytes source); the two
statistics they report samples by; and the run of a benchmark's inner half in the vLLM venv."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


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


def run_inner(cmd: list[str], result: Path, cwd: str) -> dict[str, Any] | int:
    """A benchmark's inner half (`cmd`, in the vLLM venv), the checkout on PYTHONPATH and no
    packed-table counters directory inherited: the JSON it wrote to `result`, or its exit
    status where it failed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SPARKPLE_STATS_DIR", None)
    proc = subprocess.run(cmd, env=env, cwd=cwd)
    if proc.returncode:
        return proc.returncode
    found: dict[str, Any] = json.loads(result.read_text())
    return found
