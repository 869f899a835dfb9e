"""The PLE table's NVMe drive kept out of its idle power states (kernel_tuning, preflight, status).

The kernel runs an NVMe drive's Autonomous Power State Transitions (APST): after some idle time
the drive drops into a non-operational power state and wakes on the next command, which then
waits for it. The table is read one row at a time through mmap, so each decode step's page
faults can meet a drive that fell asleep between steps. The kernel's knob is per controller:

  /sys/class/nvme/nvmeX/power/pm_qos_latency_tolerance_us

the largest wake-up latency (µs) the driver may accept from the power states it programs.
0 turns APST off for that controller; a number N allows only the states whose entry and exit
latencies add up to N or less; "auto" and "any" (what the file reads when no limit was asked
for) allow every state. It is there only while the kernel runs APST on the controller: the
drive reports no APST, or a quirk turned it off, and the file is absent. New controllers start
at nvme_core.default_ps_max_latency_us (the module parameter, 100000 by default; 0 on the
kernel command line keeps APST off from boot for every NVMe drive). Sources:
docs/ansible.md#the-tables-drive-kept-awake.

From a directory this finds the block device holding it (its st_dev in /sys/dev/block, else
the mount's source in /proc/self/mountinfo), the disks below it (a partition's disk; the
devices a device-mapper or md device is built on) and the NVMe controller of each disk; it
reads the knob, and writes it only where it is there (never creating a file):

  nvme status --path DIR [--line]             what holds DIR and each controller's knob (JSON)
  nvme set --path DIR --value N [--check]     set the knob of every controller under DIR
  nvme set --path DIR --value kernel-default  give back the kernel's own value

`set` prints {"changed": [controllers], ...}; with --check it only says what would change. A
directory not on an NVMe drive, or a controller without the knob, is refused: exit status 1
with the reason on stderr, nothing written. Standard library only, and no import from the
package: preflight runs this file as a script on a host that has no package copy yet.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SYSFS = Path("/sys")
MOUNTINFO = Path("/proc/self/mountinfo")
KNOB = "power/pm_qos_latency_tolerance_us"
KERNEL_DEFAULT = "module/nvme_core/parameters/default_ps_max_latency_us"
# the kernel keeps a latency tolerance as a signed 32-bit number (it clamps the module's default)
S32_MAX = 2**31 - 1
SKIP = "set kernel_tuning_nvme_latency_tolerance_us: null for this host to leave it alone"
CONTROLLER = re.compile(r"nvme\d+")
# how the mount table writes a space, a tab, a newline or a backslash in a path
OCTAL = re.compile(r"\\([0-7]{3})")


class Refused(Exception):
    """What cannot be set, and why (the message says what to do)."""


@dataclass(frozen=True)
class Drive:
    """Where a directory's data lives, as far as APST goes."""

    path: str  # the directory looked at (the nearest one that exists)
    device: str | None  # the block device holding it (kernel name), None when on none
    source: str  # what the mount table names as the file system's source
    controllers: tuple[str, ...]  # the NVMe controllers below the device
    others: tuple[str, ...]  # the disks below it that are not NVMe


