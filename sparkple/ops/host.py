"""Running the site's configured commands, and what the host's kernel tells about its devices.

Commands are given as one string (a unit file or a role variable), split with shell rules and
run without a shell; `{name}` placeholders in each word are filled from a mapping, so a value
with spaces stays one argument.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path


def service_options() -> argparse.ArgumentParser:
    """The flags of every program that watches the serving unit (an argparse parent): the unit
    and container it acts on, and how often one kind of alert may repeat."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--unit", default="sparkple-vllm.service", help="systemd unit name ({unit})")
    p.add_argument("--container", default="sparkple-vllm", help="container name ({container})")
    p.add_argument(
        "--alert-min-interval-s", type=float, default=900.0, help="seconds between alerts of a kind"
    )
    return p


@dataclass(frozen=True)
class CommandResult:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def render_command(template: str, values: dict[str, str]) -> list[str]:
    """Split `template` into words and fill `{name}` placeholders in each word."""
    try:
        return [word.format(**values) for word in shlex.split(template)]
    except (KeyError, ValueError, IndexError) as exc:
        raise ValueError(
            f"command {template!r} has a bad placeholder ({exc}); "
            f"known placeholders: {', '.join('{' + k + '}' for k in sorted(values))}"
        ) from exc


def run_command(
    template: str, values: dict[str, str], timeout_s: float, stdout_path: Path | None = None
) -> CommandResult:
    """Run a configured command; a missing program or a timeout is a failed result, not a crash,
    because the loops that call this must keep running."""
    argv = render_command(template, values)
    if not argv:
        return CommandResult(argv, 0, "", "")
    try:
        if stdout_path is not None:
            with open(stdout_path, "wb") as out:
                to_file = subprocess.run(
                    argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, check=False
                )
            return CommandResult(argv, to_file.returncode, "", "")
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
        return CommandResult(argv, proc.returncode, proc.stdout, proc.stderr)
    except FileNotFoundError as exc:
        return CommandResult(argv, 127, "", f"{argv[0]}: not found ({exc})")
    except OSError as exc:  # not executable, not permitted, or the output file cannot be opened
        return CommandResult(argv, 126, "", f"{argv[0]}: cannot run ({exc})")
    except subprocess.TimeoutExpired:
        return CommandResult(argv, 124, "", f"timed out after {timeout_s:g} s")


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
