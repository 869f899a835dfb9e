"""PLE counters the serving backend exports through a small JSON file.

The patched vLLM backend counts its work in a `PLEStats` and a `StatsFile` writes the counters to
`<dir>/ple-stats-<pid>.json` (one file per process, written atomically: temp file + rename), where
`<dir>` is `$SPARKPLE_STATS_DIR`, a directory bind-mounted from the host. On the host,
sparkple.metrics.collect turns the files into Prometheus metrics.

File format (version 1), one JSON object:
  format           "sparkple-ple-stats"
  version          1
  pid              writer's process id (inside its container)
  started_at       unix time the counters started from zero (a new value means a reset)
  updated_at       unix time of this write; a reader ignores files not updated for a while
                   (the writer is gone), so a live writer rewrites the file every few seconds
  counters         {name: non-negative int} for every name in COUNTERS
  handshake_wait_seconds
                   {"le": [upper bounds, s, ascending], "counts": [cumulative count per bound],
                    "count": total observations (the +Inf bucket), "sum": total seconds}

Standard library only: the same module runs in the serving container (via the read-only
bind mount of the package) and in tests.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from ..atomicfile import write_text
from ..errors import SparkpleError

FORMAT = "sparkple-ple-stats"
VERSION = 1
ENV_DIR = "SPARKPLE_STATS_DIR"

COUNTERS: tuple[str, ...] = (
    "rows_gathered",  # rows copied into staging by the gather worker
    "gather_calls",  # gather batches (one per forward that touches the table)
    "pages_prefetched",  # pages covered by WILLNEED advice
    "prefetch_calls",  # prefetch batches issued
    "staging_overruns",  # a batch did not fit the staging buffer and was split or refused
    "lookahead_pages_advised",  # pages of later prompt chunks advised ahead of their step
    "lookahead_pages_used",  # of those, pages whose chunk a step then gathered
    "lookahead_pages_wasted",  # of those, pages of requests removed before their chunk ran
    "host_device_mismatch",  # requests whose prompt tokens on the host differed from the device's
)
# Handshake wait bounds, seconds: from a spin that finds the flag set to the step timeout.
WAIT_BOUNDS_S: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
    60.0,
    300.0,
)


class StatsFormatError(SparkpleError):
    """A stats file is not in the format this module writes."""


class PLEStats:
    """Thread-safe counters and the handshake-wait histogram of one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started_at = time.time()
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._buckets = [0] * (len(WAIT_BOUNDS_S) + 1)  # per bucket, not cumulative; last: +Inf
        self._wait_sum = 0.0

    def add(self, name: str, amount: int = 1) -> None:
        self.add_all({name: amount})

    def add_all(self, amounts: dict[str, int]) -> None:
        """Several counters at once, under one lock (a decode step's gather moves four)."""
        for name, amount in amounts.items():
            if name not in self._counters:
                raise KeyError(f"unknown PLE counter {name!r}; known: {', '.join(COUNTERS)}")
            if amount < 0:
                raise ValueError(f"counter {name} can only grow, got {amount}")
        with self._lock:
            for name, amount in amounts.items():
                self._counters[name] += amount

    def observe_wait(self, seconds: float) -> None:
        with self._lock:
            self._buckets[bisect.bisect_left(WAIT_BOUNDS_S, seconds)] += 1
            self._wait_sum += max(0.0, seconds)

    def snapshot(self, pid: int | None = None) -> dict[str, Any]:
        with self._lock:
            counters = dict(self._counters)
            buckets = list(self._buckets)
            wait_sum = self._wait_sum
        cumulative, running = [], 0
        for n in buckets[:-1]:
            running += n
            cumulative.append(running)
        return {
            "format": FORMAT,
            "version": VERSION,
            "pid": os.getpid() if pid is None else pid,
            "started_at": self.started_at,
            "updated_at": time.time(),
            "counters": counters,
            "handshake_wait_seconds": {
                "le": list(WAIT_BOUNDS_S),
                "counts": cumulative,
                "count": running + buckets[-1],
                "sum": wait_sum,
            },
        }


class StatsFile:
    """Writes a PLEStats snapshot to `<directory>/ple-stats-<pid>.json`, atomically."""

    def __init__(self, directory: str | os.PathLike[str], stats: PLEStats) -> None:
        self.directory = Path(directory)
        self.stats = stats
        self.path = self.directory / f"ple-stats-{os.getpid()}.json"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_env(cls, stats: PLEStats) -> StatsFile | None:
        """A writer into $SPARKPLE_STATS_DIR, or None when it is unset (stats are optional)."""
        directory = os.environ.get(ENV_DIR, "")
        return cls(directory, stats) if directory else None

    def write(self) -> None:
        text = json.dumps(self.stats.snapshot(), separators=(",", ":"))
        write_text(self.path, text, 0o644, durable=False)  # rewritten every few seconds

    def start(self, interval_s: float = 5.0) -> None:
        """Rewrite the file every `interval_s` on a daemon thread (also while idle, so readers
        can tell a live writer from a dead one)."""
        if self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.wait(interval_s):
                with contextlib.suppress(OSError):  # a full or gone dir must not break serving
                    self.write()

        self.write()
        self._thread = threading.Thread(target=loop, name="ple-stats", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with contextlib.suppress(OSError):
            self.write()


def parse(text: str) -> dict[str, Any]:
    """Validate one stats file's content; raises StatsFormatError saying what is wrong."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise StatsFormatError(f"not JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise StatsFormatError(f'not a PLE stats file (expected "format": "{FORMAT}")')
    if doc.get("version") != VERSION:
        raise StatsFormatError(f"version {doc.get('version')!r}, this reader knows {VERSION}")
    counters = doc.get("counters")
    if not isinstance(counters, dict) or not all(
        isinstance(v, int) and v >= 0 for v in counters.values()
    ):
        raise StatsFormatError("counters must map names to non-negative integers")
    hist = doc.get("handshake_wait_seconds")
    if (
        not isinstance(hist, dict)
        or not isinstance(hist.get("le"), list)
        or not isinstance(hist.get("counts"), list)
        or len(hist["le"]) != len(hist["counts"])
    ):
        raise StatsFormatError("handshake_wait_seconds needs le and counts of equal length")
    return doc