def nearest_existing(path: Path) -> Path:
    """The path, or its nearest parent that exists (the table's directory may not yet)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def mount_of(path: Path, mountinfo: Path) -> tuple[str, str]:
    """(file system type, source) of the mount that holds `path` ("", "" when none is read)."""
    best, found = -1, ("", "")
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return found
    target = str(path.resolve())
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        point = OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:  # the last of equal points is the one on top
            best, found = len(point), (tail[0], tail[1])
    return found


def device_of_source(source: str, sysfs: Path) -> str | None:
    """The kernel name of a mount source such as /dev/nvme0n1p2 or /dev/mapper/data."""
    if not source.startswith("/dev/"):
        return None
    name = source.rsplit("/", 1)[-1]
    if source.startswith("/dev/mapper/"):
        for dm in sorted((sysfs / "class" / "block").glob("dm-*")):
            try:
                if (dm / "dm" / "name").read_text().strip() == name:
                    return dm.name
            except OSError:
                continue
        return None
    return name if (sysfs / "class" / "block" / name).exists() else None


def block_device(path: Path, sysfs: Path, mountinfo: Path) -> tuple[str | None, str]:
    """(the block device holding `path`, the mount's source): by st_dev where the kernel lists
    that number as a block device, else by the mount's source (btrfs, or a bind mount)."""
    st_dev = path.stat().st_dev
    link = sysfs / "dev" / "block" / f"{os.major(st_dev)}:{os.minor(st_dev)}"
    fstype, source = mount_of(path, mountinfo)
    if link.exists():
        return link.resolve().name, source or fstype
    return device_of_source(source, sysfs), source or fstype or "unknown"


def disks_below(device: str, sysfs: Path, seen: frozenset[str] = frozenset()) -> list[str]:
    """The whole disks a block device lives on: a partition's disk, the devices a
    device-mapper or md device is built on (recursively), else the device itself."""
    node = sysfs / "class" / "block" / device
    if device in seen or not node.exists():
        return [device]
    if (node / "partition").exists():
        return disks_below(node.resolve().parent.name, sysfs, seen | {device})
    slaves = (
        sorted(p.name for p in (node / "slaves").glob("*")) if (node / "slaves").is_dir() else []
    )
    if slaves:
        return sorted({d for s in slaves for d in disks_below(s, sysfs, seen | {device})})
    return [device]


def controllers_of(disk: str, sysfs: Path) -> tuple[str, ...]:
    """The NVMe controllers of a namespace's disk: the controller it sits under
    (.../nvme/nvme0/nvme0n1), or those of its subsystem for a multipath disk
    (.../nvme-subsystem/nvme-subsys0/nvme0n1); () for any other disk."""
    node = sysfs / "class" / "block" / disk
    if not node.exists():
        return ()
    parent = node.resolve().parent
    if CONTROLLER.fullmatch(parent.name) and parent.parent.name == "nvme":
        return (parent.name,)
    if parent.name.startswith("nvme-subsys"):
        return tuple(sorted(p.name for p in parent.iterdir() if CONTROLLER.fullmatch(p.name)))
    return ()


def drive_of(device: str | None, source: str, path: str, sysfs: Path) -> Drive:
    if device is None:
        return Drive(path, None, source, (), ())
    controllers: list[str] = []
    others: list[str] = []
    for disk in disks_below(device, sysfs):
        found = controllers_of(disk, sysfs)
        controllers += [c for c in found if c not in controllers]
        if not found:
            others.append(disk)
    return Drive(path, device, source, tuple(controllers), tuple(others))


def locate(path: Path, sysfs: Path = SYSFS, mountinfo: Path = MOUNTINFO) -> Drive:
    """The drive under a directory (its nearest existing parent, if it is not there yet)."""
    where = nearest_existing(path)
    device, source = block_device(where, sysfs, mountinfo)
    return drive_of(device, source, str(where), sysfs)


def locate_device(device: str, sysfs: Path = SYSFS) -> Drive:
    """The drive under a named block device (as `status` knows the table's)."""
    name = device.rsplit("/", 1)[-1]
    return drive_of(name, device, "", sysfs)


def knob(sysfs: Path, controller: str) -> Path:
    return sysfs / "class" / "nvme" / controller / KNOB


def read_knob(sysfs: Path, controller: str) -> str | None:
    """The controller's latency tolerance as the kernel prints it, None where it has none."""
    try:
        return knob(sysfs, controller).read_text().strip()
    except OSError:
        return None


def kernel_default(sysfs: Path) -> str | None:
    """nvme_core.default_ps_max_latency_us as the running kernel has it (None: not loaded)."""
    try:
        return (sysfs / KERNEL_DEFAULT).read_text().strip()
    except OSError:
        return None


def apst(value: str | None) -> str:
    """What a latency tolerance means for the drive."""
    if value is None:
        return "no APST knob"
    if value == "0":
        return "APST off"
    if value in ("auto", "any"):
        return "APST on, every power state allowed"
    return f"APST on, power states waking within {value} µs"


def refusal(drive: Drive, sysfs: Path) -> str | None:
    """Why the knob cannot be set for this drive (None when it can)."""
    if drive.device is None:
        return (
            f"the table's directory {drive.path} is not on a block device "
            f"({drive.source}): there is no NVMe drive to keep awake; {SKIP}"
        )
    if not drive.controllers:
        below = "" if drive.others == (drive.device,) else f" (on {', '.join(drive.others)})"
        return (
            f"the table's device {drive.device} is not NVMe{below}: it has no NVMe power-state "
            f"latency to set; {SKIP}"
        )
    if drive.others:
        return (
            f"the table's device {drive.device} is only partly NVMe ({', '.join(drive.others)} "
            f"is not): the drives that are not keep their own power management; {SKIP}"
        )
    missing = [c for c in drive.controllers if read_knob(sysfs, c) is None]
    if missing:
        return (
            f"{', '.join(missing)} (the table's device {drive.device}) has no {KNOB}: the "
            "kernel's APST latency knob is missing, which it is while it runs no APST on the "
            "controller (the drive reports none, or a quirk turned it off); nothing here can "
            f"set its power states; {SKIP}"
        )
    return None


def report(drive: Drive, sysfs: Path = SYSFS) -> dict[str, Any]:
    """The drive, each controller's live knob and its meaning, the kernel's default, and the
    refusal `set` would give (None where it would set)."""
    controllers = []
    for name in drive.controllers:
        value = read_knob(sysfs, name)
        controllers.append({"name": name, "latency_tolerance_us": value, "apst": apst(value)})
    return {
        "path": drive.path or None,
        "device": drive.device,
        "source": drive.source,
        "controllers": controllers,
        "not_nvme": list(drive.others),
        "kernel_default_us": kernel_default(sysfs),
        "problem": refusal(drive, sysfs),
    }


def line(rep: dict[str, Any]) -> str:
    """The report in one line (preflight's, and status's)."""
    if rep["device"] is None:
        return f"table drive: none (the table's directory is on {rep['source']})"
    if not rep["controllers"]:
        return f"table drive: {rep['device']} is not NVMe"
    parts = []
    for c in rep["controllers"]:
        value = c["latency_tolerance_us"]
        shown = {"0": " (latency tolerance 0 µs)", "auto": " (latency tolerance auto)",
                 "any": " (latency tolerance any)"}.get(value, "")  # fmt: skip
        parts.append(f"{c['name']} {c['apst']}{shown}")
    text = f"table drive {rep['device']}: " + ", ".join(parts)
    if rep["not_nvme"]:
        text += f"; not NVMe: {', '.join(rep['not_nvme'])}"
    return text + f"; nvme_core.default_ps_max_latency_us={rep['kernel_default_us'] or 'unknown'}"


def wanted_value(value: str, sysfs: Path) -> str:
    """The value to write: a number of µs, or the kernel's own default for new controllers."""
    if value == "kernel-default":
        default = kernel_default(sysfs)
        if default is None or not default.isdigit():
            raise Refused(
                f"cannot read the kernel's default ({sysfs / KERNEL_DEFAULT}): nvme_core is not "
                "loaded, so no controller can be given its value back"
            )
        return str(min(int(default), S32_MAX))
    if not value.isdigit() or int(value) > S32_MAX:
        raise Refused(
            f"--value {value!r} is not a latency in µs (0-{S32_MAX}; 0 turns APST off) "
            "nor kernel-default"
        )
    return str(int(value))


def apply(drive: Drive, value: str, sysfs: Path = SYSFS, check: bool = False) -> dict[str, Any]:
    """Set the knob of every controller of the drive to `value` where it differs."""
    problem = refusal(drive, sysfs)
    if problem:
        raise Refused(problem)
    want = wanted_value(value, sysfs)
    changed = []
    for name in drive.controllers:
        if read_knob(sysfs, name) == want:
            continue
        changed.append(name)
        if check:
            continue
        target = knob(sysfs, name)
        try:
            # as `echo N > FILE` opens it, less O_CREAT: the file is sysfs's, or this is refused
            fd = os.open(target, os.O_WRONLY | os.O_TRUNC)
            try:
                os.write(fd, f"{want}\n".encode())
            finally:
                os.close(fd)
        except OSError as exc:
            raise Refused(f"cannot write {want} to {target}: {exc.strerror or exc}") from None
        back = read_knob(sysfs, name)
        if back != want:
            raise Refused(f"wrote {want} to {target}, and it reads back {back}")
    return {"changed": changed, "value": want, **report(drive, sysfs)}


def main(argv: list[str] | None = None) -> int:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--sysfs", type=Path, default=SYSFS, help="the sysfs tree (/sys)")
    common.add_argument(
        "--mountinfo", type=Path, default=MOUNTINFO, help="the mount table (/proc/self/mountinfo)"
    )
    common.add_argument("--path", type=Path, required=True, help="the table's directory")
    parser = argparse.ArgumentParser(prog="nvme", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", parents=[common], help="the drive and its knob (JSON)")
    status.add_argument("--line", action="store_true", help="one line of text instead")
    setter = sub.add_parser("set", parents=[common], help="set the knob where it differs")
    setter.add_argument("--value", required=True, help="µs (0: APST off), or kernel-default")
    setter.add_argument("--check", action="store_true", help="only say what would change")
    args = parser.parse_args(argv)
    try:
        drive = locate(args.path, args.sysfs, args.mountinfo)
        if args.command == "status":
            rep = report(drive, args.sysfs)
            print(line(rep) if args.line else json.dumps(rep, sort_keys=True))
            return 0
        print(json.dumps(apply(drive, args.value, args.sysfs, args.check), sort_keys=True))
        return 0
    except Refused as exc:
        print(f"sparkple.nvme: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"sparkple.nvme: {args.path}: {exc.strerror or exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
