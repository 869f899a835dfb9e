"""Shared-memory cleanup after the serving engine stopped (stop.yml, and the supervisor before
every relaunch).

With --ipc host the engine's POSIX shared memory (vLLM's message queues `psm_*`, NCCL's
`nccl-*`, torch's `torch_*`, sparkple's handshake flags `sparkple-*`) lives in the host's
/dev/shm; a SIGKILL leaves it behind, and on a unified-memory machine every leaked byte is
taken from the model. This lists the segments matching the patterns and which processes hold
them (an open descriptor or a mapping, from /proc/*/fd and /proc/*/maps). With --remove it
deletes them, but only when no process holds any of them: a live holder means an engine is
still running, and its siblings' segments may not be mapped yet.

Exit status: 0 nothing held (removed when asked), 1 held segments (nothing removed), 2 usage.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
from pathlib import Path
from typing import TypedDict

DEFAULT_PATTERNS = "psm_*,nccl-*,torch_*,sparkple-*"


class Segment(TypedDict):
    path: str
    bytes: int


class Report(TypedDict):
    """What survey() found and did; main() prints it as JSON."""

    segments: list[Segment]
    held: dict[str, list[int]]
    removed: list[str]
    bytes_freed: int


def segments(shm_dir: Path, patterns: list[str]) -> list[Path]:
    return sorted(
        p
        for p in shm_dir.iterdir()
        if p.is_file() and any(fnmatch.fnmatchcase(p.name, pat) for pat in patterns)
    )


def holders(paths: list[Path]) -> dict[str, list[int]]:
    """Segment path -> ids of the processes that have it open or mapped."""
    wanted = {str(p) for p in paths}
    held: dict[str, set[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        found: set[str] = set()
        try:
            for fd in os.listdir(f"/proc/{entry}/fd"):
                try:
                    target = os.readlink(f"/proc/{entry}/fd/{fd}")
                except OSError:
                    continue
                if target in wanted:
                    found.add(target)
            with open(f"/proc/{entry}/maps") as maps:
                for line in maps:
                    mapped = line.rstrip("\n").split(None, 5)[5:]
                    if mapped and mapped[0].removesuffix(" (deleted)") in wanted:
                        found.add(mapped[0].removesuffix(" (deleted)"))
        except OSError:  # the process exited, or is not ours to read
            continue
        for path in found:
            held.setdefault(path, set()).add(int(entry))
    return {path: sorted(pids) for path, pids in held.items()}


def survey(shm_dir: Path, patterns: list[str], remove: bool) -> Report:
    """The matching segments and their holders; with `remove`, delete them when none is held."""
    found = segments(shm_dir, [pat for pat in patterns if pat])
    held = holders(found)
    report: Report = {"segments": [], "held": held, "removed": [], "bytes_freed": 0}
    for seg in found:
        try:
            report["segments"].append({"path": str(seg), "bytes": seg.stat().st_size})
        except FileNotFoundError:
            continue
    if remove and not held:
        for seg in found:
            try:
                size = seg.stat().st_size
                seg.unlink()
            except FileNotFoundError:
                continue
            report["removed"].append(str(seg))
            report["bytes_freed"] += size
    return report


def clean_unheld(shm_dir: Path, patterns: list[str]) -> Report:
    """Remove the matching segments unless a live process holds any of them (the report says)."""
    return survey(shm_dir, patterns, remove=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))
    p.add_argument("--patterns", default=DEFAULT_PATTERNS, help="comma-separated globs")
    p.add_argument("--remove", action="store_true", help="delete them if none is held")
    args = p.parse_args(argv)
    patterns = [pat for pat in args.patterns.split(",") if pat]
    if not patterns:
        p.error("--patterns must name at least one glob")
    report = survey(args.shm_dir, patterns, args.remove)
    held = report["held"]
    print(json.dumps(report, indent=2, sort_keys=True))
    if held:
        print(
            f"ple-shm: {len(held)} segment(s) still held by running processes "
            f"{sorted({pid for pids in held.values() for pid in pids})}; nothing removed. "
            "Stop the engine first.",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
