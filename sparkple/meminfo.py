"""/proc/meminfo, read by the serving plan (MemTotal), the launch gate and the host programs
(MemAvailable, MemFree, the page cache). Standard library only."""

from __future__ import annotations

from pathlib import Path

MEMINFO = Path("/proc/meminfo")
KIB = 1024


def read_meminfo(path: Path = MEMINFO) -> dict[str, int]:
    """/proc/meminfo (or a file in its format) as bytes per field (kB in it are KiB)."""
    fields: dict[str, int] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name] = int(parts[0]) * (KIB if parts[1:] == ["kB"] else 1)
    return fields
