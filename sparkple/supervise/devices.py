"""The host's devices as its kernel tells of them: the block device under a path, and the kernel
log's error counts (the NVIDIA driver's, and I/O errors on the PLE table's device)."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

KMSG = Path("/dev/kmsg")
# Kernel log lines that count: the NVIDIA driver's Xid errors, and its out-of-memory status
# (on a unified-memory Spark it comes before the host hangs).
KERNEL_PATTERNS = {"xid": "NVRM: Xid", "nv_err_no_memory": "NV_ERR_NO_MEMORY"}


# Kernel lines of a failed read on a block device (the block layer's, the page cache's, a
# drive's medium error): on the PLE table's device they mean rows whose page-in fails, which
# the gather thread gets as SIGBUS through the mmap.
IO_ERROR_NEEDLES = ("I/O error", "critical medium error", "Medium Error")


def block_device(path: Path) -> str | None:
    """The kernel name of the block device (partition) holding `path`, if it has one."""
    st_dev = path.stat().st_dev
    link = Path(f"/sys/dev/block/{os.major(st_dev)}:{os.minor(st_dev)}")
    return link.resolve().name if link.exists() else None


def device_names(device: str) -> tuple[str, ...]:
    """The device and, for a partition, its disk: the block layer logs errors by disk."""
    sys_dir = Path(f"/sys/class/block/{device}")
    if (sys_dir / "partition").exists():
        return (device, sys_dir.resolve().parent.name)
    return (device,)


def kernel_error_counts(path: Path = KMSG, io_device: str = "") -> dict[str, int] | None:
    """How many kernel log records in the ring buffer match each KERNEL_PATTERNS entry, and
    with io_device, how many are I/O errors on that device or its disk ("table_io").

    /dev/kmsg returns one record per read and EAGAIN at the end (opened non-blocking); a plain
    file (a saved log, in tests) is read the same way. None when the log cannot be read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    counts = dict.fromkeys(KERNEL_PATTERNS, 0)
    chunks: list[bytes] = []
    try:
        while True:
            try:
                chunk = os.read(fd, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:  # records overwritten while reading: go on with the next
                continue
            except OSError:
                return None
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    names = device_names(io_device) if io_device else ()
    alternatives = "|".join(map(re.escape, names))
    on_device = re.compile(rf"\b(?:{alternatives})\b") if names else None
    if on_device is not None:
        counts["table_io"] = 0
    for line in b"".join(chunks).decode("utf-8", "replace").splitlines():
        for key, needle in KERNEL_PATTERNS.items():
            if needle in line:
                counts[key] += 1
        if on_device and any(n in line for n in IO_ERROR_NEEDLES) and on_device.search(line):
            counts["table_io"] += 1
    return counts


def table_device(args: argparse.Namespace) -> str:
    """--table-device, else the block device under --table-dir ("" when neither tells)."""
    if getattr(args, "table_device", ""):
        return str(args.table_device)
    table_dir = getattr(args, "table_dir", None)
    if table_dir is None:
        return ""
    try:
        return block_device(table_dir) or ""
    except OSError:
        return ""
