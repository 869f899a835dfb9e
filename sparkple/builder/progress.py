"""Progress of a long copy: a bar on a terminal, plain periodic lines otherwise (for logs)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """A bar on a terminal, plain periodic lines otherwise (for logs)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, quiet: bool = False):
        self.total, self.label, self.quiet = max(1, total), label, quiet
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = self.last = time.monotonic()
        self.next_pct = 10

    def update(self, done: int) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        pct = 100 * done / self.total
        rate = done / max(now - self.start, 1e-6) / 2**20
        if self.tty:
            if now - self.last >= 0.2 or done >= self.total:
                bar = "#" * int(pct / 4)
                self.stream.write(f"\r{self.label} [{bar:<25}] {pct:5.1f}% {rate:7.1f} MiB/s")
                self.stream.flush()
                self.last = now
        elif pct >= self.next_pct or now - self.last >= 30:
            self.stream.write(
                f"{self.label}: {done / 2**20:.0f}/{self.total / 2**20:.0f} MiB "
                f"({pct:.0f}%), {rate:.0f} MiB/s\n"
            )
            self.stream.flush()
            self.last = now
            while self.next_pct <= pct:
                self.next_pct += 10

    def finish(self) -> None:
        if self.tty and not self.quiet:
            self.stream.write("\n")
            self.stream.flush()
