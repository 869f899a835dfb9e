"""Fake sysfs trees laid out as the kernel lays out /sys, for what reads a table drive's NVMe
controller (sparkple.nvme, the benchmark's record): controllers, disks and partitions, and a
real path's st_dev named as one of them."""

from __future__ import annotations

import os
from pathlib import Path

PCI = "devices/pci0000:00/0000:00:01.1/0000:01:00.0"


def link(sysfs: Path, name: str, target: str) -> None:
    """A relative symlink, as sysfs has them (so it resolves inside the fake tree)."""
    where = sysfs / name
    where.parent.mkdir(parents=True, exist_ok=True)
    where.symlink_to(os.path.relpath(sysfs / target, where.parent))


def controller(
    sysfs: Path, name: str = "nvme0", knob: str | None = "100000", pci: str = PCI
) -> str:
    path = f"{pci}/nvme/{name}"
    (sysfs / path).mkdir(parents=True)
    if knob is not None:
        (sysfs / path / "power").mkdir()
        (sysfs / path / "power" / "pm_qos_latency_tolerance_us").write_text(f"{knob}\n")
    link(sysfs, f"class/nvme/{name}", path)
    return path


def disk(sysfs: Path, parent: str, name: str, number: str, parts: int = 0) -> None:
    path = f"{parent}/{name}"
    (sysfs / path).mkdir(parents=True)
    link(sysfs, f"class/block/{name}", path)
    link(sysfs, f"dev/block/{number}:0", path)
    for n in range(1, parts + 1):
        (sysfs / path / f"{name}{'p' if name[-1].isdigit() else ''}{n}").mkdir()
        part = f"{path}/{name}{'p' if name[-1].isdigit() else ''}{n}"
        (sysfs / part / "partition").write_text(f"{n}\n")
        link(sysfs, f"class/block/{Path(part).name}", part)
        link(sysfs, f"dev/block/{number}:{n}", part)


def on(sysfs: Path, path: Path, device: str) -> None:
    """Make `path`'s real st_dev name `device` in the fake tree, as the kernel would."""
    st = path.stat()
    number = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    here = sysfs / "dev" / "block" / number
    if here.is_symlink():
        here.unlink()
    here.symlink_to(os.path.relpath((sysfs / "class/block" / device).resolve(), here.parent))
