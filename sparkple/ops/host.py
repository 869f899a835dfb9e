"""Reading the host's memory figures and running the site's configured commands.

Commands are given as one string (a unit file or a role variable), split with shell rules and
run without a shell; `{name}` placeholders in each word are filled from a mapping, so a value
with spaces stays one argument.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

MEMINFO = Path("/proc/meminfo")
KIB = 1024


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


def read_meminfo(path: Path = MEMINFO) -> dict[str, int]:
    """/proc/meminfo (or a file in its format) as bytes per field (kB in it are KiB)."""
    fields: dict[str, int] = {}
    for line in path.read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name] = int(parts[0]) * (KIB if parts[1:] == ["kB"] else 1)
    return fields


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
                proc = subprocess.run(
                    argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, check=False
                )
            return CommandResult(argv, proc.returncode, "", "")
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


def kernel_error_counts(path: Path = KMSG) -> dict[str, int] | None:
    """How many kernel log records in the ring buffer match each KERNEL_PATTERNS entry.

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
    for line in b"".join(chunks).decode("utf-8", "replace").splitlines():
        for key, needle in KERNEL_PATTERNS.items():
            if needle in line:
                counts[key] += 1
    return counts
