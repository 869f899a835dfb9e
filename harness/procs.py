"""The processes /proc shows, each with its state, parent and process group: what the tests'
process guard (tests/process_guard.py) and the served engine's stop (engine_serve) read.
Standard library only."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

PROC = Path("/proc")


class ProcessStat(NamedTuple):
    state: str  # R, S, D, Z (a zombie), X (dead), ...
    ppid: int
    pgrp: int


def process_stats() -> dict[int, ProcessStat]:
    """pid -> its state, parent pid and process group, for every process /proc shows (one that
    ends while the table is read is left out)."""
    found = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name is in parentheses and may hold spaces: the fields follow the last ')'
        state, ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
        found[int(entry.name)] = ProcessStat(state, int(ppid), int(pgrp))
    return found
